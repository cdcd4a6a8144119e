//! Per-queue receivers: the three MaximumConcurrencyLevel models of the NServiceBus SQL
//! transport ([`fixed`], [`adaptive`], [`monitor`]), all bounded by the queue's
//! [`crate::queue::gate::ConcurrencyGate`] and all waiting the delivery throttle before each receive.
//!
//! Invariant: the throttling wait happens *before* the receive statement, so no row is ever
//! locked while a delay is waited out.
//!
//! An idle queue costs at most one statement per `peek_interval`: the monitor peeks once per
//! interval; fixed and adaptive receivers park every loop but one, and that one polls with a
//! peek (one statement) rather than a receive (a transaction) once the queue has been found
//! empty. A queue whose every arrival the transport tells of (a PostgreSQL table with the
//! insert trigger while the host listens) peeks once per
//! `queue::arrivals::NOTIFIED_PEEK_INTERVAL` instead, as a safety net.

pub(crate) mod adaptive;
mod batch;
pub(crate) mod fixed;
pub(crate) mod monitor;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ConcurrencyModel;
use crate::dispatch::{Dispatched, Dispatcher};
use crate::queue::gate::Permit;
pub(crate) use crate::queue::{QueueRuntime, QueueSettings};
use crate::throttling::Throttle;
use crate::throttling::admission::Receiving;
use crate::transport::{Received, Transport, TransportError};

/// What receivers share: the transport, the dispatcher, the throttle and the lifecycle.
pub(crate) struct ReceiveContext {
    /// Where the queues are.
    pub transport: Arc<dyn Transport>,
    /// Processes what is received.
    pub dispatcher: Arc<Dispatcher>,
    /// The delivery admission.
    pub throttle: Arc<Throttle>,
    /// Cancelled when receiving must stop (shutdown begins).
    pub stop: CancellationToken,
    /// Cancelled when in-flight work must be rolled back (shutdown timeout).
    pub abort: CancellationToken,
    /// Every receive and processing task, so shutdown can wait for them.
    pub tasks: TaskTracker,
}

/// Starts the receiver of a queue according to its model.
pub(crate) fn start(queue: Arc<QueueRuntime>, ctx: Arc<ReceiveContext>) {
    let tasks = ctx.tasks.clone();
    // Alive from now (readiness right after start is true); cleared when the receiver returns
    // or panics, so readiness sees a dead receiver.
    queue.receiver_alive_flag().store(true, Ordering::Release);
    tasks.spawn(async move {
        let _alive = Alive(queue.receiver_alive_flag());
        let q = queue.clone();
        match q.model() {
            ConcurrencyModel::Fixed => fixed::run(q, ctx).await,
            // Boxed: the adaptive loop's state is more than twice the monitor's, and the
            // task of every queue would be sized to the largest of the three.
            ConcurrencyModel::Adaptive => Box::pin(adaptive::run(q, ctx)).await,
            ConcurrencyModel::Monitor => monitor::run(q, ctx).await,
        }
    });
}

/// Clears a flag when dropped, by a return or by a panic's unwinding.
struct Alive<'a>(&'a AtomicBool);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// What one admission-plus-receive produced.
pub(crate) enum ReceiveOutcome {
    /// A message (or an expired or poison row) to process.
    Got(Box<dyn Received>),
    /// The queue had nothing for us.
    Empty,
    /// The transport failed; pause this long before trying again.
    Failed(Duration),
    /// What came went back to the queue: the queue's limit shrank while the receive was out
    /// ([`give_back_past_the_limit`]).
    GivenBack,
}

/// What one turn of a receive loop came to.
pub(crate) enum Turn {
    /// The host is stopping.
    Stop,
    /// Messages were handled, or what came was given back because the limit shrank; the loop
    /// goes again at once (and waits at the gate for a permit).
    Handled,
    /// The queue had nothing for us.
    Empty,
    /// The transport failed; pause this long before trying again.
    Failed(Duration),
}

/// One turn of a receive loop, the same in every model: wait the delivery admission, take a
/// gate permit, receive, and handle the message and those its commits bring along. `got`
/// runs once when a receive found a message, `on_message` for every message handled. The
/// permit is given back before the turn ends. What to do after an empty or failed receive is
/// the model's policy.
pub(crate) async fn turn(
    q: &Arc<QueueRuntime>,
    ctx: &Arc<ReceiveContext>,
    got: impl FnOnce(),
    mut on_message: impl FnMut(),
) -> Turn {
    let Some((permit, receiving)) = admit_then_acquire(q, ctx).await else {
        return Turn::Stop;
    };
    let received = give_back_past_the_limit(q, batch::receive_some(q, ctx).await);
    drop(receiving);
    let outcome = match received {
        ReceiveOutcome::Got(received) => {
            got();
            on_message();
            let end = process(q, ctx, received, &mut on_message).await;
            drop(permit);
            match end {
                Some(outcome) => outcome,
                None => return Turn::Handled,
            }
        }
        other => {
            drop(permit);
            other
        }
    };
    match outcome {
        ReceiveOutcome::Empty => Turn::Empty,
        ReceiveOutcome::Failed(wait) => Turn::Failed(wait),
        ReceiveOutcome::GivenBack => Turn::Handled,
        ReceiveOutcome::Got(_) => unreachable!("process ends a chain only on a non-message"),
    }
}

/// Waits the delivery throttle, then takes a permit of the queue's gate, then starts the
/// receive: a receiver waiting out a delay holds no slot and does not count as in flight, and
/// when a delay ends, only as many receivers as the (possibly reduced) limit allows go on.
/// The receive counts against the delivery ceiling's allowance only when it starts, with its
/// permit: receivers admitted while the queue was at its limit would otherwise start later,
/// one per freed slot, past any allowance set since. None when shutdown began.
pub(crate) async fn admit_then_acquire<'c>(
    q: &QueueRuntime,
    ctx: &'c ReceiveContext,
) -> Option<(Permit, Receiving<'c>)> {
    loop {
        tokio::select! {
            biased;
            _ = ctx.stop.cancelled() => return None,
            _ = ctx.throttle.delivery.admit() => {}
        }
        let permit = tokio::select! {
            biased;
            _ = ctx.stop.cancelled() => return None,
            p = q.gate().acquire() => p,
        };
        // The ceiling's allowance may have run out while this receiver waited for its
        // permit: then it gives the permit back and waits again.
        if let Some(receiving) = ctx.throttle.delivery.start() {
            return Some((permit, receiving));
        }
    }
}

/// Receives once. The caller has waited the throttle and holds a gate permit.
pub(crate) async fn receive(q: &QueueRuntime, ctx: &ReceiveContext) -> ReceiveOutcome {
    account(q, ctx.transport.receive(q.name()).await)
}

/// Counts a receive's result and turns it into an outcome.
pub(crate) fn account(
    q: &QueueRuntime,
    result: Result<Option<Box<dyn Received>>, crate::transport::TransportError>,
) -> ReceiveOutcome {
    match (
        q.observe_receive(result.as_ref().map(Option::is_some)),
        result,
    ) {
        (Some(wait), _) => ReceiveOutcome::Failed(wait),
        (None, Ok(Some(received))) => ReceiveOutcome::Got(received),
        (None, _) => ReceiveOutcome::Empty,
    }
}

/// Whether the next receive may go out with a commit: only when it would not have to wait.
fn may_follow_on(q: &QueueRuntime, ctx: &ReceiveContext) -> bool {
    // The atomic checks first: the settings are an Arc to load. A batch queue's next
    // receive is a batch: it goes out from the loop, not with a commit.
    ctx.throttle.delivery.is_open()
        && !ctx.stop.is_cancelled()
        && within_limit(q)
        && q.settings().receive_batch <= 1
}

/// Whether the permits held are within the gate's size now (it may have shrunk since they
/// were taken: a shrink takes effect as permits come back).
fn within_limit(q: &QueueRuntime) -> bool {
    q.gate().in_flight() <= q.gate().effective()
}

/// A message that came while the gate shrank below the permits held (a fleet share taken
/// back while a frozen database held the receive, a throttling cut) goes back to the queue
/// instead of running past the limit: the permit that fetched it was taken under the old
/// limit. Checked for every receive, the first of a turn as much as one that came with a
/// commit; before, a receive stuck in a frozen server ran its message at the thaw beside the
/// full share the others had taken meanwhile (6 at once for a fleet limit of 4).
fn give_back_past_the_limit(q: &QueueRuntime, outcome: ReceiveOutcome) -> ReceiveOutcome {
    match outcome {
        ReceiveOutcome::Got(received) if !within_limit(q) => {
            tracing::debug!(queue = %q.name(), "a message is given back: the queue's limit shrank while it was received");
            drop(received);
            ReceiveOutcome::GivenBack
        }
        other => other,
    }
}

/// Processes a received message and, while the commits bring the queue's next message along,
/// the messages after it; `on_message` is called for each follow-on message. The dispatcher
/// takes each message as far as its commit; this path decides whether the commit brings the
/// next receive along ([`may_follow_on`]: only when that receive would not have to wait).
/// Returns how the chain ended: `None` when no follow-on receive was attempted, else the empty
/// or failed receive that ended it. When shutdown's deadline passes first, the work is dropped
/// and its receive rolls back.
pub(crate) async fn process(
    q: &QueueRuntime,
    ctx: &ReceiveContext,
    received: Box<dyn Received>,
    mut on_message: impl FnMut(),
) -> Option<ReceiveOutcome> {
    let mut current = received;
    loop {
        if ctx.abort.is_cancelled() {
            // A receive that was stuck (on a lock, a frozen server) and returned after the
            // shutdown gave up on it: roll it back rather than handle it after the host stopped.
            drop(current);
            return None;
        }
        let next = tokio::select! {
            biased;
            next = dispatch_and_commit(q, ctx, current) => next,
            _ = ctx.abort.cancelled() => {
                tracing::warn!(queue = %q.name(), "shutdown timeout reached: rolled back an in-flight message; it returns to the queue");
                return None;
            }
        };
        match give_back_past_the_limit(q, account(q, next?)) {
            // The permit is given back with the message.
            ReceiveOutcome::GivenBack => return None,
            ReceiveOutcome::Got(received) => {
                on_message();
                current = received;
            }
            other => return Some(other),
        }
    }
}

/// Hands `received` to the dispatcher, then commits what it leaves: with the queue's next
/// receive when that may go now, else alone. The next receive's result, when one was tried.
async fn dispatch_and_commit(
    q: &QueueRuntime,
    ctx: &ReceiveContext,
    received: Box<dyn Received>,
) -> Option<Result<Option<Box<dyn Received>>, TransportError>> {
    match ctx.dispatcher.process(q, received).await {
        Dispatched::Ended => None,
        Dispatched::ToCommit(pending) if may_follow_on(q, ctx) => {
            pending.commit_and_receive().await
        }
        Dispatched::ToCommit(pending) => {
            pending.commit().await;
            None
        }
    }
}

/// Sleeps unless shutdown begins; returns false if it did.
pub(crate) async fn pause(ctx: &ReceiveContext, d: Duration) -> bool {
    if d.is_zero() {
        return !ctx.stop.is_cancelled();
    }
    tokio::select! {
        _ = ctx.stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// Waits `d` on a queue found idle, or less when messages arrive ([`QueueRuntime::arrived`]):
/// false when shutdown began.
pub(crate) async fn idle_pause(ctx: &ReceiveContext, q: &QueueRuntime, d: Duration) -> bool {
    tokio::select! {
        _ = ctx.stop.cancelled() => false,
        _ = q.arrival() => true,
        _ = tokio::time::sleep(d) => true,
    }
}

/// Back-off between polls of an empty queue: doubles from 50 ms up to the peek interval.
#[derive(Debug)]
pub(crate) struct Backoff {
    current_ms: AtomicU64,
}

const FIRST_BACKOFF_MS: u64 = 50;
/// The back-off past which a notified queue's receiver waits its whole idle interval.
const FOLLOW_UP_MS: u64 = 1_000;

impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff {
            current_ms: AtomicU64::new(FIRST_BACKOFF_MS),
        }
    }

    /// A back-off that starts at its longest wait (for a queue not yet seen busy).
    pub(crate) fn idle() -> Self {
        let backoff = Backoff::new();
        backoff.rest();
        backoff
    }

    /// The next wait of an idle receiver of `q`: as [`Backoff::next`] up to its idle peek
    /// interval, except that a queue that peeks rarely ([`QueueRuntime::peeks_rarely`]) goes
    /// straight to that interval once the quick follow-up after activity (50 ms doubling,
    /// about 1.5 s) is over: it need not creep up to it in doublings, a peek each.
    pub(crate) fn next_idle(&self, q: &QueueRuntime) -> Duration {
        let max = q.idle_peek_interval();
        if q.peeks_rarely() && self.current_ms.load(Ordering::Relaxed) >= FOLLOW_UP_MS {
            let max_ms = max.as_millis().max(1) as u64;
            self.current_ms.store(max_ms, Ordering::Relaxed);
            return max;
        }
        self.next(max)
    }

    /// The next wait, capped by `max`.
    pub(crate) fn next(&self, max: Duration) -> Duration {
        let max_ms = max.as_millis().max(1) as u64;
        let current = self.current_ms.load(Ordering::Relaxed).min(max_ms);
        self.current_ms
            .store((current * 2).min(max_ms), Ordering::Relaxed);
        Duration::from_millis(current)
    }

    pub(crate) fn reset(&self) {
        self.current_ms.store(FIRST_BACKOFF_MS, Ordering::Relaxed);
    }

    /// Back to its longest wait, as [`Backoff::idle`] starts: no quick follow-up is owed.
    pub(crate) fn rest(&self) {
        self.current_ms.store(u64::MAX / 4, Ordering::Relaxed);
    }
}

/// Parks the loops of an empty queue: one of them (the poller) peeks with back-off, the rest
/// wait until the poller finds messages.
pub(crate) struct IdlePolling {
    poller_taken: AtomicBool,
    parked: AtomicU32,
    found_work: Notify,
    backoff: Backoff,
}

impl IdlePolling {
    pub(crate) fn new() -> Self {
        IdlePolling {
            poller_taken: AtomicBool::new(false),
            parked: AtomicU32::new(0),
            found_work: Notify::new(),
            backoff: Backoff::new(),
        }
    }

    /// Called when a loop got a message: resets the back-off and wakes parked loops.
    pub(crate) fn work_found(&self) {
        self.backoff.reset();
        if self.parked.load(Ordering::SeqCst) > 0 {
            self.found_work.notify_waiters();
        }
    }

    /// Returns when the queue may have messages again (or shutdown began: false).
    pub(crate) async fn wait_for_work(&self, q: &QueueRuntime, ctx: &ReceiveContext) -> bool {
        if self
            .poller_taken
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let depth = self.poll(q, ctx).await;
            self.poller_taken.store(false, Ordering::SeqCst);
            if let Some(depth) = depth {
                self.wake_for(depth);
            }
            return depth.is_some();
        }
        let woken = self.found_work.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        self.parked.fetch_add(1, Ordering::SeqCst);
        // The poller may have left just before we parked; do not sleep forever on its behalf.
        let result = if !self.poller_taken.load(Ordering::SeqCst) {
            true
        } else {
            tokio::select! {
                _ = &mut woken => true,
                _ = ctx.stop.cancelled() => false,
            }
        };
        self.parked.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// After a peek saw `depth` messages: wakes as many parked loops as there are messages
    /// beyond the poller's own, and leaves the back-off alone. Only a receive that gets a
    /// message resets it ([`IdlePolling::work_found`]): a peek can count messages no receive
    /// can take (an ordered queue's rows waiting for their key, rows another host took
    /// first), and resetting on the peek made a key waiting on a long handler cost a peek
    /// every 50 ms and a receive from every loop after each (8 400 receives a minute at 8).
    fn wake_for(&self, depth: u64) {
        let parked = u64::from(self.parked.load(Ordering::SeqCst));
        for _ in 0..depth.saturating_sub(1).min(parked) {
            self.found_work.notify_one();
        }
    }

    /// Peeks with back-off until the queue shows messages; returns how many (None when
    /// shutdown began).
    async fn poll(&self, q: &QueueRuntime, ctx: &ReceiveContext) -> Option<u64> {
        loop {
            let wait = self.backoff.next_idle(q);
            if !idle_pause(ctx, q, wait).await {
                return None;
            }
            match q.peek(ctx.transport.as_ref()).await {
                Ok(0) => {}
                Ok(depth) => return Some(depth),
                Err(wait) => {
                    if !pause(ctx, wait).await {
                        return None;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_peek_interval() {
        let b = Backoff::new();
        let max = Duration::from_millis(1000);
        let waits: Vec<u128> = (0..7).map(|_| b.next(max).as_millis()).collect();
        assert_eq!(waits, vec![50, 100, 200, 400, 800, 1000, 1000]);
        b.reset();
        assert_eq!(b.next(max).as_millis(), 50);
    }
}
