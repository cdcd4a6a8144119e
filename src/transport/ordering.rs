//! Key order, an ability of a transport (`[queues.ordering]`): receives that take a message
//! only when it is the oldest of its key and nothing of its key is in flight on any host, keys
//! held by a failed message, and the count of messages waiting for their turn.

use async_trait::async_trait;
use uuid::Uuid;

use super::{QueueName, TransportError};
use crate::config::OrderingConfig;

/// The statements of a schema's held-keys table (`failed_key = "hold"`): a row per failed
/// message that holds its key, by its queue table (as the transport quotes it) and id. Each
/// SQL transport writes them in its dialect (`held_statements`).
#[derive(Debug)]
pub struct HeldStatements {
    /// The table, quoted.
    pub table: String,
    /// Creates the table when missing.
    pub create: String,
    /// Records a hold: queue table, message id, key, reason (bound in that order).
    pub insert: String,
    /// The holds of a queue table: key, message id, reason, held at (text), oldest first.
    pub list: String,
    /// A row when a key of a queue table is held (queue table, key).
    pub is_held: String,
    /// Lifts the holds of a queue table's key (queue table, key); the count comes back.
    pub release: String,
    /// Lifts every hold of a queue table; the count comes back.
    pub release_all: String,
}

/// A key held by its failed message ([`KeyOrdering::hold`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldKey {
    /// The key's value.
    pub key: String,
    /// The native id of the message that failed (still in the queue).
    pub message_id: Uuid,
    /// Why it failed: the last attempt's error.
    pub reason: String,
    /// When it was held (UTC, as the store writes it).
    pub held_at: String,
}

/// A transport that can keep key order on a queue (see the module documentation).
#[async_trait]
pub trait KeyOrdering: Send + Sync {
    /// Keeps key order on `queue` from now on ([`OrderingConfig`]): a receive takes a message
    /// only when it is the oldest stored message of its key and no message of that key is in
    /// flight, here or on any other host (the database's rows and locks decide, never this
    /// process's memory); messages without the key header are taken as usual. Call it before
    /// the first receive from `queue`. Refused with [`TransportError::Queue`] in transaction
    /// mode `none` (a message is deleted before its handler runs) and where a dialect cannot
    /// keep the guarantee.
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError>;

    /// Holds a failed message's key (`[queues.ordering] failed_key = "hold"`): records in the
    /// store, outside the message's unit of work and while that receive still holds it, that
    /// message `id` of `queue` failed with `key` (`reason`). Once the receive rolls back, no
    /// receive on any host takes the message again, nor (it being its key's oldest) any
    /// later message of its key, until [`KeyOrdering::release_held`]. Holding a message
    /// already held changes nothing.
    async fn hold(
        &self,
        queue: &QueueName,
        id: Uuid,
        key: &str,
        reason: &str,
    ) -> Result<(), TransportError>;

    /// Whether `key` of `queue` is held, read after the asker's receive took a message. A
    /// receive whose statement began before a hold was committed reads the store as it was
    /// then, and once the holding receive rolls back it may take the held message; a hold
    /// committed before that rollback is seen by any statement that starts after the take.
    async fn is_held(&self, queue: &QueueName, key: &str) -> Result<bool, TransportError>;

    /// The keys of `queue` held by a failed message ([`KeyOrdering::hold`]), oldest first.
    async fn held_keys(&self, queue: &QueueName) -> Result<Vec<HeldKey>, TransportError>;

    /// Lifts the holds of `queue` (of one key, or all): each held message is the next of its
    /// key again and is tried afresh. Returns how many holds were lifted.
    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError>;

    /// Messages of an ordered queue ([`KeyOrdering::order_by_key`]) that may not run now: their
    /// key has a message in flight or their previous stage is unfinished. Counted among the
    /// oldest `lookahead` rows, which is where receives look. None for an unordered queue.
    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError>;
}
