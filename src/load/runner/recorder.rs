//! The recorder: every controller tick with the phase that ran, and the latencies the simulated
//! handlers saw.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::handlers::SimulateHandler;
use crate::host::HostHandle;
use crate::load::record::Sample;
use crate::throttling::Snapshot;

use super::ledger::Ledger;

/// Records every controller tick (subscribed to its decisions, not sampled on a timer of
/// its own), labelled with the phase that was running.
pub(super) struct Recorder {
    pub(super) samples: Arc<Mutex<Vec<Sample>>>,
    pub(super) phase: Arc<Mutex<String>>,
    pub(super) stop: CancellationToken,
    pub(super) task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    pub(super) fn start(
        host: &HostHandle,
        simulated: &[(String, Arc<SimulateHandler>)],
        started: Instant,
        ledger: Arc<Ledger>,
    ) -> Self {
        let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
        let phase = Arc::new(Mutex::new(String::new()));
        let stop = CancellationToken::new();
        let mut decisions = host.throttling_samples();
        let (samples2, phase2, stop2) = (samples.clone(), phase.clone(), stop.clone());
        let sims: Vec<Arc<SimulateHandler>> = simulated.iter().map(|(_, h)| h.clone()).collect();
        let task = tokio::spawn(async move {
            loop {
                let snapshot = tokio::select! {
                    _ = stop2.cancelled() => return,
                    s = decisions.recv() => s,
                };
                let snapshot = match snapshot {
                    Ok(s) => s,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "the load recorder fell behind the controller");
                        continue;
                    }
                    Err(_) => return,
                };
                let queues = queue_rows(&snapshot);
                let outage = snapshot.readings.downstream.outage.active;
                let sample = Sample {
                    t: started.elapsed().as_secs_f64(),
                    phase: phase2.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                    snapshot,
                    queues,
                    sent: ledger.sent.load(Ordering::Relaxed),
                    done: ledger.done.load(Ordering::Relaxed),
                    calls: sims.iter().map(|s| s.calls()).sum(),
                    outage,
                };
                samples2
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sample);
            }
        });
        Recorder {
            samples,
            phase,
            stop,
            task,
        }
    }

    pub(super) fn set_phase(&self, name: &str) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = name.to_string();
    }

    pub(super) fn latest(&self) -> Option<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .cloned()
    }

    pub(super) async fn finish(self) -> Vec<Sample> {
        self.stop.cancel();
        let _ = self.task.await;
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Each queue at a tick: its name, what its gate allows once the tick is applied (the least
/// of its max, the controller's limit, the downstream guards' limit and this instance's
/// fleet share), in flight and depth.
fn queue_rows(snapshot: &Snapshot) -> Vec<(String, u32, u32, u64)> {
    snapshot
        .queues
        .iter()
        .map(|q| {
            let limit = snapshot
                .decision
                .queue_limits
                .get(&q.load.name)
                .copied()
                .unwrap_or(q.load.max)
                .min(q.load.max)
                .min(q.downstream_limit.unwrap_or(u32::MAX))
                .min(q.fleet_share.unwrap_or(u32::MAX));
            (q.load.name.to_string(), limit, q.load.in_flight, q.depth)
        })
        .collect()
}

/// The latencies of every simulate handler since the last take, sorted.
pub(super) fn take_latencies(simulated: &[Arc<SimulateHandler>]) -> Vec<f32> {
    let mut all: Vec<f32> = simulated.iter().flat_map(|s| s.take_latencies()).collect();
    all.sort_by(f32::total_cmp);
    all
}
