//! SQL Server transport: the NServiceBus SQL Server transport's table layout and statement
//! semantics on tiberius 0.13, pooled with bb8 (see [`pool`]).
//!
//! A receive takes a pooled connection and sends one batch: `BEGIN TRAN`, the receive DELETE
//! (`UPDLOCK, READPAST, ROWLOCK`, oldest RowVersion first, OUTPUT of the deleted row), and a
//! `COMMIT` of the empty transaction when nothing was deleted: one round trip either way. The
//! connection keeps the transaction open until the caller commits or rolls back; a receive
//! dropped without either marks its connection broken, and closing it makes the server roll
//! back. Sessions run READ COMMITTED with `XACT_ABORT ON`.
//!
//! Not verified against a live server in this project's CI (none is available there); the
//! conformance suite runs against one when `SQLSERVER_URL` is set.

mod claim;
mod failed;
pub mod fleet;
pub mod pool;
pub mod statements;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bb8::{PooledConnection, RunError};
use chrono::NaiveDateTime;
use uuid::Uuid;

pub use statements::{QueueStatements, bracket, held_statements};

use self::pool::{Connection, Manager};
use super::batch;
use super::delayed::{DelayedDelivery, Moved, delay_millis, delayed_headers};
use super::headers::serialize_headers;
use super::row::RawRow;
use super::unit_of_work::{Receipt, SqlReceived, SqlStore, split_batch};
use super::{
    CommitAndReceive, ConflictSink, HeldKey, QueueAdmin, QueueName, Received, Transport,
    TransportError,
};
use crate::config::{Dialect, FailedKey, OrderingConfig, TransactionMode, TransportConfig};
use crate::message::OutgoingMessage;
use crate::names::validate_schema_name;

/// Rows deleted per statement by [`Transport::purge_expired`] (NServiceBus default).
const PURGE_BATCH: i64 = 10_000;
/// Standalone sends chosen as deadlock victims are retried this many times.
const DEADLOCK_RETRIES: u32 = 3;
/// The most rows one batch receive takes (the configuration allows no more).
const MAX_BATCH: u32 = 1000;

type Pooled = PooledConnection<'static, Manager>;

/// The SQL Server transport.
#[derive(Clone)]
pub struct SqlServerTransport {
    inner: Arc<Inner>,
}

struct Inner {
    pool: bb8::Pool<Manager>,
    schema: String,
    /// The database the connection string names, or the login's default database as the
    /// server told it at connect: NServiceBus's addresses name it (`table@[schema]@[catalog]`).
    catalog: std::sync::OnceLock<String>,
    /// Delayed tables are `<queue>.<delayed_suffix>` (`transport.delayed_table_suffix`).
    delayed_suffix: String,
    dialect: Dialect,
    mode: TransactionMode,
    pool_size: u32,
    wait_timeout: Duration,
    max_pool_size_in_connection_string: bool,
    last_connect_error: Arc<std::sync::Mutex<Option<String>>>,
    /// Whether the server answers the pool's statements.
    silence: Arc<super::silence::Silence>,
    /// How long statements may wait unanswered before the server counts as not answering.
    silent_after: Duration,
    statements: RwLock<HashMap<QueueName, Arc<QueueStatements>>>,
    recoverable: RwLock<HashMap<QueueName, bool>>,
    /// Held while `recoverable` is looked up in the catalog.
    recoverable_lookup: tokio::sync::Mutex<()>,
    /// Rows this host's claiming receives hold, per queue (Babelfish).
    held: claim::HeldRows,
    /// What each connection runs once before it claims (Babelfish; see [`pool::WarmUp`]).
    warm_up: Arc<pool::WarmUp>,
    /// Where handled lock conflicts are counted ([`Transport::report_conflicts_to`]).
    conflicts: RwLock<Option<Arc<dyn ConflictSink>>>,
    /// Told when this process's sends commit (SQL Server does not notify; see
    /// [`Transport::wake_on_arrival`]).
    arrivals: RwLock<Option<Arc<dyn super::ArrivalSink>>>,
}

/// Parses an ADO.NET connection string into a tiberius configuration. Errors never contain
/// the password.
pub fn parse_connection_string(raw: &str) -> Result<tiberius::Config, TransportError> {
    tiberius::Config::from_ado_string(raw).map_err(|e| {
        let mut message = e.to_string();
        for secret in password_values(raw) {
            message = message.replace(&secret, "***");
        }
        TransportError::Setting {
            setting: "transport.connection_string",
            message: format!(
                "not a usable ADO.NET connection string ({message}): {}",
                crate::config::secret::redact(raw)
            ),
        }
    })
}

/// Says once per process that the server's certificate is trusted without validation, when
/// the connection string asks for it (the driver's own warning, on every new connection, is
/// off by default: see the CLI's log filter).
fn warn_once_if_trusting(raw: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let trusting = raw.split(';').any(|part| {
        let (key, value) = part.split_once('=').unwrap_or((part, ""));
        key.trim().eq_ignore_ascii_case("TrustServerCertificate")
            && ["true", "yes"].contains(&value.trim().to_ascii_lowercase().as_str())
    });
    if trusting && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "TrustServerCertificate=true: the SQL Server's certificate is trusted without validation"
        );
    }
}

/// The database an ADO.NET connection string names (`Database` or `Initial Catalog`).
fn catalog_in_connection_string(raw: &str) -> Option<String> {
    raw.split(';')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| {
            matches!(
                k.trim().to_ascii_lowercase().as_str(),
                "database" | "initial catalog"
            )
        })
        .map(|(_, v)| v.trim().trim_matches(['\'', '"']).to_string())
        .rfind(|v| !v.is_empty())
}

fn password_values(raw: &str) -> Vec<String> {
    raw.split(';')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| matches!(k.trim().to_ascii_lowercase().as_str(), "password" | "pwd"))
        .map(|(_, v)| v.trim().trim_matches(['\'', '"']).to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

impl SqlServerTransport {
    /// Opens a pool from the configuration and checks that the server answers.
    pub async fn connect(config: &TransportConfig) -> Result<Self, TransportError> {
        let transport = Self::new(config)?;
        transport.ping().await?;
        if transport.inner.catalog.get().is_none() {
            let mut conn = transport.inner.conn().await?;
            let row = async { conn.query("SELECT DB_NAME()", &[]).await?.into_row().await }
                .await
                .map_err(|e| map_error(e, None))?;
            if let Some(name) = row.and_then(|r| r.get::<&str, _>(0).map(str::to_string)) {
                let _ = transport.inner.catalog.set(name);
            }
        }
        Ok(transport)
    }

    /// Builds the pool without connecting.
    pub fn new(config: &TransportConfig) -> Result<Self, TransportError> {
        let schema = config.effective_schema().to_string();
        validate_schema_name(&schema).map_err(TransportError::InvalidName)?;
        crate::names::validate_delayed_table_suffix(&config.delayed_table_suffix).map_err(
            |message| TransportError::Setting {
                setting: "transport.delayed_table_suffix",
                message,
            },
        )?;
        let raw = config.connection_string.expose();
        let catalog = std::sync::OnceLock::new();
        if let Some(named) = catalog_in_connection_string(raw) {
            let _ = catalog.set(named);
        }
        let mut tiberius_config = parse_connection_string(raw)?;
        warn_once_if_trusting(raw);
        if !raw.to_ascii_lowercase().contains("application name") {
            tiberius_config.application_name("throttlehost");
        }
        tiberius_config.command_timeout(Some(config.command_timeout));
        let manager = Manager::new(tiberius_config, config.connect_timeout);
        let last_connect_error = manager.last_error();
        let silence = manager.silence();
        let warm_up = manager.warm_up();
        // A little longer than a connect may take, so that a failed or stalled connect is
        // reported with its reason, not as a pool without a free connection.
        let wait_timeout = config.connect_timeout + Duration::from_millis(500);
        let pool = bb8::Pool::builder()
            .max_size(config.pool_size.max(1))
            .connection_timeout(wait_timeout)
            .test_on_check_out(false)
            .build_unchecked(manager);
        Ok(SqlServerTransport {
            inner: Arc::new(Inner {
                pool,
                schema,
                catalog,
                delayed_suffix: config.delayed_table_suffix.clone(),
                dialect: config.dialect,
                mode: config.transaction_mode,
                pool_size: config.pool_size,
                wait_timeout,
                max_pool_size_in_connection_string: raw
                    .to_ascii_lowercase()
                    .contains("max pool size"),
                last_connect_error,
                silence,
                silent_after: super::silence::SILENT_AFTER.min(config.command_timeout),
                statements: RwLock::new(HashMap::new()),
                recoverable: RwLock::new(HashMap::new()),
                recoverable_lookup: tokio::sync::Mutex::new(()),
                held: claim::HeldRows::default(),
                warm_up,
                conflicts: RwLock::new(None),
                arrivals: RwLock::new(None),
            }),
        })
    }
}

/// The code Babelfish gives a PostgreSQL error it has no SQL Server number for.
const BABELFISH_UNMAPPED: u32 = 33_557_097;

/// Turns a tiberius error into a transport error that says what happened.
fn map_error(e: tiberius::error::Error, queue: Option<&QueueName>) -> TransportError {
    use tiberius::error::Error;
    match &e {
        Error::Server(token) => match token.code() {
            208 => TransportError::QueueNotFound(
                queue
                    .map(|q| q.to_string())
                    .unwrap_or_else(|| token.message().to_string()),
            ),
            1205 => TransportError::Deadlock(token.message().to_string()),
            // Babelfish reports a missing table as PostgreSQL's error under its catch-all
            // code, not as SQL Server's 208.
            BABELFISH_UNMAPPED
                if token.message().starts_with("relation \"")
                    && token.message().ends_with("does not exist") =>
            {
                TransportError::QueueNotFound(
                    queue
                        .map(|q| q.to_string())
                        .unwrap_or_else(|| token.message().to_string()),
                )
            }
            code => {
                TransportError::database(format!("{} (error {code})", token.message())).caused_by(e)
            }
        },
        Error::Io { .. } | Error::Tls(_) | Error::Routing { .. } | Error::Protocol(_) => {
            TransportError::connection(e.to_string()).caused_by(e)
        }
        _ => TransportError::database(e.to_string()).caused_by(e),
    }
}

/// A server error leaves the connection usable (XACT_ABORT has rolled back what needs it); any
/// other error may leave it out of step with the server.
fn is_server_error(e: &tiberius::error::Error) -> bool {
    matches!(e, tiberius::error::Error::Server(_))
}

impl Inner {
    fn statements(&self, queue: &QueueName) -> Arc<QueueStatements> {
        if let Some(s) = self
            .statements
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return s.clone();
        }
        let built = Arc::new(QueueStatements::new(
            &self.schema,
            queue,
            self.dialect,
            &self.delayed_suffix,
        ));
        self.statements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.clone(), built.clone());
        built
    }

    /// Counts a handled lock conflict on `queue`'s tables where the host asked.
    fn conflict(&self, queue: &QueueName, deadlock: bool) {
        let sink = self.conflicts.read().unwrap_or_else(|e| e.into_inner());
        match (sink.as_ref(), deadlock) {
            (Some(sink), true) => sink.deadlock(queue),
            (Some(sink), false) => sink.lock_timeout(queue),
            (None, _) => {}
        }
    }

    async fn conn(&self) -> Result<Pooled, TransportError> {
        self.pool.get_owned().await.map_err(|e| match e {
            RunError::User(e) => map_error(e, None),
            // The pool could have grown, but the last connect failed and none has worked
            // since: that is why nothing came (a full pool is plain exhaustion).
            RunError::TimedOut => match self
                .last_connect_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
            {
                Some(reason) if self.pool.state().connections < self.pool_size.max(1) => {
                    TransportError::connection(format!("cannot connect to SQL Server: {reason}"))
                }
                // Every connection waits on a server that says nothing: that, not the pool's
                // size, is the news.
                _ if let Some(silent) = self.silence.silent_for(self.silent_after) => {
                    TransportError::connection(format!(
                        "the database is not answering: statements have waited {:.0} s with no answer",
                        silent.as_secs_f64()
                    ))
                }
                _ => TransportError::PoolTimeout {
                    waited: self.wait_timeout,
                    pool_size: self.pool_size,
                },
            },
        })
    }

    /// Whether the queue table has the legacy Recoverable column (checked once per queue, as
    /// NServiceBus does).
    async fn has_recoverable(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        st: &QueueStatements,
    ) -> Result<bool, TransportError> {
        if let Some(known) = self
            .recoverable
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(*known);
        }
        // One look-up at a time: concurrent first sends would each read the catalog, which
        // Babelfish answers slowly (0.2-0.35 s).
        let _one_at_a_time = self.recoverable_lookup.lock().await;
        if let Some(known) = self
            .recoverable
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(*known);
        }
        let row = async {
            conn.simple_query(st.has_recoverable.as_str())
                .await?
                .into_row()
                .await
        }
        .await
        .map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })?;
        let n = row.and_then(|r| int_at(&r, 0)).unwrap_or(-1);
        if n < 0 {
            return Err(TransportError::QueueNotFound(queue.to_string()));
        }
        let has = n > 0;
        self.recoverable
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.clone(), has);
        Ok(has)
    }

    /// Inserts a message on `conn` (inside whatever transaction it has open).
    async fn send_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let st = self.statements(queue);
        if let Some(delay_ms) = delay_millis(message)? {
            let headers =
                serialize_headers(&delayed_headers(&message.headers, self.address_of(queue)));
            let result = conn
                .execute(
                    st.delayed.store.as_str(),
                    &[&headers.as_str(), &message.body.as_slice(), &delay_ms],
                )
                .await;
            return self
                .after_insert(conn, queue, result)
                .map_err(|e| delayed_table_named(e, queue, &st));
        }
        let recoverable = self.has_recoverable(conn, queue, &st).await?;
        let sql = if recoverable {
            &st.send_with_recoverable
        } else {
            &st.send_without_recoverable
        };
        let ttbr = super::ttbr_millis(message)?;
        let headers = serialize_headers(&message.headers);
        let result = conn
            .execute(
                sql.as_str(),
                &[
                    &message.id,
                    &ttbr,
                    &headers.as_str(),
                    &message.body.as_slice(),
                ],
            )
            .await;
        self.after_insert(conn, queue, result)
    }

    /// Inserts `messages` on `conn` in the order given, [`statements::SEND_MANY_ROWS`] per
    /// statement (one statement, all or none, up to that many; several beyond it, so the
    /// caller wraps more in a transaction when they must be all or none).
    async fn send_many_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        let st = self.statements(queue);
        if messages.iter().any(|m| m.deliver_after.is_some()) {
            // Delayed ones go to another table: one by one, in the order given.
            for message in messages {
                self.send_on(conn, queue, message).await?;
            }
            return Ok(());
        }
        for chunk in messages.chunks(statements::SEND_MANY_ROWS) {
            let recoverable = self.has_recoverable(conn, queue, &st).await?;
            let sql = statements::send_many(&st.table, chunk.len(), recoverable);
            let (ttbrs, headers) = super::insert_columns(chunk)?;
            let mut params: Vec<&dyn tiberius::ToSql> = Vec::with_capacity(4 * chunk.len());
            for (i, message) in chunk.iter().enumerate() {
                params.push(&message.id);
                params.push(&ttbrs[i]);
                params.push(&headers[i]);
                params.push(&message.body);
            }
            let result = conn.execute(sql.as_str(), &params).await;
            self.after_insert(conn, queue, result)?;
        }
        Ok(())
    }

    /// Stores `messages` (none with an expiry or a delay) in the order given through the TDS
    /// bulk load, inside the transaction open on `conn`.
    async fn bulk_load_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        use tiberius::IntoRow;
        let st = self.statements(queue);
        let recoverable = self.has_recoverable(conn, queue, &st).await?;
        let (_, headers) = super::insert_columns(messages)?;
        let loaded = async {
            let columns: &[&str] = match recoverable {
                true => &["Id", "Recoverable", "Headers", "Body"],
                false => &["Id", "Headers", "Body"],
            };
            let mut request = conn.bulk_insert_columns(&st.table, columns).await?;
            for (message, headers) in messages.iter().zip(&headers) {
                let row = match recoverable {
                    true => {
                        (message.id, true, headers.as_str(), message.body.as_slice()).into_row()
                    }
                    false => (message.id, headers.as_str(), message.body.as_slice()).into_row(),
                };
                request.send(row).await?;
            }
            request.finalize().await
        }
        .await;
        loaded.map(|_| ()).map_err(|e| {
            conn.broken = true;
            map_error(e, Some(queue))
        })
    }

    /// Inserts a raw row (poison dead-lettering) on `conn`.
    async fn send_raw_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        id: Uuid,
        headers: &str,
        body: &[u8],
    ) -> Result<(), TransportError> {
        let st = self.statements(queue);
        let recoverable = self.has_recoverable(conn, queue, &st).await?;
        let sql = if recoverable {
            &st.send_raw_with_recoverable
        } else {
            &st.send_raw_without_recoverable
        };
        let result = conn.execute(sql.as_str(), &[&id, &headers, &body]).await;
        self.after_insert(conn, queue, result)
    }

    fn after_insert(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        result: Result<tiberius::ExecuteResult, tiberius::error::Error>,
    ) -> Result<(), TransportError> {
        match result {
            Ok(_) => Ok(()),
            Err(e) => {
                // Invalid column (207) or NULL into a NOT NULL column (515) naming Recoverable:
                // the table changed shape; detect the column again next time.
                if let tiberius::error::Error::Server(t) = &e
                    && matches!(t.code(), 207 | 515)
                    && t.message().contains("Recoverable")
                {
                    self.recoverable
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(queue);
                }
                conn.broken |= !is_server_error(&e);
                Err(map_error(e, Some(queue)))
            }
        }
    }

    /// Runs a receive batch and turns its result into a [`Received`].
    async fn run_receive(
        self: &Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
        sql: &str,
        transactional: bool,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let rows = receive_rows(&mut conn, queue, sql).await?;
        let Some(row) = rows.first() else {
            // The batch already ended the empty transaction.
            return Ok(None);
        };
        let row = match decode_row(queue, row) {
            Ok(row) => row,
            Err(e) => {
                conn.broken = true;
                return Err(e);
            }
        };
        let conn = if transactional { Some(conn) } else { None };
        Ok(Some(SqlReceived::boxed(self.clone(), queue, conn, row)))
    }

    /// Babelfish's receive: claims a row no other transaction holds (see `claim.rs`).
    async fn claim_receive(
        self: &Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
        transactional: bool,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue);
        for _ in 0..claim::CLAIM_ATTEMPTS {
            let Some(target) = self.candidates(&mut conn, queue, 1).await?.pop() else {
                return Ok(None);
            };
            let sql =
                statements::babelfish_claim(&st.table, &[target.row_version()], transactional);
            match conn.first_result(&sql).await {
                Ok(rows) => match rows.first() {
                    Some(row) => {
                        let (row, _) =
                            decode_claimed(queue, row).inspect_err(|_| conn.broken = true)?;
                        if !transactional {
                            return Ok(Some(SqlReceived::boxed(self.clone(), queue, None, row)));
                        }
                        conn.claim.push(target);
                        return Ok(Some(SqlReceived::boxed(
                            self.clone(),
                            queue,
                            Some(conn),
                            row,
                        )));
                    }
                    // Gone since the look-up (another host took it): the next candidate.
                    None if transactional => self.end_empty_claim(&mut conn, queue).await?,
                    None => {}
                },
                Err(e) => {
                    self.gave_up_on_held_row(&mut conn, queue, e).await?;
                    target.held_elsewhere();
                }
            }
        }
        Ok(None)
    }

    /// Up to `n` rows for this host's receive to claim, each held by it alone until the
    /// guard drops: the last look-up's candidates, or a new look-up's when those run short.
    async fn candidates(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        n: usize,
    ) -> Result<Vec<claim::Held>, TransportError> {
        // Every look-up comes before a claim, and the first ones run while the queue is
        // still empty (each receiver's first receive): the queue's claim of no row joins the
        // warm-up there, and this connection runs it now, not inside a message's receive.
        let table = &self.statements(queue).table;
        self.warm_up
            .add(table, || statements::babelfish_warm_up(table));
        conn.warm().await;
        let mut taken = self.held.take(queue, n);
        if taken.len() == n {
            return Ok(taken);
        }
        let looking = self.held.look_up(queue).await;
        if !looking.found_meanwhile() {
            let sql = statements::babelfish_candidates(
                &self.statements(queue).claim_from,
                (&looking.excluded, looking.skip),
                n.saturating_mul(2).max(claim::CANDIDATES),
            );
            let rows = conn.first_result(&sql).await.map_err(|e| {
                conn.broken |= !is_server_error(&e);
                map_error(e, Some(queue))
            })?;
            let found: Vec<i64> = rows.iter().filter_map(|row| int_at(row, 0)).collect();
            looking.found(&found);
        }
        taken.extend(self.held.take(queue, n - taken.len()));
        Ok(taken)
    }

    /// After a statement that failed under the claims' 1 ms lock timeout: Ok when it gave
    /// up on a row another transaction holds (counted, its transaction rolled back, the
    /// connection fit for the next attempt); any other error closes the connection and is
    /// returned.
    async fn gave_up_on_held_row(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        error: tiberius::error::Error,
    ) -> Result<(), TransportError> {
        let held = matches!(&error, tiberius::error::Error::Server(t)
            if claim::classify(t.code(), t.message()) == claim::ClaimFailure::Held);
        if !held {
            conn.broken = true;
            return Err(map_error(error, Some(queue)));
        }
        self.conflict(queue, false);
        self.end_empty_claim(conn, queue).await
    }

    /// Ends the transaction of a claim that took nothing ([`statements::CLAIM_GIVE_UP`]),
    /// leaving the connection fit for the next statement.
    async fn end_empty_claim(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
    ) -> Result<(), TransportError> {
        conn.run_batch(statements::CLAIM_GIVE_UP)
            .await
            .map_err(|e| {
                conn.broken = true;
                map_error(e, Some(queue))
            })
    }

    /// Babelfish's commit-and-receive: the commit, then a claim on the same connection.
    async fn commit_and_claim(
        self: Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
    ) -> CommitAndReceive {
        let committed = conn.run_batch("COMMIT TRAN;").await;
        claim::release(&mut conn.claim, committed.is_err());
        if let Err(e) = committed {
            conn.broken = true;
            return CommitAndReceive {
                committed: Err(map_error(e, Some(queue))),
                next: None,
            };
        }
        CommitAndReceive {
            committed: Ok(()),
            next: Some(self.claim_receive(conn, queue, true).await),
        }
    }

    /// Receives up to `max` messages in one transaction (see [`Transport::receive_batch`]).
    async fn receive_batch(
        self: &Arc<Self>,
        queue: &QueueName,
        max: u32,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue);
        if st.ordered {
            return Err(super::refuse_ordered_batch(queue));
        }
        let mut conn = self.conn().await?;
        if self.dialect == Dialect::Babelfish {
            return self.claim_batch(conn, queue, max).await;
        }
        let sql = statements::begin_and_receive_batch(&st.table, max, self.dialect);
        let rows = receive_rows(&mut conn, queue, &sql).await?;
        if rows.is_empty() {
            // The batch already ended the empty transaction.
            return Ok(Vec::new());
        }
        let decoded = rows.iter().map(|row| decode_row(queue, row)).collect();
        split_batch(self.clone(), queue, conn, decoded).await
    }

    /// Babelfish's batch receive: a claim of up to `max` candidates at once (see
    /// `claim.rs`). A row another host holds makes it give up within 1 ms and answer empty.
    async fn claim_batch(
        self: &Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
        max: u32,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue);
        let targets = self.candidates(&mut conn, queue, max as usize).await?;
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let row_versions: Vec<i64> = targets.iter().map(claim::Held::row_version).collect();
        let sql = statements::babelfish_claim(&st.table, &row_versions, true);
        let rows = match conn.first_result(&sql).await {
            Ok(rows) => rows,
            Err(e) => {
                self.gave_up_on_held_row(&mut conn, queue, e).await?;
                return Ok(Vec::new());
            }
        };
        if rows.is_empty() {
            self.end_empty_claim(&mut conn, queue).await?;
            return Ok(Vec::new());
        }
        let claimed: Result<Vec<(RawRow, i64)>, TransportError> =
            rows.iter().map(|row| decode_claimed(queue, row)).collect();
        let decoded = claimed.map(|mut claimed| {
            // OUTPUT promises no order; a batch runs oldest first.
            claimed.sort_by_key(|(_, row_version)| *row_version);
            // Rows gone since the look-up are released; the claimed ones stay held.
            conn.claim.extend(
                targets
                    .into_iter()
                    .filter(|held| claimed.iter().any(|(_, v)| *v == held.row_version())),
            );
            claimed.into_iter().map(|(row, _)| row).collect()
        });
        split_batch(self.clone(), queue, conn, decoded).await
    }

    /// The held-keys statements of this transport's schema.
    fn held(&self) -> super::HeldStatements {
        held_statements(&bracket(&self.schema))
    }

    /// The held-keys table of this schema, created when missing.
    async fn ensure_held_table(&self, queue: &QueueName) -> Result<(), TransportError> {
        let mut conn = self.conn().await?;
        match conn.run_batch(&self.held().create).await {
            Ok(()) => Ok(()),
            // Another host created it between the check and the CREATE.
            Err(tiberius::error::Error::Server(t)) if t.code() == 2714 => Ok(()),
            Err(e) => {
                conn.broken |= !is_server_error(&e);
                Err(map_error(e, Some(queue)))
            }
        }
    }

    /// `queue`'s address as NServiceBus writes it: `table@[schema]@[catalog]`, or
    /// `table@[schema]` while the catalog is not known (a transport built without connecting).
    fn address_of(&self, queue: &QueueName) -> String {
        let parts = queue.parts();
        let schema = statements::bracket(parts.schema.unwrap_or(&self.schema));
        match parts.catalog.or(self.catalog.get().map(String::as_str)) {
            // Database names may hold `]`: doubled, as SQL Server's QUOTENAME does.
            Some(catalog) => format!("{}@{schema}@[{}]", parts.table, catalog.replace(']', "]]")),
            None => format!("{}@{schema}", parts.table),
        }
    }

    /// Tables are created in this connection's database only: a queue whose address names
    /// another is refused, naming it.
    fn check_creatable(&self, queue: &QueueName) -> Result<(), TransportError> {
        let Some(catalog) = queue.parts().catalog else {
            return Ok(());
        };
        if self
            .catalog
            .get()
            .is_some_and(|own| own.eq_ignore_ascii_case(catalog))
        {
            return Ok(());
        }
        Err(TransportError::queue(
            queue,
            format!(
                "is in database `{catalog}`: the host creates tables in its own database only; create it there (sql/sqlserver/queue.sql, or the endpoint's installers)"
            ),
        ))
    }

    /// Runs a batch whose first result's first value is a bigint count.
    async fn count(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        sql: &str,
        params: &[&dyn tiberius::ToSql],
    ) -> Result<u64, TransportError> {
        let row = async { conn.query(sql, params).await?.into_row().await }
            .await
            .map_err(|e| {
                conn.broken |= !is_server_error(&e);
                map_error(e, Some(queue))
            })?;
        Ok(row.and_then(|r| int_at(&r, 0)).unwrap_or(0).max(0) as u64)
    }
}

impl SqlServerTransport {
    /// Stores a batch ([`Transport::send_batch`]): multi-row inserts
    /// ([`statements::send_many`]) or the TDS bulk load; more than one statement's worth
    /// runs in a transaction, so a batch is stored all or none.
    async fn store_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        if messages.is_empty() {
            return Ok(());
        }
        let mut conn = self.inner.conn().await?;
        if messages.len() <= statements::SEND_MANY_ROWS {
            return self.inner.send_many_on(&mut conn, queue, messages).await;
        }
        conn.run_batch("BEGIN TRAN;").await.map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })?;
        // Messages that neither expire nor wait go in through the TDS bulk load (no
        // parameters to bind: Babelfish took 2-4 s for 10 000 in multi-row inserts); an
        // expiry is the server's clock plus the time to be received, so those take the
        // multi-row insert, which computes it there.
        let bulk = messages
            .iter()
            .all(|m| m.deliver_after.is_none() && m.time_to_be_received.is_none());
        let sent = match bulk {
            true => self.inner.bulk_load_on(&mut conn, queue, messages).await,
            false => self.inner.send_many_on(&mut conn, queue, messages).await,
        };
        self.inner
            .end(conn, queue, sent.is_ok(), sent.is_err())
            .await?;
        sent
    }
}

#[async_trait]
impl Transport for SqlServerTransport {
    fn failed_store(&self) -> Option<&dyn crate::transport::failed::FailedStore> {
        Some(self)
    }

    fn key_ordering(&self) -> Option<&dyn crate::transport::KeyOrdering> {
        Some(self)
    }

    fn batch_receive(&self) -> Option<&dyn crate::transport::BatchReceive> {
        Some(self)
    }

    fn describe(&self) -> String {
        let dialect = match self.inner.dialect {
            Dialect::Sqlserver => "sqlserver",
            Dialect::Babelfish => "babelfish",
        };
        format!(
            "{dialect} (schema [{}], pool {})",
            self.inner.schema, self.inner.pool_size
        )
    }

    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.inner.insert_alone(queue, message).await?;
        self.inner.arrived(queue);
        Ok(())
    }

    /// Multi-row inserts ([`statements::send_many`]); more than one statement's worth runs
    /// in a transaction, so a batch is stored all or none.
    async fn send_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        self.store_batch(queue, messages).await?;
        self.inner.arrived(queue);
        Ok(())
    }

    async fn receive(
        &self,
        queue: &QueueName,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let st = self.inner.statements(queue);
        let conn = self.inner.conn().await?;
        let transactional = self.inner.mode != TransactionMode::None;
        // Babelfish receives by claim, an ordered queue from the rows that may run (see
        // `statements::babelfish_ordered_candidates`).
        if self.inner.dialect == Dialect::Babelfish {
            return self.inner.claim_receive(conn, queue, transactional).await;
        }
        let sql = if transactional {
            &st.begin_and_receive
        } else {
            &st.receive
        };
        self.inner
            .run_receive(conn, queue, sql, transactional)
            .await
    }

    async fn peek_depth(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        self.inner.count(&mut conn, queue, &st.peek, &[]).await
    }

    fn silent_for(&self) -> Option<Duration> {
        self.inner.silence.silent_for(self.inner.silent_after)
    }

    fn connections_in_use(&self) -> u64 {
        let s = self.inner.pool.state();
        s.connections.saturating_sub(s.idle_connections) as u64
    }

    fn delayed_delivery(&self) -> Option<&dyn DelayedDelivery> {
        Some(self)
    }

    fn instance_registry(&self) -> Option<&dyn crate::transport::InstanceRegistry> {
        Some(self)
    }

    fn fleet_shares(&self) -> Option<&dyn crate::transport::FleetShares> {
        Some(self)
    }

    /// SQL Server does not notify: only this process's own sends wake (when they commit);
    /// messages of other senders are found at the next peek.
    fn wake_on_arrival(&self, _queues: &[QueueName], sink: Arc<dyn super::ArrivalSink>) {
        *self
            .inner
            .arrivals
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    fn report_conflicts_to(&self, sink: Arc<dyn ConflictSink>) {
        *self
            .inner
            .conflicts
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    async fn ping(&self) -> Result<(), TransportError> {
        let mut conn = self.inner.conn().await?;
        conn.run_batch("SELECT 1").await.map_err(|e| {
            conn.broken = true;
            map_error(e, None)
        })
    }

    fn address(&self, queue: &QueueName) -> String {
        self.inner.address_of(queue)
    }

    fn resolve_address(&self, address: &str) -> Option<QueueName> {
        super::address::parse(
            address,
            &self.inner.schema,
            self.inner.catalog.get().map(String::as_str),
        )
    }
}

/// An error of a statement on `queue`'s delayed table: a missing table is named as such.
fn delayed_table_named(
    e: TransportError,
    queue: &QueueName,
    st: &QueueStatements,
) -> TransportError {
    match e {
        TransportError::QueueNotFound(_) => TransportError::DelayedTableNotFound {
            queue: queue.to_string(),
            table: st.delayed.table.clone(),
        },
        other => other,
    }
}

#[async_trait]
impl DelayedDelivery for SqlServerTransport {
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError> {
        self.inner.check_creatable(queue)?;
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        match conn.run_batch(&st.delayed.create).await {
            Ok(_) => Ok(()),
            Err(e) => {
                conn.broken = true;
                match e {
                    tiberius::error::Error::Server(t) if matches!(t.code(), 2714 | 1913) => Ok(()),
                    e => Err(delayed_table_named(map_error(e, Some(queue)), queue, &st)),
                }
            }
        }
    }

    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        let recoverable = self.inner.has_recoverable(&mut conn, queue, &st).await?;
        let sql = if recoverable {
            &st.delayed.move_due_with_recoverable
        } else {
            &st.delayed.move_due_without_recoverable
        };
        let batch = i64::from(batch.max(1));
        let answer = async { conn.query(sql.as_str(), &[&batch]).await?.into_row().await }.await;
        let row = match answer {
            Ok(row) => row,
            // Babelfish: another host's mover holds the due rows (see the statement). Any
            // other error: XACT_ABORT rolled the move back, the connection is closed.
            Err(e) => {
                let gave_up = self.inner.gave_up_on_held_row(&mut conn, queue, e).await;
                gave_up.map_err(|e| delayed_table_named(e, queue, &st))?;
                drop(conn);
                return Ok(Moved {
                    moved: 0,
                    busy: true,
                    waiting: self.delayed_count(queue).await?,
                    next_due_in: None,
                });
            }
        };
        let Some(row) = row else {
            return Err(TransportError::database(format!(
                "the move of `{queue}`'s due delayed messages returned nothing"
            )));
        };
        let count = |i: usize| int_at(&row, i).unwrap_or(0).max(0) as u64;
        let now: Option<NaiveDateTime> = row.try_get(3).ok().flatten();
        let next: Option<NaiveDateTime> = row.try_get(4).ok().flatten();
        if count(0) > 0 {
            // The move committed: due messages are in the queue now, not at the next peek.
            self.inner.arrived(queue);
        }
        Ok(Moved {
            moved: count(0),
            busy: count(1) == 0,
            waiting: count(2),
            next_due_in: now
                .zip(next)
                .map(|(now, next)| (next - now).to_std().unwrap_or_default()),
        })
    }

    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        self.inner
            .count(&mut conn, queue, &st.delayed.count, &[])
            .await
            .map_err(|e| delayed_table_named(e, queue, &st))
    }

    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        // Names are validated (no quotes), so the table sits inside the literal.
        let sql = format!(
            "SELECT CAST(CASE WHEN OBJECT_ID(N'{}', N'U') IS NULL THEN 0 ELSE 1 END AS bigint)",
            st.delayed.table
        );
        Ok(self.inner.count(&mut conn, queue, &sql, &[]).await? == 1)
    }

    fn delayed_table(&self, queue: &QueueName) -> String {
        self.inner.statements(queue).delayed.table.clone()
    }
}

#[async_trait]
impl QueueAdmin for SqlServerTransport {
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        self.inner.check_creatable(queue)?;
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        let result = conn.run_batch(&st.create).await;
        match result {
            Ok(_) => Ok(()),
            Err(e) => {
                // The script's transaction was aborted: do not reuse the connection.
                conn.broken = true;
                match e {
                    // "Already exists" from a host that won a race the lock did not cover.
                    tiberius::error::Error::Server(t) if matches!(t.code(), 2714 | 1913) => Ok(()),
                    e => Err(map_error(e, Some(queue))),
                }
            }
        }
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        let mut total = 0;
        loop {
            let n = self
                .inner
                .count(&mut conn, queue, &st.purge_expired_batch, &[&PURGE_BATCH])
                .await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        self.inner.count(&mut conn, queue, &st.purge, &[]).await
    }

    async fn reset_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue);
        {
            let mut conn = self.inner.conn().await?;
            let dropped = conn.run_batch(&st.drop).await;
            if let Err(e) = dropped {
                conn.broken = true;
                return Err(map_error(e, Some(queue)));
            }
        }
        self.inner
            .recoverable
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
        self.create_queue(queue).await
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        let mut conn = self.inner.conn().await?;
        let schema = self.inner.schema.as_str();
        let rows = async {
            conn.query(statements::LIST_QUEUES, &[&schema])
                .await?
                .into_first_result()
                .await
        }
        .await
        .map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, None)
        })?;
        Ok(rows
            .iter()
            .filter_map(|r| r.get::<&str, _>(0).map(str::to_string))
            .collect())
    }

    async fn server_checks(&self) -> Result<Vec<String>, TransportError> {
        let mut conn = match self.inner.conn().await {
            Ok(c) => c,
            Err(e) => return Ok(vec![format!("cannot run start-up checks: {e}")]),
        };
        let server = async {
            conn.simple_query(statements::IS_BABELFISH)
                .await?
                .into_row()
                .await
        }
        .await;
        match server {
            Ok(row) => {
                let babelfish = row.and_then(|r| int_at(&r, 0)) == Some(1);
                dialect_check(self.inner.dialect, babelfish)
            }
            Err(e) => {
                conn.broken |= !is_server_error(&e);
                Ok(vec![format!(
                    "cannot tell SQL Server from Babelfish: {}",
                    map_error(e, None)
                )])
            }
        }
    }

    async fn startup_checks(&self, queues: &[QueueName]) -> Result<Vec<String>, TransportError> {
        let mut warnings = Vec::new();
        if !self.inner.max_pool_size_in_connection_string {
            warnings.push(format!(
                "the connection string sets no Max Pool Size; the pool holds at most transport.pool_size = {} connections, one per in-flight message: keep it above the queues' total concurrency",
                self.inner.pool_size
            ));
        }
        let mut conn = match self.inner.conn().await {
            Ok(c) => c,
            Err(e) => return Ok(vec![format!("cannot run start-up checks: {e}")]),
        };
        for queue in queues {
            let st = self.inner.statements(queue);
            let table = st.table.as_str();
            let indexes = async {
                conn.query(statements::ROWVERSION_INDEXES, &[&table])
                    .await?
                    .into_first_result()
                    .await
            }
            .await;
            match indexes {
                Ok(rows) => {
                    let types: Vec<i64> = rows.iter().filter_map(|r| int_at(r, 0)).collect();
                    if types.is_empty() {
                        warnings.push(format!(
                            "queue `{queue}` has no index on RowVersion: every receive scans the table (create Index_RowVersion, see sql/sqlserver/queue.sql)"
                        ));
                    } else if !types.contains(&2) {
                        warnings.push(format!(
                            "queue `{queue}` has a clustered index on RowVersion: under concurrency it suffers page-latch contention; recreate Index_RowVersion as NONCLUSTERED (sql/sqlserver/migrate-nonclustered.sql)"
                        ));
                    }
                }
                Err(e) => warnings.push(format!(
                    "cannot check the indexes of `{queue}`: {}",
                    map_error(e, Some(queue))
                )),
            }
            let headers = async {
                conn.query(statements::HEADERS_TYPE, &[&table])
                    .await?
                    .into_row()
                    .await
            }
            .await;
            match headers {
                Ok(Some(row)) if row.get::<&str, _>(0) == Some("varchar") => warnings.push(format!(
                    "queue `{queue}` stores Headers as varchar: characters outside its code page are lost; change the column to nvarchar(max)"
                )),
                Ok(_) => {}
                Err(e) => warnings.push(format!("cannot check the Headers column of `{queue}`: {}", map_error(e, Some(queue)))),
            }
        }
        Ok(warnings)
    }
}

/// Whether `transport.dialect` fits the server: an error that stops the start when the exact
/// SQL Server dialect meets Babelfish (every receive would fail with `relation "message" does
/// not exist`: Babelfish rejects DML through a CTE), warnings otherwise.
fn dialect_check(
    dialect: Dialect,
    server_is_babelfish: bool,
) -> Result<Vec<String>, TransportError> {
    match (dialect, server_is_babelfish) {
        (Dialect::Sqlserver, true) => Err(TransportError::Setting {
            setting: "transport.dialect",
            message: "the server is Babelfish for PostgreSQL, which rejects the SQL Server receive statement (DELETE through a CTE); set transport.dialect = \"babelfish\"".into(),
        }),
        (Dialect::Babelfish, true) => Ok(vec![
            "dialect babelfish: Babelfish ignores READPAST, so receivers claim rows: a row another receive holds is passed over within 1 ms and counted in throttlehost_lock_conflicts_total{kind=\"lock_timeout\"} (see sql/sqlserver/README.md)".into(),
        ]),
        (Dialect::Babelfish, false) => Ok(vec![
            "transport.dialect = \"babelfish\" on SQL Server: it works, but receives claim rows under a lock timeout where READPAST passes over them; \"sqlserver\" is the dialect for this server".into(),
        ]),
        (Dialect::Sqlserver, false) => Ok(Vec::new()),
    }
}

/// Runs a receive batch and reads the rows it returned.
async fn receive_rows(
    conn: &mut Pooled,
    queue: &QueueName,
    sql: &str,
) -> Result<Vec<tiberius::Row>, TransportError> {
    let rows = conn.first_result(sql).await;
    rows.map_err(|e| {
        // Whatever the error, do not reuse a connection whose transaction state is in doubt.
        conn.broken = true;
        map_error(e, Some(queue))
    })
}

/// Reads a received row: id, expired flag, headers, body, expiry.
fn decode_row(queue: &QueueName, row: &tiberius::Row) -> Result<RawRow, TransportError> {
    let decoded: Result<_, tiberius::error::Error> = (|| {
        let id: Option<Uuid> = row.try_get(0)?;
        let expired: Option<i32> = row.try_get(1)?;
        let headers: Option<&str> = row.try_get(2)?;
        let body: Option<&[u8]> = row.try_get(3)?;
        let expires: Option<NaiveDateTime> = row.try_get(4)?;
        Ok((id, expired, headers, body, expires))
    })();
    match decoded {
        Ok((Some(id), expired, headers, body, expires)) => Ok(RawRow {
            id,
            expired: expired.unwrap_or(0) != 0,
            headers: headers.unwrap_or("").to_string(),
            body: body.unwrap_or(&[]).to_vec(),
            expires,
            transaction: None,
        }),
        Ok((None, ..)) | Err(_) => Err(TransportError::database(format!(
            "queue `{queue}` returned a row of unexpected shape; is it an NServiceBus queue table?"
        ))),
    }
}

/// A row as a Babelfish claim sends it back (`statements::CLAIM_OUTPUT`: Id, the server's
/// UTC time, Headers, Body, Expires, RowVersion), with its RowVersion. Expired as the SQL
/// Server receive decides it: Expires set and not after the server's time.
fn decode_claimed(queue: &QueueName, row: &tiberius::Row) -> Result<(RawRow, i64), TransportError> {
    let decoded: Result<_, tiberius::error::Error> = (|| {
        let id: Option<Uuid> = row.try_get(0)?;
        let now: Option<NaiveDateTime> = row.try_get(1)?;
        let headers: Option<&str> = row.try_get(2)?;
        let body: Option<&[u8]> = row.try_get(3)?;
        let expires: Option<NaiveDateTime> = row.try_get(4)?;
        Ok((id, now, headers, body, expires))
    })();
    match (decoded, int_at(row, 5)) {
        (Ok((Some(id), Some(now), headers, body, expires)), Some(row_version)) => Ok((
            RawRow {
                id,
                expired: expires.is_some_and(|expires| expires <= now),
                headers: headers.unwrap_or("").to_string(),
                body: body.unwrap_or(&[]).to_vec(),
                expires,
                transaction: None,
            },
            row_version,
        )),
        _ => Err(TransportError::database(format!(
            "queue `{queue}` returned a row of unexpected shape; is it an NServiceBus queue table?"
        ))),
    }
}

/// An integer column in whatever width the server sends it: SQL Server and Babelfish differ
/// (`sys.dm_exec_sessions.session_id` is smallint on one and int on the other).
pub fn int_at(row: &tiberius::Row, index: usize) -> Option<i64> {
    row.try_get::<u8, _>(index)
        .ok()
        .flatten()
        .map(i64::from)
        .or_else(|| row.try_get::<i16, _>(index).ok().flatten().map(i64::from))
        .or_else(|| row.try_get::<i32, _>(index).ok().flatten().map(i64::from))
        .or_else(|| row.try_get::<i64, _>(index).ok().flatten())
}

#[async_trait]
impl SqlStore for Inner {
    fn arrived(&self, queue: &QueueName) {
        let sink = self
            .arrivals
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(sink) = sink {
            sink.arrived(queue);
        }
    }

    type Conn = Pooled;

    async fn hold(
        &self,
        queue: &QueueName,
        id: Uuid,
        key: &str,
        reason: &str,
    ) -> Result<(), TransportError> {
        let table = self.statements(queue).table.clone();
        let mut conn = self.conn().await?;
        let insert = self.held().insert;
        let result = conn
            .execute(insert.as_str(), &[&table.as_str(), &id, &key, &reason])
            .await;
        result.map(|_| ()).map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })
    }

    async fn insert(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.send_on(conn, queue, message).await
    }

    async fn insert_many(
        &self,
        conn: &mut Pooled,
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
        let mut attempt = 0;
        loop {
            let mut conn = self.conn().await?;
            match self.send_on(&mut conn, queue, message).await {
                Err(e) if e.is_deadlock() && attempt < DEADLOCK_RETRIES => {
                    attempt += 1;
                    self.conflict(queue, true);
                    tracing::debug!(queue = %queue, attempt, "send was a deadlock victim; retrying");
                }
                other => return other,
            }
        }
    }

    async fn insert_raw(
        &self,
        conn: Option<&mut Pooled>,
        queue: &QueueName,
        (id, headers, body): (Uuid, &str, &[u8]),
    ) -> Result<(), TransportError> {
        match conn {
            Some(conn) => self.send_raw_on(conn, queue, id, headers, body).await,
            None => {
                let mut conn = self.conn().await?;
                self.send_raw_on(&mut conn, queue, id, headers, body).await
            }
        }
    }

    async fn end(
        &self,
        mut conn: Pooled,
        queue: &QueueName,
        commit: bool,
        after_failure: bool,
    ) -> Result<(), TransportError> {
        let sql = match commit {
            true => "COMMIT TRAN;",
            false => "IF @@TRANCOUNT > 0 ROLLBACK TRAN;",
        };
        let result = conn.run_batch(sql).await;
        claim::release(&mut conn.claim, !commit || result.is_err());
        // After an error inside the transaction the client's idea of it may be stale: start
        // the next unit of work on a fresh connection.
        conn.broken |= after_failure || result.is_err();
        result.map(|_| ()).map_err(|e| map_error(e, Some(queue)))
    }

    fn abandon(&self, mut conn: Pooled) {
        // Closing the connection makes the server roll the transaction back.
        conn.broken = true;
        claim::release(&mut conn.claim, true);
    }

    async fn took_effect(
        &self,
        queue: &QueueName,
        receipt: Receipt,
    ) -> Result<bool, TransportError> {
        // SQL Server keeps no status of ended transactions: the row is looked up. Gone means
        // the commit took effect, or it rolled back and another receiver has handled the
        // message since (it is then reported as done by both).
        let sql = self.statements(queue).still_queued.clone();
        let mut conn = self.conn().await?;
        let result = async {
            let row = conn
                .query(sql.as_str(), &[&receipt.id])
                .await?
                .into_row()
                .await?;
            Ok::<_, tiberius::error::Error>(row.as_ref().and_then(|r| int_at(r, 0)).unwrap_or(0))
        }
        .await;
        result.map(|count| count == 0).map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })
    }

    async fn commit_and_receive(
        self: Arc<Self>,
        conn: Pooled,
        _transport: &dyn Transport,
        queue: &QueueName,
    ) -> CommitAndReceive {
        let st = self.statements(queue);
        if self.dialect == Dialect::Babelfish {
            return self.commit_and_claim(conn, queue).await;
        }
        // One batch: COMMIT, BEGIN, receive. With XACT_ABORT ON a failed COMMIT aborts the
        // batch before anything is received.
        match self
            .run_receive(conn, queue, &st.commit_and_receive, true)
            .await
        {
            Ok(next) => CommitAndReceive {
                committed: Ok(()),
                next: Some(Ok(next)),
            },
            // Which statement of the batch failed is not known here: the commit is reported
            // as failed (its message returns to the queue if it did not take effect).
            Err(e) => CommitAndReceive {
                committed: Err(e),
                next: None,
            },
        }
    }
}

#[async_trait]
impl crate::transport::KeyOrdering for SqlServerTransport {
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError> {
        super::check_orderable(self.inner.mode, queue)?;
        let plain = QueueStatements::new(
            &self.inner.schema,
            queue,
            self.inner.dialect,
            &self.inner.delayed_suffix,
        );
        let statements = match ordering.is_ordered() {
            false => plain,
            true => plain.with_ordering(ordering),
        };
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
        let table = self.inner.statements(queue).table.clone();
        let mut conn = self.inner.conn().await?;
        let rows = async {
            conn.query(&self.inner.held().list, &[&table.as_str()])
                .await?
                .into_first_result()
                .await
        }
        .await;
        let rows = match rows {
            Ok(rows) => rows,
            // 208: no held-keys table, so nothing was ever held here.
            Err(tiberius::error::Error::Server(t)) if t.code() == 208 => return Ok(Vec::new()),
            Err(e) => {
                conn.broken |= !is_server_error(&e);
                return Err(map_error(e, Some(queue)));
            }
        };
        Ok(rows
            .iter()
            .map(|r| HeldKey {
                key: r.get::<&str, _>(0).unwrap_or_default().to_string(),
                message_id: r.get::<Uuid, _>(1).unwrap_or_default(),
                reason: r.get::<&str, _>(2).unwrap_or_default().to_string(),
                held_at: r.get::<&str, _>(3).unwrap_or_default().to_string(),
            })
            .collect())
    }

    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut conn = self.inner.conn().await?;
        let held = self.inner.held();
        let released = match key {
            Some(key) => {
                let params: &[&dyn tiberius::ToSql] = &[&table.as_str(), &key];
                self.inner
                    .count(&mut conn, queue, &held.release, params)
                    .await
            }
            None => {
                let params: &[&dyn tiberius::ToSql] = &[&table.as_str()];
                self.inner
                    .count(&mut conn, queue, &held.release_all, params)
                    .await
            }
        };
        match released {
            // No held-keys table: nothing was ever held here.
            Err(TransportError::QueueNotFound(_)) => Ok(0),
            other => other,
        }
    }

    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError> {
        let st = self.inner.statements(queue);
        let Some(sql) = &st.waiting else {
            return Ok(None);
        };
        // A pooled connection between receives holds no application lock, so the count's
        // lock tests see every receive's locks (see `statements::ordered_waiting`).
        let mut conn = self.inner.conn().await?;
        self.inner.count(&mut conn, queue, sql, &[]).await.map(Some)
    }
}

#[async_trait]
impl crate::transport::BatchReceive for SqlServerTransport {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        // Mode `none` deletes before handlers run: a batch there is single receives.
        if max <= 1 || self.inner.mode == TransactionMode::None {
            return batch::EachOnItsOwn::receive(self, queue, max).await;
        }
        let max = u32::try_from(max).unwrap_or(u32::MAX).min(MAX_BATCH);
        self.inner.receive_batch(queue, max).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_parse_and_errors_hide_the_password() {
        let ok = parse_connection_string(
            "Server=tcp:db.example,1433;Database=q;User Id=app;Password=Sup3r;Encrypt=true;TrustServerCertificate=true",
        );
        assert!(ok.is_ok());
        let cfg = ok.unwrap();
        assert_eq!(cfg.get_addr(), "db.example:1433");
        let err = parse_connection_string("Server=tcp:db,notaport;Password=Sup3r")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("Sup3r"), "{err}");
        assert!(err.contains("Password=***"), "{err}");
    }

    #[tokio::test]
    async fn a_pool_is_built_without_connecting() {
        let config = TransportConfig {
            kind: crate::config::TransportKind::Sqlserver,
            connection_string: crate::config::ConnectionString::new(
                "Server=tcp:127.0.0.1,1;User Id=sa;Password=x;Encrypt=false",
            ),
            ..TransportConfig::default()
        };
        let t = SqlServerTransport::new(&config).unwrap();
        assert_eq!(t.describe(), "sqlserver (schema [dbo], pool 20)");
        assert_eq!(t.connections_in_use(), 0);
    }

    /// A server that accepts the connection and never answers the login: a receive fails
    /// within the connect timeout, naming the address, instead of waiting for ever (or for
    /// a command timeout of a statement it never sent).
    #[tokio::test]
    async fn a_server_that_stalls_the_login_is_a_clear_connect_failure() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut sockets = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                sockets.push(socket);
            }
        });
        let config = TransportConfig {
            kind: crate::config::TransportKind::Sqlserver,
            connection_string: crate::config::ConnectionString::new(format!(
                "Server=tcp:127.0.0.1,{port};User Id=sa;Password=x;Encrypt=false"
            )),
            pool_size: 1,
            connect_timeout: Duration::from_millis(500),
            command_timeout: Duration::from_secs(30),
            ..TransportConfig::default()
        };
        let t = SqlServerTransport::new(&config).unwrap();
        let started = tokio::time::Instant::now();
        let err = match t.receive(&QueueName::new("in").unwrap()).await {
            Err(e) => e,
            Ok(_) => panic!("nothing answers: the receive must fail"),
        };
        assert!(started.elapsed() < Duration::from_secs(5), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("cannot connect") && text.contains(&format!("127.0.0.1:{port}")),
            "{text}"
        );
        held.abort();
    }

    #[test]
    fn the_exact_dialect_on_babelfish_stops_the_start_naming_the_setting() {
        let err = dialect_check(Dialect::Sqlserver, true).unwrap_err();
        assert!(matches!(err, TransportError::Setting { .. }));
        assert!(
            err.to_string()
                .contains("transport.dialect = \"babelfish\""),
            "{err}"
        );
        assert_eq!(
            dialect_check(Dialect::Sqlserver, false).unwrap(),
            Vec::<String>::new()
        );
        assert!(dialect_check(Dialect::Babelfish, true).unwrap()[0].contains("READPAST"));
        assert!(dialect_check(Dialect::Babelfish, false).unwrap()[0].contains("\"sqlserver\""));
    }
}
