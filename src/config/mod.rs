//! The host's settings: one TOML file, described here once.
//!
//! Every struct carries its defaults (BizTalk's where BizTalk has one) and a doc comment per
//! field; `config/host.toml` lists the same settings with the same defaults, and a test keeps
//! the two in step. Loading (with errors that name the key, the value and the line) lives in
//! [`load`], checks across fields in [`validate`], live reloading in [`reload`].

pub mod load;
pub mod reload;
pub mod secret;
pub mod units;
pub mod validate;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use load::{ConfigError, exposed_secrets, load_file, parse_str};
pub use secret::{ConnectionString, Secret};
pub use units::{ByteSize, MemoryThreshold};
pub use validate::MAX_WORKER_THREADS;

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Identity of this host instance and its lifecycle.
    pub host: HostConfig,
    /// The admin HTTP endpoint: auth and ingest limits.
    pub admin: AdminConfig,
    /// Where the queues live.
    pub transport: TransportConfig,
    /// The queues this host receives from, each with its handler and concurrency.
    pub queues: Vec<QueueConfig>,
    /// The host throttling controller.
    pub throttling: ThrottlingConfig,
    /// The instance registry: how this host shows itself to the others on its database.
    pub fleet: FleetConfig,
    /// What the host keeps counting of its error queues.
    pub failed_messages: FailedMessagesConfig,
}

/// `[host]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// Logical name of the host (the NServiceBus endpoint name written into failure headers).
    pub name: String,
    /// This instance's id: names the instance queues (`<queue>.<instance_id>`). Empty = the
    /// machine's host name.
    pub instance_id: String,
    /// Address of the admin HTTP endpoint (/metrics, /status, ingest). `"off"` disables it.
    pub admin_address: String,
    /// How long in-flight messages may run after a shutdown signal before they are rolled back.
    #[serde(with = "units::duration")]
    pub shutdown_timeout: Duration,
    /// Create missing queue tables (input, instance and error queues) at start-up.
    pub create_queues: bool,
    /// Async worker threads of `throttlehost run`; 0 = one per CPU. Fewer cost less CPU per
    /// message when the host shares its cores with the database. Needs a restart.
    pub worker_threads: u32,
    /// `run` keeps trying (every second, answering on the admin address meanwhile) when the
    /// database cannot be reached at start, instead of exiting; false = exit with an error at
    /// once. A refused login is not waited for.
    pub wait_for_database: bool,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            name: "throttlehost".into(),
            instance_id: String::new(),
            admin_address: "127.0.0.1:9464".into(),
            shutdown_timeout: Duration::from_secs(30),
            create_queues: true,
            worker_threads: 0,
            wait_for_database: true,
        }
    }
}

impl HostConfig {
    /// The instance id, falling back to the machine's host name.
    pub fn effective_instance_id(&self) -> String {
        if !self.instance_id.trim().is_empty() {
            return self.instance_id.trim().to_string();
        }
        sysinfo::System::host_name()
            .ok()
            .filter(|h| !h.is_empty())
            .map(|h| {
                h.chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '-' {
                            c
                        } else {
                            '-'
                        }
                    })
                    .collect()
            })
            .unwrap_or_else(|| "local".into())
    }
}

/// `[admin]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token required by mutating endpoints (ingest, override). Empty = no auth.
    pub token: Secret,
    /// Largest message body accepted by `POST /queues/{name}/messages`.
    pub max_body_size: ByteSize,
    /// Ingest answers 503 with Retry-After while the publishing delay exceeds this.
    #[serde(with = "units::duration")]
    pub ingest_reject_after: Duration,
    /// Host names the endpoint answers to besides IP addresses, `localhost` and this
    /// machine's name (a request naming another is refused: DNS rebinding); `"*"` = any.
    pub allowed_hosts: Vec<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            token: Secret::default(),
            max_body_size: ByteSize(4 << 20),
            ingest_reject_after: Duration::from_secs(5),
            allowed_hosts: Vec::new(),
        }
    }
}

/// `[fleet]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Write this host into the instance registry and read the others from it.
    pub enabled: bool,
    /// How often this host writes its heartbeat (one statement each).
    #[serde(with = "units::duration")]
    pub heartbeat_interval: Duration,
    /// An instance not seen for this long is shown as gone.
    #[serde(with = "units::duration")]
    pub gone_after: Duration,
    /// The row of an instance not seen for this long is deleted (by any instance).
    #[serde(with = "units::duration")]
    pub forget_after: Duration,
    /// How often this host takes its share of each fleet-wide limit (`fleet_max`) again:
    /// a few statements per fleet-limited queue each time (sooner while shares move).
    #[serde(with = "units::duration")]
    pub share_interval: Duration,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            enabled: true,
            heartbeat_interval: Duration::from_secs(5),
            gone_after: Duration::from_secs(20),
            forget_after: Duration::from_secs(3600),
            share_interval: Duration::from_secs(1),
        }
    }
}

/// `[failed_messages]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailedMessagesConfig {
    /// How often the host counts the failed messages in its error queues, by the queue they
    /// failed in and by group, for the `failed_messages` gauges. Each count reads every
    /// row's headers once (about 0.7 s per 100 000 rows on PostgreSQL); zero = never.
    #[serde(with = "units::duration")]
    pub count_interval: Duration,
}

impl Default for FailedMessagesConfig {
    fn default() -> Self {
        FailedMessagesConfig {
            count_interval: Duration::from_secs(60),
        }
    }
}

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
        }
    }
}

/// NServiceBus's default delayed table suffix (`DelayedDeliveryOptions.TableSuffix`).
pub const DEFAULT_DELAYED_TABLE_SUFFIX: &str = "Delayed";

impl TransportConfig {
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

/// `[[queues]]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Queue (table) name.
    pub name: String,
    /// Where messages go after their retries are used up, and where poison rows go.
    pub error_queue: String,
    /// Immediate retries after the first failed attempt (NServiceBus default 5).
    pub immediate_retries: u32,
    /// A handler attempt running longer than this fails. `"off"` = no limit.
    #[serde(with = "units::optional_duration")]
    pub handler_timeout: Option<Duration>,
    /// MaximumConcurrencyLevel and the model that enforces it.
    pub concurrency: ConcurrencyConfig,
    /// The per-instance queue `<name>.<instance_id>` (secondary queue).
    pub instance_queue: InstanceQueueConfig,
    /// Per-key sequential processing; off unless a key header is named.
    pub ordering: OrderingConfig,
    /// Delayed retries after the immediate ones (NServiceBus recoverability).
    pub recoverability: RecoverabilityConfig,
    /// The queue's delayed table and its mover.
    pub delayed_delivery: DelayedDeliveryConfig,
    /// Outage mode: one message at a time with a pause after a run of failures.
    pub outage: OutageConfig,
    /// The latency-aware concurrency limit (off by default).
    pub latency_limit: LatencyLimitConfig,
    /// The handler for this queue's messages (binary); the library can register one instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handler: Option<HandlerConfig>,
}

impl QueueConfig {
    /// This queue's instance queue, `<name>.<instance>`.
    pub fn instance_queue_name(&self, instance: &str) -> String {
        format!("{}.{}", self.name, instance)
    }

    /// Every table this queue uses, each with the setting that names it: the queue, its error
    /// queue, its instance queue (when enabled) and a forward handler's target.
    pub fn tables(&self, instance: &str) -> Vec<(&'static str, String)> {
        let mut tables = vec![
            ("name", self.name.clone()),
            ("error_queue", self.error_queue.clone()),
        ];
        if self.instance_queue.enabled {
            tables.push(("instance_queue.enabled", self.instance_queue_name(instance)));
        }
        if let Some(HandlerConfig::Forward(f)) = &self.handler {
            tables.push(("handler.to", f.to.clone()));
        }
        tables
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            name: String::new(),
            error_queue: "error".into(),
            immediate_retries: 5,
            handler_timeout: None,
            concurrency: ConcurrencyConfig::default(),
            instance_queue: InstanceQueueConfig::default(),
            ordering: OrderingConfig::default(),
            recoverability: RecoverabilityConfig::default(),
            delayed_delivery: DelayedDeliveryConfig::default(),
            outage: OutageConfig::default(),
            latency_limit: LatencyLimitConfig::default(),
            handler: None,
        }
    }
}

/// `[queues.recoverability]`: what happens after a message's immediate retries, as in
/// NServiceBus: it is stored in the queue's delayed table and tried again later, up to
/// `delayed_retries` times, `delayed_retry_increment` x the retry's number later (10 s, 20 s,
/// 30 s by default); after the last, it goes to the error queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecoverabilityConfig {
    /// Delayed retries (0: none, straight to the error queue after the immediate retries).
    /// Unset: 3, except in transaction mode `none` (the message is gone before its handler
    /// runs, so nothing can be retried) and on queues that keep key order or stages (a
    /// message taken out to wait would let the later messages of its key pass it), where it
    /// is 0 and a number set is refused, naming this setting.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delayed_retries: Option<u32>,
    /// The delay of retry n is n x this.
    #[serde(with = "units::duration")]
    pub delayed_retry_increment: Duration,
}

/// NServiceBus's default number of delayed retries.
pub const DEFAULT_DELAYED_RETRIES: u32 = 3;

impl RecoverabilityConfig {
    /// The delayed retries in force: as set, else the default where retries can be taken
    /// (`can_retry`: not mode `none`, not an ordered queue) and 0 elsewhere.
    pub fn effective_delayed_retries(&self, can_retry: bool) -> u32 {
        match (self.delayed_retries, can_retry) {
            (Some(n), _) => n,
            (None, true) => DEFAULT_DELAYED_RETRIES,
            (None, false) => 0,
        }
    }
}

impl Default for RecoverabilityConfig {
    fn default() -> Self {
        RecoverabilityConfig {
            delayed_retries: None,
            delayed_retry_increment: Duration::from_secs(10),
        }
    }
}

/// `[queues.delayed_delivery]`: the queue's delayed table (`<queue>.Delayed` on both engines,
/// see `transport.delayed_table_suffix`), created with the queue, and the mover that moves due
/// messages into the queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DelayedDeliveryConfig {
    /// Create the delayed table and run its mover. Off: delayed sends to this queue and its
    /// delayed retries are refused (set `recoverability.delayed_retries = 0` too).
    pub enabled: bool,
    /// Due messages moved per transaction (NServiceBus default 100).
    pub batch_size: u32,
}

impl Default for DelayedDeliveryConfig {
    fn default() -> Self {
        DelayedDeliveryConfig {
            enabled: true,
            batch_size: 100,
        }
    }
}

/// `[queues.outage]`: after `consecutive_failures` different messages failed in a row on the
/// queue, it takes one message at a time with `pause` between attempts (doubling while the
/// failures go on, up to `max_pause`), and returns to its limits at the first success.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutageConfig {
    /// Different messages (by logical id) failing in a row, with no success between, that
    /// start outage mode; 0 = never. A message's retries count once, so a few bad messages
    /// failing again and again never look like an outage; 20 is seen within a fifth of a
    /// second at 100 messages/s.
    pub consecutive_failures: u32,
    /// The first pause between attempts in outage mode.
    #[serde(with = "units::duration")]
    pub pause: Duration,
    /// The longest pause (the pause doubles after each failure in outage mode).
    #[serde(with = "units::duration")]
    pub max_pause: Duration,
}

impl Default for OutageConfig {
    fn default() -> Self {
        OutageConfig {
            consecutive_failures: 20,
            pause: Duration::from_secs(1),
            max_pause: Duration::from_secs(10),
        }
    }
}

/// `[queues.latency_limit]`: keeps handler latency near its unloaded baseline by lowering the
/// queue's limit when latency rises (additive increase, multiplicative decrease: +1 per
/// interval while the limit is used and latency stays within `tolerance` of the baseline,
/// x `decrease_ratio` when it rises past it or an attempt times out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyLimitConfig {
    /// Switch it on.
    pub enabled: bool,
    /// The lowest limit it sets.
    pub min: u32,
    /// The limit it starts from (capped by the queue's max).
    pub initial: u32,
    /// How far the limit falls when latency rises (0 < ratio < 1).
    pub decrease_ratio: f64,
    /// How far above its baseline (the lowest latency seen) latency may be and still count as
    /// healthy: 0.05 = 5 %, measured on the mean of an interval of at least 50 ms, so timer
    /// jitter averages out. Raise it for a downstream whose latency varies by itself.
    pub tolerance: f64,
}

impl Default for LatencyLimitConfig {
    fn default() -> Self {
        LatencyLimitConfig {
            enabled: false,
            min: 1,
            initial: 1,
            decrease_ratio: 0.9,
            tolerance: 0.05,
        }
    }
}

/// The three MaximumConcurrencyLevel models of the NServiceBus SQL transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencyModel {
    /// `max` receive loops polling with back-off (transport < 2.0).
    Fixed,
    /// One loop to start, more on consecutive successes, fewer on consecutive empties (2.1).
    Adaptive,
    /// One peeker starting a receive task per pending message, bounded by `max` (3.0+).
    #[default]
    Monitor,
}

/// `[queues.concurrency]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrencyConfig {
    /// `fixed`, `adaptive` or `monitor`.
    pub model: ConcurrencyModel,
    /// MaximumConcurrencyLevel: messages of this queue in flight at most.
    pub max: u32,
    /// Wait between peeks (monitor) and the longest idle back-off (fixed, adaptive) when the
    /// queue is empty.
    #[serde(with = "units::duration")]
    pub peek_interval: Duration,
    /// Adaptive: a loop with more consecutive successful receives than this starts another.
    pub ramp_up_after: u32,
    /// Adaptive: a loop with more consecutive empty receives than this retires (never the last).
    pub ramp_down_after: u32,
    /// Messages one receive may take in one transaction (1: one per transaction). A batch
    /// takes only messages that may be in flight now (free places under the effective limit)
    /// and only while delivery is not throttled; it commits once, after every message of it
    /// has ended, and a crash returns all of it (duplicates after a crash: up to this many).
    pub receive_batch: u32,
    /// The most messages of this queue in flight across every instance on the database at
    /// once (unset: no fleet-wide limit). The instances share it by demand through the
    /// database (`[fleet]`); each one's own `max` still bounds it.
    pub fleet_max: Option<u32>,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        ConcurrencyConfig {
            model: ConcurrencyModel::Monitor,
            max: 8,
            peek_interval: Duration::from_secs(1),
            ramp_up_after: 5,
            ramp_down_after: 2,
            receive_batch: 1,
            fleet_max: None,
        }
    }
}

/// `[queues.instance_queue]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InstanceQueueConfig {
    /// Also receive from `<name>.<instance_id>`.
    pub enabled: bool,
    /// MaximumConcurrencyLevel of the instance queue.
    pub max_concurrency: u32,
}

impl Default for InstanceQueueConfig {
    fn default() -> Self {
        InstanceQueueConfig {
            enabled: false,
            max_concurrency: 1,
        }
    }
}

/// `[queues.ordering]`: messages that share a key are handled one at a time, in the order
/// they were stored, by every receiver of every host on the queue; different keys run in
/// parallel. Messages without the key header are not ordered. With `stages`, a message
/// whose `throttlehost.PreviousStage` header names a stage starts only when no message of
/// that stage (`throttlehost.ExecutionStage`) is left in the queue or in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrderingConfig {
    /// The header whose value is the key (e.g. `NServiceBus.ConversationId`); empty = no
    /// per-key order.
    pub key_header: String,
    /// Ordered stages by the `throttlehost.ExecutionStage` and `throttlehost.PreviousStage`
    /// headers.
    pub stages: bool,
    /// How many of the oldest rows a receive looks at to find a message that may run. Keep it
    /// above the in-flight messages of every host on the queue together: a receive that sees
    /// only waiting messages finds nothing and waits like an empty one.
    pub lookahead: u32,
    /// What a keyed message that failed after its retries does to its key: `continue` (it
    /// goes to the error queue and the key goes on) or `hold` (it stays in the queue, its
    /// key's later messages wait behind it, until `throttlehost queues release` lifts the
    /// hold and it is tried again, first).
    pub failed_key: FailedKey,
}

/// What a keyed message that failed after its retries does to its key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailedKey {
    /// To the error queue; the key continues with its next message.
    #[default]
    Continue,
    /// Stays in place and holds its key (recorded in the database) until released.
    Hold,
}

impl OrderingConfig {
    /// The key header when the queue keeps per-key order.
    pub fn key_header(&self) -> Option<&str> {
        Some(self.key_header.as_str()).filter(|h| !h.is_empty())
    }

    /// Whether receives must keep any order (per key, stages or both).
    pub fn is_ordered(&self) -> bool {
        self.key_header().is_some() || self.stages
    }
}

impl Default for OrderingConfig {
    fn default() -> Self {
        OrderingConfig {
            key_header: String::new(),
            stages: false,
            lookahead: 64,
            failed_key: FailedKey::Continue,
        }
    }
}

/// `[queues.handler]`: a built-in handler of the binary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HandlerConfig {
    /// Accepts every message and does nothing.
    Noop,
    /// Simulated work with tunable latency, memory, CPU, threads and failures.
    Simulate(SimulateConfig),
    /// Sends every message on to another queue through the throttled publish path.
    Forward(ForwardConfig),
    /// Runs a program per message with the body on stdin; exit code 0 is success.
    Command(CommandConfig),
    /// POSTs every message to a URL; a 2xx answer is success.
    Http(HttpConfig),
}

/// How the simulated handler's latency is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LatencyDistribution {
    /// Always `latency`.
    #[default]
    Fixed,
    /// Uniform between 0 and twice `latency`.
    Uniform,
    /// Exponential with mean `latency` (many short, a few long).
    Exponential,
}

/// `kind = "simulate"`: the knobs load tests turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulateConfig {
    /// Mean time a message takes.
    #[serde(with = "units::duration")]
    pub latency: Duration,
    /// `fixed`, `uniform` or `exponential`.
    pub latency_distribution: LatencyDistribution,
    /// Memory allocated and touched per message, held until the message is done.
    pub memory_per_message: ByteSize,
    /// CPU time burned per message (busy loop).
    #[serde(with = "units::duration")]
    pub cpu_work: Duration,
    /// Spend the latency blocking a thread of the blocking pool instead of sleeping
    /// asynchronously (raises the process thread count under load).
    pub blocking: bool,
    /// Share of attempts that fail, 0.0 to 1.0.
    pub failure_rate: f64,
    /// A downstream the handler calls for its latency that serves this many calls at once
    /// (the rest wait their turn, so latency grows with the calls made); 0 = unlimited.
    pub downstream_capacity: u32,
}

impl Default for SimulateConfig {
    fn default() -> Self {
        SimulateConfig {
            latency: Duration::from_millis(10),
            latency_distribution: LatencyDistribution::Fixed,
            memory_per_message: ByteSize(0),
            cpu_work: Duration::ZERO,
            blocking: false,
            failure_rate: 0.0,
            downstream_capacity: 0,
        }
    }
}

/// `kind = "forward"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardConfig {
    /// Destination queue.
    pub to: String,
}

/// `kind = "command"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandConfig {
    /// Program to run (looked up on PATH).
    pub program: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
}

/// `kind = "http"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `http://` URL the message body is POSTed to; headers travel as `X-Header-<name>`.
    pub url: String,
}

/// A direction's override, as BizTalk's "throttling override".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OverrideMode {
    /// Throttle by the conditions.
    #[default]
    None,
    /// Always throttle, at the override severity (state 10 delivery, 11 publishing).
    Throttle,
    /// Never throttle this direction (conditions are still measured and shown).
    Never,
}

impl OverrideMode {
    /// BizTalk's counter value: 0 none, 1 throttle, 2 never.
    pub fn code(self) -> u8 {
        match self {
            OverrideMode::None => 0,
            OverrideMode::Throttle => 1,
            OverrideMode::Never => 2,
        }
    }
}

/// `[throttling]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ThrottlingConfig {
    /// Master switch. Off: no delays, no limit changes; conditions are still measured.
    pub enabled: bool,
    /// How often sensors are read and states decided.
    #[serde(with = "units::duration")]
    pub sample_interval: Duration,
    /// A condition clears when its value falls below threshold x this (hysteresis).
    pub resume_ratio: f64,
    /// ... and has stayed below it this long (hysteresis in time): a value that the control
    /// holds at its line and that dips under it for a sample is one episode, not a state
    /// change per dip, even with `resume_ratio = 1.0`.
    #[serde(with = "units::duration")]
    pub resume_after: Duration,
    /// A direction that throttled on a measured cause keeps showing it (recovering) until
    /// the cause has been clear this long, so a cause that comes back within it (a sawtooth,
    /// a periodic batch) is one state, not a flip each time. Overrides end at once.
    #[serde(with = "units::duration")]
    pub min_dwell: Duration,
    /// First delay when a resource condition begins.
    #[serde(with = "units::duration")]
    pub initial_delay: Duration,
    /// Process memory (RSS) threshold: "25%" of physical memory, "1.5GiB" or "off".
    pub process_memory: MemoryThreshold,
    /// System-wide used physical memory threshold.
    pub system_memory: MemoryThreshold,
    /// Messages handed to handlers and not done, per CPU (0 = off).
    pub in_process_per_cpu: u64,
    /// Threads in the process, per CPU (0 = off).
    pub threads_per_cpu: u64,
    /// Messages in the queues this host receives from and publishes to (0 = off).
    pub database_size: u64,
    /// Count the error queues in the database size.
    pub database_size_includes_error_queue: bool,
    /// Longest age of a queue depth used for the database size before it is peeked again.
    #[serde(with = "units::duration")]
    pub database_size_refresh: Duration,
    /// Database connections in use, per CPU (0 = off).
    pub database_sessions_per_cpu: u64,
    /// Under memory, thread or session pressure a queue's limit is cut to the messages in
    /// flight x min(this, target / value), the target being midway between resume line and
    /// threshold: this is the gentlest cut (floor 1, never deeper than a quarter).
    pub concurrency_decrease_ratio: f64,
    /// Below the resume line a limit grows by its headroom share per sample (up to doubling
    /// far below the line) and by at least this step.
    pub concurrency_increase_step: u32,
    /// Severity (1-1000) of each resource condition: scales its delay (severity / 100 x
    /// (100 ms x overage + 100 ms x overage-seconds)).
    pub severity: SeverityConfig,
    /// Delivery: queue -> handler.
    pub delivery: DirectionConfig,
    /// Publishing: sends -> queue.
    pub publishing: DirectionConfig,
}

impl Default for ThrottlingConfig {
    fn default() -> Self {
        ThrottlingConfig {
            enabled: true,
            sample_interval: Duration::from_millis(500),
            resume_ratio: 0.9,
            resume_after: Duration::from_secs(1),
            min_dwell: Duration::from_secs(3),
            initial_delay: Duration::from_millis(10),
            process_memory: MemoryThreshold::Percent(25.0),
            system_memory: MemoryThreshold::Off,
            in_process_per_cpu: 1000,
            threads_per_cpu: 0,
            database_size: 50_000,
            database_size_includes_error_queue: false,
            database_size_refresh: Duration::from_secs(5),
            database_sessions_per_cpu: 0,
            concurrency_decrease_ratio: 0.9,
            concurrency_increase_step: 1,
            severity: SeverityConfig::default(),
            delivery: DirectionConfig::default(),
            publishing: DirectionConfig::default(),
        }
    }
}

/// `[throttling.severity]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SeverityConfig {
    /// Process memory (BizTalk default 500).
    pub process_memory: u32,
    /// System memory.
    pub system_memory: u32,
    /// In-process messages (BizTalk default 75).
    pub in_process: u32,
    /// Thread count.
    pub threads: u32,
    /// Database size (BizTalk default 1).
    pub database_size: u32,
    /// Database sessions.
    pub database_sessions: u32,
}

impl Default for SeverityConfig {
    fn default() -> Self {
        SeverityConfig {
            process_memory: 500,
            system_memory: 500,
            in_process: 75,
            threads: 100,
            database_size: 1,
            database_sessions: 100,
        }
    }
}

/// `[throttling.delivery]` and `[throttling.publishing]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DirectionConfig {
    /// Rate overdrive factor in percent: throttle when incoming > outgoing x this / 100.
    pub overdrive_percent: u32,
    /// Sliding window the rates are measured over.
    #[serde(with = "units::duration")]
    pub sampling_window: Duration,
    /// Fewer messages than this in the window: no rate throttling.
    pub min_samples: u64,
    /// Cap of the throttling delay.
    #[serde(with = "units::duration")]
    pub max_delay: Duration,
    /// `none`, `throttle` or `never`.
    #[serde(rename = "override")]
    pub override_mode: OverrideMode,
    /// Severity of the forced condition when override = throttle.
    pub override_severity: u32,
}

impl Default for DirectionConfig {
    fn default() -> Self {
        DirectionConfig {
            overdrive_percent: 125,
            sampling_window: Duration::from_secs(15),
            min_samples: 100,
            max_delay: Duration::from_secs(300),
            override_mode: OverrideMode::None,
            override_severity: 100,
        }
    }
}
