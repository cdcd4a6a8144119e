//! The one send path: the library API, the forward handler, handler sends and HTTP ingest all
//! come through here, so all of them wait the publishing throttle and are counted once.
//!
//! A send is two steps: [`Publisher::admit`] (waits the publishing delay or pacing, then counts
//! the message as incoming: handed to the database) and an insert (counts it as outgoing:
//! stored). As BizTalk's publishing rates, incoming is what is sent to the database and
//! outgoing what it has taken; a request still waiting out a delay counts in neither, so a
//! throttling episode does not leave a rate imbalance behind it. [`Publisher::send`] does both
//! steps; handler sends admit when the handler asks and insert when it has succeeded.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::message::OutgoingMessage;
use crate::metrics::Metrics;
use crate::throttling::Throttle;
use crate::transport::{QueueName, Received, Transport, TransportError};

/// The throttled publisher.
pub struct Publisher {
    transport: Arc<dyn Transport>,
    throttle: Arc<Throttle>,
    metrics: Metrics,
    /// Every queue published to, with its published-messages counter: one lookup per insert.
    targets: RwLock<HashMap<QueueName, metrics::Counter>>,
}

impl Publisher {
    /// A publisher writing through `transport`, throttled by `throttle`.
    pub fn new(transport: Arc<dyn Transport>, throttle: Arc<Throttle>, metrics: Metrics) -> Self {
        Publisher {
            transport,
            throttle,
            metrics,
            targets: RwLock::new(HashMap::new()),
        }
    }

    /// Admits and inserts one message.
    pub async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.admit().await;
        self.insert(queue, message).await
    }

    /// Waits until publishing admits one more message, and counts it; returns the wait.
    pub async fn admit(&self) -> Duration {
        let waited = self.throttle.publishing.admit().await;
        self.throttle.publishing_rates.incoming();
        waited
    }

    /// Inserts an admitted message on its own connection.
    pub async fn insert(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.transport.send(queue, message).await?;
        self.published(queue);
        Ok(())
    }

    /// Inserts an admitted message inside an open receive (it appears if the receive commits).
    pub async fn insert_within(
        &self,
        received: &mut dyn Received,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        received.send(queue, message).await?;
        self.published(queue);
        Ok(())
    }

    fn published(&self, queue: &QueueName) {
        self.throttle.publishing_rates.outgoing();
        let known = self
            .targets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .cloned();
        let counter = known.unwrap_or_else(|| {
            self.targets
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .entry(queue.clone())
                .or_insert_with(|| self.metrics.published(queue.as_str()))
                .clone()
        });
        counter.increment(1);
    }

    /// Every queue this host has published to (their depths count toward database size).
    pub fn targets(&self) -> Vec<QueueName> {
        self.targets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// The wait a new send would see right now (delay plus one pacing interval).
    pub fn current_wait(&self) -> Duration {
        self.throttle.publishing.delay() + self.throttle.publishing.pace().unwrap_or_default()
    }
}
