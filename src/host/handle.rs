//! What a caller may do with a running host besides stopping it: a cheap, cloneable handle
//! that tasks and threads can keep. It offers intents (send, reload, override, read the
//! status, the throttling snapshot and the metrics) and hands out nothing of the host's
//! machinery: what `HostInner` holds stays behind it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::HostInner;
use crate::config::{Config, OverrideMode};
use crate::fleet::{FleetOrder, FleetOrderError, FleetView};
use crate::message::OutgoingMessage;
use crate::publish::{EventTypes, Published};
use crate::status::{HostStatus, OverrideScope, QueueStatus};
use crate::throttling::{Direction, Snapshot};
use crate::transport::{QueueName, Transport, TransportError};

/// Sends `message` to `queue` as `host` sends: origin headers, the throttled publish path.
pub(super) async fn send_from(
    host: &HostInner,
    queue: &str,
    message: OutgoingMessage,
) -> Result<(), TransportError> {
    let queue = QueueName::new(queue)?;
    let message = message.sent_by(host.origin());
    host.publisher().send(&queue, &message).await
}

/// Publishes an event of `types` as `host` publishes: origin headers, intent `Publish`, a
/// copy for every subscriber through the throttled publish path.
pub(super) async fn publish_from(
    host: &HostInner,
    types: &EventTypes,
    message: OutgoingMessage,
) -> Result<Published, TransportError> {
    // The publisher marks it an event (intent Publish over the Send `sent_by` sets).
    let message = message.sent_by(host.origin());
    host.publisher().publish(types, message).await
}

/// A handle to a running host (see [`crate::Host::handle`]). Cloning it is cheap; it stays
/// usable after the host shut down (sends then fail and the status says it stopped).
#[derive(Clone)]
pub struct HostHandle {
    inner: Arc<HostInner>,
}

impl HostHandle {
    pub(super) fn new(inner: Arc<HostInner>) -> Self {
        HostHandle { inner }
    }

    /// Sends a message through the throttled publish path, with this host's origin headers.
    pub async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), TransportError> {
        send_from(&self.inner, queue, message).await
    }

    /// Publishes an event to every subscriber of its topics, each copy through the throttled
    /// publish path, all stored in one transaction (see [`crate::Context::publish`] for a
    /// handler's). A topic nobody subscribes to stores nothing and is not an error.
    pub async fn publish(
        &self,
        types: &EventTypes,
        message: OutgoingMessage,
    ) -> Result<Published, TransportError> {
        publish_from(&self.inner, types, message).await
    }

    /// The status document (as `/status` serves it).
    pub fn status(&self) -> HostStatus {
        self.inner.status()
    }

    /// One receiving queue's part of the status document; None for a queue it does not
    /// receive from.
    pub fn queue_status(&self, queue: &str) -> Option<QueueStatus> {
        self.status().queues.into_iter().find(|q| q.name == queue)
    }

    /// This instance's share of `queue`'s fleet-wide limit now, read from its gate alone (a
    /// status document reads every queue); None without a fleet-wide limit or such a queue.
    pub fn fleet_share(&self, queue: &str) -> Option<u32> {
        let q = self.inner.queue(queue)?;
        let fleet_max = q.settings().fleet_max?;
        Some(q.gate().fleet_share().min(fleet_max))
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.inner.config()
    }

    /// The transport the host receives and sends through.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        self.inner.transport()
    }

    /// Messages handed to handlers and not done.
    pub fn in_process(&self) -> u64 {
        self.inner.in_process()
    }

    /// The throttling controller's latest sample and decision; None before the first.
    pub fn throttling(&self) -> Option<Arc<Snapshot>> {
        self.inner.control().snapshot()
    }

    /// Every throttling sample and decision from now on (a slow reader skips the ones it
    /// missed: the channel keeps the latest few).
    pub fn throttling_samples(&self) -> tokio::sync::broadcast::Receiver<Arc<Snapshot>> {
        self.inner.control().subscribe()
    }

    /// How long a send waits for the publishing admission now (its delay or pace).
    pub fn publishing_wait(&self) -> Duration {
        self.inner.publisher().current_wait()
    }

    /// Whether delivery's admission lets receives through without waiting now.
    pub fn delivery_is_open(&self) -> bool {
        self.inner.throttle().delivery.is_open()
    }

    /// Overrides throttling in `direction` on this instance (`PUT
    /// /throttling/{direction}/override`).
    pub fn set_override(&self, direction: Direction, mode: OverrideMode) {
        self.inner.set_override(direction, mode)
    }

    /// Orders every instance on the database to override `direction` (this one at once, the
    /// others at their next heartbeat), through the instance registry.
    pub async fn set_fleet_override(
        &self,
        direction: Direction,
        mode: OverrideMode,
    ) -> Result<FleetOrder, FleetOrderError> {
        self.inner.set_fleet_override(direction, mode).await
    }

    /// `direction`'s override in force now and where it came from (the status document shows
    /// it from the next sample on).
    pub fn override_in_force(&self, direction: Direction) -> (OverrideMode, OverrideScope) {
        let config = self.inner.control().config();
        let mode = match direction {
            Direction::Delivery => config.delivery.override_mode,
            Direction::Publishing => config.publishing.override_mode,
        };
        (mode, self.inner.override_scope(direction))
    }

    /// Reloads the file the configuration came from; Ok lists what needs a restart.
    pub fn reload(&self) -> Result<Vec<String>, String> {
        self.inner.reload()
    }

    /// Reloads the configuration from `path`; Ok lists what needs a restart.
    pub fn reload_from(&self, path: &Path) -> Result<Vec<String>, String> {
        self.inner.reload_from(path)
    }

    /// Applies a configuration that was already checked; returns what needs a restart.
    pub fn apply_config(&self, config: Config) -> Vec<String> {
        self.inner.apply_config(config)
    }

    /// The metrics as `/metrics` serves them (Prometheus text format).
    pub fn metrics_text(&self) -> String {
        self.inner.metrics().render()
    }

    /// Every instance on this host's database, as `/fleet` shows it.
    pub async fn fleet(&self) -> Result<FleetView, String> {
        self.inner.fleet().await
    }
}
