//! Delayed delivery, the ability of a transport to keep a message until it is due.
//!
//! Laid out as the NServiceBus SQL transports do it: each receiving queue has a delayed table
//! beside it, `<queue>.Delayed` on both engines (NServiceBus's `TableSuffix`, configurable as
//! `transport.delayed_table_suffix`), holding the headers,
//! the body and the due time, computed by the database server from its own clock. A stored
//! message carries `NServiceBus.SqlServer.ForwardDestination`, the queue it is for. A mover
//! (`crate::delayed`) moves due rows into the queue in batches; the receiver removes the
//! header, and when it names another queue sends the message on in the receive's unit of work.
//!
//! A send goes to the delayed table when its [`OutgoingMessage::deliver_after`] is set: every
//! send path of every transport (a send, a batch, a send inside a receive) routes it there.

use std::time::Duration;

use async_trait::async_trait;

use super::{QueueName, TransportError};
use crate::message::{FORWARD_DESTINATION_HEADER, Headers, OutgoingMessage};

/// What one move of due delayed messages did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moved {
    /// Messages moved into the queue (in one transaction).
    pub moved: u64,
    /// How long until the earliest message still waiting is due (None: none waits, or its due
    /// time is beyond what can be waited for).
    pub next_due_in: Option<Duration>,
    /// Messages still in the delayed table after the move.
    pub waiting: u64,
    /// Another mover (another host) held the queue's mover lock: nothing was moved and the
    /// readings are of the table as it was.
    pub busy: bool,
}

/// A delayed table as a sweep reads it ([`DelayedDelivery::sweep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DelayedReading {
    /// Messages in the table (due or not).
    pub waiting: u64,
    /// How long until its earliest message is due (zero: one is due now; None: none waits).
    pub next_due_in: Option<Duration>,
}

/// Delayed tables read per sweep statement: a UNION of this many short reads stays one
/// statement a server plans and runs in milliseconds.
pub const TABLES_PER_SWEEP: usize = 200;

/// A transport that can store messages until they are due (see the module documentation).
#[async_trait]
pub trait DelayedDelivery: Send + Sync {
    /// Creates the delayed table of `queue` when it is missing (safe when hosts do it at once).
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError>;

    /// Moves up to `batch` due messages of `queue`'s delayed table into `queue`, oldest due
    /// first, in one transaction, and reports what is left. Only one mover per queue works at
    /// a time across hosts (a lock the database keeps); a mover that finds it taken moves
    /// nothing and says [`Moved::busy`].
    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError>;

    /// The delayed tables of `queues` as they are now, in order, [`TABLES_PER_SWEEP`] tables
    /// per statement: the host's sweeper reads every table it leads this way once per
    /// interval, so an idle table costs no statement of its own. A missing table fails the
    /// statement it is in.
    async fn sweep(&self, queues: &[QueueName]) -> Result<Vec<DelayedReading>, TransportError>;

    /// Messages in `queue`'s delayed table now (due or not); a missing table is
    /// [`TransportError::DelayedTableNotFound`].
    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError>;

    /// `queue`'s delayed table as the database names it (schema-qualified, quoted).
    fn delayed_table(&self, queue: &QueueName) -> String;

    /// Whether `queue`'s delayed table exists (a catalog look-up, whatever its size).
    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError>;

    /// Of `queues`, those whose delayed tables already stand as
    /// [`DelayedDelivery::create_delayed`] leaves them (nothing left to create or adopt), in
    /// as few statements as the transport can: a start creates or looks for only the rest.
    /// Default: none.
    async fn delayed_in_place(
        &self,
        queues: &[QueueName],
    ) -> Result<std::collections::HashSet<QueueName>, TransportError> {
        let _ = queues;
        Ok(Default::default())
    }
}

/// The headers a delayed message is stored with: its own plus the forward destination (the
/// queue whose table it is stored in, unless the sender named another: a delayed retry of an
/// instance queue waits in its main queue's table).
pub(crate) fn delayed_headers(headers: &Headers, destination: String) -> Headers {
    let mut headers = headers.clone();
    headers
        .entry(FORWARD_DESTINATION_HEADER.into())
        .or_insert(Some(destination));
    headers
}

/// The delay of a message as the SQL statements bind it: whole milliseconds, checked.
pub(crate) fn delay_millis(message: &OutgoingMessage) -> Result<Option<i64>, TransportError> {
    message
        .checked_delay()
        .map(|d| d.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)))
        .map_err(TransportError::InvalidMessage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delayed_message_carries_its_destination() {
        let m = OutgoingMessage::new("x").with_delay(Duration::from_secs(1));
        let h = delayed_headers(&m.headers, "Sales@[dbo]".into());
        assert_eq!(
            h.get(FORWARD_DESTINATION_HEADER)
                .cloned()
                .flatten()
                .as_deref(),
            Some("Sales@[dbo]")
        );
        assert_eq!(delay_millis(&m).unwrap(), Some(1000));
    }
}
