//! Delayed delivery, the ability of a transport to keep a message until it is due.
//!
//! Laid out as the NServiceBus SQL transports do it: each receiving queue has a delayed table
//! beside it (SQL Server `<queue>.Delayed`, PostgreSQL `<queue>.delayed`) holding the headers,
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

    /// Messages in `queue`'s delayed table now (due or not).
    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError>;

    /// The address written into the forward destination header for `queue`.
    fn forward_address(&self, queue: &QueueName) -> String;

    /// The queue of this transport's schema that a forward destination names; None when it
    /// names none (another schema or catalog, or not an address).
    fn parse_forward_address(&self, address: &str) -> Option<QueueName>;
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

/// Reads a forward destination in the forms the SQL transports write: `table`,
/// `table@schema`, `table@[schema]@[catalog]` (SQL Server) and `"schema"."table"`
/// (PostgreSQL). A schema, when named, must be `schema` (compared without case); the catalog
/// is not checked (a host reaches one database).
pub(crate) fn parse_address(address: &str, schema: &str) -> Option<QueueName> {
    let address = address.trim();
    let unbracket = |s: &str| {
        let s = s.trim();
        s.strip_prefix('[')
            .and_then(|s| s.strip_suffix(']'))
            .unwrap_or(s)
            .replace("]]", "]")
    };
    let (table, named_schema) = if let Some(rest) = address.strip_prefix('"') {
        // "schema"."table" or "table"
        match rest.split_once("\".\"") {
            Some((s, t)) => (t.strip_suffix('"')?.to_string(), Some(s.to_string())),
            None => (rest.strip_suffix('"')?.to_string(), None),
        }
    } else {
        let mut parts = address.split('@');
        let table = unbracket(parts.next()?);
        (table, parts.next().map(unbracket))
    };
    if named_schema.is_some_and(|s| !s.is_empty() && !s.eq_ignore_ascii_case(schema)) {
        return None;
    }
    QueueName::new(&table).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_addresses_in_every_written_form_name_the_queue() {
        let q = |s: &str| parse_address(s, "dbo").map(|q| q.to_string());
        assert_eq!(q("Sales").as_deref(), Some("Sales"));
        assert_eq!(q("Sales@dbo").as_deref(), Some("Sales"));
        assert_eq!(q("Sales@[dbo]@[Messaging]").as_deref(), Some("Sales"));
        assert_eq!(q("Sales.host-1@[DBO]").as_deref(), Some("Sales.host-1"));
        assert_eq!(q("[Sales]@[dbo]").as_deref(), Some("Sales"));
        assert_eq!(q("bad name@[dbo]"), None, "not a queue name");
        assert_eq!(q("Sales@[other]"), None, "another schema is not ours");
        assert_eq!(
            parse_address("\"public\".\"Sales\"", "public")
                .map(|q| q.to_string())
                .as_deref(),
            Some("Sales")
        );
        assert_eq!(parse_address("\"other\".\"Sales\"", "public"), None);
        assert_eq!(q(""), None);
    }

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
