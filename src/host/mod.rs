//! The host: assembles transport, queues, receivers, dispatcher, publisher, throttling and the
//! admin endpoint from a [`Config`], runs them, reloads settings, and shuts down without
//! losing messages.
//!
//! This file is the face: the host's error, its shared parts ([`Host`] and the state its tasks
//! share). The rooms: `builder` (assembly in order), `plan` (queues and their handlers),
//! `prepare` (tables before receiving), `tasks` (what runs), `running` (status, sends,
//! overrides, shutdown), `fleet_orders`, `reload`, and beside them the handle, the status
//! document, the probe and the admin endpoint's state.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use throttlehost::{Config, HostBuilder};
//! let config = throttlehost::config::load_file("config/host.toml".as_ref())?;
//! let host = HostBuilder::new(config).start().await?;
//! // ... until a signal arrives:
//! host.shutdown().await;
//! # Ok(()) }
//! ```

mod admin_state;
mod arrival_scan;
mod builder;
mod fleet_orders;
mod handle;
mod overrides;
mod plan;
mod prepare;
mod probe;
mod reload;
mod running;
mod status;
mod tasks;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Limits of the admin endpoint (`host.admin_address`) against clients that hold connections.
pub use crate::admin::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS};
pub use crate::status::{
    DirectionStatus, FleetShareStatus, HostStatus, OverrideScope, QueueStatus, ResourceStatus,
    ThrottlingStatus,
};
pub use builder::HostBuilder;
pub use handle::HostHandle;
use tasks::AdminServer;

use crate::config::Config;
use crate::dispatch::Dispatcher;
use crate::handlers::SimulateHandler;
use crate::metrics::Metrics;
use crate::publish::Publisher;
use crate::receive::{QueueRuntime, ReceiveContext};
use crate::throttling::Throttle;
use crate::throttling::service::ThrottleControl;
use crate::transport::{QueueName, Transport, TransportError};

/// Why a host could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A setting cannot be run as it is; names it.
    #[error("{setting}: {message}")]
    Setting {
        /// The setting, as written in the configuration file (`queues[0].concurrency.receive_batch`).
        setting: String,
        /// What is wrong with it and what to do instead.
        message: String,
    },
    /// A configured queue has no handler.
    #[error(
        "queue `{queue}` has no handler: set [queues.handler] in the configuration or register one with HostBuilder::handler"
    )]
    NoHandler {
        /// The queue.
        queue: String,
    },
    /// A table the host creates or prepares for a queue could not be made ready.
    #[error("queue `{queue}`: cannot {what}: {source} ({remedy})")]
    Prepare {
        /// The queue.
        queue: String,
        /// What the host tried.
        what: &'static str,
        /// Why it failed.
        source: TransportError,
        /// What an operator can do about it.
        remedy: &'static str,
    },
    /// A configured queue name is not a valid name.
    #[error(transparent)]
    QueueName(#[from] crate::names::InvalidName),
    /// The admin endpoint could not listen.
    #[error("cannot listen on admin address {address}: {source}")]
    Admin {
        /// The address.
        address: String,
        /// Why.
        source: std::io::Error,
    },
}

impl HostError {
    /// The database could not be reached (as opposed to a configuration it rejected): worth
    /// trying again once it answers.
    pub fn is_unreachable_database(&self) -> bool {
        matches!(
            self,
            HostError::Transport(
                TransportError::Connection { .. } | TransportError::PoolTimeout { .. }
            )
        )
    }
}

/// The parts of a running host that the admin endpoint and the host handle share.
pub(crate) struct HostInner {
    config: ArcSwap<Config>,
    config_path: Option<PathBuf>,
    instance: String,
    transport: Arc<dyn Transport>,
    queues: Vec<Arc<QueueRuntime>>,
    /// The simulate handlers' knobs by receiving queue (load tests and reloads turn them).
    simulated: Vec<(QueueName, Arc<SimulateHandler>)>,
    known_queues: HashSet<QueueName>,
    dispatcher: Arc<Dispatcher>,
    publisher: Arc<Publisher>,
    throttle: Arc<Throttle>,
    control: Arc<ThrottleControl>,
    metrics: Metrics,
    receive_ctx: Arc<ReceiveContext>,
    /// The host's runtime: transport work from the admin thread runs here.
    runtime: tokio::runtime::Handle,
    started: Instant,
    /// This process in the instance registry.
    process_id: uuid::Uuid,
    /// Whether its heartbeat is written.
    fleet_health: Arc<crate::fleet::HeartbeatHealth>,
    /// Where each direction's override came from; the fleet's orders.
    overrides: overrides::Overrides,
}

/// How long shutdown waits for in-flight work after telling it to roll back.
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// A running host.
pub struct Host {
    inner: Arc<HostInner>,
    service_stop: CancellationToken,
    service_task: JoinHandle<()>,
    controller_ended: CancellationToken,
    admin: Option<AdminServer>,
}

/// What shutdown did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// In-flight work finished within the timeout.
    pub drained: bool,
    /// Messages rolled back because the timeout passed (they return to their queues).
    pub rolled_back: u64,
}
