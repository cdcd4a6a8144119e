//! `kind = "simulate"`: a handler whose latency, memory, CPU use, thread use and failure rate
//! are set in TOML and may be changed while it runs (load-test phases do).

use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;

use super::{Context, Handler, HandlerError};
use crate::config::{LatencyDistribution, SimulateConfig};

/// The simulate handler.
pub struct SimulateHandler {
    knobs: ArcSwap<SimulateConfig>,
    /// The simulated downstream: `downstream_capacity` permits, remade when it changes.
    downstream: std::sync::Mutex<Option<(u32, std::sync::Arc<tokio::sync::Semaphore>)>>,
    calls: std::sync::atomic::AtomicU64,
    /// Each call's latency in seconds since the last [`SimulateHandler::take_latencies`]
    /// (the load tool reads them per phase).
    latencies: std::sync::Mutex<Vec<f32>>,
}

/// The error a simulated failure returns.
#[derive(Debug, thiserror::Error)]
#[error("simulated failure (failure_rate = {0})")]
pub(super) struct SimulatedFailure(pub f64);

const PAGE: usize = 4096;

/// A poisoned message's failure.
#[derive(Debug, thiserror::Error)]
#[error("simulated poison message ({POISON_HEADER})")]
pub(super) struct PoisonedMessage;

/// A message carrying this header fails every attempt of a simulate handler (the load tool's
/// poisoned messages).
pub const POISON_HEADER: &str = "throttlehost.SimulateFailure";

impl SimulateHandler {
    /// A handler with these knobs.
    pub fn new(knobs: SimulateConfig) -> Self {
        SimulateHandler {
            knobs: ArcSwap::from_pointee(knobs),
            downstream: std::sync::Mutex::new(None),
            calls: std::sync::atomic::AtomicU64::new(0),
            latencies: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The knobs in force.
    pub fn knobs(&self) -> SimulateConfig {
        (**self.knobs.load()).clone()
    }

    /// Changes the knobs; attempts already running keep the old ones.
    pub fn set_knobs(&self, knobs: SimulateConfig) {
        self.knobs.store(std::sync::Arc::new(knobs));
    }

    /// Attempts made so far (calls to the simulated downstream).
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The latencies of the calls since the last take, seconds.
    pub fn take_latencies(&self) -> Vec<f32> {
        std::mem::take(&mut *self.latencies.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The simulated downstream's permits for `capacity` concurrent calls; None: unlimited.
    fn downstream(&self, capacity: u32) -> Option<std::sync::Arc<tokio::sync::Semaphore>> {
        if capacity == 0 {
            return None;
        }
        let mut d = self.downstream.lock().unwrap_or_else(|e| e.into_inner());
        match &*d {
            Some((c, s)) if *c == capacity => Some(s.clone()),
            _ => {
                let s = std::sync::Arc::new(tokio::sync::Semaphore::new(capacity as usize));
                *d = Some((capacity, s.clone()));
                Some(s)
            }
        }
    }

    fn latency(knobs: &SimulateConfig) -> Duration {
        let mean = knobs.latency.as_secs_f64();
        let secs = match knobs.latency_distribution {
            LatencyDistribution::Fixed => mean,
            LatencyDistribution::Uniform => fastrand::f64() * 2.0 * mean,
            LatencyDistribution::Exponential => -mean * (1.0 - fastrand::f64()).ln(),
        };
        Duration::from_secs_f64(secs.max(0.0))
    }
}

/// Memory the handler holds while it works: an anonymous mapping with every page written, so
/// it counts in RSS, and unmapped on drop, so RSS falls as soon as the message is done (heap
/// memory would stay with the allocator and keep RSS high).
fn hold_memory(bytes: u64) -> Option<memmap2::MmapMut> {
    if bytes == 0 {
        return None;
    }
    let mut map = memmap2::MmapMut::map_anon(bytes as usize).ok()?;
    for i in (0..map.len()).step_by(PAGE) {
        map[i] = 1;
    }
    Some(map)
}

fn burn_cpu(d: Duration) {
    let start = std::time::Instant::now();
    let mut x = 0u64;
    while start.elapsed() < d {
        for i in 0..1000u64 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
    }
}

#[async_trait]
impl Handler for SimulateHandler {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let knobs = self.knobs.load_full();
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let called = tokio::time::Instant::now();
        // A downstream of limited capacity: calls past it wait their turn, so latency grows
        // with the calls made at once.
        let served = match self.downstream(knobs.downstream_capacity) {
            Some(permits) => Some(permits.acquire_owned().await?),
            None => None,
        };
        let memory = hold_memory(knobs.memory_per_message.bytes());
        if !knobs.cpu_work.is_zero() {
            burn_cpu(knobs.cpu_work);
        }
        let latency = Self::latency(&knobs);
        if !latency.is_zero() {
            if knobs.blocking {
                // Holding a blocking-pool thread is the point of this knob.
                #[allow(clippy::disallowed_methods)]
                tokio::task::spawn_blocking(move || std::thread::sleep(latency)).await?;
            } else {
                tokio::time::sleep(latency).await;
            }
        }
        drop(memory);
        drop(served);
        {
            let mut latencies = self.latencies.lock().unwrap_or_else(|e| e.into_inner());
            // Bounded: a run that never takes them keeps the last million.
            if latencies.len() < 1 << 20 {
                latencies.push(called.elapsed().as_secs_f32());
            }
        }
        if ctx.message().header(POISON_HEADER).is_some() {
            return Err(Box::new(PoisonedMessage));
        }
        if knobs.failure_rate > 0.0 && fastrand::f64() < knobs.failure_rate {
            return Err(Box::new(SimulatedFailure(knobs.failure_rate)));
        }
        Ok(())
    }

    fn name(&self) -> &str {
        "simulate"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_distributions_have_the_configured_mean() {
        for dist in [
            LatencyDistribution::Fixed,
            LatencyDistribution::Uniform,
            LatencyDistribution::Exponential,
        ] {
            let knobs = SimulateConfig {
                latency: Duration::from_millis(10),
                latency_distribution: dist,
                ..SimulateConfig::default()
            };
            let n = 20_000;
            let mean: f64 = (0..n)
                .map(|_| SimulateHandler::latency(&knobs).as_secs_f64())
                .sum::<f64>()
                / n as f64;
            assert!((mean - 0.010).abs() < 0.0005, "{dist:?}: {mean}");
        }
    }

    #[test]
    fn held_memory_is_resident() {
        let map = hold_memory(8 << 20).unwrap();
        assert_eq!(map.len(), 8 << 20);
        assert!(map.iter().step_by(PAGE).all(|b| *b == 1));
        assert!(hold_memory(0).is_none());
    }
}
