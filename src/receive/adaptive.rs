//! `model = "adaptive"`: the ramp-up controller of the NServiceBus SQL transport 2.1.
//!
//! One loop to start. Each loop counts its consecutive successful and empty receives. A loop
//! with more than `ramp_up_after` successes in a row starts another loop (while there are fewer
//! loops than the queue's effective limit) and starts counting again; a loop with more than
//! `ramp_down_after` empties in a row retires (never the last one). The last loop, once the
//! queue is empty, polls with a peek and back-off up to `peek_interval`.

use std::sync::Arc;

use super::{Backoff, IdlePolling, QueueRuntime, ReceiveContext, Turn, idle_pause, pause, turn};

struct Adaptive {
    q: Arc<QueueRuntime>,
    ctx: Arc<ReceiveContext>,
    idle: IdlePolling,
}

/// Runs the first loop (it adds and retires the others) until receiving stops.
pub(crate) async fn run(q: Arc<QueueRuntime>, ctx: Arc<ReceiveContext>) {
    let adaptive = Arc::new(Adaptive {
        q,
        ctx,
        idle: IdlePolling::new(),
    });
    adaptive.q.set_loops(1);
    receive_loop(adaptive).await;
}

impl Adaptive {
    /// Adds a loop if below the effective limit; true if it did.
    fn ramp_up(self: &Arc<Self>) -> bool {
        let open = self.ctx.throttle.delivery.is_open();
        let limit = self
            .q
            .settings()
            .receivers_for(self.q.gate().effective(), open);
        let grew = self.q.add_loop_below(limit);
        if grew {
            self.ctx.tasks.spawn(receive_loop(self.clone()));
        }
        grew
    }

    /// Removes this loop unless it is the last; true if it should exit.
    fn ramp_down(&self) -> bool {
        self.q.remove_loop_but_last()
    }
}

async fn receive_loop(a: Arc<Adaptive>) {
    let (q, ctx) = (&a.q, &a.ctx);
    let backoff = Backoff::new();
    let mut successes = 0u32;
    let mut empties = 0u32;
    loop {
        if ctx.stop.is_cancelled() {
            break;
        }
        let got = || {
            empties = 0;
            backoff.reset();
            a.idle.work_found();
        };
        let succeeded = || {
            successes += 1;
            if successes > q.settings().ramp_up_after {
                successes = 0;
                a.ramp_up();
            }
        };
        let step = turn(q, ctx, got, succeeded).await;
        let go_on = match step {
            Turn::Stop => false,
            Turn::Handled => true,
            Turn::Empty => {
                successes = 0;
                empties += 1;
                if empties > q.settings().ramp_down_after {
                    if a.ramp_down() {
                        return;
                    }
                    // The last loop: poll cheaply until messages show up.
                    a.idle.wait_for_work(q, ctx).await
                } else {
                    idle_pause(ctx, q, backoff.next_idle(q)).await
                }
            }
            Turn::Failed(wait) => pause(ctx, wait).await,
        };
        if !go_on {
            break;
        }
    }
    q.loop_ended();
}
