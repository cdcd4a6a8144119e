//! The host's settings: one TOML file, described here once.
//!
//! Every struct carries its defaults (BizTalk's where BizTalk has one) and a doc comment per
//! field; `config/host.toml` lists the same settings with the same defaults, and a test keeps
//! the two in step. Loading (with errors that name the key, the value and the line) lives in
//! [`load`], checks across fields in [`validate`], live reloading in [`reload`]. The sections
//! live in `host` (host, admin, fleet, failed messages), `transport`, `queue` and `throttling`.

mod defaults;
mod host;
pub mod load;
mod queue;
pub mod reload;
pub mod secret;
mod throttling;
mod transport;
pub mod units;
pub mod validate;

use serde::{Deserialize, Serialize};

pub use self::host::{AdminConfig, FailedMessagesConfig, FleetConfig, HostConfig};
pub use self::queue::{
    CommandConfig, ConcurrencyConfig, ConcurrencyModel, DEFAULT_DELAYED_RETRIES,
    DelayedDeliveryConfig, FailedKey, ForwardConfig, HandlerConfig, HttpConfig,
    InstanceQueueConfig, LatencyDistribution, LatencyLimitConfig, OrderingConfig, OutageConfig,
    PublishConfig, QueueConfig, RecoverabilityConfig, SimulateConfig,
};
pub use self::throttling::{DirectionConfig, OverrideMode, SeverityConfig, ThrottlingConfig};
pub use self::transport::{
    DEFAULT_DELAYED_TABLE_SUFFIX, Dialect, TransactionMode, TransportConfig, TransportKind,
};
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
