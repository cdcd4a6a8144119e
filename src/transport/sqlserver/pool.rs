//! Pooled tiberius connections: a bb8 manager of our own (the published tiberius pool crates
//! do not build against tiberius 0.13).
//!
//! tiberius cannot say whether a connection is still usable after an error (a timed-out or
//! cancelled request leaves it out of step with the server), so any connection that saw an
//! error or timeout is marked broken and the pool drops it instead of handing it out again.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tiberius::{BulkLoadRequest, Client, Config, ExecuteResult, QueryStream, ToSql};
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use crate::transport::silence::{Silence, Ticket};

/// Statements run on every new connection: counts off (NServiceBus does the same per
/// statement), abort the transaction on any error, READ COMMITTED (READPAST needs it).
const SESSION_SETUP: &str =
    "SET NOCOUNT ON; SET XACT_ABORT ON; SET TRANSACTION ISOLATION LEVEL READ COMMITTED;";

/// A pooled connection. Every statement goes through its methods, which tell the pool's
/// [`Silence`] when it was sent and whether the server answered: a frozen server shows in
/// `/status` within seconds instead of after the command timeout.
pub struct Connection {
    client: Client<Compat<TcpStream>>,
    silence: Arc<Silence>,
    /// Set after any error: the pool drops the connection instead of reusing it.
    pub broken: bool,
    /// The row this connection's open transaction claimed (Babelfish's claiming receive);
    /// counted as held until the transaction ends or the connection goes.
    pub claim: Vec<super::claim::Held>,
    warm_up: Arc<WarmUp>,
    /// How many of the [`WarmUp`] statements this connection has run.
    warmed: usize,
}

/// Statements every connection runs once before its first receive, for the server to do
/// per session what it would otherwise do inside a message's receive.
///
/// Babelfish pays for the first `DELETE` on a table in each session: a claim took 30-500 ms
/// on a connection's first use and 1-15 ms after (measured over TDS, three hosts on one
/// queue), so messages that arrive at an idle host started hundreds of milliseconds apart and
/// a stage's members did not run together. A claim of no row (RowVersion -1) on each
/// receiving queue's table, when the connection opens or when a queue is added, pays it while
/// nothing waits. The list only grows: a queue receives for the life of the process.
#[derive(Debug, Default)]
pub struct WarmUp {
    /// Each statement with the key it was added under.
    statements: std::sync::RwLock<Vec<(String, String)>>,
}

impl WarmUp {
    /// Adds the statement `sql` makes under `key`, for every connection to run once; a key
    /// already added is left as it is (and `sql` not called: every look-up asks).
    pub fn add(&self, key: &str, sql: impl FnOnce() -> String) {
        let known = |statements: &[(String, String)]| statements.iter().any(|(k, _)| k == key);
        if known(&self.statements.read().unwrap_or_else(|e| e.into_inner())) {
            return;
        }
        let mut statements = self.statements.write().unwrap_or_else(|e| e.into_inner());
        if !known(&statements) {
            statements.push((key.to_owned(), sql()));
        }
    }

    /// The statements from the `from`-th on.
    fn since(&self, from: usize) -> Vec<String> {
        let statements = self.statements.read().unwrap_or_else(|e| e.into_inner());
        statements
            .get(from..)
            .unwrap_or_default()
            .iter()
            .map(|(_, sql)| sql.clone())
            .collect()
    }
}

/// Records `result` on `ticket`: anything the server said is an answer; the command timeout
/// is none.
fn heard<T>(ticket: Ticket, result: &Result<T, tiberius::error::Error>) {
    match result {
        Err(tiberius::error::Error::Io {
            kind: std::io::ErrorKind::TimedOut,
            ..
        }) => ticket.unanswered(),
        _ => ticket.answered(),
    }
}

impl Connection {
    /// Runs a parameterized statement and returns its result stream.
    pub async fn query<'a, 'b>(
        &'a mut self,
        sql: impl Into<Cow<'b, str>>,
        params: &'b [&'b dyn ToSql],
    ) -> Result<QueryStream<'a>, tiberius::error::Error>
    where
        'a: 'b,
    {
        let ticket = self.silence.ask();
        let result = self.client.query(sql, params).await;
        heard(ticket, &result);
        result
    }

    /// Runs a parameterized statement that returns no rows.
    pub async fn execute<'b>(
        &mut self,
        sql: impl Into<Cow<'b, str>>,
        params: &[&dyn ToSql],
    ) -> Result<ExecuteResult, tiberius::error::Error> {
        let ticket = self.silence.ask();
        let result = self.client.execute(sql, params).await;
        heard(ticket, &result);
        result
    }

    /// Runs a batch of statements without parameters and returns its result stream.
    pub async fn simple_query<'a, 'b>(
        &'a mut self,
        sql: impl Into<Cow<'b, str>>,
    ) -> Result<QueryStream<'a>, tiberius::error::Error>
    where
        'a: 'b,
    {
        let ticket = self.silence.ask();
        let result = self.client.simple_query(sql).await;
        heard(ticket, &result);
        result
    }

    /// Starts a bulk load of `columns` into `table` (the server answers with the table's
    /// metadata before any row is sent).
    pub async fn bulk_insert_columns<'a>(
        &'a mut self,
        table: &'a str,
        columns: &'a [&'a str],
    ) -> Result<BulkLoadRequest<'a, Compat<TcpStream>>, tiberius::error::Error> {
        let ticket = self.silence.ask();
        let result = self.client.bulk_insert_columns(table, columns).await;
        heard(ticket, &result);
        result
    }

    /// Runs a batch of statements whose results are not needed (transaction control,
    /// session settings), reading every result so the connection is ready for the next.
    pub async fn run_batch(&mut self, sql: &str) -> Result<(), tiberius::error::Error> {
        self.simple_query(sql).await?.into_results().await?;
        Ok(())
    }

    /// Runs the [`WarmUp`] statements this connection has not run yet. One that fails (a
    /// queue's table not created yet) is left for the receive to report; a connection that
    /// did not answer is marked broken.
    pub async fn warm(&mut self) {
        for sql in self.warm_up.since(self.warmed) {
            self.warmed += 1;
            if let Err(e) = self.run_batch(&sql).await {
                self.broken |= !matches!(e, tiberius::error::Error::Server(_));
                tracing::debug!(error = %e, "a connection's warm-up statement failed");
                // The claim stopped before it set the lock timeout back to "wait".
                let _ = self.run_batch(super::statements::CLAIM_GIVE_UP).await;
            }
        }
    }

    /// Runs `sql` with `params` and returns the rows of its first result set; an error that is
    /// not the server's own (a broken stream) marks the connection broken.
    pub async fn rows(
        &mut self,
        sql: &str,
        params: &[&dyn tiberius::ToSql],
    ) -> Result<Vec<tiberius::Row>, tiberius::error::Error> {
        let rows = async { self.query(sql, params).await?.into_first_result().await }.await;
        if let Err(e) = &rows {
            self.broken |= !matches!(e, tiberius::error::Error::Server(_));
        }
        rows
    }

    /// Runs a batch and returns the rows of its first result set.
    pub async fn first_result(
        &mut self,
        sql: &str,
    ) -> Result<Vec<tiberius::Row>, tiberius::error::Error> {
        self.simple_query(sql).await?.into_first_result().await
    }
}

/// Opens connections for bb8.
pub struct Manager {
    config: Config,
    connect_timeout: Duration,
    /// The last connect error, so a pool timeout can say why ("connection refused", bad
    /// password) instead of only that it timed out.
    last_error: Arc<Mutex<Option<String>>>,
    /// Whether the server answers, told by every connection's statements.
    silence: Arc<Silence>,
    /// What every new connection runs first.
    warm_up: Arc<WarmUp>,
}

impl Manager {
    /// A manager opening connections with this configuration.
    pub fn new(config: Config, connect_timeout: Duration) -> Self {
        Manager {
            config,
            connect_timeout,
            last_error: Arc::default(),
            silence: Arc::default(),
            warm_up: Arc::default(),
        }
    }

    /// What every connection runs once before it receives (see [`WarmUp`]).
    pub fn warm_up(&self) -> Arc<WarmUp> {
        self.warm_up.clone()
    }

    /// Whether the server answers the pool's statements.
    pub fn silence(&self) -> Arc<Silence> {
        self.silence.clone()
    }

    /// A handle on the reason the last connection attempt failed (None after a success).
    pub fn last_error(&self) -> Arc<Mutex<Option<String>>> {
        self.last_error.clone()
    }

    /// Connects, logs in and sets the session up, all within `connect_timeout`: a server that
    /// accepts the TCP connection and then says nothing (a stalled login) is a connect
    /// failure that names the address, not a wait without end.
    async fn open(&self) -> Result<Connection, tiberius::error::Error> {
        let addr = self.config.get_addr();
        tokio::time::timeout(self.connect_timeout, self.open_unbounded(&addr))
            .await
            .map_err(|_| tiberius::error::Error::Io {
                kind: std::io::ErrorKind::TimedOut,
                message: format!(
                    "connecting to {addr} timed out after {:?}",
                    self.connect_timeout
                ),
            })?
    }

    async fn open_unbounded(&self, addr: &str) -> Result<Connection, tiberius::error::Error> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let mut client = Client::connect(self.config.clone(), tcp.compat_write()).await?;
        client
            .simple_query(SESSION_SETUP)
            .await?
            .into_results()
            .await?;
        let mut connection = Connection {
            client,
            silence: self.silence.clone(),
            broken: false,
            claim: Vec::new(),
            warm_up: self.warm_up.clone(),
            warmed: 0,
        };
        connection.warm().await;
        Ok(connection)
    }
}

/// A connect error in words, with what to change where the driver's words do not say it.
pub fn explained(error: &tiberius::error::Error) -> String {
    let text = error.to_string();
    if text.to_ascii_lowercase().contains("encryption level") {
        return format!(
            "{text}: the connection string's Encrypt= setting does not fit the server. \
             Encrypt=true (also when Encrypt= is missing) encrypts everything and needs TLS on the server; \
             Encrypt=false encrypts the login only and still needs TLS on the server; \
             Encrypt=DANGER_PLAINTEXT encrypts nothing, for a server without TLS (the password travels in clear)"
        );
    }
    text
}

impl bb8::ManageConnection for Manager {
    type Connection = Connection;
    type Error = tiberius::error::Error;

    async fn connect(&self) -> Result<Connection, Self::Error> {
        let result = self.open().await;
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) =
            result.as_ref().err().map(explained);
        result
    }

    async fn is_valid(&self, conn: &mut Connection) -> Result<(), Self::Error> {
        conn.run_batch("SELECT 1").await
    }

    fn has_broken(&self, conn: &mut Connection) -> bool {
        conn.broken
    }
}

#[cfg(test)]
mod tests {
    use super::{WarmUp, explained};

    /// Each statement is kept once, in the order added; a connection that has run some runs
    /// only the rest.
    #[test]
    fn the_warm_up_list_grows_once_per_statement() {
        let warm_up = WarmUp::default();
        warm_up.add("a", || "a".into());
        warm_up.add("b", || "b".into());
        warm_up.add("a", || unreachable!("a key added once is not built again"));
        assert_eq!(warm_up.since(0), ["a", "b"]);
        assert_eq!(warm_up.since(1), ["b"]);
        assert!(warm_up.since(2).is_empty());
        assert!(warm_up.since(9).is_empty());
    }

    #[test]
    fn an_encryption_mismatch_names_the_setting_and_its_values() {
        let refused = tiberius::error::Error::Protocol(
            "Server does not allow the requested encryption level.".into(),
        );
        let text = explained(&refused);
        for needed in [
            "Encrypt=",
            "Encrypt=true",
            "Encrypt=false",
            "DANGER_PLAINTEXT",
        ] {
            assert!(text.contains(needed), "{needed}: {text}");
        }
        let other = tiberius::error::Error::Protocol("something else".into());
        assert_eq!(explained(&other), "Protocol error: something else");
    }
}
