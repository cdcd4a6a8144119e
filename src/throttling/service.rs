//! The throttling loop of a running host. Every sample interval it
//!
//! 1. **senses**: the resource sensor, the host's counters through a [`HostProbe`], the rate
//!    windows, and the backlog's drain rate;
//! 2. **decides**: runs the [`Policy`]'s tick (the controller, with what the delivery ceiling
//!    held since the last tick);
//! 3. **applies**: sets both admissions and hands the queue limits to a [`LimitSink`]; until
//!    the next tick, reads what the ceiling guards every few milliseconds and sets
//!    delivery's allowance from [`Policy::between_ticks`];
//! 4. **exports**: metrics, the status snapshot, and every decision to subscribers (the load
//!    tool records each tick this way, not on a timer of its own).
//!
//! The service knows nothing of receivers, dispatchers or transports. The host
//! implements the two narrow traits. It runs on a thread of its own (see
//! [`crate::isolate::spawn_isolated`]), so handlers that saturate the worker threads cannot delay a tick.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::ceiling::{AdmissionCounts, Usage};
use super::controller::{Decision, MachineFacts, QueueLoad, Readings, Thresholds};
use super::policy::Policy;
use super::rates::{DrainMeter, RateWindow};
use super::sensors::ResourceSensor;
use super::{Clock, Condition, Direction, Throttle};
use crate::config::{OverrideMode, ThrottlingConfig};
use crate::metrics::{HostMetrics, Metrics};
use crate::names::QueueName;

/// A receiving queue at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct QueueReading {
    /// Max and in flight, as the controller sees them.
    #[serde(flatten)]
    pub load: QueueLoad,
    /// Last known depth.
    pub depth: u64,
    /// The limit its gate applies now: the least of its max, the controller's limit, the
    /// downstream guards' limit and this instance's fleet share.
    pub limit: u32,
    /// The limit the queue's downstream guards set (outage mode, latency-aware), if any.
    pub downstream_limit: Option<u32>,
    /// This instance's share of the queue's fleet-wide limit, if it has one.
    pub fleet_share: Option<u32>,
}

/// What the host tells the controller each tick: its counters, read without waiting for I/O
/// (the database size asks for stale depths to be peeked in the background and answers from
/// the last known ones, so a slow database never delays a tick).
pub(crate) trait HostProbe: Send + Sync + 'static {
    /// Messages handed to handlers and not done.
    fn in_process(&self) -> u64;
    /// Database connections in use.
    fn database_sessions(&self) -> u64;
    /// Every receiving queue.
    fn queues(&self) -> Vec<QueueReading>;
    /// Messages in the queues counted as database size, from the last known depths; depths
    /// older than `max_age` are refreshed in the background for a later tick.
    fn database_size(&self, max_age: Duration) -> u64;
    /// What the queues' downstream guards do (outage mode, the latency-aware limit). The
    /// default: none.
    fn downstream(&self) -> crate::throttling::controller::DownstreamGuards {
        Default::default()
    }
}

/// Where the controller's queue limits go.
pub(crate) trait LimitSink: Send + Sync + 'static {
    /// Sets one queue's throttling limit.
    fn set_limit(&self, queue: &QueueName, limit: u32);
}

/// One tick's full picture, for `/status`, the demo table and load-test timelines.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// Throttling switched on.
    pub enabled: bool,
    /// What the controller decided.
    pub decision: Decision,
    /// What it saw.
    pub readings: Readings,
    /// Thresholds in force.
    pub thresholds: Thresholds,
    /// The machine.
    pub machine: MachineFacts,
    /// Every receiving queue at the tick (limit as decided).
    pub queues: Vec<QueueReading>,
}

impl Snapshot {
    /// A tick of a throttling-enabled host without receiving queues: what tools that replay
    /// or simulate decisions build (a host builds its own each tick).
    pub fn of_tick(
        decision: Decision,
        readings: Readings,
        thresholds: Thresholds,
        machine: MachineFacts,
    ) -> Self {
        Snapshot {
            enabled: true,
            decision,
            readings,
            thresholds,
            machine,
            queues: Vec::new(),
        }
    }
}

/// Decisions kept for late subscribers.
const DECISION_BUFFER: usize = 4096;

/// The host's handle on its throttling: settings, overrides, the latest snapshot.
pub(crate) struct ThrottleControl {
    policy: Mutex<Policy>,
    machine: MachineFacts,
    snapshot: ArcSwapOption<Snapshot>,
    reconfigured: tokio::sync::Notify,
    decisions: broadcast::Sender<Arc<Snapshot>>,
}

impl ThrottleControl {
    /// Control for a machine with these facts.
    pub(crate) fn new(config: ThrottlingConfig, machine: MachineFacts) -> Self {
        let thresholds = Thresholds::resolve(&config, machine);
        ThrottleControl {
            policy: Mutex::new(Policy::new(config, thresholds)),
            machine,
            snapshot: ArcSwapOption::empty(),
            reconfigured: tokio::sync::Notify::new(),
            decisions: broadcast::channel(DECISION_BUFFER).0,
        }
    }

    /// Bounds the receives out and messages in process at once, for the delivery ceiling
    /// (see [`super::ceiling::Ceiling::bound_at_once`]).
    pub(crate) fn bound_at_once(&self, at_once: Option<u64>) {
        self.policy().bound_at_once(at_once);
    }

    fn policy(&self) -> std::sync::MutexGuard<'_, Policy> {
        self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the settings (hot reload); delays and limits carry over.
    pub(crate) fn reconfigure(&self, config: ThrottlingConfig) {
        let thresholds = Thresholds::resolve(&config, self.machine);
        self.policy().reconfigure(config, thresholds);
        self.reconfigured.notify_waiters();
    }

    /// Sets a direction's override until the next reload.
    pub(crate) fn set_override(&self, direction: Direction, mode: OverrideMode) {
        self.policy().set_override(direction, mode);
        self.reconfigured.notify_waiters();
    }

    /// The settings in force (overrides included).
    pub(crate) fn config(&self) -> ThrottlingConfig {
        self.policy().config().clone()
    }

    /// The latest snapshot (None before the first tick).
    pub(crate) fn snapshot(&self) -> Option<Arc<Snapshot>> {
        self.snapshot.load_full()
    }

    /// Every snapshot from now on, one per tick.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.decisions.subscribe()
    }
}

/// Everything the loop reads and writes.
pub(crate) struct ServiceParts {
    /// Settings, overrides, snapshot.
    pub control: Arc<ThrottleControl>,
    /// Process and system sensor.
    pub sensor: Box<dyn ResourceSensor>,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Admissions and rate counters.
    pub throttle: Arc<Throttle>,
    /// The host's counters.
    pub probe: Arc<dyn HostProbe>,
    /// Where queue limits go.
    pub limits: Arc<dyn LimitSink>,
    /// Metric registry.
    pub metrics: Metrics,
}

/// Database size is read fresh every tick once it is within this share of its threshold.
const FRESH_DEPTH_SHARE: f64 = 0.8;

/// Runs the loop until `stop` is cancelled.
pub(crate) async fn run(mut parts: ServiceParts, stop: CancellationToken) {
    let host_metrics = parts.metrics.host();
    let mut loop_state = LoopState::starting(parts.clock.now());
    let mut last_upkeep = parts.clock.now();
    let control = parts.control.clone();
    loop {
        let config = control.config();
        let reconfigured = control.reconfigured.notified();
        let snapshot = tick(&mut parts, &config, &mut loop_state);
        export(&host_metrics, &snapshot);
        parts.control.snapshot.store(Some(snapshot.clone()));
        let _ = parts.control.decisions.send(snapshot);
        let now = parts.clock.now();
        if now.saturating_sub(last_upkeep) >= Duration::from_secs(5) {
            parts.metrics.upkeep();
            last_upkeep = now;
        }
        // Until the next tick, the delivery ceiling (when any resource it guards has a
        // threshold).
        let next_tick = tokio::time::Instant::now() + config.sample_interval;
        tokio::pin!(reconfigured);
        loop {
            let step = enforce_ceiling(&mut parts).unwrap_or(config.sample_interval);
            let wake = next_tick.min(tokio::time::Instant::now() + step);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(wake) => {}
                _ = &mut reconfigured => break,
            }
            if tokio::time::Instant::now() >= next_tick {
                break;
            }
        }
    }
}

/// One read of the delivery ceiling: reads what it guards, sets delivery's allowance.
/// Returns when it wants the next read, or None when it guards nothing.
fn enforce_ceiling(parts: &mut ServiceParts) -> Option<Duration> {
    let admission = &parts.throttle.delivery;
    let mut policy = parts.control.policy();
    if !policy.ceiling_armed() {
        admission.allow(None);
        return None;
    }
    // Only what is guarded: the process's own numbers cost one read of a small file; the
    // machine's memory one more.
    let (process_memory, threads, system_memory_used) = if policy.guards(Condition::SystemMemory) {
        let r = parts.sensor.read();
        (r.process_memory, r.threads, r.system_memory_used)
    } else if policy.guards(Condition::ProcessMemory) || policy.guards(Condition::Threads) {
        let p = parts.sensor.process();
        (p.memory, p.threads, 0)
    } else {
        (0, 0, 0)
    };
    let usage = Usage {
        process_memory,
        system_memory_used,
        threads,
        database_sessions: parts.probe.database_sessions(),
        in_process: parts.probe.in_process(),
    };
    let counts = AdmissionCounts {
        started: admission.started(),
        receiving: admission.receiving(),
        // Receives in a delay (an override, a throttling delay) are not held by the ceiling:
        // counted as its holds, they showed a memory condition after its cause had gone.
        held: admission.is_held() && admission.waiting_on_allowance() > 0,
    };
    admission.allow(policy.between_ticks(tokio::time::Instant::now(), usage, counts));
    Some(policy.next_read_in())
}

#[derive(Default)]
struct LoopState {
    windows: [RateWindow; 2],
    drain: DrainMeter,
    last_size: u64,
}

impl LoopState {
    /// The loop's state as the service starts at `now`: the rate windows begin at the
    /// counters' origin, not at the first tick. A host starting on a backlog receives it
    /// within milliseconds, and when its receivers ran before the first tick, the window's
    /// first snapshot already held every receive: it counted none of them, and `cold-start`'s
    /// rate imbalance never engaged (1 release run in 4).
    fn starting(now: Duration) -> Self {
        let mut state = LoopState::default();
        for window in &mut state.windows {
            window.record(now, (0, 0), Duration::ZERO);
        }
        state
    }
}

/// Messages waiting in the queues that could take one now (below their limit): what a
/// delivery pace can be holding back. A queue at its limit holds its own backlog, and counted
/// as the pace's, it kept a relaxing pace at its release line, and the state showing rate
/// imbalance, until that backlog drained (28 a second into 21 handlers of 1 s: 26 s), even
/// with an idle queue beside it.
fn queued_with_room(queues: &[QueueReading]) -> u64 {
    queues
        .iter()
        .filter(|q| q.load.in_flight < q.limit)
        .map(|q| q.depth)
        .sum()
}

/// Messages in process in the queues at their limit (see `Readings::in_process_at_limit`).
fn in_process_at_limit(queues: &[QueueReading]) -> u64 {
    queues
        .iter()
        .filter(|q| q.load.in_flight >= q.limit)
        .map(|q| u64::from(q.load.in_flight))
        .sum()
}

/// Sense, decide (the policy), apply.
fn tick(parts: &mut ServiceParts, config: &ThrottlingConfig, st: &mut LoopState) -> Arc<Snapshot> {
    let now = parts.clock.now();
    let queues = parts.probe.queues();
    let sensed = Readings {
        queued: queued_with_room(&queues),
        in_process_at_limit: in_process_at_limit(&queues),
        ..sense(parts, config, st, now)
    };
    let loads: Vec<QueueLoad> = queues.iter().map(|q| q.load.clone()).collect();
    let (decision, readings, thresholds) = {
        let mut policy = parts.control.policy();
        let (decision, readings) = policy.tick(now, sensed, &loads);
        (decision, readings, *policy.thresholds())
    };
    for direction in Direction::ALL {
        let d = decision.direction(direction);
        parts.throttle.admission(direction).set(d.delay, d.pace);
    }
    for q in &queues {
        if let Some(limit) = decision.queue_limits.get(&q.load.name) {
            parts.limits.set_limit(&q.load.name, *limit);
        }
    }
    Arc::new(Snapshot {
        enabled: config.enabled,
        decision,
        readings,
        thresholds,
        machine: parts.control.machine,
        queues,
    })
}

fn sense(
    parts: &mut ServiceParts,
    config: &ThrottlingConfig,
    st: &mut LoopState,
    now: Duration,
) -> Readings {
    let resources = parts.sensor.read();
    let threshold = config.database_size as f64;
    let near = threshold > 0.0 && st.last_size as f64 >= threshold * FRESH_DEPTH_SHARE;
    let max_age = if near {
        Duration::ZERO
    } else {
        config.database_size_refresh
    };
    let database_size = parts.probe.database_size(max_age);
    st.last_size = database_size;
    let mut readings = Readings {
        process_memory: resources.process_memory,
        system_memory_used: resources.system_memory_used,
        in_process: parts.probe.in_process(),
        threads: resources.threads,
        database_size,
        database_sessions: parts.probe.database_sessions(),
        downstream: parts.probe.downstream(),
        ..Readings::default()
    };
    for direction in Direction::ALL {
        let window = match direction {
            Direction::Delivery => config.delivery.sampling_window,
            Direction::Publishing => config.publishing.sampling_window,
        };
        let totals = parts.throttle.rates(direction).totals();
        let mut reading = st.windows[direction.index()].record(now, totals, window);
        reading.waiting = parts.throttle.admission(direction).waiting();
        match direction {
            Direction::Delivery => readings.delivery = reading,
            Direction::Publishing => readings.publishing = reading,
        }
    }
    let published = parts.throttle.rates(Direction::Publishing).totals().1;
    readings.database_drain_per_sec = st.drain.record(now, published, database_size);
    readings
}

fn export(metrics: &HostMetrics, snapshot: &Snapshot) {
    metrics.samples.increment(1);
    let (readings, thresholds) = (&snapshot.readings, &snapshot.thresholds);
    for direction in Direction::ALL {
        export_direction(metrics, direction, snapshot);
    }
    let off = |t: Option<u64>| t.unwrap_or(0) as f64;
    let pairs = [
        (
            &metrics.process_memory,
            readings.process_memory,
            &metrics.process_memory_threshold,
            thresholds.process_memory,
        ),
        (
            &metrics.system_memory,
            readings.system_memory_used,
            &metrics.system_memory_threshold,
            thresholds.system_memory,
        ),
        (
            &metrics.in_process,
            readings.in_process,
            &metrics.in_process_threshold,
            thresholds.in_process,
        ),
        (
            &metrics.threads,
            readings.threads,
            &metrics.threads_threshold,
            thresholds.threads,
        ),
        (
            &metrics.database_size,
            readings.database_size,
            &metrics.database_size_threshold,
            thresholds.database_size,
        ),
        (
            &metrics.database_sessions,
            readings.database_sessions,
            &metrics.database_sessions_threshold,
            thresholds.database_sessions,
        ),
    ];
    for (value, v, threshold, t) in pairs {
        value.set(v as f64);
        threshold.set(off(t));
    }
}

/// A direction's state, delay, pace, conditions and rates into its gauges.
fn export_direction(metrics: &HostMetrics, direction: Direction, snapshot: &Snapshot) {
    let readings = &snapshot.readings;
    let d = snapshot.decision.direction(direction);
    let m = metrics.direction(direction);
    m.state.set(d.state as f64);
    m.delay.set(d.effective_wait().as_secs_f64());
    m.state_duration.set(d.state_duration.as_secs_f64());
    m.override_mode.set(d.override_mode.code() as f64);
    m.recovering.set(if d.recovering { 1.0 } else { 0.0 });
    m.pace_rate.set(d.pace_rate.unwrap_or(0.0));
    for (condition, gauge) in &m.conditions {
        let active = d.active().any(|c| c.condition == *condition);
        gauge.set(if active { 1.0 } else { 0.0 });
    }
    let rates = match direction {
        Direction::Delivery => readings.delivery,
        Direction::Publishing => readings.publishing,
    };
    m.incoming.set(rates.incoming_per_sec);
    m.outgoing.set(rates.outgoing_per_sec);
    m.waiting.set(rates.waiting as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Receives made before the first tick count in its window.
    #[test]
    fn the_rate_windows_count_from_the_services_start() {
        let mut state = LoopState::starting(Duration::ZERO);
        let window = Duration::from_secs(5);
        let first = state.windows[Direction::Delivery.index()].record(
            Duration::from_millis(3),
            (1000, 0),
            window,
        );
        assert_eq!(first.samples, 1000);
        let unseeded = RateWindow::default().record(Duration::from_millis(3), (1000, 0), window);
        assert_eq!(
            unseeded.samples, 0,
            "a window begun at the first tick misses them"
        );
    }

    #[test]
    fn queues_with_room_and_queues_at_their_limit_are_told_apart() {
        let queue = |name: &str, in_flight, limit, depth| QueueReading {
            load: QueueLoad {
                in_flight,
                ..QueueLoad::idle(QueueName::new(name).expect("a valid name"), 64)
            },
            depth,
            limit,
            downstream_limit: None,
            fleet_share: None,
        };
        let full = queue("orders", 21, 21, 900);
        let idle = queue("invoices", 0, 64, 0);
        let room = queue("shipping", 10, 64, 300);
        assert_eq!(queued_with_room(&[full.clone(), idle.clone()]), 0);
        assert_eq!(
            in_process_at_limit(&[full.clone(), idle.clone(), room.clone()]),
            21
        );
        let cut = queue("billing", 30, 20, 0);
        assert_eq!(in_process_at_limit(&[cut, room.clone()]), 30, "a cut limit");
        assert_eq!(queued_with_room(&[full, idle, room]), 300);
    }
}
