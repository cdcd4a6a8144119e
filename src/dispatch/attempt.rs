//! The handler's attempts: in-flight accounting, the call under its timeout and downstream guards,
//! immediate retries, and the outbox sent with the unit of work.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
// The runtime's clock: a handler's time follows a paused clock in tests as its sleeps do.
use tokio::time::Instant;
use uuid::Uuid;

use crate::config::{FailedKey, TransactionMode};
use crate::handlers::{Context, Handler, Sender};
use crate::message::{FORWARD_DESTINATION_HEADER, Message, OutgoingMessage};
use crate::queue::downstream::Change;
use crate::queue::{QueueEvent, QueueRuntime};
use crate::transport::{Payload, QueueName, Received};

use super::failure::{Failure, TIMEOUT_KIND, delayed_retries_of};
use super::{Dispatched, Dispatcher, Done, Outcome, Verdict};

/// Calls a handler once, turning errors, panics and timeouts into a [`Failure`].
pub(super) async fn call_handler(
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

/// Counts a message as in process while alive.
pub(super) struct InProcess<'a>(&'a AtomicU64);

impl<'a> InProcess<'a> {
    pub(super) fn enter(counter: &'a AtomicU64) -> Self {
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
pub(super) struct KeyInFlight<'a>(&'a metrics::Gauge);

impl<'a> KeyInFlight<'a> {
    /// Some when `q` keeps key order and the message carries a key.
    pub(super) fn enter(q: &'a QueueRuntime, payload: &Payload) -> Option<Self> {
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

impl Dispatcher {
    /// A received message, unless its key was held as it was taken: tried, then committed,
    /// deferred, held or moved to the error queue.
    pub(super) async fn handle<'a>(
        &'a self,
        q: &'a QueueRuntime,
        received: Box<dyn Received>,
    ) -> Dispatched<'a> {
        if self.taken_while_held(q, received.payload()).await {
            release(q, received, "its key is held").await;
            return Dispatched::Ended;
        }
        self.try_and_settle(q, received).await
    }

    /// Calls the handler on a received message and settles it by the verdict.
    async fn try_and_settle<'a>(
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
            let local_copy = without_forward_header(received_message);
            let message = local_copy.as_ref().unwrap_or(received_message);
            let id = message.id;
            let hold_key = hold_key_of(q, message);
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
                release(q, received, "outage mode: one at a time").await;
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
            Verdict::Failed(error_message, failure) => {
                let failed = (error_message.as_ref(), &failure);
                self.fail(q, received, id, hold_key.as_deref(), failed)
                    .await
            }
        };
        if let Some(outcome) = outcome {
            self.observe(q, id, logical_id.as_deref(), outcome);
        }
        Dispatched::Ended
    }

    /// A message whose retries are used up: held under its key when its queue holds failed
    /// keys, moved to the error queue otherwise.
    async fn fail(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        id: Uuid,
        hold_key: Option<&str>,
        (error_message, failure): (&OutgoingMessage, &Failure),
    ) -> Option<Outcome> {
        match hold_key {
            Some(key) => {
                self.hold(q, received, id, key, error_message, failure)
                    .await
            }
            None => {
                self.move_to_error(q, received, id, error_message, failure)
                    .await
            }
        }
    }

    /// Calls the handler until it succeeds or the immediate retries are used up (counting the
    /// attempts of earlier deliveries this host remembers), then decides what becomes of the
    /// message: its outbox, a delayed retry, or the error queue.
    pub(super) async fn attempt_until_done(
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
    pub(super) async fn attempt(
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
    pub(super) async fn send_outbox(
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
}

/// The message a handler sees: a message from its queue's delayed table without the forward
/// header (handlers do not see it), `None` when the received one has none.
fn without_forward_header(message: &Message) -> Option<Message> {
    message
        .headers
        .contains_key(FORWARD_DESTINATION_HEADER)
        .then(|| {
            let mut m = message.clone();
            m.headers.remove(FORWARD_DESTINATION_HEADER);
            m
        })
}

impl Dispatcher {
    /// A message this receive took although its key is held: the receive's statement began
    /// before another receive's hold was committed and read the store as it was then. Asked
    /// only on queues that hold failed keys. When the question cannot be answered the message
    /// goes back too, to be asked again on its next receive (never tried while maybe held).
    async fn taken_while_held(&self, q: &QueueRuntime, payload: &Payload) -> bool {
        let Payload::Message(message) = payload else {
            return false;
        };
        let (Some(key), Some(ordering)) = (hold_key_of(q, message), self.store.key_ordering())
        else {
            return false;
        };
        match ordering.is_held(q.name(), &key).await {
            Ok(held) => held,
            Err(e) => {
                tracing::warn!(queue = %q.name(), id = %message.id, %key, error = %e,
                    "could not ask whether the message's key is held; it goes back to the queue");
                true
            }
        }
    }
}

/// The key a failure of `message` holds (`failed_key = "hold"`), when it has one.
fn hold_key_of(q: &QueueRuntime, message: &Message) -> Option<String> {
    q.ordering()
        .as_ref()
        .filter(|o| o.failed_key == FailedKey::Hold)
        .and_then(|o| o.key_header())
        .and_then(|h| message.header(h))
        .map(str::to_string)
}

/// A message goes back to its place untried, for the reason `why`.
async fn release(q: &QueueRuntime, received: Box<dyn Received>, why: &str) {
    let id = received.payload().id();
    tracing::debug!(queue = %q.name(), ?id, why, "message returned to the queue untried");
    if let Err(e) = received.rollback().await {
        tracing::warn!(queue = %q.name(), %id, error = %e, "rollback failed (the connection was discarded; the message returns)");
    }
}
