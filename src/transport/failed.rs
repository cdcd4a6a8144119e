//! The ability to work on an error queue's rows in place: read them without taking them, and
//! move or delete chosen rows by id, so an operator can see what failed, send it back, or
//! remove it (`crate::failed` builds the tool on this). A receive would take a row away from
//! whoever else reads the error queue (ServiceControl, another host); browsing leaves it.

use async_trait::async_trait;
use uuid::Uuid;

use super::{QueueName, TransportError};
use crate::message::OutgoingMessage;

/// A row of an error queue as stored: its native id, the headers column as text (poison rows
/// keep headers no parser reads) and, where asked for, the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRow {
    /// Where the row stands in its queue (Seq, RowVersion): browsing continues after it.
    pub position: i64,
    /// The native id (the `Id` column).
    pub id: Uuid,
    /// The headers column, unparsed.
    pub headers: String,
    /// The body; empty when it was not asked for.
    pub body: Vec<u8>,
}

/// A row to move out of an error queue: it goes to `to` as `message` (the same body, its
/// headers as the retry wants them).
#[derive(Debug, Clone)]
pub struct MoveOut {
    /// The row's native id in the error queue.
    pub id: Uuid,
    /// Where it goes.
    pub to: QueueName,
    /// What is stored there.
    pub message: OutgoingMessage,
}

/// The messages of the rows `taken` of `moves`, grouped by destination in the order the
/// destinations first appear, each group in the error queue's order: what a move inserts,
/// one statement per destination.
pub(crate) fn by_destination<'m>(
    moves: &'m [MoveOut],
    taken: &[Uuid],
) -> Vec<(&'m QueueName, Vec<OutgoingMessage>)> {
    let mut groups: Vec<(&QueueName, Vec<OutgoingMessage>)> = Vec::new();
    for m in moves.iter().filter(|m| taken.contains(&m.id)) {
        match groups.iter_mut().find(|(to, _)| *to == &m.to) {
            Some((_, messages)) => messages.push(m.message.clone()),
            None => groups.push((&m.to, vec![m.message.clone()])),
        }
    }
    groups
}

/// A transport whose error queues can be browsed and edited row by row.
#[async_trait]
pub trait FailedStore: Send + Sync {
    /// Up to `limit` rows of `queue` after position `after` (0: from the start), oldest
    /// first, read without locking or taking them; bodies only when `with_body`.
    async fn browse(
        &self,
        queue: &QueueName,
        after: i64,
        limit: u32,
        with_body: bool,
    ) -> Result<Vec<StoredRow>, TransportError>;

    /// The rows of `queue` with these ids, bodies included; ids not there are left out.
    async fn read(&self, queue: &QueueName, ids: &[Uuid])
    -> Result<Vec<StoredRow>, TransportError>;

    /// In one transaction: deletes each row of `moves` from `queue` and stores its message in
    /// its destination. A row that is gone, or that a receive holds now, is left out; the
    /// ids moved are returned. A crash or an error leaves every row either still in `queue`
    /// or moved, never both and never neither.
    async fn move_out(
        &self,
        queue: &QueueName,
        moves: &[MoveOut],
    ) -> Result<Vec<Uuid>, TransportError>;

    /// Deletes the rows of `queue` with these ids (those a receive holds now are left);
    /// returns how many.
    async fn remove(&self, queue: &QueueName, ids: &[Uuid]) -> Result<u64, TransportError>;
}
