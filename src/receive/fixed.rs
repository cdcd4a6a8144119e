//! `model = "fixed"`: the NServiceBus SQL transport before 2.0. `max` receive loops, each
//! receiving in turn. When the queue runs dry the loops park and one of them polls with
//! back-off (50 ms doubling to `peek_interval`), so an idle queue costs one peek per
//! interval, not one statement per loop. A config reload that raises `max` starts more loops;
//! one that lowers it retires the surplus after their current message.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::task::JoinHandle;

use super::{IdlePolling, QueueRuntime, ReceiveContext, Turn, pause, turn};

/// Starts the loops and the supervisor that follows `max`.
pub(crate) async fn run(q: Arc<QueueRuntime>, ctx: Arc<ReceiveContext>) {
    let idle = Arc::new(IdlePolling::new());
    let mut loops: BTreeMap<u32, JoinHandle<()>> = BTreeMap::new();
    loop {
        let changed = q.reconfigured();
        tokio::pin!(changed);
        changed.as_mut().enable();
        loops.retain(|_, h| !h.is_finished());
        for index in 0..q.settings().max {
            loops.entry(index).or_insert_with(|| {
                q.loop_started();
                ctx.tasks
                    .spawn(receive_loop(index, q.clone(), ctx.clone(), idle.clone()))
            });
        }
        tokio::select! {
            _ = &mut changed => {}
            _ = ctx.stop.cancelled() => return,
        }
    }
}

async fn receive_loop(
    index: u32,
    q: Arc<QueueRuntime>,
    ctx: Arc<ReceiveContext>,
    idle: Arc<IdlePolling>,
) {
    loop {
        if ctx.stop.is_cancelled() || index >= q.settings().max {
            break;
        }
        if !standby(index, &q, &ctx).await {
            break;
        }
        let go_on = match turn(&q, &ctx, || idle.work_found(), || {}).await {
            Turn::Stop => false,
            Turn::Handled => true,
            Turn::Empty => idle.wait_for_work(&q, &ctx).await,
            Turn::Failed(wait) => pause(&ctx, wait).await,
        };
        if !go_on {
            break;
        }
    }
    q.loop_ended();
}

/// With batch receive, a loop beyond those the batches need waits while delivery is open
/// (its permits would split the batches) and takes part while delivery is throttled (each
/// receive is then a single one, waited for alone). Polled every 100 ms: no statement, and a
/// throttled host has all its loops within a tick. False when shutdown began.
async fn standby(index: u32, q: &QueueRuntime, ctx: &ReceiveContext) -> bool {
    loop {
        let settings = q.settings();
        let open = ctx.throttle.delivery.is_open();
        if index < settings.receivers_for(settings.max, open) {
            return true;
        }
        if !pause(ctx, STANDBY_POLL).await {
            return false;
        }
    }
}

const STANDBY_POLL: std::time::Duration = std::time::Duration::from_millis(100);
