//! A running host: the shared parts its tasks read, status, sends, overrides and shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::message::OutgoingMessage;
use crate::metrics::Metrics;
use crate::publish::Publisher;
use crate::publish::{EventTypes, Published};
use crate::receive::QueueRuntime;
use crate::throttling::service::ThrottleControl;
use crate::throttling::{Direction, Throttle};
use crate::transport::{QueueName, Transport, TransportError};

use super::tasks::moves_delayed;
use super::{ABORT_GRACE, Host, HostHandle, HostInner, ShutdownReport};
use super::{HostStatus, handle, status};

impl HostInner {
    /// The configuration in force.
    pub(crate) fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// The transport.
    pub(crate) fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// The runtime the host's receivers and transport connections run on.
    pub(crate) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// The throttled publisher.
    pub(crate) fn publisher(&self) -> &Arc<Publisher> {
        &self.publisher
    }

    /// Who this host is in the headers it writes (`Originating*`, `Processing*`).
    pub(crate) fn origin(&self) -> &crate::message::Origin {
        self.dispatcher.origin()
    }

    /// Throttling settings, overrides and the latest snapshot.
    pub(crate) fn control(&self) -> &Arc<ThrottleControl> {
        &self.control
    }

    /// The admissions and rate counters.
    pub(crate) fn throttle(&self) -> &Arc<Throttle> {
        &self.throttle
    }

    /// The metric registry.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Receiving queues (input and instance queues).
    pub(crate) fn queues(&self) -> &[Arc<QueueRuntime>] {
        &self.queues
    }

    /// A receiving queue by name.
    pub(crate) fn queue(&self, name: &str) -> Option<&Arc<QueueRuntime>> {
        self.queues.iter().find(|q| q.name().as_str() == name)
    }

    /// Queues this host receives from, sends errors to or forwards to: what ingest accepts.
    pub(crate) fn is_known_queue(&self, name: &QueueName) -> bool {
        self.known_queues.contains(name)
    }

    /// Messages handed to handlers and not done.
    pub(crate) fn in_process(&self) -> u64 {
        self.dispatcher.in_process()
    }

    /// True until shutdown begins.
    pub(crate) fn is_receiving(&self) -> bool {
        !self.receive_ctx.stop.is_cancelled()
    }

    /// The status document served at `/status`.
    pub(crate) fn status(&self) -> HostStatus {
        status::build(self)
    }
}

impl HostInner {
    /// Sets a direction's override on this instance until the next reload or fleet order.
    pub(crate) fn set_override(&self, direction: Direction, mode: crate::config::OverrideMode) {
        tracing::info!(%direction, mode = ?mode, "throttling override set");
        self.control.set_override(direction, mode);
        self.overrides.set_locally(direction);
    }

    /// Where `direction`'s override in force came from.
    pub(crate) fn override_scope(&self, direction: Direction) -> crate::status::OverrideScope {
        self.overrides.scope(direction)
    }
}

impl HostInner {
    /// Whether this host runs a mover for `q`'s delayed table.
    pub(crate) fn moves_delayed(&self, q: &QueueRuntime) -> bool {
        moves_delayed(q, self.transport.as_ref())
    }
}

impl Host {
    /// A handle to this host that tasks and threads can keep: send, reload, override, and
    /// read its status, throttling and metrics.
    pub fn handle(&self) -> HostHandle {
        HostHandle::new(self.inner.clone())
    }

    /// The admin endpoint's address, if it listens.
    pub fn admin_address(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(|a| a.address)
    }

    /// Sends a message through the throttled publish path.
    pub async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), TransportError> {
        handle::send_from(&self.inner, queue, message).await
    }

    /// Publishes an event to every subscriber of its topics ([`HostHandle::publish`]).
    pub async fn publish(
        &self,
        types: &EventTypes,
        message: OutgoingMessage,
    ) -> Result<Published, TransportError> {
        handle::publish_from(&self.inner, types, message).await
    }

    /// Resolves if the throttling controller stops while the host runs (it panicked): the
    /// host can no longer throttle or apply an override, so the caller should shut it down
    /// and exit with an error. Never resolves during a normal run.
    pub async fn controller_failed(&self) {
        self.controller_ended.cancelled().await;
        if self.service_stop.is_cancelled() {
            std::future::pending::<()>().await;
        }
    }

    /// The status document.
    pub fn status(&self) -> HostStatus {
        self.inner.status()
    }

    /// Stops receiving, lets in-flight messages finish for up to `host.shutdown_timeout`,
    /// rolls back what is still running (it returns to its queue), and stops.
    pub async fn shutdown(self) -> ShutdownReport {
        let timeout = self.inner.config().host.shutdown_timeout;
        self.shutdown_within(timeout).await
    }

    /// [`Host::shutdown`] with an explicit timeout.
    pub async fn shutdown_within(self, timeout: Duration) -> ShutdownReport {
        let ctx = &self.inner.receive_ctx;
        tracing::info!(
            in_process = self.inner.in_process(),
            "shutting down: receiving stopped, waiting for in-flight messages"
        );
        ctx.stop.cancel();
        ctx.tasks.close();
        let drained = tokio::time::timeout(timeout, ctx.tasks.wait())
            .await
            .is_ok();
        let mut rolled_back = 0;
        if !drained {
            rolled_back = self.inner.in_process();
            tracing::warn!(
                rolled_back,
                "shutdown timeout passed: rolling back in-flight messages"
            );
            ctx.abort.cancel();
            // Rolling back is dropping: a task stuck in a statement (a lock wait, a frozen
            // server) is not waited for past a short grace, so the timeout stays a limit.
            // Its connection goes with the runtime, and the server rolls its work back.
            if tokio::time::timeout(ABORT_GRACE, ctx.tasks.wait())
                .await
                .is_err()
            {
                tracing::warn!(
                    "in-flight work did not stop within {}s of the rollback; leaving it to the server",
                    ABORT_GRACE.as_secs()
                );
            }
        }
        self.service_stop.cancel();
        let _ = self.service_task.await;
        if let Some(admin) = self.admin {
            admin.stop.cancel();
            let _ = admin.task.await;
        }
        tracing::info!(drained, rolled_back, "host stopped");
        ShutdownReport {
            drained,
            rolled_back,
        }
    }
}
