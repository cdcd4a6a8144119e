//! PostgreSQL transport: the NServiceBus PostgreSQL transport's table layout and statements on
//! tokio-postgres with a deadpool pool.
//!
//! A receive takes a pooled connection, runs `BEGIN; EXECUTE <receive>` as one query (one
//! round trip, see `pipeline`), and keeps connection and transaction open until the caller
//! commits or rolls back. A receive dropped without either discards its connection, which makes the
//! server roll the transaction back: the message returns to the queue.

mod failed;
pub mod fleet;
mod listen;
mod pipeline;
mod statements;
mod tls;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use chrono::NaiveDateTime;
use deadpool_postgres::{
    Manager, ManagerConfig, Object, ObjectId, Pool, PoolError, RecyclingMethod, Runtime,
};
use tokio_postgres::error::SqlState;
use uuid::Uuid;

pub use statements::{QueueStatements, held_statements, quote_ident};

use super::batch;
use super::delayed::{DelayedDelivery, Moved, delay_millis, delayed_headers};
use super::headers::serialize_headers;
use super::row::RawRow;
use super::unit_of_work::{Receipt, SqlReceived, SqlStore, split_batch};
use super::{
    CommitAndReceive, HeldKey, QueueAdmin, QueueName, Received, Transport, TransportError,
};
use crate::config::{FailedKey, OrderingConfig, TransactionMode, TransportConfig};
use crate::message::OutgoingMessage;
use crate::names::{validate_delayed_table_suffix, validate_schema_name};

/// Connections [`Inner::prepared_receives`] remembers before it starts over: closed
/// connections leave their entries behind, and forgetting a live one costs one `PREPARE`
/// that finds the name taken.
const PREPARED_REMEMBERED: usize = 1024;

/// Rows deleted per statement by [`Transport::purge_expired`].
const PURGE_BATCH: i64 = 10_000;

/// The PostgreSQL transport.
#[derive(Clone)]
pub struct PostgresTransport {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    schema: String,
    /// Delayed tables are `<queue>.<delayed_suffix>` (`transport.delayed_table_suffix`).
    delayed_suffix: String,
    mode: TransactionMode,
    pool_size: u32,
    wait_timeout: Duration,
    /// How long the client waits for an answer before it gives the connection up (see
    /// [`Inner::answered`]).
    answer_deadline: Duration,
    /// Statements waiting for an answer, to tell a database that stopped answering.
    silence: Arc<super::silence::Silence>,
    statements: RwLock<HashMap<QueueName, Arc<QueueStatements>>>,
    /// Which pooled connections have which receive statements prepared under their SQL
    /// names (see `pipeline`).
    prepared_receives: Mutex<HashMap<ObjectId, Vec<String>>>,
    /// How the listening connection connects (see `listen`): the pool's settings.
    listen_with: (
        tokio_postgres::Config,
        Option<tokio_postgres_rustls::MakeRustlsConnect>,
    ),
    /// Whether tables get the insert trigger and the host listens (`notify_on_insert`).
    notify_on_insert: bool,
    /// Ends the listening connection with the transport.
    stop_listening: tokio_util::sync::CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop_listening.cancel();
    }
}

impl PostgresTransport {
    /// Opens a pool from the configuration and checks that the server answers.
    pub async fn connect(config: &TransportConfig) -> Result<Self, TransportError> {
        let transport = Self::new(config)?;
        transport.ping().await?;
        Ok(transport)
    }

    /// Builds the pool without connecting (connections open on first use).
    pub fn new(config: &TransportConfig) -> Result<Self, TransportError> {
        let schema = config.effective_schema().to_string();
        validate_schema_name(&schema).map_err(TransportError::InvalidName)?;
        validate_delayed_table_suffix(&config.delayed_table_suffix).map_err(|message| {
            TransportError::Setting {
                setting: "transport.delayed_table_suffix",
                message,
            }
        })?;
        check_url_userinfo(config.connection_string.expose())?;
        let tls = tls::TlsSettings::read(config.connection_string.expose());
        let mut pg = tokio_postgres::Config::from_str(&tls.connection_string).map_err(|e| {
            TransportError::Setting {
                setting: "transport.connection_string",
                message: format!(
                    "not a PostgreSQL connection string ({e}); got {}",
                    config.connection_string
                ),
            }
        })?;
        libpq_environment(&mut pg);
        pg.connect_timeout(config.connect_timeout);
        if pg.get_application_name().is_none() {
            pg.application_name("throttlehost");
        }
        let statement_timeout = format!(
            "-c statement_timeout={}",
            config.command_timeout.as_millis()
        );
        let options = match pg.get_options() {
            Some(existing) => format!("{existing} {statement_timeout}"),
            None => statement_timeout,
        };
        pg.options(&options);
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let (manager, listen_with) =
            if pg.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
                let listen_with = (pg.clone(), None);
                (
                    Manager::from_config(pg, tokio_postgres::NoTls, manager_config),
                    listen_with,
                )
            } else {
                // libpq semantics (see `tls`): prefer/require encrypt without checking the
                // certificate; verify-ca/verify-full check it.
                let connector = tls.connector().map_err(|e| TransportError::Setting {
                    setting: "transport.connection_string",
                    message: e.to_string(),
                })?;
                let listen_with = (pg.clone(), Some(connector.clone()));
                (
                    Manager::from_config(pg, connector, manager_config),
                    listen_with,
                )
            };
        let pool = Pool::builder(manager)
            .max_size(config.pool_size as usize)
            .wait_timeout(Some(config.connect_timeout))
            .create_timeout(Some(config.connect_timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| TransportError::Setting {
                setting: "transport.pool_size",
                message: format!("cannot build the connection pool: {e}"),
            })?;
        Ok(PostgresTransport {
            inner: Arc::new(Inner {
                pool,
                schema,
                delayed_suffix: config.delayed_table_suffix.clone(),
                mode: config.transaction_mode,
                pool_size: config.pool_size,
                wait_timeout: config.connect_timeout,
                answer_deadline: config.command_timeout + ANSWER_GRACE,
                silence: Arc::default(),
                statements: RwLock::new(HashMap::new()),
                prepared_receives: Mutex::new(HashMap::new()),
                listen_with,
                notify_on_insert: config.notify_on_insert,
                stop_listening: tokio_util::sync::CancellationToken::new(),
            }),
        })
    }

    /// The schema the queue tables live in.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }
}

/// A URL whose password holds an unencoded `@` is read by every driver as a host name after
/// the first `@`: a name lookup error that says nothing of the password. Say what it is.
fn check_url_userinfo(raw: &str) -> Result<(), TransportError> {
    let Some(rest) = raw
        .strip_prefix("postgres://")
        .or_else(|| raw.strip_prefix("postgresql://"))
    else {
        return Ok(());
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    if authority.matches('@').count() > 1 {
        return Err(TransportError::Setting {
            setting: "transport.connection_string",
            message: "the URL's user or password holds an `@`; write it percent-encoded as %40 (and `:` as %3A, `/` as %2F)".into(),
        });
    }
    Ok(())
}

/// Fills what the connection string leaves out from the environment variables libpq reads
/// (`PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`, `PGPASSWORD`) and then from the password file
/// (`PGPASSFILE`, else `~/.pgpass`), as a PostgreSQL user expects.
fn libpq_environment(pg: &mut tokio_postgres::Config) {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if pg.get_hosts().is_empty()
        && let Some(hosts) = var("PGHOST")
    {
        for host in hosts.split(',') {
            pg.host(host.trim());
        }
    }
    if pg.get_ports().is_empty()
        && let Some(port) = var("PGPORT").and_then(|p| p.trim().parse::<u16>().ok())
    {
        pg.port(port);
    }
    if pg.get_user().is_none()
        && let Some(user) = var("PGUSER")
    {
        pg.user(&user);
    }
    if pg.get_dbname().is_none()
        && let Some(db) = var("PGDATABASE")
    {
        pg.dbname(&db);
    }
    if pg.get_password().is_some() {
        return;
    }
    if let Some(password) = var("PGPASSWORD") {
        pg.password(password);
        return;
    }
    let file = var("PGPASSFILE")
        .map(std::path::PathBuf::from)
        .or_else(|| var("HOME").map(|h| std::path::Path::new(&h).join(".pgpass")));
    if let Some(text) = file.and_then(|f| std::fs::read_to_string(f).ok())
        && let Some(password) = password_file_entry(pg, &text)
    {
        pg.password(password);
    }
}

/// The password of the first line of a libpq password file (`host:port:database:user:password`,
/// `*` matching anything, `\:` and `\\` escaped) that matches these settings.
fn password_file_entry(pg: &tokio_postgres::Config, text: &str) -> Option<String> {
    use tokio_postgres::config::Host;
    let host = match pg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(Host::Unix(_)) | None => "localhost".to_string(),
        #[cfg(not(unix))]
        None => "localhost".to_string(),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = pg.get_user().unwrap_or_default().to_string();
    let db = pg
        .get_dbname()
        .map(str::to_string)
        .unwrap_or_else(|| user.clone());
    let wanted = [host, port, db, user];
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .find_map(|line| {
            let mut fields = Vec::new();
            let mut field = String::new();
            let mut chars = line.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => field.extend(chars.next()),
                    ':' if fields.len() < 4 => fields.push(std::mem::take(&mut field)),
                    c => field.push(c),
                }
            }
            fields.push(field);
            (fields.len() == 5
                && fields[..4]
                    .iter()
                    .zip(&wanted)
                    .all(|(f, w)| f == "*" || f == w))
            .then(|| fields.pop().unwrap_or_default())
        })
}

/// How much longer than `command_timeout` the client waits for an answer: the server's own
/// `statement_timeout` error should come first whenever the server is alive.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

impl Inner {
    /// Runs `work` on `client`, waiting at most the answer deadline, and hands the client
    /// back with what the work returned. The server enforces `command_timeout` itself
    /// (`statement_timeout`), but a frozen server or a network that drops packets never
    /// answers, and the kernel keeps acknowledging a stopped server's socket, so without this
    /// a receive waited forever and nothing was logged. On timeout the connection is closed
    /// (its state is unknown; the server rolls back what it had).
    async fn answered<T>(
        &self,
        what: &'static str,
        client: Object,
        work: impl AsyncFnOnce(&Object) -> T,
    ) -> Result<(Object, T), TransportError> {
        self.answered_mut(what, client, async |c: &mut Object| work(c).await)
            .await
    }

    /// [`Inner::answered`] for work that needs the connection mutably (a transaction).
    async fn answered_mut<T>(
        &self,
        what: &'static str,
        mut client: Object,
        work: impl AsyncFnOnce(&mut Object) -> T,
    ) -> Result<(Object, T), TransportError> {
        let ticket = self.silence.ask();
        match tokio::time::timeout(self.answer_deadline, work(&mut client)).await {
            Ok(answer) => {
                ticket.answered();
                Ok((client, answer))
            }
            Err(_) => {
                ticket.unanswered();
                discard(client);
                Err(TransportError::Unanswered {
                    what,
                    after: self.answer_deadline,
                })
            }
        }
    }

    /// How long statements wait unanswered before the database counts as not answering.
    fn silent_after(&self) -> Duration {
        super::silence::SILENT_AFTER.min(self.answer_deadline)
    }

    /// The schema `queue`'s table is in: the one its address names, else the transport's.
    fn schema_of<'q>(&'q self, queue: &'q QueueName) -> &'q str {
        queue.parts().schema.unwrap_or(&self.schema)
    }

    fn statements(&self, queue: &QueueName) -> Result<Arc<QueueStatements>, TransportError> {
        if let Some(s) = self
            .statements
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(s.clone());
        }
        let parts = queue.parts();
        if parts.catalog.is_some() {
            return Err(TransportError::queue(
                queue,
                "names a catalog: a PostgreSQL address is \"schema\".\"table\" (the database is the connection's)",
            ));
        }
        crate::names::validate_postgres_table_name(parts.table)
            .map_err(TransportError::InvalidName)?;
        let built = Arc::new(QueueStatements::new(
            &self.schema,
            queue,
            &self.delayed_suffix,
        ));
        self.statements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.clone(), built.clone());
        Ok(built)
    }

    /// Whether `client` has the receive of `st` prepared under its SQL name.
    fn receive_prepared(&self, client: &Object, st: &QueueStatements) -> bool {
        self.prepared_receives
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&Object::id(client))
            .is_some_and(|names| names.contains(&st.receive_name))
    }

    /// Prepares the receive of `st` on `client` under its SQL name, once per connection
    /// (outside a transaction: a name found taken is an error that would abort one).
    async fn prepare_receive(
        &self,
        client: &Object,
        st: &QueueStatements,
    ) -> Result<(), tokio_postgres::Error> {
        if self.receive_prepared(client, st) {
            return Ok(());
        }
        let prepare = format!("PREPARE {} AS {}", st.receive_name, st.receive);
        match client.batch_execute(&prepare).await {
            Ok(()) => {}
            // Prepared before this set was started over.
            Err(e) if e.code() == Some(&SqlState::DUPLICATE_PSTATEMENT) => {}
            Err(e) => return Err(e),
        }
        let mut prepared = self
            .prepared_receives
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if prepared.len() >= PREPARED_REMEMBERED {
            prepared.clear();
        }
        prepared
            .entry(Object::id(client))
            .or_default()
            .push(st.receive_name.clone());
        Ok(())
    }

    async fn client(&self) -> Result<Object, TransportError> {
        self.pool.get().await.map_err(|e| match e {
            // Every connection waits on a database that says nothing: that, not the pool's
            // size, is the news.
            PoolError::Timeout(_) => match self.silence.silent_for(self.silent_after()) {
                Some(silent) => TransportError::connection(format!(
                    "the database is not answering: statements have waited {:.0} s with no answer",
                    silent.as_secs_f64()
                )),
                None => TransportError::PoolTimeout {
                    waited: self.wait_timeout,
                    pool_size: self.pool_size,
                },
            },
            PoolError::Backend(e) => map_error(e, None),
            other => TransportError::connection(other.to_string()),
        })
    }

    async fn send_on(
        &self,
        client: &Object,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let st = self.statements(queue)?;
        if let Some(delay_ms) = delay_millis(message)? {
            return self
                .store_delayed_on(client, queue, &st, message, delay_ms)
                .await;
        }
        let stmt = client
            .prepare_cached(&st.send)
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        let ttbr_ms = super::ttbr_millis(message)?;
        let headers = serialize_headers(&message.headers);
        client
            .execute(&stmt, &[&message.id, &ttbr_ms, &headers, &message.body])
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        Ok(())
    }
}

impl Inner {
    /// Stores a delayed message in `queue`'s delayed table, due `delay_ms` after the server's
    /// clock now, with the forward destination set to `queue`.
    async fn store_delayed_on(
        &self,
        client: &Object,
        queue: &QueueName,
        st: &QueueStatements,
        message: &OutgoingMessage,
        delay_ms: i64,
    ) -> Result<(), TransportError> {
        let headers = serialize_headers(&delayed_headers(&message.headers, st.table.clone()));
        let stmt = client
            .prepare_cached(&st.delayed.store)
            .await
            .map_err(|e| map_delayed_error(e, queue, st))?;
        client
            .execute(&stmt, &[&message.id, &headers, &message.body, &delay_ms])
            .await
            .map_err(|e| map_delayed_error(e, queue, st))?;
        Ok(())
    }

    /// Builds the expression indexes an ordered queue's receives probe, those missing only.
    ///
    /// `CREATE INDEX IF NOT EXISTS` takes a SHARE lock on the table before it looks for the
    /// name, so a host starting while others receive would wait for every open receive and
    /// make every new one wait behind it. Existing indexes are therefore looked up first, and
    /// a missing one is built `CONCURRENTLY` (writes go on), one host at a time under the
    /// table's advisory lock (session level: CONCURRENTLY runs outside a transaction).
    async fn ensure_indexes(
        &self,
        queue: &QueueName,
        st: &QueueStatements,
    ) -> Result<(), TransportError> {
        if st.ordering_indexes.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let built: Result<(), tokio_postgres::Error> = async {
            for index in &st.ordering_indexes {
                let exists = "SELECT to_regclass($1) IS NOT NULL";
                if client.query_one(exists, &[&index.name]).await?.get(0) {
                    continue;
                }
                client
                    .execute("SELECT pg_advisory_lock(hashtext($1))", &[&st.table])
                    .await?;
                let created = client.batch_execute(&index.create).await;
                client
                    .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&st.table])
                    .await?;
                created?;
            }
            Ok(())
        }
        .await;
        built.map_err(|e| {
            // A session lock may still be held on it: the connection goes.
            discard(client);
            map_error(e, Some(queue))
        })
    }

    /// The held-keys table of this schema, created when missing (under an advisory lock on
    /// its name: concurrent `CREATE TABLE IF NOT EXISTS` can still collide).
    async fn ensure_held_table(&self, queue: &QueueName) -> Result<(), TransportError> {
        let held = held_statements(&quote_ident(&self.schema));
        let mut client = self.client().await?;
        create_under_lock(&mut client, &held.table, &[&held.create])
            .await
            .map_err(|e| map_error(e, Some(queue)))
    }

    /// Whether this schema has a held-keys table (queues that never held a key have none).
    async fn has_held_table(&self, client: &Object) -> Result<bool, TransportError> {
        let held = held_statements(&quote_ident(&self.schema));
        client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&held.table])
            .await
            .map(|row| row.get(0))
            .map_err(|e| map_error(e, None))
    }

    /// Runs a statement that answers one bigint count (negative read as 0).
    async fn count(
        &self,
        queue: &QueueName,
        what: &'static str,
        sql: &str,
    ) -> Result<u64, TransportError> {
        let client = self.client().await?;
        let (_, row) = self
            .answered(what, client, async |c| {
                let stmt = c.prepare_cached(sql).await?;
                c.query_one(&stmt, &[]).await
            })
            .await?;
        let row = row.map_err(|e| map_error(e, Some(queue)))?;
        let n: i64 = row
            .try_get(0)
            .map_err(|e| TransportError::database(e.to_string()))?;
        Ok(n.max(0) as u64)
    }

    /// Inserts `messages` on `client` with one statement (all or none), in the order given:
    /// arrays through `unnest ... WITH ORDINALITY`, so Seq follows that order.
    async fn send_many_on(
        &self,
        client: &Object,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        if messages.is_empty() {
            return Ok(());
        }
        if messages.iter().any(|m| m.deliver_after.is_some()) {
            // Delayed ones go to another table: one by one, in the order given.
            for message in messages {
                self.send_on(client, queue, message).await?;
            }
            return Ok(());
        }
        let st = self.statements(queue)?;
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
        let (ttbrs, headers) = super::insert_columns(messages)?;
        let bodies: Vec<&[u8]> = messages.iter().map(|m| m.body.as_slice()).collect();
        let stmt = client
            .prepare_cached(&st.send_batch)
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        client
            .execute(&stmt, &[&ids, &ttbrs, &headers, &bodies])
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        Ok(())
    }

    /// Turns the receive statement's result into a [`Received`] (or ends an empty receive).
    /// Whatever went wrong closes the connection: the server rolls its transaction back.
    async fn received(
        self: Arc<Self>,
        queue: &QueueName,
        client: Object,
        transactional: bool,
        row: Result<Option<RawRow>, TransportError>,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                discard(client);
                return Err(e);
            }
        };
        let Some(row) = row else {
            if transactional && let Err(e) = client.batch_execute("ROLLBACK").await {
                discard(client);
                return Err(map_error(e, Some(queue)));
            }
            return Ok(None);
        };
        let client = if transactional { Some(client) } else { None };
        Ok(Some(SqlReceived::boxed(self, queue, client, row)))
    }

    /// Receives up to `max` messages in one transaction (see [`Transport::receive_batch`]).
    async fn receive_batch(
        self: Arc<Self>,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue)?;
        if st.ordered {
            return Err(super::refuse_ordered_batch(queue));
        }
        let client = self.client().await?;
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let (client, asked) = self
            .answered("a receive", client, async |c| {
                let stmt = c.prepare_cached(&st.receive_batch).await?;
                // Pipelined as the single receive is: BEGIN and the DELETE in one write.
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&limit];
                let (begin, rows) = tokio::join!(c.batch_execute("BEGIN"), c.query(&stmt, &params));
                Ok::<_, tokio_postgres::Error>((begin, rows))
            })
            .await?;
        let rows = match asked {
            Ok((Ok(()), Ok(rows))) => rows,
            Ok((Err(e), Ok(rows))) => {
                // BEGIN failed yet the DELETE ran and committed on its own: put the rows
                // back rather than lose them (they go to the tail of the queue).
                discard(client);
                for row in &rows {
                    self.reinsert_autocommitted(queue, row).await;
                }
                return Err(map_error(e, Some(queue)));
            }
            Ok((_, Err(e))) | Err(e) => {
                discard(client);
                return Err(map_error(e, Some(queue)));
            }
        };
        let decoded = rows.iter().map(|row| decode_row(queue, row)).collect();
        split_batch(self, queue, client, decoded).await
    }

    async fn reinsert_autocommitted(&self, queue: &QueueName, row: &tokio_postgres::Row) {
        let result = async {
            let st = self.statements(queue)?;
            let id: Uuid = row
                .try_get(0)
                .map_err(|e| TransportError::database(e.to_string()))?;
            let headers: String = row
                .try_get(2)
                .map_err(|e| TransportError::database(e.to_string()))?;
            let body: Option<Vec<u8>> = row
                .try_get(3)
                .map_err(|e| TransportError::database(e.to_string()))?;
            let client = self.client().await?;
            client
                .execute(&st.send_raw, &[&id, &headers, &body])
                .await
                .map_err(|e| map_error(e, Some(queue)))
        }
        .await;
        if let Err(e) = result {
            tracing::error!(queue = %queue, error = %e, "a message deleted outside a transaction could not be put back");
        }
    }
}

/// Reads `Expires` as the receive prints it (`statements::EXPIRES_TEXT`: ISO, with its offset
/// from UTC; without one it is taken as UTC). Values no date type here can hold (`infinity`,
/// years past 262143) read as no expiry: whether the row has expired was already decided by the
/// server, so only the informational expiry of the message is lost.
fn parse_expires(text: &str) -> Option<NaiveDateTime> {
    NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f")
        .ok()
        .or_else(|| {
            chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
                .ok()
                .map(|t| t.naive_utc())
        })
}

/// The column types a queue table must have (`information_schema` names), by column.
const LAYOUT: [(&str, &[&str]); 5] = [
    ("id", &["uuid"]),
    (
        "expires",
        &["timestamp without time zone", "timestamp with time zone"],
    ),
    ("headers", &["text", "character varying"]),
    ("body", &["bytea"]),
    ("seq", &["integer", "bigint"]),
];

/// Checks a queue table's columns against [`LAYOUT`]; names the first one that differs.
async fn check_layout(
    client: &tokio_postgres::Client,
    schema: &str,
    queue: &QueueName,
) -> Result<(), TransportError> {
    let rows = client
        .query(
            "SELECT lower(column_name::text), data_type::text FROM information_schema.columns              WHERE table_schema = $1 AND table_name = $2",
            &[&schema, &queue.table()],
        )
        .await
        .map_err(|e| map_error(e, Some(queue)))?;
    if rows.is_empty() {
        return Err(TransportError::QueueNotFound(queue.to_string()));
    }
    for (column, accepted) in LAYOUT {
        let found = rows
            .iter()
            .find(|r| r.get::<_, String>(0) == column)
            .map(|r| r.get::<_, String>(1));
        match found {
            Some(t) if accepted.contains(&t.as_str()) => {}
            Some(t) => {
                return Err(TransportError::queue(
                    queue,
                    format!(
                        "has column {column} of type {t}; the queue layout needs {} (see sql/postgres/queue.sql)",
                        accepted.join(" or ")
                    ),
                ));
            }
            None => {
                return Err(TransportError::queue(
                    queue,
                    format!(
                        "has no column {column}: it is not a queue table (see sql/postgres/queue.sql)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Turns a driver error into a transport error that says what happened.
/// An error of a statement on `queue`'s delayed table `st`: a missing table is named as such.
fn map_delayed_error(
    e: tokio_postgres::Error,
    queue: &QueueName,
    st: &QueueStatements,
) -> TransportError {
    match map_error(e, Some(queue)) {
        TransportError::QueueNotFound(_) => TransportError::DelayedTableNotFound {
            queue: queue.to_string(),
            table: st.delayed.table.clone(),
        },
        other => other,
    }
}

fn map_error(e: tokio_postgres::Error, queue: Option<&QueueName>) -> TransportError {
    if let Some(db) = e.as_db_error() {
        let code = db.code();
        if *code == SqlState::UNDEFINED_TABLE {
            return TransportError::QueueNotFound(
                queue
                    .map(|q| q.to_string())
                    .unwrap_or_else(|| db.message().to_string()),
            );
        }
        if *code == SqlState::T_R_DEADLOCK_DETECTED {
            return TransportError::Deadlock(db.message().to_string());
        }
        let class = &code.code()[..2];
        let message = format!("{} (SQLSTATE {})", db.message(), code.code());
        if class == "28" {
            // Not an outage: waiting will not make the password right.
            return TransportError::Login(format!(
                "the server refused the login: {message}; check the user and password in transport.connection_string (or PGUSER, PGPASSWORD, PGPASSFILE)"
            ));
        }
        let mapped = if class == "08" || class == "57" {
            TransportError::connection(message)
        } else {
            TransportError::database(message)
        };
        return mapped.caused_by(e);
    }
    let mapped = if e.is_closed() {
        TransportError::connection("the connection was closed")
    } else {
        // tokio-postgres prints its kind only ("error performing TLS handshake"); the cause
        // says what went wrong ("invalid peer certificate: UnknownIssuer", "Connection
        // refused").
        let mut message = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            message.push_str(&format!(": {c}"));
            cause = c.source();
        }
        if message.contains("password missing") {
            return TransportError::Login(
                "the server asks for a password and none was given: set it in transport.connection_string, PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)".into(),
            );
        }
        TransportError::connection(message)
    };
    mapped.caused_by(e)
}

/// Reads a received row: id, expired flag, headers, body, expiry as text.
fn decode_row(queue: &QueueName, row: &tokio_postgres::Row) -> Result<RawRow, TransportError> {
    let decoded: Result<_, tokio_postgres::Error> = (|| {
        let id: Uuid = row.try_get(0)?;
        let expired: bool = row.try_get(1)?;
        let headers: String = row.try_get(2)?;
        let body: Option<Vec<u8>> = row.try_get(3)?;
        let expires: Option<String> = row.try_get(4)?;
        Ok(RawRow {
            id,
            expired,
            headers,
            body: body.unwrap_or_default(),
            expires: expires.as_deref().and_then(parse_expires),
            // Absent from receives that do not return it (batch receives).
            transaction: row.try_get::<_, Option<i64>>(5).ok().flatten(),
        })
    })();
    decoded.map_err(|e| {
        TransportError::database(format!(
            "queue `{queue}` has columns of unexpected types: {e}"
        ))
    })
}

/// Drops a pooled connection instead of returning it: used whenever its state is unknown
/// (an error mid-transaction, a cancelled receive). Closing it makes the server roll back.
fn discard(client: Object) {
    drop(Object::take(client));
}

#[async_trait]
impl Transport for PostgresTransport {
    fn key_ordering(&self) -> Option<&dyn crate::transport::KeyOrdering> {
        Some(self)
    }

    fn batch_receive(&self) -> Option<&dyn crate::transport::BatchReceive> {
        Some(self)
    }

    fn describe(&self) -> String {
        format!(
            "postgres (schema \"{}\", pool {})",
            self.inner.schema, self.inner.pool_size
        )
    }

    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let client = self.inner.client().await?;
        let (_, sent) = self
            .inner
            .answered("a send", client, async |c| {
                self.inner.send_on(c, queue, message).await
            })
            .await?;
        sent
    }

    async fn send_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        if messages.is_empty() {
            return Ok(());
        }
        let client = self.inner.client().await?;
        let (_, sent) = self
            .inner
            .answered("a batch send", client, async |c| {
                self.inner.send_many_on(c, queue, messages).await
            })
            .await?;
        sent
    }

    async fn receive(
        &self,
        queue: &QueueName,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let transactional = self.inner.mode != TransactionMode::None;
        let (client, row) = self
            .inner
            .answered("a receive", client, async |c| {
                if transactional {
                    if let Err(e) = self.inner.prepare_receive(c, &st).await {
                        return Err(map_error(e, Some(queue)));
                    }
                    // `BEGIN; EXECUTE`: one query, one answer (see `pipeline`).
                    let (_, row) = pipeline::begin_and_receive(c, false, &st.receive_name)
                        .await
                        .outcome(queue);
                    row.unwrap_or_else(|| {
                        Err(TransportError::database(format!(
                            "the receive from queue `{queue}` did not begin"
                        )))
                    })
                } else {
                    let stmt = match c.prepare_cached(&st.receive).await {
                        Ok(stmt) => stmt,
                        Err(e) => return Err(map_error(e, Some(queue))),
                    };
                    match c.query_opt(&stmt, &[]).await {
                        Ok(Some(row)) => decode_row(queue, &row).map(Some),
                        Ok(None) => Ok(None),
                        Err(e) => Err(map_error(e, Some(queue))),
                    }
                }
            })
            .await?;
        self.inner
            .clone()
            .received(queue, client, transactional, row)
            .await
    }

    async fn peek_depth(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        self.inner.count(queue, "a peek", &st.peek).await
    }

    fn silent_for(&self) -> Option<Duration> {
        self.inner.silence.silent_for(self.inner.silent_after())
    }

    /// One listening connection for all of `queues` (outside the pool), woken by the
    /// tables' insert trigger (see `listen`).
    fn wake_on_arrival(&self, queues: &[QueueName], sink: Arc<dyn super::ArrivalSink>) {
        if !self.inner.notify_on_insert {
            return;
        }
        let channels: HashMap<String, QueueName> = queues
            .iter()
            .filter_map(|queue| {
                let st = self.inner.statements(queue).ok()?;
                Some((st.notify_channel.clone(), queue.clone()))
            })
            .collect();
        if channels.is_empty() {
            return;
        }
        let (config, tls) = self.inner.listen_with.clone();
        let listener = listen::Listener {
            config,
            tls,
            channels,
            sink,
            stop: self.inner.stop_listening.clone(),
        };
        tokio::spawn(listener.run());
    }

    fn connections_in_use(&self) -> u64 {
        let s = self.inner.pool.status();
        s.size.saturating_sub(s.available) as u64
    }

    fn delayed_delivery(&self) -> Option<&dyn DelayedDelivery> {
        Some(self)
    }

    fn instance_registry(&self) -> Option<&dyn crate::transport::InstanceRegistry> {
        Some(self)
    }

    fn failed_store(&self) -> Option<&dyn crate::transport::failed::FailedStore> {
        Some(self)
    }

    fn fleet_shares(&self) -> Option<&dyn crate::transport::FleetShares> {
        Some(self)
    }

    async fn ping(&self) -> Result<(), TransportError> {
        let client = self.inner.client().await?;
        let (_, answer) = self
            .inner
            .answered("a ping", client, async |c| c.simple_query("SELECT 1").await)
            .await?;
        answer.map(|_| ()).map_err(|e| map_error(e, None))
    }

    /// NServiceBus's canonical PostgreSQL address, `"schema"."table"`.
    fn address(&self, queue: &QueueName) -> String {
        format!(
            "{}.{}",
            quote_ident(self.inner.schema_of(queue)),
            quote_ident(queue.table())
        )
    }

    fn resolve_address(&self, address: &str) -> Option<QueueName> {
        super::address::parse(address, &self.inner.schema, None)
    }
}

#[async_trait]
impl DelayedDelivery for PostgresTransport {
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let mut client = self.inner.client().await?;
        let schema = format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_ident(self.inner.schema_of(queue))
        );
        // The old table is adopted under the lock that creates the new one, in its
        // transaction: a host creating the table at the same time finds it complete.
        let result = async {
            let tx = client.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock(hashtext($1))",
                &[&st.delayed.table],
            )
            .await?;
            tx.batch_execute(&schema).await?;
            let mut adopted = None;
            if let Some(adopt) = &st.delayed.adopt_old {
                // The DO block leaves its count in a setting the final SELECT reads.
                let rows = tx.simple_query(adopt).await?;
                adopted = rows.iter().find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => {
                        r.get(0).and_then(|v| v.parse::<u64>().ok())
                    }
                    _ => None,
                });
            }
            tx.batch_execute(&st.delayed.create).await?;
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>(adopted)
        }
        .await;
        match result {
            Ok(Some(rows)) => {
                tracing::info!(
                    queue = %queue,
                    table = %st.delayed.table,
                    rows,
                    "adopted the delayed table this host used to name \"{queue}.delayed\": NServiceBus names it {}",
                    st.delayed.table
                );
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) if is_concurrent_creation(&e) => Ok(()),
            Err(e) => Err(map_delayed_error(e, queue, &st)),
        }
    }

    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let lock = format!("throttlehost.mover {}", st.delayed.table);
        let batch = i64::from(batch.max(1));
        let (_, row) = self
            .inner
            .answered("a move of due delayed messages", client, async |c| {
                let stmt = c.prepare_cached(&st.delayed.move_due).await?;
                c.query_one(&stmt, &[&batch, &lock]).await
            })
            .await?;
        let row = row.map_err(|e| map_delayed_error(e, queue, &st))?;
        let count = |i: usize| row.try_get::<_, i64>(i).unwrap_or(0).max(0) as u64;
        let got: bool = row.try_get(1).unwrap_or(false);
        let next_ms: Option<f64> = row.try_get(3).ok().flatten();
        Ok(Moved {
            moved: count(0),
            busy: !got,
            waiting: count(2),
            // A row written by anyone may be due in centuries: kept as it is, up to a bound
            // `Duration` holds (a u32 of milliseconds cut it to 49.7 days).
            next_due_in: next_ms
                .filter(|ms| ms.is_finite())
                .map(|ms| Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 1e12))),
        })
    }

    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let (_, row) = self
            .inner
            .answered("a count of delayed messages", client, async |c| {
                c.query_one(&st.delayed.count, &[]).await
            })
            .await?;
        let n: i64 = row
            .map_err(|e| map_delayed_error(e, queue, &st))?
            .try_get(0)
            .unwrap_or(0);
        Ok(n.max(0) as u64)
    }

    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let (_, row) = self
            .inner
            .answered("a look-up of a delayed table", client, async |c| {
                c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&st.delayed.table])
                    .await
            })
            .await?;
        row.map_err(|e| map_error(e, Some(queue)))?
            .try_get(0)
            .map_err(|e| TransportError::database(e.to_string()))
    }

    fn delayed_table(&self, queue: &QueueName) -> String {
        match self.inner.statements(queue) {
            Ok(st) => st.delayed.table.clone(),
            Err(_) => format!("{queue}.{}", self.inner.delayed_suffix),
        }
    }
}

/// Runs `ddl` (statements that create what is missing, each `IF NOT EXISTS`) in one
/// transaction under an advisory lock keyed by `name`: two hosts creating the same object at
/// once can still collide inside `CREATE ... IF NOT EXISTS`, so they take turns, and the
/// "already exists" errors that remain are harmless (Ok).
async fn create_under_lock(
    client: &mut Object,
    name: &str,
    ddl: &[&str],
) -> Result<(), tokio_postgres::Error> {
    let result = async {
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&name])
            .await?;
        for statement in ddl {
            tx.batch_execute(statement).await?;
        }
        tx.commit().await
    }
    .await;
    match result {
        Err(e) if !is_concurrent_creation(&e) => Err(e),
        _ => Ok(()),
    }
}

/// "Already exists" errors of two hosts creating the same table at once: harmless.
fn is_concurrent_creation(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        [
            SqlState::DUPLICATE_TABLE,
            SqlState::DUPLICATE_OBJECT,
            SqlState::UNIQUE_VIOLATION,
            SqlState::DUPLICATE_SCHEMA,
        ]
        .contains(c)
    })
}

#[async_trait]
impl QueueAdmin for PostgresTransport {
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let mut client = self.inner.client().await?;
        let own_schema = self.inner.schema_of(queue);
        let schema = quote_ident(own_schema);
        // Two hosts creating the same table at once can still collide inside
        // CREATE ... IF NOT EXISTS; an advisory lock keyed by the table serialises them and the
        // remaining "already exists" codes are harmless.
        let result: Result<(), tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&st.table])
                .await?;
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
            tx.batch_execute(&st.create).await?;
            if self.inner.notify_on_insert {
                // The notify function is the schema's, shared by its tables: one creator at a
                // time.
                tx.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('throttlehost_notify:' || $1))",
                    &[&own_schema],
                )
                .await?;
                tx.batch_execute(&st.notify_on_insert).await?;
            }
            tx.commit().await
        }
        .await;
        let created = match result {
            Err(e) if !is_concurrent_creation(&e) => Err(map_error(e, Some(queue))),
            _ => Ok(()),
        };
        created?;
        // CREATE TABLE IF NOT EXISTS leaves a table of another layout in place.
        check_layout(&client, own_schema, queue).await
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let mut total = 0;
        loop {
            let n = client
                .execute(&st.purge_expired_batch, &[&PURGE_BATCH])
                .await
                .map_err(|e| map_error(e, Some(queue)))?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        client
            .execute(&st.purge, &[])
            .await
            .map_err(|e| map_error(e, Some(queue)))
    }

    async fn reset_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", st.table))
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        drop(client);
        self.create_queue(queue).await
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        let client = self.inner.client().await?;
        let rows = client
            .query(
                "SELECT table_name::text FROM information_schema.columns \
                 WHERE table_schema = $1 AND lower(column_name) IN ('id', 'expires', 'headers', 'body', 'seq') \
                 GROUP BY table_name HAVING count(*) = 5 ORDER BY 1",
                &[&self.inner.schema],
            )
            .await
            .map_err(|e| map_error(e, None))?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    async fn startup_checks(&self, queues: &[QueueName]) -> Result<Vec<String>, TransportError> {
        let mut warnings = Vec::new();
        let client = match self.inner.client().await {
            Ok(c) => c,
            Err(e) => return Ok(vec![format!("cannot run start-up checks: {e}")]),
        };
        for queue in queues {
            match check_layout(&client, self.inner.schema_of(queue), queue).await {
                Err(e) if e.is_configuration() => return Err(e),
                Err(e) => warnings.push(format!("cannot check the layout of `{queue}`: {e}")),
                Ok(()) => {}
            }
            let indexed = client
                .query_opt(
                    "SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 \
                     AND indexdef ILIKE '%UNIQUE%(seq)%'",
                    &[&self.inner.schema_of(queue), &queue.table()],
                )
                .await;
            match indexed {
                Ok(Some(_)) => {}
                Ok(None) => warnings.push(format!(
                    "queue `{queue}` has no unique index on Seq: receives will scan the table (see sql/postgres/queue.sql)"
                )),
                Err(e) => warnings.push(format!("cannot check the indexes of `{queue}`: {}", map_error(e, Some(queue)))),
            }
        }
        Ok(warnings)
    }
}

#[async_trait]
impl SqlStore for Inner {
    type Conn = Object;

    async fn hold(
        &self,
        queue: &QueueName,
        id: Uuid,
        key: &str,
        reason: &str,
    ) -> Result<(), TransportError> {
        let st = self.statements(queue)?;
        let held = held_statements(&quote_ident(&self.schema));
        let client = self.client().await?;
        client
            .execute(&held.insert, &[&st.table, &id, &key, &reason])
            .await
            .map(|_| ())
            .map_err(|e| map_error(e, Some(queue)))
    }

    async fn insert(
        &self,
        conn: &mut Object,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.send_on(conn, queue, message).await
    }

    async fn insert_many(
        &self,
        conn: &mut Object,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        self.send_many_on(conn, queue, messages).await
    }

    async fn insert_alone(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let client = self.client().await?;
        self.send_on(&client, queue, message).await
    }

    async fn insert_raw(
        &self,
        conn: Option<&mut Object>,
        queue: &QueueName,
        (id, headers, body): (Uuid, &str, &[u8]),
    ) -> Result<(), TransportError> {
        let st = self.statements(queue)?;
        let pooled;
        let client = match conn {
            Some(c) => &*c,
            None => {
                pooled = self.client().await?;
                &pooled
            }
        };
        async {
            let stmt = client.prepare_cached(&st.send_raw).await?;
            client.execute(&stmt, &[&id, &headers, &body]).await
        }
        .await
        .map(|_| ())
        .map_err(|e| map_error(e, Some(queue)))
    }

    async fn end(
        &self,
        client: Object,
        queue: &QueueName,
        commit: bool,
        _after_failure: bool,
    ) -> Result<(), TransportError> {
        // After a failed statement PostgreSQL only needs the ROLLBACK: the connection is
        // clean again once it answered.
        let (statement, what) = match commit {
            true => ("COMMIT", "a commit"),
            false => ("ROLLBACK", "a rollback"),
        };
        let (client, ended) = self
            .answered(what, client, async |c| c.batch_execute(statement).await)
            .await?;
        ended.map_err(|e| {
            discard(client);
            map_error(e, Some(queue))
        })
    }

    fn abandon(&self, client: Object) {
        discard(client);
    }

    async fn took_effect(
        &self,
        queue: &QueueName,
        receipt: Receipt,
    ) -> Result<bool, TransportError> {
        // A statement's deadline passed and nothing has answered since: asking now would wait
        // another deadline on a connection others need (a frozen server then went unnoticed
        // for 15 s while every receiver asked). The commit stays in doubt.
        if self.silence.deadline_passed() {
            return Err(TransportError::connection(
                "the database has not answered since a statement's deadline passed",
            ));
        }
        let Some(transaction) = receipt.transaction else {
            return Err(TransportError::database(
                "the receive did not return its transaction's id",
            ));
        };
        // The server knows: `txid_status` says committed, aborted or still in progress (a
        // backend that has not yet read the COMMIT or seen its connection closed).
        let deadline = tokio::time::Instant::now() + self.answer_deadline;
        loop {
            let client = self.client().await?;
            let (client, status) = self
                .answered("the status of a commit", client, async |c| {
                    c.query_one("SELECT txid_status($1)", &[&transaction]).await
                })
                .await?;
            let status: Option<String> = status.and_then(|row| row.try_get(0)).map_err(|e| {
                discard(client);
                map_error(e, Some(queue))
            })?;
            match status.as_deref() {
                Some("committed") => return Ok(true),
                Some("aborted") => return Ok(false),
                Some("in progress") if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => {
                    return Err(TransportError::database(format!(
                        "transaction {transaction} is {}",
                        other.unwrap_or("too old to be known")
                    )));
                }
            }
        }
    }

    async fn commit_and_receive(
        self: Arc<Self>,
        client: Object,
        transport: &dyn Transport,
        queue: &QueueName,
    ) -> CommitAndReceive {
        let st = match self.statements(queue) {
            Ok(st) if self.receive_prepared(&client, &st) => st,
            // A receive that changed since (the queue began keeping order): commit, then
            // receive as a first receive does.
            _ => {
                let committed = self.end(client, queue, true, false).await;
                return CommitAndReceive::then_receive(committed, transport, queue).await;
            }
        };
        // One round trip and one answer: `COMMIT; BEGIN; EXECUTE` (see `pipeline`).
        let asked = self
            .answered("a commit", client, async |c| {
                pipeline::begin_and_receive(c, true, &st.receive_name).await
            })
            .await;
        let (client, pipelined) = match asked {
            Ok(answers) => answers,
            // Whether the COMMIT took effect is not known: reported as failed, the message
            // is handled again if it did not (at least once).
            Err(unanswered) => {
                return CommitAndReceive {
                    committed: Err(unanswered),
                    next: None,
                };
            }
        };
        let (committed, row) = pipelined.outcome(queue);
        let next = match row {
            Some(row) => Some(self.received(queue, client, true, row).await),
            // The COMMIT failed: the next receive counts as not attempted.
            None => {
                discard(client);
                None
            }
        };
        CommitAndReceive { committed, next }
    }
}

#[async_trait]
impl crate::transport::KeyOrdering for PostgresTransport {
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError> {
        super::check_orderable(self.inner.mode, queue)?;
        // Validates the name, as every statement of the queue does.
        self.inner.statements(queue)?;
        let plain = QueueStatements::new(&self.inner.schema, queue, &self.inner.delayed_suffix);
        let statements = match ordering.is_ordered() {
            true => plain.with_ordering(ordering),
            false => plain,
        };
        self.inner.ensure_indexes(queue, &statements).await?;
        if ordering.failed_key == FailedKey::Hold && ordering.key_header().is_some() {
            self.inner.ensure_held_table(queue).await?;
        }
        self.inner
            .statements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.clone(), Arc::new(statements));
        Ok(())
    }

    async fn held_keys(&self, queue: &QueueName) -> Result<Vec<HeldKey>, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        if !self.inner.has_held_table(&client).await? {
            return Ok(Vec::new());
        }
        let held = held_statements(&quote_ident(&self.inner.schema));
        let rows = client
            .query(&held.list, &[&st.table])
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        Ok(rows
            .iter()
            .map(|r| HeldKey {
                key: r.get(0),
                message_id: r.get(1),
                reason: r.get(2),
                held_at: r.get(3),
            })
            .collect())
    }

    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        if !self.inner.has_held_table(&client).await? {
            return Ok(0);
        }
        let held = held_statements(&quote_ident(&self.inner.schema));
        let released = match key {
            Some(key) => client.execute(&held.release, &[&st.table, &key]).await,
            None => client.execute(&held.release_all, &[&st.table]).await,
        };
        released.map_err(|e| map_error(e, Some(queue)))
    }

    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError> {
        let st = self.inner.statements(queue)?;
        match &st.waiting {
            Some(sql) => self.inner.count(queue, "a count", sql).await.map(Some),
            None => Ok(None),
        }
    }
}

#[async_trait]
impl crate::transport::BatchReceive for PostgresTransport {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        // Mode `none` deletes before handlers run: a batch there is single receives.
        if max <= 1 || self.inner.mode == TransactionMode::None {
            return batch::EachOnItsOwn::receive(self, queue, max).await;
        }
        self.inner.clone().receive_batch(queue, max).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unencoded_at_in_a_url_password_is_named() {
        let e = check_url_userinfo("postgres://app:p@ss@db/test").unwrap_err();
        assert!(e.to_string().contains("%40"), "{e}");
        assert!(check_url_userinfo("postgres://app:p%40ss@db/test?x=a@b").is_ok());
        assert!(check_url_userinfo("host=db password=p@ss").is_ok());
    }

    #[test]
    fn the_password_file_is_read_as_libpq_reads_it() {
        let pg: tokio_postgres::Config = "host=db.example port=5433 user=app dbname=orders"
            .parse()
            .unwrap();
        let file = "# comment\nother:5433:orders:app:wrong\ndb.example:5433:*:app:pa\\:ss\\\\word\n*:*:*:*:fallback\n";
        assert_eq!(
            password_file_entry(&pg, file).as_deref(),
            Some("pa:ss\\word")
        );
        let other: tokio_postgres::Config = "host=x user=u".parse().unwrap();
        assert_eq!(
            password_file_entry(&other, file).as_deref(),
            Some("fallback")
        );
        assert_eq!(password_file_entry(&other, "x:1:2:3:4\n"), None);
    }
}
