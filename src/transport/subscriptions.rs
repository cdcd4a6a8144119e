//! Native publish/subscribe as NServiceBus's SQL transports keep it: one table per database
//! (`SubscriptionRouting` by default) holding, per subscribing endpoint and topic, the queue
//! address its events go to. A subscriber writes its own rows; a publisher reads the rows of
//! an event's topics and stores a copy of the event in each subscriber's queue.
//!
//! The table is the one NServiceBus creates (`QueueAddress`, `Endpoint`, `Topic`, key
//! `(Endpoint, Topic)`), written with the same semantics: subscribe is an upsert on the key,
//! unsubscribe deletes the key's row, and a publisher reads the distinct addresses of the
//! topics it publishes to.

use async_trait::async_trait;

use super::{QueueName, TransportError};
use crate::message::OutgoingMessage;

/// One row of the subscription table.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Subscription {
    /// The subscribing endpoint's name (`Endpoint`).
    pub endpoint: String,
    /// The event's topic: its type's full name (`Topic`).
    pub topic: String,
    /// Where the endpoint receives the event: a transport address (`QueueAddress`).
    pub queue_address: String,
}

/// A transport that keeps native subscriptions.
#[async_trait]
pub trait Subscriptions: Send + Sync {
    /// The subscription table as the database names it (for messages and the CLI).
    fn subscription_table(&self) -> String;

    /// Creates the subscription table when it is missing, as NServiceBus creates it.
    async fn create_subscription_table(&self) -> Result<(), TransportError>;

    /// Subscribes `endpoint` to `topic`, receiving at `queue_address`: adds the row, or points
    /// the one there at `queue_address`.
    async fn subscribe(
        &self,
        endpoint: &str,
        topic: &str,
        queue_address: &str,
    ) -> Result<(), TransportError>;

    /// Removes `endpoint`'s subscription to `topic`; true when there was one.
    async fn unsubscribe(&self, endpoint: &str, topic: &str) -> Result<bool, TransportError>;

    /// The distinct queue addresses subscribed to any of `topics` (an event's type and the
    /// types it derives from), in no particular order.
    async fn subscribers(&self, topics: &[String]) -> Result<Vec<String>, TransportError>;

    /// Every row of the table, ordered by topic and endpoint.
    async fn all_subscriptions(&self) -> Result<Vec<Subscription>, TransportError>;

    /// Stores one event's copies, each in its subscriber's queue, all or none: in one
    /// transaction on the database transports.
    async fn deliver(&self, copies: &[(QueueName, OutgoingMessage)]) -> Result<(), TransportError>;
}

/// The error of a statement on a subscription table that does not exist, naming it.
pub(crate) fn missing_table(table: &str) -> TransportError {
    TransportError::QueueNotFound(format!(
        "{table} (the subscription table; create it with `throttlehost queues create`)"
    ))
}
