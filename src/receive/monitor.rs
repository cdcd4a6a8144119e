//! `model = "monitor"` (default): the NServiceBus SQL transport 3.0+ pump.
//!
//! One peeker per queue estimates the depth (rows not locked by in-flight receives), then
//! starts one receive task per estimated message, each as soon as the queue's gate has a free
//! permit, so no more than the effective limit run at once. It then waits until every started
//! task has executed its receive, or one came back empty, before peeking again: re-peeking
//! earlier would count rows those tasks are about to take and start receives that find nothing
//! (the "empty receive flood" of NServiceBus.SqlServer #1614 / #1412). An empty queue is peeked
//! once per `peek_interval`; right after messages were seen, sooner (50 ms doubling). A queue
//! whose every arrival the transport tells of, drained until a receive found it empty, is
//! peeked once more when the batch's tasks have all ended, for messages they gave back, and is
//! then idle.
//!
//! Each receive task waits the delivery throttle *before* it takes a gate permit, so tasks
//! waiting out a delay hold no slot and a delay that ends releases no more receives than the
//! current limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::{Backoff, QueueRuntime, ReceiveContext, Turn, idle_pause, pause, turn};

/// Counts receive tasks of one batch until each has run its receive, or one found nothing.
struct Batch(watch::Sender<BatchState>);

#[derive(Debug, Default, Clone, Copy)]
struct BatchState {
    /// Started tasks that have not run their receive yet.
    pending: usize,
    /// A receive found the queue empty: start no more receives in this batch.
    exhausted: bool,
    /// Receives that brought a message.
    got: usize,
    /// A receive found the queue empty (not one that failed).
    found_empty: bool,
}

/// How a batch of receives ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// No receive brought a message.
    Nothing,
    /// Messages came, and a receive then found the queue empty.
    Drained,
    /// Messages came, and no receive found the queue empty: more may wait.
    Busy,
}

impl Batch {
    fn new() -> Self {
        Batch(watch::Sender::new(BatchState::default()))
    }

    fn start_one(&self) {
        self.0.send_modify(|s| s.pending += 1);
    }

    fn received(&self, found_nothing: bool) {
        self.0.send_modify(|s| {
            s.pending -= 1;
            s.exhausted |= found_nothing;
            s.got += usize::from(!found_nothing);
        });
    }

    /// A receive failed: start no more receives in this batch.
    fn exhaust(&self) {
        self.0
            .send_if_modified(|s| !std::mem::replace(&mut s.exhausted, true));
    }

    /// A receive found the queue empty: start no more receives in this batch.
    fn found_empty(&self) {
        self.0.send_if_modified(|s| {
            let changed = !s.exhausted || !s.found_empty;
            s.exhausted = true;
            s.found_empty = true;
            changed
        });
    }

    fn exhausted(&self) -> bool {
        self.0.borrow().exhausted
    }

    fn ended(&self) -> Ended {
        let state = self.0.borrow();
        match (state.got, state.found_empty) {
            (0, _) => Ended::Nothing,
            (_, true) => Ended::Drained,
            (_, false) => Ended::Busy,
        }
    }

    /// Returns once every started task has received, or the batch is exhausted.
    async fn wait(&self) {
        self.wait_until(|s| s.exhausted || s.pending == 0).await;
    }

    async fn wait_exhausted(&self) {
        self.wait_until(|s| s.exhausted).await;
    }

    async fn wait_until(&self, done: impl FnMut(&BatchState) -> bool) {
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = self.0.subscribe().wait_for(done).await;
    }
}

/// Runs the peeker until receiving stops.
pub(crate) async fn run(q: Arc<QueueRuntime>, ctx: Arc<ReceiveContext>) {
    q.set_loops(1);
    let mut slots = Slots::new(q.settings().max);
    // Idle from the start: one peek per peek_interval. After messages were seen, the next
    // empty peeks come sooner (50 ms doubling), so a trickle of messages, or a queue that
    // looked empty because its rows were locked by receives just started, is followed closely
    // instead of collecting for a whole interval and starting all at once.
    let backoff = Backoff::idle();
    while !ctx.stop.is_cancelled() {
        let depth = match q.peek(ctx.transport.as_ref()).await {
            Ok(depth) => depth,
            Err(wait) => {
                if !pause(&ctx, wait).await {
                    break;
                }
                continue;
            }
        };
        let ended = match depth {
            0 => Ended::Nothing,
            _ => {
                let batch = start_receives(&q, &ctx, &mut slots, depth).await;
                tokio::select! {
                    _ = batch.wait() => {}
                    _ = ctx.stop.cancelled() => break,
                }
                batch.ended()
            }
        };
        if ended == Ended::Drained && q.empty_receive_settles() {
            // A receive found the queue empty and every arrival is told of: a peek now, and
            // the quick ones after it, would find what that receive found. Only messages this
            // host still holds can come back without an insert (rolled back for a retry,
            // given back): once its receive tasks have all ended, one peek looks for those,
            // and the queue is idle from there. 1 000 queues drained at once otherwise peeked
            // six times each on the way to idle, one statement each.
            backoff.rest();
            if !slots.settle(&q, &ctx).await {
                break;
            }
        } else if ended != Ended::Nothing {
            backoff.reset();
        } else if !idle_pause(&ctx, &q, backoff.next_idle(&q)).await {
            // An empty queue, or a peek that counted messages no receive could take: rows of
            // an ordered queue waiting for their key's message in a handler, or rows another
            // host took first. Peeking again at once spun a peek and a receive back to back
            // for as long as a key waited; this backs off as an empty queue does.
            break;
        }
    }
    q.set_loops(0);
}

/// Starts one receive task per message the peek counted (per batch of messages while
/// batches can form; one while the circuit breaker is triggered), each as a slot frees, and
/// stops starting them once a receive finds the queue empty. Returns the batch to wait on.
async fn start_receives(
    q: &Arc<QueueRuntime>,
    ctx: &Arc<ReceiveContext>,
    slots: &mut Slots,
    depth: u64,
) -> Arc<Batch> {
    // While batches can form, a receive takes up to receive_batch messages, and fewer
    // receive tasks are outstanding, or their permits would split the batches.
    let settings = q.settings();
    let batching = settings.receive_batch > 1 && ctx.throttle.delivery.is_open();
    slots.follow(q, batching);
    let batch_size = if batching {
        u64::from(settings.receive_batch)
    } else {
        1
    };
    let size = if q.breaker().is_triggered() {
        1
    } else {
        depth.div_ceil(batch_size)
    };
    let batch = Arc::new(Batch::new());
    for _ in 0..size {
        if batch.exhausted() {
            break;
        }
        let Some(slot) = slots.take(q, ctx, &batch, batching).await else {
            break;
        };
        batch.start_one();
        ctx.tasks
            .spawn(receive_task(q.clone(), ctx.clone(), slot, batch.clone()));
    }
    batch
}

/// The receive tasks a queue may have outstanding (waiting out a delay, waiting for a gate
/// permit, or running): bounded by max, while the gate bounds those that run by the
/// effective limit.
struct Slots {
    semaphore: Arc<Semaphore>,
    count: u32,
}

impl Slots {
    fn new(max: u32) -> Self {
        Slots {
            semaphore: Arc::new(Semaphore::new(max as usize)),
            count: max,
        }
    }

    /// Follows the queue's max (fewer while batches can form): more slots at once; fewer
    /// as free slots can be taken back.
    fn follow(&mut self, q: &QueueRuntime, batching: bool) {
        let settings = q.settings();
        let target = settings.receivers_for(settings.max, batching).max(1);
        if target > self.count {
            self.semaphore.add_permits((target - self.count) as usize);
            self.count = target;
        } else if target < self.count {
            let forgotten = self
                .semaphore
                .forget_permits((self.count - target) as usize);
            self.count -= forgotten as u32;
        }
    }

    /// Returns once every receive task has ended (each gives its slot back after its last
    /// message was committed or given back), or at an arrival; false when shutdown began.
    async fn settle(&self, q: &QueueRuntime, ctx: &ReceiveContext) -> bool {
        tokio::select! {
            all = self.semaphore.acquire_many(self.count) => {
                drop(all);
                true
            }
            _ = q.arrival() => true,
            _ = ctx.stop.cancelled() => false,
        }
    }

    /// A free slot; None when the batch ran dry or shutdown began first. A reload that raises
    /// max while every slot is taken adds slots now, not after this batch ends (a deep
    /// queue's batch can last minutes).
    async fn take(
        &mut self,
        q: &QueueRuntime,
        ctx: &ReceiveContext,
        batch: &Batch,
        batching: bool,
    ) -> Option<OwnedSemaphorePermit> {
        loop {
            let reconfigured = q.reconfigured();
            tokio::select! {
                s = self.semaphore.clone().acquire_owned() => return s.ok(),
                _ = batch.wait_exhausted() => return None,
                _ = ctx.stop.cancelled() => return None,
                _ = reconfigured => self.follow(q, batching),
            }
        }
    }
}

async fn receive_task(
    q: Arc<QueueRuntime>,
    ctx: Arc<ReceiveContext>,
    slot: OwnedSemaphorePermit,
    batch: Arc<Batch>,
) {
    // The same turn the loops of the other models take; what follows an empty or failed
    // receive is this model's: the batch stops, and the peeker backs off.
    let got = AtomicBool::new(false);
    let turn = turn(
        &q,
        &ctx,
        || {
            got.store(true, Ordering::Relaxed);
            batch.received(false);
        },
        || {},
    )
    .await;
    if !got.load(Ordering::Relaxed) {
        // No message: the first receive found nothing, failed, or never ran (shutdown).
        batch.received(true);
    }
    match turn {
        Turn::Stop | Turn::Handled => {}
        Turn::Empty => batch.found_empty(),
        Turn::Failed(wait) => {
            batch.exhaust();
            // Hold the slot through the pause: a failing transport gets fewer receives.
            pause(&ctx, wait).await;
        }
    }
    drop(slot);
}
