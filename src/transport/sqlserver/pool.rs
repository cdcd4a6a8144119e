//! Pooled tiberius connections: a bb8 manager of our own (the published tiberius pool crates
//! do not build against tiberius 0.13).
//!
//! tiberius cannot say whether a connection is still usable after an error (a timed-out or
//! cancelled request leaves it out of step with the server), so any connection that saw an
//! error or timeout is marked broken and the pool drops it instead of handing it out again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tiberius::{Client, Config};
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

/// Statements run on every new connection: counts off (NServiceBus does the same per
/// statement), abort the transaction on any error, READ COMMITTED (READPAST needs it).
const SESSION_SETUP: &str =
    "SET NOCOUNT ON; SET XACT_ABORT ON; SET TRANSACTION ISOLATION LEVEL READ COMMITTED;";

/// A pooled connection.
pub struct Connection {
    /// The tiberius client.
    pub client: Client<Compat<TcpStream>>,
    /// Set after any error: the pool drops the connection instead of reusing it.
    pub broken: bool,
    /// The row this connection's open transaction claimed (Babelfish's claiming receive);
    /// counted as held until the transaction ends or the connection goes.
    pub claim: Vec<super::claim::Held>,
}

impl Connection {
    /// Runs a batch of statements whose results are not needed (transaction control,
    /// session settings), reading every result so the connection is ready for the next.
    pub async fn run_batch(&mut self, sql: &str) -> Result<(), tiberius::error::Error> {
        self.client.simple_query(sql).await?.into_results().await?;
        Ok(())
    }

    /// Runs a batch and returns the rows of its first result set.
    pub async fn first_result(
        &mut self,
        sql: &str,
    ) -> Result<Vec<tiberius::Row>, tiberius::error::Error> {
        self.client
            .simple_query(sql)
            .await?
            .into_first_result()
            .await
    }
}

/// Opens connections for bb8.
pub struct Manager {
    config: Config,
    connect_timeout: Duration,
    /// The last connect error, so a pool timeout can say why ("connection refused", bad
    /// password) instead of only that it timed out.
    last_error: Arc<Mutex<Option<String>>>,
}

impl Manager {
    /// A manager opening connections with this configuration.
    pub fn new(config: Config, connect_timeout: Duration) -> Self {
        Manager {
            config,
            connect_timeout,
            last_error: Arc::default(),
        }
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
        Ok(Connection {
            client,
            broken: false,
            claim: Vec::new(),
        })
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
        conn.client
            .simple_query("SELECT 1")
            .await?
            .into_results()
            .await?;
        Ok(())
    }

    fn has_broken(&self, conn: &mut Connection) -> bool {
        conn.broken
    }
}

#[cfg(test)]
mod tests {
    use super::explained;

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
