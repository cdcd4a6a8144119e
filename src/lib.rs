//! throttlehost: a message-processing host for SQL Server queue tables (the NServiceBus SQL
//! Server transport's layout and semantics) with BizTalk-style host throttling.
//!
//! The map of the crate is in `docs/ARCHITECTURE.md`. In short: [`transport`] holds the
//! queue tables, [`receive`] takes messages off them under each queue's concurrency model,
//! [`dispatch`] runs [`Handler`]s with retries and the error queue, [`publish`] is the one
//! throttled send path, and [`throttling`] watches resources and rates and sets the delays
//! and limits the receivers and the publisher obey. [`Host`] puts them together.
//!
//! ```no_run
//! use throttlehost::{Context, Handler, HandlerError, HostBuilder, OutgoingMessage};
//!
//! struct Billing;
//!
//! #[throttlehost::async_trait]
//! impl Handler for Billing {
//!     async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
//!         let invoice = OutgoingMessage::new(ctx.body().to_vec());
//!         ctx.send("invoices", invoice).await?; // throttled; written only if this succeeds
//!         Ok(())
//!     }
//! }
//!
//! async fn start() -> Result<(), Box<dyn std::error::Error>> {
//!     let config = throttlehost::config::load_file("host.toml".as_ref())?;
//!     let host = HostBuilder::new(config).handler("billing", Billing).start().await?;
//!     // ... until shutdown:
//!     host.shutdown().await; // in-flight messages finish or roll back; none is lost
//!     Ok(())
//! }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The version of this build (`--version`, the `build_info` and `host_info` metrics).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit this build was made from: `git rev-parse --short=12 HEAD` at build time, the
/// `THROTTLEHOST_COMMIT` environment variable when a packager sets it, or "unknown".
pub const COMMIT: &str = env!("THROTTLEHOST_COMMIT");

pub mod admin;
pub mod config;
pub mod console;
pub mod delayed;
pub mod depth;
pub mod dispatch;
pub mod fleet;
pub mod handlers;
pub mod host;
pub mod isolate;
#[cfg(feature = "load")]
pub mod load;
pub mod message;
pub mod metrics;
pub mod names;
pub mod publish;
pub mod queue;
pub mod receive;
pub mod states;
pub mod status;
pub mod throttling;
pub mod transport;

/// Handlers are async traits; re-exported so users need no extra dependency.
pub use async_trait::async_trait;
pub use config::Config;
pub use handlers::{Context, Handler, HandlerError};
pub use host::{Host, HostBuilder, HostError, HostStatus};
pub use message::{Headers, Message, OutgoingMessage};
