//! throttlehost: a message-processing host for SQL Server queue tables (the NServiceBus SQL
//! Server transport's layout and semantics) with BizTalk-style host throttling.
//!
//! The map of the crate is in `docs/ARCHITECTURE.md`. In short: [`transport`] holds the
//! queue tables, [`receive`] takes messages off them under each queue's concurrency model,
//! [`dispatch`] runs [`Handler`]s with retries and the error queue, [`publish`] is the one
//! throttled send path, and [`throttling`] watches resources and rates and sets the delays
//! and limits the receivers and the publisher obey. [`Host`] puts them together.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod config;
pub mod dispatch;
pub mod handlers;
pub mod host;
pub mod load;
pub mod message;
pub mod metrics;
pub mod publish;
pub mod receive;
pub mod throttling;
pub mod transport;

pub use config::Config;
pub use handlers::{Context, Handler, HandlerError};
pub use host::{Host, HostBuilder, HostError, HostStatus};
pub use message::{Headers, Message, OutgoingMessage};
