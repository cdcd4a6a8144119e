//! The host seen by its admin endpoint: [`AdminState`] over [`HostInner`].

use std::sync::Arc;

use super::HostInner;
use crate::admin::AdminState;
use crate::config::{AdminConfig, OverrideMode};
use crate::publish::Publisher;
use crate::status::HostStatus;
use crate::throttling::Direction;
use crate::transport::{QueueName, Transport};

impl AdminState for HostInner {
    fn status(&self) -> HostStatus {
        HostInner::status(self)
    }

    fn fleet(
        &self,
    ) -> futures_util::future::BoxFuture<'_, Result<crate::fleet::FleetView, String>> {
        Box::pin(HostInner::fleet(self))
    }

    fn metrics_text(&self) -> String {
        self.metrics().render()
    }

    fn not_ready(&self) -> Option<String> {
        if !self.is_receiving() {
            return Some("shutting down: receivers stopped".to_string());
        }
        let stopped: Vec<&str> = self
            .queues()
            .iter()
            .filter(|q| !q.receiver_alive())
            .map(|q| q.name().as_str())
            .collect();
        if !stopped.is_empty() {
            return Some(format!(
                "receiver not running for queue {}",
                stopped.join(", ")
            ));
        }
        let open: Vec<&str> = self
            .queues()
            .iter()
            .filter(|q| q.breaker().is_triggered())
            .map(|q| q.name().as_str())
            .collect();
        (!open.is_empty()).then(|| {
            format!(
                "receive circuit breaker open for queue {}: receives have failed for 30 s or more",
                open.join(", ")
            )
        })
    }

    fn transport(&self) -> Arc<dyn Transport> {
        HostInner::transport(self).clone()
    }

    fn runtime(&self) -> tokio::runtime::Handle {
        HostInner::runtime(self).clone()
    }

    fn settings(&self) -> AdminConfig {
        self.config().admin.clone()
    }

    fn accepts(&self, queue: &QueueName) -> bool {
        self.is_known_queue(queue)
    }

    fn publisher(&self) -> Arc<Publisher> {
        HostInner::publisher(self).clone()
    }

    fn origin(&self) -> crate::message::Origin {
        HostInner::origin(self).clone()
    }

    fn failed_handled(&self, queue: &str, action: &'static str, n: u64) {
        self.metrics().failed_handled(queue, action, n);
    }

    fn error_queues(&self) -> Vec<String> {
        let mut queues: Vec<String> = Vec::new();
        for q in &self.config().queues {
            if !queues.contains(&q.error_queue) {
                queues.push(q.error_queue.clone());
            }
        }
        queues
    }

    fn header_names(&self) -> Vec<String> {
        self.config()
            .queues
            .iter()
            .filter_map(|q| q.ordering.key_header().map(str::to_string))
            .collect()
    }

    fn set_override(&self, direction: Direction, mode: OverrideMode) {
        HostInner::set_override(self, direction, mode)
    }

    fn set_fleet_override(
        &self,
        direction: Direction,
        mode: OverrideMode,
    ) -> futures_util::future::BoxFuture<'_, Result<(), crate::fleet::FleetOrderError>> {
        Box::pin(async move {
            HostInner::set_fleet_override(self, direction, mode)
                .await
                .map(|_| ())
        })
    }
}
