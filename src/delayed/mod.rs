//! The mover of a queue's delayed table: moves due messages into the queue.
//!
//! One task per receiving queue with delayed delivery (`[queues.delayed_delivery]`). Each turn
//! moves up to `batch_size` due messages in one transaction
//! ([`DelayedDelivery::move_due`](crate::transport::DelayedDelivery::move_due)). A full batch is followed at once by the next; otherwise
//! the mover waits, as NServiceBus's does: 500 ms doubling to 60 s while nothing is due,
//! shortened to the next due time the table reported and to any earlier one this process
//! stored since ([`Schedule::due_in`], told by the publisher). On several hosts the database
//! lets one mover per queue work at a time; the others find its lock taken and wait their
//! turn. Failures are logged once per run of them and retried with the same back-off, so a
//! database that is down costs one statement per minute at most.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::QueueMetrics;
use crate::transport::{Moved, QueueName, Transport};

pub(crate) mod sweep;

/// The first wait when nothing is due.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait (also the longest a message stored by another process may wait past its
/// due time before this host moves it).
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Where a queue's mover is told of messages this process stored, so it wakes in time.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    wakes: Mutex<HashMap<QueueName, Arc<Wake>>>,
}

/// One mover's wake-up: the earliest due time told since it last looked.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    notify: Notify,
    earliest: Mutex<Option<Instant>>,
    /// The count of messages in the table, which this process's stores raise between reads
    /// (the mover and the sweeper set it from the table).
    waiting: Mutex<Option<Arc<AtomicU64>>>,
}

impl Wake {
    /// The earliest due time told since the last call, cleared.
    fn take(&self) -> Option<Instant> {
        self.earliest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

impl Schedule {
    /// The wake-up of `queue`'s mover (made on first use).
    pub(crate) fn wake(&self, queue: &QueueName) -> Arc<Wake> {
        self.wakes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_default()
            .clone()
    }

    /// A message was stored in `queue`'s delayed table, due after `delay`: its mover, if
    /// this process runs one, looks no later than then, and the table's count (which the
    /// database size includes) holds it until the next read.
    pub(crate) fn due_in(&self, queue: &QueueName, delay: Duration) {
        let Some(wake) = self
            .wakes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .cloned()
        else {
            return;
        };
        if let Some(waiting) = &*wake.waiting.lock().unwrap_or_else(|e| e.into_inner()) {
            waiting.fetch_add(1, Ordering::Relaxed);
        }
        wake.due_in(delay);
    }
}

impl Wake {
    /// Where this process's stores count the table's messages between reads.
    pub(crate) fn count_into(&self, waiting: Arc<AtomicU64>) {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(waiting);
    }

    /// Something in the mover's table is due after `delay`: it looks no later than then.
    pub(crate) fn due_in(&self, delay: Duration) {
        let due = Instant::now() + delay;
        {
            let mut earliest = self.earliest.lock().unwrap_or_else(|e| e.into_inner());
            if earliest.is_some_and(|e| e <= due) {
                return;
            }
            *earliest = Some(due);
        }
        self.notify.notify_one();
    }
}

/// How long a swept mover waits when nothing it knows of is due: the sweeper tells it of
/// what comes (and a move now and then costs nothing that matters).
pub(crate) const SWEPT_IDLE: Duration = Duration::from_secs(3600);

/// The wait after a move: none after a full batch; otherwise the back-off (doubled from the
/// last one while nothing moves, back to the first after a move), no later than the next
/// due time the table reported. A swept mover (`swept`: the host's sweeper reads its table)
/// does not back off: it waits for the next due time it knows of, or to be told.
pub(crate) fn next_wait(last: Duration, moved: &Moved, batch: u32, swept: bool) -> Duration {
    if !moved.busy && moved.moved >= u64::from(batch.max(1)) {
        return Duration::ZERO;
    }
    if swept {
        return match moved.next_due_in {
            Some(due) if !moved.busy => due.max(Duration::from_millis(5)),
            _ => SWEPT_IDLE,
        };
    }
    let backoff = if moved.moved > 0 {
        FIRST_BACKOFF
    } else {
        (last * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF)
    };
    match moved.next_due_in {
        // A busy table belongs to another host's mover: no hurry for what it will move.
        Some(due) if !moved.busy => backoff.min(due.max(Duration::from_millis(5))),
        _ => backoff,
    }
}

/// Whether a queue's delayed table is being moved, for `/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DelayedMoves {
    /// Moved: by this instance, or by the one that leads the queue (or the queue keeps its
    /// delayed messages in another queue's table).
    Moving,
    /// This instance's moves fail (the log names the error): due messages wait.
    Failing,
    /// No instance alive that receives from the queue moves its delayed table (delayed
    /// delivery is off on each): delayed messages sent to it wait until one does.
    Nobody,
}

/// What the mover and the fleet's leads tell of a queue's delayed table.
#[derive(Debug, Default)]
pub(crate) struct MovesHealth {
    failing: AtomicBool,
    unmoved: AtomicBool,
}

impl MovesHealth {
    /// The mover's statements fail (true) or work again.
    pub(crate) fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::Relaxed);
    }

    /// Whether this instance's moves fail now.
    pub(crate) fn is_failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// Nobody moves the table (true) or somebody does; returns whether that changed.
    pub(crate) fn set_unmoved(&self, unmoved: bool) -> bool {
        self.unmoved.swap(unmoved, Ordering::Relaxed) != unmoved
    }

    /// The table's state now.
    pub(crate) fn reading(&self) -> DelayedMoves {
        if self.unmoved.load(Ordering::Relaxed) {
            DelayedMoves::Nobody
        } else if self.failing.load(Ordering::Relaxed) {
            DelayedMoves::Failing
        } else {
            DelayedMoves::Moving
        }
    }
}

/// What a mover moves and where it reports.
pub(crate) struct MoverOf {
    /// The queue whose delayed table it moves.
    pub queue: QueueName,
    /// Due messages per transaction.
    pub batch: u32,
    /// The queue's metrics (moved, waiting, next due).
    pub metrics: Arc<QueueMetrics>,
    /// Messages in the delayed table as last read (the database size counts them).
    pub waiting: Arc<AtomicU64>,
    /// Whether this mover polls (this instance leads the queue, `fleet::lead`); when it does
    /// not, it moves only at the due times this process was told of, and the leader's polls
    /// move what other processes scheduled.
    pub polls: Arc<AtomicBool>,
    /// Where it says whether its moves fail.
    pub health: Arc<MovesHealth>,
    /// The host's sweeper reads its table ([`sweep`]) and tells it when something is due:
    /// it does not poll on its own.
    pub swept: bool,
}

/// How often a mover that does not poll looks whether it has come to lead its queue.
const LEAD_CHECK: Duration = Duration::from_secs(1);

/// Runs the mover of a queue's delayed table until `stop`.
pub(crate) async fn run_mover(
    transport: Arc<dyn Transport>,
    of: MoverOf,
    wake: Arc<Wake>,
    stop: CancellationToken,
) {
    let (queue, batch, metrics) = (&of.queue, of.batch, &of.metrics);
    let Some(delayed) = transport.delayed_delivery() else {
        return;
    };
    let mut wait = Duration::ZERO;
    // A swept mover moves when the sweeper (or this process) tells it something is due.
    let mut next_move = match of.swept {
        true => Instant::now() + SWEPT_IDLE,
        false => Instant::now(),
    };
    let mut failing = false;
    let mut following_until: Option<Instant> = None;
    loop {
        if !wait_for_turn(&of, &wake, &stop, next_move, following_until).await {
            return;
        }
        // A due time this process was told of is followed through for a while (a move that
        // came a little early, or found the table busy, looks again at the table's next due
        // time), whether or not this mover polls.
        if let Some(due) = wake.take() {
            following_until = Some(due.max(Instant::now()) + LEAD_CHECK);
        }
        if stop.is_cancelled() {
            return;
        }
        match delayed.move_due(queue, batch).await {
            Ok(moved) => {
                if failing {
                    tracing::info!(queue = %queue, "moving due delayed messages works again");
                    failing = false;
                    metrics.delayed_moves_failing.set(0.0);
                    of.health.set_failing(false);
                }
                record_moved(&of, &moved);
                wait = next_wait(wait, &moved, batch, of.swept);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(queue = %queue, error = %e,
                        "cannot move due delayed messages into the queue; retrying with back-off");
                    failing = true;
                    metrics.delayed_moves_failing.set(1.0);
                    of.health.set_failing(true);
                }
                wait = (wait * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
            }
        }
        next_move = Instant::now() + wait;
    }
}

/// Waits until the next move, or an earlier due time this process tells of. A mover that
/// does not poll looks again every LEAD_CHECK whether it has come to lead the queue. False
/// once `stop` is cancelled.
async fn wait_for_turn(
    of: &MoverOf,
    wake: &Wake,
    stop: &CancellationToken,
    next_move: Instant,
    following_until: Option<Instant>,
) -> bool {
    loop {
        let told = *wake.earliest.lock().unwrap_or_else(|e| e.into_inner());
        let polling =
            of.polls.load(Ordering::Relaxed) || following_until.is_some_and(|t| Instant::now() < t);
        let next = match polling {
            true => next_move,
            false => Instant::now() + LEAD_CHECK,
        };
        let until = told.map_or(next, |t| t.min(next));
        if until <= Instant::now() && (polling || told.is_some()) {
            return true;
        }
        tokio::select! {
            _ = stop.cancelled() => return false,
            _ = tokio::time::sleep_until(until) => {}
            _ = wake.notify.notified() => {}
        }
    }
}

/// A move's numbers into the queue's gauges and counters, and what waits for the lead's
/// decision.
fn record_moved(of: &MoverOf, moved: &Moved) {
    of.metrics.delayed_moved.increment(moved.moved);
    record_table(&of.waiting, &of.metrics, moved.waiting, moved.next_due_in);
    if moved.moved > 0 {
        tracing::debug!(queue = %of.queue, moved = moved.moved, "due delayed messages moved into the queue");
    }
}

/// What a read of a delayed table found (a move's, or a sweep's): its count for the database
/// size, and the queue's gauges.
fn record_table(
    waiting: &AtomicU64,
    metrics: &QueueMetrics,
    count: u64,
    next_due_in: Option<Duration>,
) {
    waiting.store(count, Ordering::Relaxed);
    metrics.delayed_messages.set(count as f64);
    metrics
        .delayed_next_due
        .set(next_due_in.map_or(0.0, |d| d.as_secs_f64()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(n: u64, next: Option<u64>) -> Moved {
        Moved {
            moved: n,
            next_due_in: next.map(Duration::from_millis),
            ..Moved::default()
        }
    }

    #[test]
    fn the_wait_doubles_while_nothing_is_due_and_stops_at_the_next_due_time() {
        let mut wait = Duration::ZERO;
        let mut waits = Vec::new();
        for _ in 0..10 {
            wait = next_wait(wait, &moved(0, None), 100, false);
            waits.push(wait.as_millis());
        }
        assert_eq!(
            waits,
            vec![
                500, 1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000
            ]
        );
        assert_eq!(
            next_wait(wait, &moved(100, None), 100, false),
            Duration::ZERO,
            "full batch"
        );
        assert_eq!(next_wait(wait, &moved(3, None), 100, false), FIRST_BACKOFF);
        assert_eq!(
            next_wait(wait, &moved(0, Some(1200)), 100, false),
            Duration::from_millis(1200),
            "the next due time comes first"
        );
        let busy = Moved {
            busy: true,
            ..moved(0, Some(10))
        };
        assert_eq!(
            next_wait(Duration::from_secs(8), &busy, 100, false),
            Duration::from_secs(16)
        );
    }

    /// A swept mover never backs off into polling: it waits for the next due time it knows
    /// of, or to be told, and still follows a full batch at once.
    #[test]
    fn a_swept_mover_waits_for_what_it_knows_is_due() {
        let wait = Duration::from_secs(4);
        assert_eq!(next_wait(wait, &moved(0, None), 100, true), SWEPT_IDLE);
        assert_eq!(next_wait(wait, &moved(3, None), 100, true), SWEPT_IDLE);
        assert_eq!(
            next_wait(wait, &moved(0, Some(90_000)), 100, true),
            Duration::from_secs(90),
            "a due time past the back-off's cap is waited for, not polled towards"
        );
        assert_eq!(
            next_wait(wait, &moved(100, None), 100, true),
            Duration::ZERO
        );
        let busy = Moved {
            busy: true,
            ..moved(0, Some(10))
        };
        assert_eq!(next_wait(wait, &busy, 100, true), SWEPT_IDLE);
    }
}
