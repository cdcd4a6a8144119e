//! throttlehost: a message-processing host for SQL Server queue tables (the NServiceBus SQL
//! Server transport's layout and semantics) with BizTalk-style host throttling.
//!
//! The API: a [`HostBuilder`] starts a [`Host`] from a [`Config`] (`config`), with a
//! [`Handler`] per queue (`handlers`); messages are [`Message`] and [`OutgoingMessage`]
//! (`message`); [`transport`] holds the transport traits a database must implement, its
//! optional abilities, and the memory, PostgreSQL and SQL Server transports; [`throttling`]
//! names the states, conditions and snapshots a host reports, and the sensor a host reads.
//! Everything else is the machinery behind them, mapped in `docs/ARCHITECTURE.md`.
//!
//! A handler and a host on the embedded memory transport (a configuration file names
//! PostgreSQL or SQL Server instead: `throttlehost::config::load_file`):
//!
//! ```
//! use std::sync::Arc;
//!
//! use throttlehost::config::{Config, HandlerConfig, QueueConfig};
//! use throttlehost::{Context, Handler, HandlerError, HostBuilder, OutgoingMessage};
//! use tokio::sync::Notify;
//!
//! /// Sends an invoice for every order it handles.
//! struct Billing {
//!     handled: Arc<Notify>,
//! }
//!
//! #[throttlehost::async_trait]
//! impl Handler for Billing {
//!     async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
//!         let invoice = OutgoingMessage::new(ctx.body().to_vec());
//!         ctx.send("invoices", invoice).await?; // throttled; written only if this succeeds
//!         self.handled.notify_one();
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut config = Config::default(); // the memory transport
//! config.host.admin_address = "off".into();
//! config.queues.push(QueueConfig { name: "orders".into(), ..QueueConfig::default() });
//! config.queues.push(QueueConfig {
//!     name: "invoices".into(),
//!     handler: Some(HandlerConfig::Noop), // a built-in handler, named in the configuration
//!     ..QueueConfig::default()
//! });
//! let handled = Arc::new(Notify::new());
//! let host = HostBuilder::new(config)
//!     .handler("orders", Billing { handled: handled.clone() })
//!     .start()
//!     .await?;
//! host.send("orders", OutgoingMessage::new("order 1")).await?;
//! handled.notified().await;
//! host.shutdown().await; // in-flight messages finish or roll back; none is lost
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![warn(unreachable_pub)]

// The public API: the host, handlers, configuration, messages, the transport traits a user
// may implement (and the three transports), and the throttling types a host reports.
pub mod config;
pub mod failed;
pub mod handlers;
pub mod host;
#[cfg(feature = "load")]
pub mod load;
pub mod message;
pub mod throttling;
pub mod transport;

// The machinery behind them: reachable only through the types above.
pub(crate) mod admin;
pub(crate) mod console;
pub(crate) mod delayed;
pub(crate) mod depth;
pub(crate) mod dispatch;
pub(crate) mod fleet;
pub(crate) mod isolate;
pub(crate) mod metrics;
pub(crate) mod names;
pub(crate) mod publish;
pub(crate) mod queue;
pub(crate) mod receive;
pub(crate) mod states;
pub(crate) mod status;
mod version;

/// Handlers are async traits; re-exported so users need no extra dependency.
pub use async_trait::async_trait;
pub use config::Config;
pub use delayed::DelayedMoves;
pub use dispatch::{DispatchObserver, Outcome};
pub use fleet::{FleetMember, FleetOrder, FleetOrderError, FleetView};
pub use handlers::{Context, Handler, HandlerError};
pub use host::{Host, HostBuilder, HostError, HostHandle, HostStatus};
pub use message::{Headers, Message, OutgoingMessage};
pub use publish::{EventTypes, Published};
pub use version::{COMMIT, VERSION};

/// The metrics a host exports on `/metrics`: each name, kind, help text and labels, defined
/// once (alert rules and dashboards name only these).
pub mod catalogue {
    pub use crate::metrics::{Kind, METRICS, MetricDef, PREFIX};
}

/// Not part of the API: internals the crate's criterion benchmarks measure on their own.
/// They may change in any release.
#[doc(hidden)]
pub mod bench_internals {
    pub use crate::throttling::admission::Admission;
    pub use crate::throttling::rates::{RateCounters, RateWindow};
}
