//! What happens to a received message: in-flight accounting, the handler call with retries,
//! the error queue, expiry and poison rows. Receivers (in [`crate::receive`]) decide *when*
//! to receive; this module decides what to do with what they got.
//!
//! Recoverability follows NServiceBus: immediate retries (default 5) run inside the same
//! receive; then delayed retries (default 3, 10 s x the retry's number later) store the message
//! in the queue's delayed table with `NServiceBus.Retries` set, in the unit of work that removes
//! it; after the last, the message moves to the error queue with the fault headers
//! ServiceControl reads. Each move commits with the deletion of the original. Failure counts
//! are also remembered per message id, so a message whose move failed (and was rolled back)
//! goes on from there next time instead of starting its retries over.
//!
//! A message moved in from a delayed table carries `NServiceBus.SqlServer.ForwardDestination`:
//! it is handled here when the header names this queue, and sent on (in the unit of work)
//! when it names another. Every attempt passes the queue's downstream guards
//! (`queue::downstream`): the outage pause before it, its outcome and latency after it.
//!
//! This file is the face: the dispatcher, a message's way through it and its unit of work.
//! The rooms: `attempt` (the handler's attempts and retries), `failure` (held keys, delayed
//! retries, the error queue), `forward` (forward destinations, undeliverable and poison rows).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use uuid::Uuid;

use crate::config::TransactionMode;
use crate::handlers::Handler;
use crate::message::{Origin, OutgoingMessage};
use crate::publish::Publisher;
use crate::queue::{QueueEvent, QueueRuntime};
use crate::throttling::Throttle;
use crate::transport::{Payload, QueueName, Received, Transport, TransportError};

mod attempt;
mod failure;
mod forward;

pub use crate::queue::Outcome;
use attempt::{InProcess, KeyInFlight};
pub(crate) use failure::Failure;

/// Sees every message that leaves a queue for good. Load tests use it to account for every
/// message by id; it must be cheap (it runs on the hot path).
pub trait DispatchObserver: Send + Sync + 'static {
    /// `id` is the native id; `logical_id` the `NServiceBus.MessageId` header when known.
    fn completed(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>, outcome: Outcome);

    /// A message's handling begins (before its first attempt). The load tool checks key
    /// order with it and [`DispatchObserver::handled`]; the default ignores it.
    fn started(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let _ = (queue, id, logical_id);
    }

    /// A message's last attempt has ended, before its unit of work ends (so before any
    /// message that waits for it can be received). The default ignores it.
    fn handled(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let _ = (queue, id, logical_id);
    }

    /// A message left its queue for a delayed table (a delayed retry) or for another queue (a
    /// forward destination): it will be seen again. The default ignores it.
    fn moved_on(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let _ = (queue, id, logical_id);
    }
}

/// Who is processing: written into the fault headers.
#[derive(Debug, Clone)]
pub(crate) struct HostIdentity {
    /// `NServiceBus.ProcessingEndpoint` and `ProcessingMachine`, `$.diagnostics.hostid`, and
    /// the `Originating*` headers of what this host sends.
    pub origin: Origin,
    /// `$.diagnostics.hostdisplayname`: the instance id.
    pub instance: String,
}

impl HostIdentity {
    /// Builds the identity.
    pub(crate) fn new(endpoint: &str, instance: &str) -> Self {
        HostIdentity {
            origin: Origin::new(endpoint, instance),
            instance: instance.to_string(),
        }
    }
}

/// What the dispatcher leaves of a message's unit of work.
pub(crate) enum Dispatched<'a> {
    /// It has ended: rolled back, moved to the error queue, stored for a delayed retry, or
    /// dead-lettered.
    Ended,
    /// The message is done with and its unit of work waits for the commit, which the receive
    /// path makes: alone, or bringing the queue's next message along.
    ToCommit(Pending<'a>),
}

/// A unit of work whose message is done with, and what its commit means once it is known.
/// Dropping it without committing rolls the receive back.
pub(crate) struct Pending<'a> {
    received: Box<dyn Received>,
    done: Done,
    dispatcher: &'a Dispatcher,
    q: &'a QueueRuntime,
    // Held until the commit has ended: the message counts as in process, its key in flight.
    _in_process: Option<InProcess<'a>>,
    _key: Option<KeyInFlight<'a>>,
}

/// What a commit ends.
enum Done {
    /// An expired message dropped.
    Expired { id: Uuid },
    /// A message from a delayed table sent on to its queue.
    Forwarded { id: Uuid, logical_id: String },
    /// A message handled, its outbox written.
    Handled {
        id: Uuid,
        logical_id: Option<String>,
    },
}

impl<'a> Pending<'a> {
    /// Commits; the outcome is counted.
    pub(crate) async fn commit(self) {
        let Pending {
            received,
            done,
            dispatcher,
            q,
            ..
        } = self;
        let committed = received.commit().await;
        dispatcher.committed(q, done, committed);
    }

    /// Commits and receives the queue's next message on the same connection (one round trip
    /// where the transport can). The caller must be allowed to receive now: nothing may be
    /// waited for between the two. None when the commit failed (no receive was tried).
    pub(crate) async fn commit_and_receive(
        self,
    ) -> Option<Result<Option<Box<dyn Received>>, TransportError>> {
        let Pending {
            received,
            done,
            dispatcher,
            q,
            ..
        } = self;
        let both = received.commit_and_receive(q.name()).await;
        dispatcher.committed(q, done, both.committed);
        both.next
    }
}

enum Verdict {
    Success(Vec<(QueueName, OutgoingMessage)>),
    Failed(Box<OutgoingMessage>, Failure),
    /// Its immediate retries are used up and a delayed retry is due: store it in the delayed
    /// table of the first queue.
    Deferred(QueueName, Box<OutgoingMessage>, Failure),
    /// The queue went into outage mode while this message was in flight beside others: it
    /// goes back to its place (its failures remembered) instead of waiting for a turn, so one
    /// message at a time means one in flight.
    Released,
}

/// Where a message from a delayed table goes.
enum Destination {
    /// Here: the header named this queue (or nothing this host can read as another).
    Here,
    /// On to another queue, in the receive's unit of work.
    Queue(QueueName),
    /// An address that names no queue this transport reaches: to the error queue.
    Unknown(String),
}

/// Processes received messages for every queue of a host.
pub(crate) struct Dispatcher {
    publisher: Arc<Publisher>,
    throttle: Arc<Throttle>,
    mode: TransactionMode,
    identity: HostIdentity,
    /// The handler of each receiving queue, fixed at start.
    handlers: HashMap<QueueName, Arc<dyn Handler>>,
    /// Where a failed message's key is held ([`crate::transport::KeyOrdering::hold`]).
    store: Arc<dyn Transport>,
    in_process: AtomicU64,
    observer: Option<Arc<dyn DispatchObserver>>,
}

/// Sends `message` to `queue` inside the receive and commits both, or rolls back: the message
/// leaves its queue only together with its copy.
async fn send_and_commit(
    mut received: Box<dyn Received>,
    queue: &QueueName,
    message: &OutgoingMessage,
) -> Result<(), TransportError> {
    match received.send(queue, message).await {
        Ok(()) => received.commit().await,
        Err(e) => {
            let _ = received.rollback().await;
            Err(e)
        }
    }
}

impl Dispatcher {
    /// The handler of `q`.
    fn handler_of(&self, q: &QueueRuntime) -> &dyn Handler {
        self.handlers
            .get(q.name())
            .map(|h| h.as_ref())
            // `plan_queues` builds the handlers and the queues together, one for each.
            .expect("every receiving queue has a handler")
    }

    /// Who this host is in the headers it writes.
    pub(crate) fn origin(&self) -> &Origin {
        &self.identity.origin
    }

    /// A dispatcher sending through `publisher`.
    pub(crate) fn new(
        publisher: Arc<Publisher>,
        throttle: Arc<Throttle>,
        mode: TransactionMode,
        identity: HostIdentity,
        handlers: HashMap<QueueName, Arc<dyn Handler>>,
        store: Arc<dyn Transport>,
        observer: Option<Arc<dyn DispatchObserver>>,
    ) -> Self {
        Dispatcher {
            publisher,
            throttle,
            mode,
            identity,
            handlers,
            store,
            in_process: AtomicU64::new(0),
            observer,
        }
    }

    fn observe(&self, q: &QueueRuntime, id: Uuid, logical_id: Option<&str>, outcome: Outcome) {
        q.record_outcome(outcome);
        if let Some(o) = &self.observer {
            o.completed(q.name(), id, logical_id, outcome);
        }
    }

    /// Messages handed to handlers and not done, host-wide.
    pub(crate) fn in_process(&self) -> u64 {
        self.in_process.load(Ordering::Relaxed)
    }

    /// Takes one receive as far as its commit: handles, retries, moves to the error queue,
    /// drops expired messages, dead-letters poison rows. Never panics and never loses the
    /// message: when anything fails the receive rolls back and the message returns to its
    /// queue. What is left to commit goes back to the receive path, which decides whether the
    /// commit brings the next message along.
    pub(crate) async fn process<'a>(
        &'a self,
        q: &'a QueueRuntime,
        received: Box<dyn Received>,
    ) -> Dispatched<'a> {
        q.count(QueueEvent::Received);
        self.throttle.delivery_rates.incoming();
        match received.payload() {
            Payload::Expired { id } => {
                let done = Done::Expired { id: *id };
                self.to_commit(q, received, done, None, None)
            }
            Payload::Poison { id, reason } => {
                let (id, reason) = (*id, reason.clone());
                self.dead_letter(q, received, id, &reason).await;
                Dispatched::Ended
            }
            Payload::Message(m) => match self.destination(q, m) {
                Destination::Here => self.handle(q, received).await,
                Destination::Queue(to) => self.forward(q, received, to).await,
                Destination::Unknown(address) => {
                    self.undeliverable(q, received, &address).await;
                    Dispatched::Ended
                }
            },
        }
    }

    /// A unit of work left for the receive path to commit.
    fn to_commit<'a>(
        &'a self,
        q: &'a QueueRuntime,
        received: Box<dyn Received>,
        done: Done,
        in_process: Option<InProcess<'a>>,
        key: Option<KeyInFlight<'a>>,
    ) -> Dispatched<'a> {
        Dispatched::ToCommit(Pending {
            received,
            done,
            dispatcher: self,
            q,
            _in_process: in_process,
            _key: key,
        })
    }

    /// Counts what a commit ended, once its result is known.
    fn committed(&self, q: &QueueRuntime, done: Done, committed: Result<(), TransportError>) {
        match (done, committed) {
            (Done::Expired { id }, Ok(())) => {
                tracing::debug!(queue = %q.name(), %id, "expired message dropped");
                q.count(QueueEvent::Expired);
                self.throttle.delivery_rates.outgoing();
                self.observe(q, id, None, Outcome::Expired);
            }
            (Done::Expired { id }, Err(e)) => {
                tracing::warn!(queue = %q.name(), %id, error = %e, "dropping an expired message failed; it stays in the queue")
            }
            (Done::Forwarded { id, logical_id }, Ok(())) => {
                q.depth().departed();
                q.count(QueueEvent::Forwarded);
                self.throttle.delivery_rates.outgoing();
                if let Some(o) = &self.observer {
                    o.moved_on(q.name(), id, Some(&logical_id));
                }
            }
            (Done::Forwarded { id, .. }, Err(e)) => {
                tracing::warn!(queue = %q.name(), %id, error = %e,
                "forwarding a due delayed message did not commit; it returns to the queue")
            }
            (Done::Handled { id, logical_id }, Ok(())) => {
                q.forget_failed_attempts(id);
                q.count(QueueEvent::Succeeded);
                self.throttle.delivery_rates.outgoing();
                self.observe(q, id, logical_id.as_deref(), Outcome::Success);
            }
            (Done::Handled { id, .. }, Err(e @ TransportError::InDoubt { .. })) => {
                tracing::warn!(queue = %q.name(), %id, error = %e,
                    "the database did not say whether the commit took effect");
            }
            (Done::Handled { id, .. }, Err(e)) => {
                tracing::error!(queue = %q.name(), %id, error = %e,
                    "commit failed after the handler succeeded; the message returns to the queue");
            }
        }
    }
}
