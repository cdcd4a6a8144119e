//! `model = "monitor"` (default): the NServiceBus SQL transport 3.0+ pump.
//!
//! One peeker per queue estimates the depth (rows not locked by in-flight receives), then
//! starts one receive task per estimated message, each as soon as the queue's gate has a free
//! permit, so no more than the effective limit run at once. It then waits until every started
//! task has executed its receive, or one came back empty, before peeking again: re-peeking
//! earlier would count rows those tasks are about to take and start receives that find nothing
//! (the "empty receive flood" of NServiceBus.SqlServer #1614 / #1412). An empty queue is peeked
//! once per `peek_interval`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

use super::{
    Permit, QueueRuntime, ReceiveContext, ReceiveOutcome, admit_and_receive, pause, process,
};

/// Starts the peeker.
pub fn start(q: Arc<QueueRuntime>, ctx: Arc<ReceiveContext>) {
    let tasks = ctx.tasks.clone();
    tasks.spawn(peek_loop(q, ctx));
}

/// Counts receive tasks of one batch until each has run its receive, or one found nothing.
#[derive(Default)]
struct Batch {
    pending: AtomicUsize,
    exhausted: AtomicBool,
    changed: Notify,
}

impl Batch {
    fn start_one(&self) {
        self.pending.fetch_add(1, Ordering::AcqRel);
    }

    fn received(&self, found_nothing: bool) {
        if found_nothing {
            self.exhausted.store(true, Ordering::Release);
        }
        self.pending.fetch_sub(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// A follow-on receive found the queue empty: start no more receives in this batch.
    fn exhaust(&self) {
        self.exhausted.store(true, Ordering::Release);
        self.changed.notify_waiters();
    }

    fn exhausted(&self) -> bool {
        self.exhausted.load(Ordering::Acquire)
    }

    async fn wait(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.exhausted() || self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            changed.await;
        }
    }
}

async fn peek_loop(q: Arc<QueueRuntime>, ctx: Arc<ReceiveContext>) {
    q.loops.store(1, Ordering::Relaxed);
    while !ctx.stop.is_cancelled() {
        let depth = match ctx.transport.peek_depth(&q.name).await {
            Ok(depth) => {
                q.breaker.success();
                q.depth.set(depth);
                depth
            }
            Err(e) => {
                q.metrics.receive_error.increment(1);
                let wait = q.breaker.failure(&e);
                if !pause(&ctx, wait).await {
                    break;
                }
                continue;
            }
        };
        if depth == 0 {
            if !pause(&ctx, q.settings().peek_interval).await {
                break;
            }
            continue;
        }
        // While the breaker is triggered, one receive per peek.
        let size = if q.breaker.is_triggered() { 1 } else { depth };
        let batch = Arc::new(Batch::default());
        for _ in 0..size {
            if batch.exhausted() {
                break;
            }
            let permit = tokio::select! {
                p = q.gate.acquire() => p,
                _ = batch.wait_exhausted() => break,
                _ = ctx.stop.cancelled() => break,
            };
            batch.start_one();
            ctx.tasks
                .spawn(receive_task(q.clone(), ctx.clone(), permit, batch.clone()));
        }
        tokio::select! {
            _ = batch.wait() => {}
            _ = ctx.stop.cancelled() => break,
        }
    }
    q.loops.store(0, Ordering::Relaxed);
}

impl Batch {
    async fn wait_exhausted(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.exhausted() {
                return;
            }
            changed.await;
        }
    }
}

async fn receive_task(
    q: Arc<QueueRuntime>,
    ctx: Arc<ReceiveContext>,
    permit: Permit,
    batch: Arc<Batch>,
) {
    match admit_and_receive(&q, &ctx).await {
        ReceiveOutcome::Got(received) => {
            batch.received(false);
            match process(&q, &ctx, received, || {}).await {
                Some(ReceiveOutcome::Empty) | Some(ReceiveOutcome::Stopped) => batch.exhaust(),
                Some(ReceiveOutcome::Failed(wait)) => {
                    batch.exhaust();
                    pause(&ctx, wait).await;
                }
                Some(ReceiveOutcome::Got(_)) | None => {}
            }
        }
        ReceiveOutcome::Empty => batch.received(true),
        ReceiveOutcome::Failed(wait) => {
            batch.received(true);
            // Hold the permit through the pause: a failing transport gets fewer receives.
            pause(&ctx, wait).await;
        }
        ReceiveOutcome::Stopped => batch.received(true),
    }
    drop(permit);
}
