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
//! The suites run against a server when `SQLSERVER_URL` is set (SQL Server, or Babelfish with
//! `SQLSERVER_DIALECT=babelfish`).
//!
//! This file is the face: the transport, its shared state and the message path's core. The
//! rooms: `connection` (connection string, errors), `store` (sends and the unit of work),
//! `receive` (receives and claims), `ordering` (held keys), `admin` (tables and addresses),
//! `delayed` (the delayed table), `failed` (the failed-messages store), [`fleet`] (instances
//! and shares).

mod admin;
mod claim;
mod connection;
mod delayed;
mod failed;
pub mod fleet;
mod ordering;
pub mod pool;
mod receive;
pub mod statements;
mod store;
mod subscriptions;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bb8::{PooledConnection, RunError};

pub use statements::{QueueStatements, bracket, held_statements};

use self::pool::{Connection, Manager};
use super::delayed::DelayedDelivery;
use super::unit_of_work::SqlStore;
use super::{ConflictSink, QueueName, Received, Transport, TransportError};
use crate::config::{Dialect, TransactionMode, TransportConfig};
use crate::message::OutgoingMessage;
use crate::names::validate_schema_name;

use self::connection::{
    catalog_in_connection_string, is_server_error, map_error, warn_once_if_trusting,
};
pub use self::connection::{int_at, parse_connection_string};

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
    /// The subscription table's schema and name, unquoted (`transport.subscription_*`).
    subscription_table: (String, String),
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
        let catalog = catalog_in_connection_string(raw)
            .map_or_else(std::sync::OnceLock::new, std::sync::OnceLock::from);
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
                subscription_table: (
                    config.effective_subscription_schema().to_string(),
                    config.subscription_table.clone(),
                ),
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

    /// Runs a batch whose first result's first value is a bigint count.
    /// The depths of `queues` (at most [`super::DEPTHS_PER_STATEMENT`]) in one statement,
    /// in their order.
    async fn peek_chunk(&self, queues: &[QueueName]) -> Result<Vec<u64>, TransportError> {
        let sql = queues
            .iter()
            .enumerate()
            .map(|(i, queue)| {
                let st = self.statements(queue);
                format!("SELECT CAST({i} AS bigint), {}", st.peek_value)
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        let mut conn = self.conn().await?;
        let rows = conn.rows(&sql, &[]).await.map_err(|e| map_error(e, None))?;
        let mut depths = vec![0; queues.len()];
        for row in rows {
            let i = int_at(&row, 0).unwrap_or(-1);
            if let Some(depth) = usize::try_from(i).ok().and_then(|i| depths.get_mut(i)) {
                *depth = int_at(&row, 1).unwrap_or(0).max(0) as u64;
            }
        }
        Ok(depths)
    }

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

#[async_trait]
impl Transport for SqlServerTransport {
    fn admin(&self) -> &dyn crate::transport::QueueAdmin {
        self
    }

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

    /// [`super::DEPTHS_PER_STATEMENT`] queues per statement (a UNION ALL of their peeks); a
    /// statement that fails (a table gone) is read again queue by queue, so only that queue's
    /// depth fails.
    async fn peek_depths(&self, queues: &[QueueName]) -> Vec<Result<u64, TransportError>> {
        let mut depths = Vec::with_capacity(queues.len());
        for chunk in queues.chunks(super::DEPTHS_PER_STATEMENT) {
            match self.inner.peek_chunk(chunk).await {
                Ok(read) => depths.extend(read.into_iter().map(Ok)),
                Err(_) => {
                    for queue in chunk {
                        depths.push(self.peek_depth(queue).await);
                    }
                }
            }
        }
        depths
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

    fn subscriptions(&self) -> Option<&dyn crate::transport::Subscriptions> {
        Some(self)
    }

    fn fleet_shares(&self) -> Option<&dyn crate::transport::FleetShares> {
        Some(self)
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

    fn host_hooks(&self) -> Option<&dyn super::HostHooks> {
        Some(self)
    }
}

impl super::HostHooks for SqlServerTransport {
    fn silent_for(&self) -> Option<Duration> {
        self.inner.silence.silent_for(self.inner.silent_after)
    }

    /// SQL Server does not notify: only this process's own sends wake (when they commit);
    /// messages of other senders are found by the host's reads of its idle queues.
    fn wake_on_arrival(&self, _queues: &[QueueName], sink: Arc<dyn super::ArrivalSink>) -> bool {
        *self
            .inner
            .arrivals
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(sink);
        false
    }

    fn report_conflicts_to(&self, sink: Arc<dyn ConflictSink>) {
        *self
            .inner
            .conflicts
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::admin::dialect_check;
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
