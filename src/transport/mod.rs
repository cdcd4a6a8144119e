//! Queue tables behind two traits.
//!
//! A [`Transport`] is the message path: it sends, receives and peeks (and reports the
//! connections in use and whether the database answers). Every transport also hands out a
//! [`QueueAdmin`] ([`Transport::admin`]), the administration set-up commands and start-up
//! use and the message path never calls: create, purge, reset and list queue tables, and
//! check their layout at start (the architecture test keeps the message path's files from
//! calling it). A receive returns a
//! [`Received`]: the message plus the open unit of work that removed it from the queue. The
//! caller ends it with [`Received::commit`] (the message is gone) or [`Received::rollback`]
//! (the message is back at its place in the queue). Dropping a `Received` without either rolls
//! back, so a crashed or cancelled handler never loses a message (except in transaction mode
//! `none`, which deletes before the handler runs, by request).
//!
//! Implementations: [`memory`] (in-process), [`postgres`], [`sqlserver`]. One conformance
//! suite (`tests/conformance.rs`) runs against each of them.

mod address;
mod batch;
mod connect;
pub mod delayed;
mod error;
pub mod failed;
pub mod fleet;
pub mod headers;
mod hooks;
pub mod memory;
pub mod ordering;
pub mod postgres;
mod row;
mod rules;
pub mod silence;
pub mod sqlserver;
pub mod subscriptions;
mod unit_of_work;

use async_trait::async_trait;
use uuid::Uuid;

use crate::message::{Message, OutgoingMessage};
pub use crate::names::{InvalidName, QueueName};
pub use batch::BatchReceive;
pub use connect::connect;
pub use delayed::{DelayedDelivery, DelayedReading, Moved, TABLES_PER_SWEEP};
pub use error::{DriverError, TransportError};
pub use fleet::{
    BeatRow, FLEET_ORDER_ROWS, FleetShares, Heartbeat, InstanceRecord, InstanceRegistry,
    ShareClaim, ShareRow,
};
pub use hooks::{ArrivalSink, ConflictSink, HostHooks};
pub use ordering::{HeldKey, HeldStatements, KeyOrdering};
pub use subscriptions::{Subscription, Subscriptions};

pub(crate) use rules::{check_orderable, insert_columns, refuse_ordered_batch, ttbr_millis};

/// The most queue depths one statement reads ([`Transport::peek_depths`]).
pub const DEPTHS_PER_STATEMENT: usize = 200;

/// What a receive took off the queue.
#[derive(Debug, Clone)]
pub enum Payload {
    /// A message for the handler.
    Message(Message),
    /// A message whose time-to-be-received has passed: committed without a handler.
    Expired {
        /// Its native id.
        id: Uuid,
    },
    /// A row whose headers cannot be parsed: moved to the error queue unchanged.
    Poison {
        /// Its native id.
        id: Uuid,
        /// Why it is poison.
        reason: String,
    },
}

impl Payload {
    /// The native id of whatever was received.
    pub fn id(&self) -> Uuid {
        match self {
            Payload::Message(m) => m.id,
            Payload::Expired { id } | Payload::Poison { id, .. } => *id,
        }
    }
}

/// An open receive: a message and the unit of work that removed it from its queue.
#[async_trait]
pub trait Received: Send {
    /// What was received.
    fn payload(&self) -> &Payload;

    /// Sends a message inside this receive's unit of work: it becomes visible only if the
    /// receive commits (transaction mode `none`: immediately, on its own).
    async fn send(
        &mut self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError>;

    /// Copies the received row unchanged (same id, raw headers, body; no expiry) into `queue`
    /// inside this unit of work. Used for poison rows.
    async fn dead_letter(&mut self, queue: &QueueName) -> Result<(), TransportError>;

    /// Ends the receive: the message is gone and sends made through [`Received::send`] appear.
    async fn commit(self: Box<Self>) -> Result<(), TransportError>;

    /// Ends the receive: the message is back at its original position; sends are discarded.
    async fn rollback(self: Box<Self>) -> Result<(), TransportError>;

    /// Commits, then receives the next message from `queue` on the same connection. A
    /// transport that can pipelines both into one round trip (PostgreSQL and SQL Server do);
    /// the default commits only and leaves the next receive to the caller's own turn. The
    /// caller must be allowed to receive right away (no throttling wait due): nothing may be
    /// waited for between the two.
    async fn commit_and_receive(self: Box<Self>, queue: &QueueName) -> CommitAndReceive {
        let _ = queue;
        CommitAndReceive::commit_only(self.commit().await)
    }
}

/// What [`Received::commit_and_receive`] did.
pub struct CommitAndReceive {
    /// The commit of the current receive.
    pub committed: Result<(), TransportError>,
    /// The next receive: `None` when it was not attempted (after a failed commit, or by a
    /// receive that cannot bring the next one along), which says nothing of the queue's depth.
    pub next: Option<Result<Option<Box<dyn Received>>, TransportError>>,
}

impl CommitAndReceive {
    /// A commit that brought no receive along.
    pub fn commit_only(committed: Result<(), TransportError>) -> Self {
        CommitAndReceive {
            committed,
            next: None,
        }
    }
}

/// Administration of queue tables: what set-up commands, host start-up and tests call,
/// never the message path.
#[async_trait]
pub trait QueueAdmin: Send + Sync + 'static {
    /// Creates the queue table if it does not exist. Safe when hosts do it at the same time.
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError>;

    /// Deletes expired messages; returns how many.
    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError>;

    /// Deletes every message; returns how many.
    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError>;

    /// Drops and recreates a queue, empty. Load tests use it to start from a fresh table (a
    /// purged table keeps its dead rows until vacuumed, which slows receives). The host never
    /// calls it. Default: purge.
    async fn reset_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        self.purge(queue).await.map(|_| ())
    }

    /// Of `queues`, those whose tables already stand as [`QueueAdmin::create_queue`] leaves
    /// them: a start creates only the rest, so a host of a thousand queues whose tables exist
    /// does not run a thousand creations. Default: none (creating an existing queue is safe,
    /// only slower).
    async fn queues_in_place(
        &self,
        queues: &[QueueName],
    ) -> Result<std::collections::HashSet<QueueName>, TransportError> {
        let _ = queues;
        Ok(Default::default())
    }

    /// Names of the queue tables in the transport's schema.
    async fn list_queues(&self) -> Result<Vec<String>, TransportError>;

    /// Checks of the server itself, run before the host creates anything: an error when the
    /// configuration cannot work with it (SQL Server: the dialect), warnings otherwise.
    async fn server_checks(&self) -> Result<Vec<String>, TransportError> {
        Ok(Vec::new())
    }

    /// Warnings about the setup of these queues (missing indexes, column types, pool size);
    /// an error when a queue cannot be received from at all (a column of the wrong type).
    async fn startup_checks(&self, queues: &[QueueName]) -> Result<Vec<String>, TransportError> {
        let _ = queues;
        Ok(Vec::new())
    }
}

/// A queue store: the message path (send, receive, peek, and through [`Received`] commit and
/// rollback) and the two readings the controller takes of it. Every store also administers
/// its tables, through a separate object ([`Transport::admin`]), so the hot path reads on its
/// own.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// A human-readable description without secrets, e.g. `postgres (schema "public")`.
    fn describe(&self) -> String;

    /// The administration of this store's tables ([`QueueAdmin`]): for set-up commands, host
    /// start-up and tests, never the message path.
    fn admin(&self) -> &dyn QueueAdmin;

    /// Inserts one message. Expiry is computed by the server from `time_to_be_received`.
    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError>;

    /// Inserts `messages` in the order given. PostgreSQL writes them with one statement (all
    /// or none); the default sends them one by one (on an error, those before it are stored).
    async fn send_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        for message in messages {
            self.send(queue, message).await?;
        }
        Ok(())
    }

    /// Removes the oldest message not locked by another receiver, inside an open unit of work.
    /// `None` when no such message exists.
    async fn receive(&self, queue: &QueueName)
    -> Result<Option<Box<dyn Received>>, TransportError>;

    /// Estimates the number of messages waiting, skipping rows locked by in-flight receives.
    async fn peek_depth(&self, queue: &QueueName) -> Result<u64, TransportError>;

    /// The depths of `queues`, in their order, as [`Transport::peek_depth`] reads each: in as
    /// few statements as the transport can (PostgreSQL reads up to [`DEPTHS_PER_STATEMENT`]
    /// at once), so a host with many queues keeps its database size current cheaply. A
    /// failed read fails the queues it covered.
    async fn peek_depths(&self, queues: &[QueueName]) -> Vec<Result<u64, TransportError>> {
        let mut depths = Vec::with_capacity(queues.len());
        for queue in queues {
            depths.push(self.peek_depth(queue).await);
        }
        depths
    }

    /// Database connections in use right now (the database sessions sensor).
    fn connections_in_use(&self) -> u64;

    /// Checks that the database answers (readiness).
    async fn ping(&self) -> Result<(), TransportError>;

    /// `queue`'s transport address as NServiceBus writes it into headers
    /// (`NServiceBus.FailedQ`, `NServiceBus.ReplyToAddress`, the delayed forward
    /// destination): SQL Server `table@[schema]@[catalog]`, PostgreSQL `"schema"."table"`.
    /// Default: the bare name (the memory transport has one namespace).
    fn address(&self, queue: &QueueName) -> String {
        queue.to_string()
    }

    /// The queue of this transport's schema an address names, in any form NServiceBus or this
    /// host writes it (a bare table name too); None when it names another schema or is not an
    /// address of a queue.
    fn resolve_address(&self, address: &str) -> Option<QueueName> {
        address::parse(address, "", None)
    }

    /// Delayed delivery, when this transport can keep messages until they are due
    /// ([`DelayedDelivery`]); None when it cannot, and a send with a delay is then refused.
    fn delayed_delivery(&self) -> Option<&dyn DelayedDelivery> {
        None
    }

    /// The instance registry, when this transport can keep one ([`InstanceRegistry`]); None
    /// when it cannot, and the host then shows only itself.
    fn instance_registry(&self) -> Option<&dyn InstanceRegistry> {
        None
    }

    /// Key order ([`KeyOrdering`]), when this transport can keep it; None when it cannot, and
    /// a configuration with `[queues.ordering]` is then refused.
    fn key_ordering(&self) -> Option<&dyn KeyOrdering> {
        None
    }

    /// Batch receive ([`BatchReceive`]), when this transport can take many messages in one
    /// unit of work; None when it cannot, and `receive_batch` above 1 is then refused.
    fn batch_receive(&self) -> Option<&dyn BatchReceive> {
        None
    }

    /// Browsing and editing error queues row by row ([`failed::FailedStore`]), when this
    /// transport can; None when it cannot, and the failed-messages tools say so.
    fn failed_store(&self) -> Option<&dyn failed::FailedStore> {
        None
    }

    /// Native publish/subscribe through the subscription table ([`Subscriptions`]), when
    /// this transport keeps it; None when it cannot, and publishing or subscribing is refused.
    fn subscriptions(&self) -> Option<&dyn Subscriptions> {
        None
    }

    /// Shares of fleet-wide limits, when this transport can keep them ([`FleetShares`]);
    /// None when it cannot, and a configuration with `fleet_max` is then refused.
    fn fleet_shares(&self) -> Option<&dyn FleetShares> {
        None
    }

    /// What it tells its host beyond the message path (silence, conflicts, arrivals); None
    /// when it tells nothing: the host then sees no silence, counts no conflicts and finds
    /// messages by peeking.
    fn host_hooks(&self) -> Option<&dyn HostHooks> {
        None
    }
}
