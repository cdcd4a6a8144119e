//! The `[transport]` section: which database, how to reach it, and the NServiceBus layout's names.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConnectionString;
use super::units;

/// Which database holds the queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// SQL Server (or Babelfish) through tiberius: the production transport.
    Sqlserver,
    /// PostgreSQL with the NServiceBus PostgreSQL transport's table layout.
    Postgres,
    /// In-process queues; messages are lost when the process exits.
    #[default]
    Memory,
}

/// How receiving relates to database transactions (NServiceBus transport transaction modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TransactionMode {
    /// The receive transaction stays open while the handler runs: commit on success, rollback
    /// on failure. Handler sends go out on their own connection after the handler succeeds.
    #[default]
    ReceiveOnly,
    /// As `receive_only`, and handler sends are written in the receive transaction, so they
    /// commit (or vanish) together with the receive.
    SendsAtomicWithReceive,
    /// The message is deleted before the handler runs: at-most-once.
    None,
}

/// SQL dialect of the `sqlserver` transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Dialect {
    /// Microsoft SQL Server / Azure SQL: the NServiceBus statements as they are.
    #[default]
    Sqlserver,
    /// Babelfish for PostgreSQL: statement forms Babelfish accepts (see sql/sqlserver/README.md).
    Babelfish,
}

/// `[transport]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// `sqlserver`, `postgres` or `memory`.
    pub kind: TransportKind,
    /// ADO.NET string for SQL Server, libpq string or URL for PostgreSQL. Never logged.
    pub connection_string: ConnectionString,
    /// Schema of the queue tables. Empty = `dbo` (SQL Server) or `public` (PostgreSQL).
    pub schema: String,
    /// Maximum pooled connections. Each in-flight message holds one; size it above the sum of
    /// the queues' max concurrency.
    pub pool_size: u32,
    /// `receive_only`, `sends_atomic_with_receive` or `none`.
    pub transaction_mode: TransactionMode,
    /// `sqlserver` or `babelfish` (SQL Server transport only).
    pub dialect: Dialect,
    /// Time allowed to open a database connection (and to wait for a pooled one).
    #[serde(with = "units::duration")]
    pub connect_timeout: Duration,
    /// Time allowed for one statement.
    #[serde(with = "units::duration")]
    pub command_timeout: Duration,
    /// Delete expired messages from the input queues once at start-up (they are otherwise
    /// dropped when received).
    pub purge_expired_on_startup: bool,
    /// PostgreSQL only: give the queue tables this host creates an insert trigger that
    /// notifies, and keep one listening connection that wakes idle receivers at once. `false`
    /// = find messages by peeking only (for databases where triggers are not allowed).
    pub notify_on_insert: bool,
    /// Memory transport only: latency added to every statement, to simulate a database.
    #[serde(with = "units::duration")]
    pub simulated_latency: Duration,
    /// The suffix of each queue's delayed table, `<queue>.<suffix>`: NServiceBus's
    /// `DelayedDeliveryOptions.TableSuffix`, default `Delayed`, on both engines.
    pub delayed_table_suffix: String,
    /// The table of native publish/subscribe, shared by every endpoint that publishes to or
    /// subscribes in this database: NServiceBus's `SubscriptionTableName`, default
    /// `SubscriptionRouting`.
    pub subscription_table: String,
    /// The schema of the subscription table. Empty = the queues' schema (`schema`).
    pub subscription_schema: String,
    /// How long a publisher keeps a topic's subscribers before it reads them again:
    /// NServiceBus's `CacheInvalidationPeriod`, default 5 s. A new subscriber may miss the
    /// events published this long after it subscribed. `"0s"` = read them on every publish.
    #[serde(with = "units::duration")]
    pub subscription_cache: Duration,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            kind: TransportKind::Memory,
            connection_string: ConnectionString::default(),
            schema: String::new(),
            pool_size: 20,
            transaction_mode: TransactionMode::ReceiveOnly,
            dialect: Dialect::Sqlserver,
            connect_timeout: Duration::from_secs(15),
            command_timeout: Duration::from_secs(30),
            purge_expired_on_startup: false,
            notify_on_insert: true,
            simulated_latency: Duration::ZERO,
            delayed_table_suffix: DEFAULT_DELAYED_TABLE_SUFFIX.into(),
            subscription_table: DEFAULT_SUBSCRIPTION_TABLE.into(),
            subscription_schema: String::new(),
            subscription_cache: Duration::from_secs(5),
        }
    }
}

/// NServiceBus's default subscription table (`SubscriptionOptions.SubscriptionTableName`).
pub(super) const DEFAULT_SUBSCRIPTION_TABLE: &str = "SubscriptionRouting";

/// NServiceBus's default delayed table suffix (`DelayedDeliveryOptions.TableSuffix`).
pub const DEFAULT_DELAYED_TABLE_SUFFIX: &str = "Delayed";

impl TransportConfig {
    /// The subscription table's schema with its default (the queues' schema) applied.
    pub fn effective_subscription_schema(&self) -> &str {
        match self.subscription_schema.is_empty() {
            true => self.effective_schema(),
            false => &self.subscription_schema,
        }
    }

    /// The schema with the per-transport default applied.
    pub fn effective_schema(&self) -> &str {
        if !self.schema.is_empty() {
            return &self.schema;
        }
        match self.kind {
            TransportKind::Sqlserver => "dbo",
            TransportKind::Postgres | TransportKind::Memory => "public",
        }
    }
}
