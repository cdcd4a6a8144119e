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

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::FutureExt;
use uuid::Uuid;

use crate::config::{FailedKey, TransactionMode};
use crate::handlers::{Context, Handler, Sender};
use crate::message::{
    FORWARD_DESTINATION_HEADER, Headers, Message, Origin, OutgoingMessage, RETRIES_HEADER,
    RETRIES_TIMESTAMP_HEADER, format_wire_time,
};
use crate::publish::Publisher;
use crate::queue::downstream::Change;
use crate::queue::{QueueEvent, QueueRuntime};
use crate::throttling::Throttle;
use crate::transport::{Payload, QueueName, Received, Transport, TransportError};

/// The exception type of an attempt that ran past the handler timeout.
const TIMEOUT_KIND: &str = "throttlehost.HandlerTimeout";

/// Longest exception message kept in `NServiceBus.ExceptionInfo.Message` (as Core does).
const MAX_EXCEPTION_MESSAGE: usize = 16_384;

pub use crate::queue::Outcome;

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
pub struct HostIdentity {
    /// `NServiceBus.ProcessingEndpoint` and `ProcessingMachine`, `$.diagnostics.hostid`, and
    /// the `Originating*` headers of what this host sends.
    pub origin: Origin,
    /// `$.diagnostics.hostdisplayname`: the instance id.
    pub instance: String,
}

impl HostIdentity {
    /// Builds the identity.
    pub fn new(endpoint: &str, instance: &str) -> Self {
        HostIdentity {
            origin: Origin::new(endpoint, instance),
            instance: instance.to_string(),
        }
    }
}

/// Why one handler attempt failed.
#[derive(Debug, Clone)]
pub struct Failure {
    /// `NServiceBus.ExceptionInfo.ExceptionType`.
    pub kind: &'static str,
    /// `NServiceBus.ExceptionInfo.Message`.
    pub message: String,
    /// `NServiceBus.ExceptionInfo.StackTrace`: the error's source chain.
    pub detail: String,
}

impl Failure {
    fn from_error(e: &(dyn std::error::Error + 'static)) -> Self {
        let mut detail = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            detail.push_str("\n  caused by: ");
            detail.push_str(&s.to_string());
            source = s.source();
        }
        Failure {
            kind: "throttlehost.HandlerError",
            message: e.to_string(),
            detail,
        }
    }

    fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "handler panicked".into());
        Failure {
            kind: "throttlehost.HandlerPanic",
            detail: format!("panic: {message}"),
            message,
        }
    }

    fn timeout(limit: Duration) -> Self {
        let message = format!(
            "handler did not finish within {}",
            humantime::format_duration(limit)
        );
        Failure {
            kind: TIMEOUT_KIND,
            detail: message.clone(),
            message,
        }
    }

    fn send(e: &crate::transport::TransportError) -> Self {
        Failure {
            kind: "throttlehost.SendFailed",
            message: format!("sending the handler's messages failed: {e}"),
            detail: e.to_string(),
        }
    }
}

/// Calls a handler once, turning errors, panics and timeouts into a [`Failure`].
pub async fn call_handler(
    handler: &dyn Handler,
    ctx: &mut Context<'_>,
    timeout: Option<Duration>,
) -> Result<(), Failure> {
    let attempt = AssertUnwindSafe(handler.handle(ctx)).catch_unwind();
    let result = match timeout {
        Some(limit) => match tokio::time::timeout(limit, attempt).await {
            Ok(r) => r,
            Err(_) => return Err(Failure::timeout(limit)),
        },
        None => attempt.await,
    };
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Failure::from_error(e.as_ref())),
        Err(panic) => Err(Failure::from_panic(panic)),
    }
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

/// Counts a message as in process while alive.
struct InProcess<'a>(&'a AtomicU64);

impl<'a> InProcess<'a> {
    fn enter(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        InProcess(counter)
    }
}

impl Drop for InProcess<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a key of an ordered queue as in flight on this host while alive (the key is held
/// until the message's unit of work ends, which happens before the dispatcher returns).
struct KeyInFlight<'a>(&'a metrics::Gauge);

impl<'a> KeyInFlight<'a> {
    /// Some when `q` keeps key order and the message carries a key.
    fn enter(q: &'a QueueRuntime, payload: &Payload) -> Option<Self> {
        let header = q.ordering()?.key_header()?;
        let Payload::Message(m) = payload else {
            return None;
        };
        m.header(header)?;
        q.metrics().ordered_keys_in_flight.increment(1.0);
        Some(KeyInFlight(&q.metrics().ordered_keys_in_flight))
    }
}

impl Drop for KeyInFlight<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// What the dispatcher leaves of a message's unit of work.
pub enum Dispatched<'a> {
    /// It has ended: rolled back, moved to the error queue, stored for a delayed retry, or
    /// dead-lettered.
    Ended,
    /// The message is done with and its unit of work waits for the commit, which the receive
    /// path makes: alone, or bringing the queue's next message along.
    ToCommit(Pending<'a>),
}

/// A unit of work whose message is done with, and what its commit means once it is known.
/// Dropping it without committing rolls the receive back.
pub struct Pending<'a> {
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
    pub async fn commit(self) {
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
    pub async fn commit_and_receive(
        self,
        transport: &dyn Transport,
    ) -> Option<Result<Option<Box<dyn Received>>, TransportError>> {
        let Pending {
            received,
            done,
            dispatcher,
            q,
            ..
        } = self;
        let both = received.commit_and_receive(transport, q.name()).await;
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

/// Delayed retries a message has had, from its `NServiceBus.Retries` header.
fn delayed_retries_of(message: &Message) -> u32 {
    message
        .header(RETRIES_HEADER)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Processes received messages for every queue of a host.
pub struct Dispatcher {
    publisher: Arc<Publisher>,
    throttle: Arc<Throttle>,
    mode: TransactionMode,
    identity: HostIdentity,
    /// The handler of each receiving queue, fixed at start.
    handlers: HashMap<QueueName, Arc<dyn Handler>>,
    in_process: AtomicU64,
    observer: Option<Arc<dyn DispatchObserver>>,
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
    pub fn new(
        publisher: Arc<Publisher>,
        throttle: Arc<Throttle>,
        mode: TransactionMode,
        identity: HostIdentity,
        handlers: HashMap<QueueName, Arc<dyn Handler>>,
        observer: Option<Arc<dyn DispatchObserver>>,
    ) -> Self {
        Dispatcher {
            publisher,
            throttle,
            mode,
            identity,
            handlers,
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
    pub fn in_process(&self) -> u64 {
        self.in_process.load(Ordering::Relaxed)
    }

    /// Takes one receive as far as its commit: handles, retries, moves to the error queue,
    /// drops expired messages, dead-letters poison rows. Never panics and never loses the
    /// message: when anything fails the receive rolls back and the message returns to its
    /// queue. What is left to commit goes back to the receive path, which decides whether the
    /// commit brings the next message along.
    pub async fn process<'a>(
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

    /// Where a received message goes: here, unless it came from a delayed table for another
    /// queue.
    fn destination(&self, q: &QueueRuntime, message: &Message) -> Destination {
        let Some(address) = message.header(FORWARD_DESTINATION_HEADER) else {
            return Destination::Here;
        };
        let parsed = self.publisher.transport().resolve_address(address);
        match parsed {
            Some(to) if to == *q.name() => Destination::Here,
            Some(to) => Destination::Queue(to),
            None => Destination::Unknown(address.to_string()),
        }
    }

    /// Sends a message from a delayed table on to the queue it is for, in the receive's unit
    /// of work. A send that fails rolls back; the next delivery of the same row goes to the
    /// error queue (as NServiceBus does), naming the destination.
    async fn forward<'a>(
        &'a self,
        q: &'a QueueRuntime,
        mut received: Box<dyn Received>,
        to: QueueName,
    ) -> Dispatched<'a> {
        let Payload::Message(message) = received.payload() else {
            return Dispatched::Ended;
        };
        let (id, logical_id) = (message.id, message.logical_id());
        if q.failed_attempts(id) > 0 {
            self.undeliverable(q, received, to.as_str()).await;
            return Dispatched::Ended;
        }
        let mut copy = OutgoingMessage::forward_of(message);
        copy.headers.remove(FORWARD_DESTINATION_HEADER);
        if let Err(e) = self
            .publisher
            .insert_within(received.as_mut(), &to, &copy)
            .await
        {
            q.remember_failed_attempts(id, 1);
            tracing::warn!(queue = %q.name(), %id, destination = %to, error = %e,
                "a due delayed message could not be sent on to its destination; it returns and goes to the error queue next");
            let _ = received.rollback().await;
            return Dispatched::Ended;
        }
        let done = Done::Forwarded { id, logical_id };
        self.to_commit(q, received, done, None, None)
    }

    /// A message whose forward destination cannot be reached goes to the error queue with
    /// `NServiceBus.FailedQ` naming that destination.
    async fn undeliverable(&self, q: &QueueRuntime, received: Box<dyn Received>, to: &str) {
        let Payload::Message(message) = received.payload() else {
            return;
        };
        let failure = Failure {
            kind: "throttlehost.ForwardFailed",
            message: format!("the forward destination `{to}` names no queue this host can send to"),
            detail: format!("{FORWARD_DESTINATION_HEADER} = {to}"),
        };
        let (id, logical_id) = (message.id, message.logical_id());
        let mut error_message = self.error_message(q, message, &failure, 1);
        error_message.headers.remove(FORWARD_DESTINATION_HEADER);
        error_message
            .headers
            .insert("NServiceBus.FailedQ".into(), Some(to.to_string()));
        if let Some(outcome) = self
            .move_to_error(q, received, id, &error_message, &failure)
            .await
        {
            self.observe(q, id, Some(&logical_id), outcome);
        }
    }

    async fn dead_letter(
        &self,
        q: &QueueRuntime,
        mut received: Box<dyn Received>,
        id: Uuid,
        reason: &str,
    ) {
        tracing::warn!(queue = %q.name(), %id, error_queue = %q.error_queue(), %reason,
            "probable message metadata corruption: moving the row to the error queue unchanged");
        let result = match received.dead_letter(q.error_queue()).await {
            Ok(()) => received.commit().await,
            Err(e) => {
                let _ = received.rollback().await;
                Err(e)
            }
        };
        match result {
            Ok(()) => {
                q.count(QueueEvent::Poison);
                self.throttle.delivery_rates.outgoing();
                self.observe(q, id, None, Outcome::Poison);
            }
            Err(e) => tracing::error!(queue = %q.name(), %id, error = %e,
                "could not move a poison row to the error queue; it stays in the queue"),
        }
    }

    async fn handle<'a>(
        &'a self,
        q: &'a QueueRuntime,
        received: Box<dyn Received>,
    ) -> Dispatched<'a> {
        let in_process = InProcess::enter(&self.in_process);
        self.throttle.delivery.message_started();
        let key = KeyInFlight::enter(q, received.payload());
        let settings = q.settings();

        let (id, logical_id, hold_key, verdict) = {
            let Payload::Message(received_message) = received.payload() else {
                return Dispatched::Ended;
            };
            // A message from this queue's delayed table: its handler does not see the header.
            let local_copy = received_message
                .headers
                .contains_key(FORWARD_DESTINATION_HEADER)
                .then(|| {
                    let mut m = received_message.clone();
                    m.headers.remove(FORWARD_DESTINATION_HEADER);
                    m
                });
            let message = local_copy.as_ref().unwrap_or(received_message);
            let id = message.id;
            // The key a failure holds (`failed_key = "hold"`), when the message has one.
            let hold_key = q
                .ordering()
                .as_ref()
                .filter(|o| o.failed_key == FailedKey::Hold)
                .and_then(|o| o.key_header())
                .and_then(|h| message.header(h))
                .map(str::to_string);
            let logical_id = self.observer.as_ref().map(|_| message.logical_id());
            if let Some(o) = &self.observer {
                o.started(q.name(), id, logical_id.as_deref());
            }
            let verdict = self.attempt_until_done(q, message, &settings).await;
            (id, logical_id, hold_key, verdict)
        };
        if let Some(o) = &self.observer {
            o.handled(q.name(), id, logical_id.as_deref());
        }

        let outcome = match verdict {
            Verdict::Success(outbox) => {
                let Some(received) = self.send_outbox(q, received, id, &outbox).await else {
                    return Dispatched::Ended;
                };
                let done = Done::Handled { id, logical_id };
                return self.to_commit(q, received, done, Some(in_process), key);
            }
            Verdict::Released => {
                tracing::debug!(queue = %q.name(), %id, "outage mode: message returned to the queue to be tried one at a time");
                if let Err(e) = received.rollback().await {
                    tracing::warn!(queue = %q.name(), %id, error = %e, "rollback failed (the connection was discarded; the message returns)");
                }
                None
            }
            Verdict::Deferred(home, retry, failure) => {
                if self.defer(q, received, id, &home, &retry, &failure).await
                    && let Some(o) = &self.observer
                {
                    o.moved_on(q.name(), id, logical_id.as_deref());
                }
                None
            }
            Verdict::Failed(error_message, failure) => match hold_key {
                Some(key) => {
                    self.hold(q, received, id, &key, &error_message, &failure)
                        .await
                }
                None => {
                    self.move_to_error(q, received, id, &error_message, &failure)
                        .await
                }
            },
        };
        if let Some(outcome) = outcome {
            self.observe(q, id, logical_id.as_deref(), outcome);
        }
        Dispatched::Ended
    }

    /// Calls the handler until it succeeds or the immediate retries are used up (counting the
    /// attempts of earlier deliveries this host remembers), then decides what becomes of the
    /// message: its outbox, a delayed retry, or the error queue.
    async fn attempt_until_done(
        &self,
        q: &QueueRuntime,
        message: &Message,
        settings: &crate::queue::QueueSettings,
    ) -> Verdict {
        let id = message.id;
        let max_attempts = settings.immediate_retries + 1;
        let mut attempt = q.failed_attempts(id);
        let mut last_failure = None;
        loop {
            if attempt >= max_attempts {
                let failure = last_failure.unwrap_or_else(|| Failure {
                    kind: "throttlehost.RetriesExhausted",
                    message: format!("{attempt} earlier attempts failed"),
                    detail: "the failures were recorded in an earlier delivery of this message"
                        .into(),
                });
                let retries = delayed_retries_of(message);
                if let Some(home) = q
                    .delayed_home()
                    .filter(|_| retries < settings.delayed_retries)
                {
                    let retry = self.delayed_retry(q, home, message, retries + 1);
                    return Verdict::Deferred(home.clone(), Box::new(retry), failure);
                }
                let error_message = self.error_message(q, message, &failure, attempt);
                return Verdict::Failed(Box::new(error_message), failure);
            }
            if last_failure.is_some() && q.downstream().in_outage() && q.gate().in_flight() > 1 {
                return Verdict::Released;
            }
            match self.attempt(q, message, attempt, settings).await {
                Ok(outbox) => return Verdict::Success(outbox),
                Err(failure) => {
                    attempt += 1;
                    q.remember_failed_attempts(id, attempt);
                    if attempt < max_attempts {
                        q.count(QueueEvent::Retried);
                        tracing::debug!(queue = %q.name(), %id, attempt, error = %failure.message, "handler failed; retrying");
                    }
                    last_failure = Some(failure);
                }
            }
        }
    }

    /// One handler attempt, past the queue's downstream guards: the outage pause before it,
    /// its outcome and latency reported after it (which may change the queue's limit).
    async fn attempt(
        &self,
        q: &QueueRuntime,
        message: &Message,
        attempt: u32,
        settings: &crate::queue::QueueSettings,
    ) -> Result<Vec<(QueueName, OutgoingMessage)>, Failure> {
        q.downstream().before_attempt().await;
        let send_immediately = self.mode == TransactionMode::None;
        let sender = Sender {
            origin: &self.identity.origin,
            publisher: &self.publisher,
            send_immediately,
        };
        let mut ctx = Context::new(message, q.name(), attempt, sender);
        let started = Instant::now();
        let result = call_handler(self.handler_of(q), &mut ctx, settings.handler_timeout).await;
        let took = started.elapsed();
        q.handler_took(took);
        let in_flight = q.gate().in_flight();
        let change = match &result {
            Ok(()) => q.downstream().succeeded(took, in_flight),
            Err(f) => {
                let logical_id = message.logical_id();
                q.downstream()
                    .failed(&logical_id, took, in_flight, f.kind == TIMEOUT_KIND)
            }
        };
        if change == Change::Limit {
            q.apply_guard_limit();
        }
        result.map(|()| std::mem::take(&mut ctx.outbox))
    }

    /// Writes a handled message's outbox (inside its unit of work in
    /// `sends_atomic_with_receive`, on its own in `receive_only`); the receive comes back to
    /// be committed, or None when a send failed and it rolled back for a retry.
    async fn send_outbox(
        &self,
        q: &QueueRuntime,
        mut received: Box<dyn Received>,
        id: Uuid,
        outbox: &[(QueueName, OutgoingMessage)],
    ) -> Option<Box<dyn Received>> {
        for (queue, message) in outbox {
            let sent = match self.mode {
                TransactionMode::SendsAtomicWithReceive => {
                    self.publisher
                        .insert_within(received.as_mut(), queue, message)
                        .await
                }
                TransactionMode::ReceiveOnly => self.publisher.insert(queue, message).await,
                TransactionMode::None => Ok(()),
            };
            if let Err(e) = sent {
                let attempts = q.failed_attempts(id) + 1;
                q.remember_failed_attempts(id, attempts);
                q.count(QueueEvent::Retried);
                tracing::warn!(queue = %q.name(), %id, destination = %queue, error = %Failure::send(&e).message,
                    "handler succeeded but its messages could not be sent; rolling back for a retry");
                if let Err(e) = received.rollback().await {
                    tracing::warn!(queue = %q.name(), %id, error = %e, "rollback failed (the connection was discarded; the message returns)");
                }
                return None;
            }
        }
        Some(received)
    }

    /// A keyed message failed after its retries on a queue that holds its key: it stays in
    /// place, its key held in the store, and this receive rolls back. When the hold cannot be
    /// recorded, the message goes to the error queue as on any other queue: never lost, and
    /// never left to fail again at once.
    async fn hold(
        &self,
        q: &QueueRuntime,
        mut received: Box<dyn Received>,
        id: Uuid,
        key: &str,
        error_message: &OutgoingMessage,
        failure: &Failure,
    ) -> Option<Outcome> {
        if let Err(e) = received.hold(key, &failure.message).await {
            tracing::error!(queue = %q.name(), %id, %key, error = %e,
                "could not hold the key of a failed message; moving it to the error queue instead");
            return self
                .move_to_error(q, received, id, error_message, failure)
                .await;
        }
        // Released, it is tried afresh: its earlier attempts do not count.
        q.forget_failed_attempts(id);
        tracing::warn!(queue = %q.name(), %id, %key, error = %failure.message,
            "message failed after its retries: it stays in the queue and holds its key until `throttlehost queues release {} --key {key}`", q.name());
        if let Err(e) = received.rollback().await {
            tracing::warn!(queue = %q.name(), %id, error = %e, "rollback failed (the connection was discarded; the message returns)");
        }
        None
    }

    async fn move_to_error(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        id: Uuid,
        error_message: &OutgoingMessage,
        failure: &Failure,
    ) -> Option<Outcome> {
        let result = send_and_commit(received, q.error_queue(), error_message).await;
        match result {
            Ok(()) => {
                q.forget_failed_attempts(id);
                q.count(QueueEvent::Failed);
                self.throttle.delivery_rates.outgoing();
                tracing::warn!(queue = %q.name(), %id, error_queue = %q.error_queue(), error = %failure.message,
                    "message moved to the error queue after its retries");
                Some(Outcome::Error)
            }
            Err(e) => {
                tracing::error!(queue = %q.name(), %id, error_queue = %q.error_queue(), error = %e,
                    "could not move a failed message to the error queue; it stays in the queue");
                None
            }
        }
    }

    /// Stores a message whose immediate retries are used up in `home`'s delayed table for its
    /// next delayed retry, in the unit of work that removes it; true when that committed.
    async fn defer(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        id: Uuid,
        home: &QueueName,
        retry: &OutgoingMessage,
        failure: &Failure,
    ) -> bool {
        let result = send_and_commit(received, home, retry).await;
        match result {
            Ok(()) => {
                q.forget_failed_attempts(id);
                q.depth().departed();
                q.count(QueueEvent::DelayedRetry);
                self.throttle.delivery_rates.outgoing();
                self.publisher.scheduled(home, retry.deliver_after);
                tracing::info!(queue = %q.name(), %id, retry = retry.headers.get(RETRIES_HEADER).cloned().flatten().as_deref().unwrap_or("?"),
                    after = %humantime::format_duration(retry.deliver_after.unwrap_or_default()), error = %failure.message,
                    "message failed its immediate retries; a delayed retry is scheduled");
                true
            }
            Err(e) => {
                tracing::error!(queue = %q.name(), %id, error = %e,
                    "could not store a failed message for its delayed retry; it stays in the queue");
                false
            }
        }
    }

    /// The copy stored for delayed retry `n`: the message's headers with `NServiceBus.Retries`
    /// and its timestamp, a fresh row id, due `n` x the increment from now. A retry of
    /// another queue's message (an instance queue's, waiting in its main queue's table) names
    /// that queue as its forward destination.
    fn delayed_retry(
        &self,
        q: &QueueRuntime,
        home: &QueueName,
        message: &Message,
        n: u32,
    ) -> OutgoingMessage {
        let mut retry = OutgoingMessage::forward_of(message);
        retry.headers.remove(FORWARD_DESTINATION_HEADER);
        retry
            .headers
            .insert(RETRIES_HEADER.into(), Some(n.to_string()));
        retry.headers.insert(
            RETRIES_TIMESTAMP_HEADER.into(),
            Some(format_wire_time(Utc::now())),
        );
        if home != q.name() {
            retry.headers.insert(
                FORWARD_DESTINATION_HEADER.into(),
                Some(self.publisher.transport().address(q.name())),
            );
        }
        if !retry
            .headers
            .contains_key(crate::message::MESSAGE_ID_HEADER)
        {
            retry.headers.insert(
                crate::message::MESSAGE_ID_HEADER.into(),
                Some(message.id.to_string()),
            );
        }
        let increment = q.settings().delayed_retry_increment;
        retry.with_delay(increment.saturating_mul(n))
    }

    /// The copy that goes to the error queue: headers plus the NServiceBus fault headers.
    fn error_message(
        &self,
        q: &QueueRuntime,
        message: &Message,
        failure: &Failure,
        attempts: u32,
    ) -> OutgoingMessage {
        let mut headers: Headers = message.headers.clone();
        headers.remove("NServiceBus.Retries");
        headers.remove("NServiceBus.FLRetries");
        let mut text = failure.message.clone();
        if text.len() > MAX_EXCEPTION_MESSAGE {
            let mut cut = MAX_EXCEPTION_MESSAGE;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        let id = &self.identity;
        for (name, value) in [
            (
                "NServiceBus.FailedQ",
                self.publisher.transport().address(q.name()),
            ),
            (
                "NServiceBus.ExceptionInfo.ExceptionType",
                failure.kind.to_string(),
            ),
            ("NServiceBus.ExceptionInfo.Message", text),
            (
                "NServiceBus.ExceptionInfo.Source",
                self.handler_of(q).name().to_string(),
            ),
            (
                "NServiceBus.ExceptionInfo.StackTrace",
                failure.detail.clone(),
            ),
            (
                "NServiceBus.ExceptionInfo.Data.Attempts",
                attempts.to_string(),
            ),
            ("NServiceBus.TimeOfFailure", format_wire_time(Utc::now())),
            ("NServiceBus.ProcessingMachine", id.origin.machine.clone()),
            ("NServiceBus.ProcessingEndpoint", id.origin.endpoint.clone()),
            ("$.diagnostics.hostid", id.origin.host_id.to_string()),
            ("$.diagnostics.hostdisplayname", id.instance.clone()),
        ] {
            headers.insert(name.into(), Some(value));
        }
        if !headers.contains_key(crate::message::MESSAGE_ID_HEADER) {
            headers.insert(
                crate::message::MESSAGE_ID_HEADER.into(),
                Some(message.id.to_string()),
            );
        }
        OutgoingMessage {
            id: Uuid::new_v4(),
            headers,
            body: message.body.clone(),
            time_to_be_received: None,
            deliver_after: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chains_become_the_stack_trace() {
        let inner = std::io::Error::other("disk full");
        #[derive(Debug, thiserror::Error)]
        #[error("saving failed")]
        struct Outer(#[source] std::io::Error);
        let f = Failure::from_error(&Outer(inner));
        assert_eq!(f.message, "saving failed");
        assert_eq!(f.detail, "saving failed\n  caused by: disk full");
    }

    #[test]
    fn panics_keep_their_message() {
        let f = Failure::from_panic(Box::new("boom"));
        assert_eq!(
            (f.kind, f.message.as_str()),
            ("throttlehost.HandlerPanic", "boom")
        );
        let f = Failure::from_panic(Box::new(String::from("bang")));
        assert_eq!(f.message, "bang");
    }
}
