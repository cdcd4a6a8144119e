//! The subscription table in memory: created like the database tables (an operation on a
//! table that was not created fails as it would there), keyed by endpoint and topic.

use std::collections::BTreeMap;

use async_trait::async_trait;

use super::{MemoryTransport, lock};
use crate::message::OutgoingMessage;
use crate::transport::{QueueName, Subscription, Subscriptions, TransportError};

/// The name the memory transport gives its subscription table in messages.
const TABLE: &str = "SubscriptionRouting";

fn no_table() -> TransportError {
    crate::transport::subscriptions::missing_table(TABLE)
}

impl MemoryTransport {
    /// Runs `f` on the subscription table, or fails as a missing table does.
    fn with_table<T>(
        &self,
        f: impl FnOnce(&mut BTreeMap<(String, String), String>) -> T,
    ) -> Result<T, TransportError> {
        lock(&self.shared.subscriptions)
            .as_mut()
            .map(f)
            .ok_or_else(no_table)
    }
}

#[async_trait]
impl Subscriptions for MemoryTransport {
    fn subscription_table(&self) -> String {
        TABLE.into()
    }

    async fn create_subscription_table(&self) -> Result<(), TransportError> {
        let _session = self.statement().await?;
        lock(&self.shared.subscriptions).get_or_insert_with(BTreeMap::new);
        Ok(())
    }

    async fn subscribe(
        &self,
        endpoint: &str,
        topic: &str,
        queue_address: &str,
    ) -> Result<(), TransportError> {
        let _session = self.statement().await?;
        self.with_table(|rows| {
            rows.insert((endpoint.into(), topic.into()), queue_address.into());
        })
    }

    async fn unsubscribe(&self, endpoint: &str, topic: &str) -> Result<bool, TransportError> {
        let _session = self.statement().await?;
        self.with_table(|rows| rows.remove(&(endpoint.into(), topic.into())).is_some())
    }

    async fn subscribers(&self, topics: &[String]) -> Result<Vec<String>, TransportError> {
        let _session = self.statement().await?;
        self.with_table(|rows| {
            let mut addresses: Vec<String> = rows
                .iter()
                .filter(|((_, topic), _)| topics.contains(topic))
                .map(|(_, address)| address.clone())
                .collect();
            addresses.sort();
            addresses.dedup();
            addresses
        })
    }

    async fn all_subscriptions(&self) -> Result<Vec<Subscription>, TransportError> {
        let _session = self.statement().await?;
        self.with_table(|rows| {
            let mut all: Vec<Subscription> = rows
                .iter()
                .map(|((endpoint, topic), address)| Subscription {
                    endpoint: endpoint.clone(),
                    topic: topic.clone(),
                    queue_address: address.clone(),
                })
                .collect();
            all.sort_by(|a, b| (&a.topic, &a.endpoint).cmp(&(&b.topic, &b.endpoint)));
            all
        })
    }

    async fn deliver(&self, copies: &[(QueueName, OutgoingMessage)]) -> Result<(), TransportError> {
        let _session = self.statement().await?;
        let stored = copies
            .iter()
            .map(|(queue, message)| Ok((queue, self.shared.stored_from(message)?)))
            .collect::<Result<Vec<_>, TransportError>>()?;
        // All or none: every copy is checked before the first is stored.
        for (queue, message) in &stored {
            self.shared.check(queue, message)?;
        }
        for (queue, message) in stored {
            self.shared.insert(queue, message)?;
        }
        Ok(())
    }
}
