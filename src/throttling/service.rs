//! The throttling loop of a running host. Every sample interval it
//!
//! 1. **senses**: the resource sensor, the host's counters through a [`HostProbe`], the rate
//!    windows, and the backlog's drain rate;
//! 2. **decides**: runs the [`Controller`];
//! 3. **applies**: sets both admissions and hands the queue limits to a [`LimitSink`];
//! 4. **exports**: metrics, the status snapshot, and every decision to subscribers (the load
//!    tool records each tick this way, not on a timer of its own).
//!
//! The service is policy: it knows nothing of receivers, dispatchers or transports. The host
//! implements the two narrow traits. It runs on a thread of its own (see
//! [`crate::isolate::spawn_isolated`]), so handlers that saturate the worker threads cannot delay a tick.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::controller::{Controller, Decision, MachineFacts, QueueLoad, Readings, Thresholds};
use super::rates::RateWindow;
use super::sensors::ResourceSensor;
use super::{Clock, Direction, Throttle};
use crate::config::{OverrideMode, ThrottlingConfig};
use crate::metrics::{HostMetrics, Metrics};

/// A receiving queue at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueReading {
    /// Max and in flight, as the controller sees them.
    #[serde(flatten)]
    pub load: QueueLoad,
    /// Last known depth.
    pub depth: u64,
}

/// What the host tells the controller each tick (its counters, read without I/O).
pub trait HostProbe: Send + Sync + 'static {
    /// Messages handed to handlers and not done.
    fn in_process(&self) -> u64;
    /// Database connections in use.
    fn database_sessions(&self) -> u64;
    /// Every receiving queue.
    fn queues(&self) -> Vec<QueueReading>;
    /// Messages in the queues counted as database size, from the last known depths; depths
    /// older than `max_age` are refreshed in the background for a later tick.
    fn database_size(&self, max_age: Duration) -> u64;
}

/// Where the controller's queue limits go.
pub trait LimitSink: Send + Sync + 'static {
    /// Sets one queue's throttling limit.
    fn set_limit(&self, queue: &str, limit: u32);
}

/// One tick's full picture, for `/status`, the demo table and load-test timelines.
#[derive(Debug, Clone, Serialize)]
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

/// Decisions kept for late subscribers.
const DECISION_BUFFER: usize = 4096;

/// The host's handle on its throttling: settings, overrides, the latest snapshot.
pub struct ThrottleControl {
    controller: Mutex<Controller>,
    machine: MachineFacts,
    snapshot: ArcSwapOption<Snapshot>,
    reconfigured: tokio::sync::Notify,
    decisions: broadcast::Sender<Arc<Snapshot>>,
}

impl ThrottleControl {
    /// Control for a machine with these facts.
    pub fn new(config: ThrottlingConfig, machine: MachineFacts) -> Self {
        let thresholds = Thresholds::resolve(&config, machine);
        ThrottleControl {
            controller: Mutex::new(Controller::new(config, thresholds)),
            machine,
            snapshot: ArcSwapOption::empty(),
            reconfigured: tokio::sync::Notify::new(),
            decisions: broadcast::channel(DECISION_BUFFER).0,
        }
    }

    fn controller(&self) -> std::sync::MutexGuard<'_, Controller> {
        self.controller.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the settings (hot reload); delays and limits carry over.
    pub fn reconfigure(&self, config: ThrottlingConfig) {
        let thresholds = Thresholds::resolve(&config, self.machine);
        self.controller().reconfigure(config, thresholds);
        self.reconfigured.notify_waiters();
    }

    /// Sets a direction's override until the next reload.
    pub fn set_override(&self, direction: Direction, mode: OverrideMode) {
        self.controller().set_override(direction, mode);
        self.reconfigured.notify_waiters();
    }

    /// The settings in force (overrides included).
    pub fn config(&self) -> ThrottlingConfig {
        self.controller().config().clone()
    }

    /// The latest snapshot (None before the first tick).
    pub fn snapshot(&self) -> Option<Arc<Snapshot>> {
        self.snapshot.load_full()
    }

    /// Every snapshot from now on, one per tick.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.decisions.subscribe()
    }

    /// The machine the thresholds were resolved for.
    pub fn machine(&self) -> MachineFacts {
        self.machine
    }
}

/// Everything the loop reads and writes.
pub struct ServiceParts {
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

/// How far back the backlog's drain rate is measured.
const DRAIN_WINDOW: Duration = Duration::from_secs(3);
/// Database size is read fresh every tick once it is within this share of its threshold.
const FRESH_DEPTH_SHARE: f64 = 0.8;

/// Estimates how fast the stored backlog drains: messages published minus growth of the
/// backlog, over the last few seconds. It covers consumers in other hosts too.
#[derive(Debug, Default)]
struct DrainMeter {
    history: VecDeque<(Duration, u64, u64)>,
}

impl DrainMeter {
    /// `published`: publishing's outgoing total; `size`: the database size now.
    fn record(&mut self, now: Duration, published: u64, size: u64) -> Option<f64> {
        self.history.push_back((now, published, size));
        while self.history.len() > 2 && self.history[1].0 + DRAIN_WINDOW <= now {
            self.history.pop_front();
        }
        let (t0, p0, s0) = *self.history.front()?;
        let elapsed = now.saturating_sub(t0).as_secs_f64();
        if elapsed < 0.5 {
            return None;
        }
        let inflow = published.saturating_sub(p0) as f64;
        let growth = size as f64 - s0 as f64;
        Some(((inflow - growth) / elapsed).max(0.0))
    }
}

/// Runs the loop until `stop` is cancelled.
pub async fn run(mut parts: ServiceParts, stop: CancellationToken) {
    let host_metrics = parts.metrics.host();
    let mut loop_state = LoopState::default();
    let mut ceiling = Ceiling::default();
    let mut last_upkeep = parts.clock.now();
    let control = parts.control.clone();
    loop {
        let config = control.config();
        let reconfigured = control.reconfigured.notified();
        let snapshot = tick(
            &mut parts,
            &config,
            &mut loop_state,
            ceiling.take_held_room(),
        );
        ceiling.after_tick(&config, &snapshot);
        export(&host_metrics, &snapshot);
        parts.control.snapshot.store(Some(snapshot.clone()));
        let _ = parts.control.decisions.send(snapshot);
        let now = parts.clock.now();
        if now.saturating_sub(last_upkeep) >= Duration::from_secs(5) {
            parts.metrics.upkeep();
            last_upkeep = now;
        }
        // Until the next tick, the memory ceiling (when memory is high enough to need it).
        let next_tick = tokio::time::Instant::now() + config.sample_interval;
        tokio::pin!(reconfigured);
        loop {
            ceiling.enforce(&mut parts);
            let step = if ceiling.is_armed() {
                CEILING_INTERVAL
            } else {
                config.sample_interval
            };
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

/// How often the memory ceiling reads RSS between ticks.
const CEILING_INTERVAL: Duration = Duration::from_millis(5);
/// How long a message admitted by the ceiling counts as not yet resident: its memory shows in
/// RSS only once it has been received and its handler has allocated.
const CEILING_SETTLE: Duration = Duration::from_millis(25);
/// Over how long the ceiling measures what the latest messages added to RSS.
const CEILING_MARGINAL_WINDOW: Duration = Duration::from_millis(50);

/// A hard bound on delivery at the process memory threshold, checked between ticks.
///
/// The controller acts once per tick; when each message starts to cost more (a bigger
/// payload, a handler that holds more), the receives started within one tick can carry RSS
/// far past its threshold before the next tick cuts. The ceiling reads RSS every few
/// milliseconds and lets through only what fits: the room left under the threshold divided
/// by what a message in process holds, less what it admitted in the last [`CEILING_SETTLE`]
/// and that is not resident yet. What a message holds is the larger of two measures: the
/// average (RSS above the idle process, over the messages in process) and the margin (what
/// RSS rose by over the last [`CEILING_MARGINAL_WINDOW`], over the receives admitted a settle
/// time earlier). The average alone lags when messages start to cost more: with 60 cheap
/// messages in process, the first costly ones look cheap, and a burst of them got through. A plain stop at the threshold is not enough: memory freed by one completion
/// would let every waiting receive through at once, and their memory shows only
/// milliseconds later. It never stops the last message (nothing else would free memory).
///
/// Whenever receives wait on it, the controller hears of it at the next tick, with how many
/// messages memory has room for: it shows process memory as active (state 4: throttling that
/// acts is never state 0) and cuts the delivery limits to that room.
#[derive(Debug, Default)]
struct Ceiling {
    /// The threshold, while the ceiling runs.
    armed: Option<u64>,
    /// RSS at the last read with nothing in process.
    idle_rss: Option<u64>,
    /// The queues' limits together at the last tick: the most receives that can be in
    /// process at once, so an allowance this large could not bind.
    limits_total: u64,
    /// Recent reads: when, RSS, and delivery's admissions so far then.
    reads: VecDeque<(tokio::time::Instant, u64, u64)>,
    /// When receives waited on the ceiling since the last tick: the most messages memory was
    /// estimated to have room for meanwhile.
    held_room: Option<u64>,
}

/// What the ceiling measured at one read.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Fit {
    /// How many more receives may start now.
    allowance: u64,
    /// How many messages in process fit under the threshold, at what one holds now.
    room: u64,
}

impl Ceiling {
    /// When receives waited on the ceiling since the last call: the room memory had.
    fn take_held_room(&mut self) -> Option<u64> {
        self.held_room.take()
    }

    /// Arms (or disarms) the ceiling for the time until the next tick.
    fn after_tick(&mut self, config: &ThrottlingConfig, snapshot: &Snapshot) {
        let applies = config.enabled && config.delivery.override_mode != OverrideMode::Never;
        // Always, not only once RSS is near its threshold: what each message costs can jump
        // at once (a new payload), and from a sixth of the threshold, the receives started
        // within one 250 ms tick carried RSS to 1.15 x before the next tick armed it.
        self.armed = snapshot.thresholds.process_memory.filter(|_| applies);
        self.limits_total = snapshot
            .decision
            .queue_limits
            .values()
            .map(|l| u64::from(*l))
            .sum();
    }

    fn is_armed(&self) -> bool {
        self.armed.is_some()
    }

    /// Reads RSS and sets delivery's allowance until the next read.
    fn enforce(&mut self, parts: &mut ServiceParts) {
        let admission = &parts.throttle.delivery;
        let Some(threshold) = self.armed else {
            admission.allow(None);
            self.reads.clear();
            return;
        };
        let now = tokio::time::Instant::now();
        let held = admission.is_held() && admission.waiting() > 0;
        let rss = parts.sensor.process_memory();
        let in_process = parts.probe.in_process();
        if in_process == 0 {
            // What the process holds by itself now, including memory its allocator kept
            // from earlier messages: none of it is freed by messages ending.
            self.idle_rss = Some(rss);
        }
        let admitted = admission.admitted();
        let margin = self.margin(now, rss, admitted);
        // Receives let through within a settle time, whose memory may not show yet.
        let recent = self
            .reads
            .iter()
            .rev()
            .find(|(at, _, _)| now.duration_since(*at) >= CEILING_SETTLE)
            .or(self.reads.front())
            .map_or(0, |(_, _, then)| admitted.saturating_sub(*then));
        let estimate = Estimate {
            idle_rss: self.idle_rss,
            margin,
        };
        let allowance = match fit(threshold, rss, in_process, estimate, recent) {
            Some(fit) => {
                if held {
                    self.held_room = Some(self.held_room.map_or(fit.room, |r| r.max(fit.room)));
                }
                // An allowance no burst could use up leaves admissions on their fast path.
                (fit.allowance < self.limits_total).then_some(fit.allowance)
            }
            None => None,
        };
        admission.allow(allowance);
    }

    /// Records this read and returns what RSS rose by per receive over the last window, from
    /// the receives admitted a settle time before it (whose memory shows in it).
    fn margin(&mut self, now: tokio::time::Instant, rss: u64, admitted: u64) -> Option<f64> {
        let keep = CEILING_MARGINAL_WINDOW + CEILING_SETTLE + CEILING_INTERVAL;
        while self
            .reads
            .front()
            .is_some_and(|(at, _, _)| now.duration_since(*at) > keep)
        {
            self.reads.pop_front();
        }
        self.reads.push_back((now, rss, admitted));
        // The latest read at least `ago` old.
        let at = |ago: Duration| {
            self.reads
                .iter()
                .rev()
                .find(|(at, _, _)| now.duration_since(*at) >= ago)
                .copied()
        };
        let (_, rss_before, _) = at(CEILING_MARGINAL_WINDOW)?;
        let (_, _, admitted_until) = at(CEILING_SETTLE)?;
        let (_, _, admitted_from) = at(CEILING_MARGINAL_WINDOW + CEILING_SETTLE)?;
        let admitted = admitted_until.saturating_sub(admitted_from);
        let rise = rss.saturating_sub(rss_before);
        (admitted > 0 && rise > 0).then(|| rise as f64 / admitted as f64)
    }
}

/// What the ceiling knows of what a message costs, besides RSS now.
#[derive(Debug, Clone, Copy, Default)]
struct Estimate {
    /// RSS with nothing in process.
    idle_rss: Option<u64>,
    /// What RSS rose by per receive admitted lately (see [`Ceiling`]).
    margin: Option<f64>,
}

/// What fits under the threshold now (`None`: no limit, because nothing is in process).
fn fit(
    threshold: u64,
    rss: u64,
    in_process: u64,
    estimate: Estimate,
    recently_admitted: u64,
) -> Option<Fit> {
    if in_process == 0 {
        // Never stop the last message: nothing in process would free memory.
        return None;
    }
    let limit = threshold as f64;
    // RSS at or below the idle process: the messages hold nothing measurable.
    let average = match estimate.idle_rss {
        Some(idle) => rss.saturating_sub(idle) as f64 / in_process as f64,
        None => limit / 20.0,
    };
    let per_message = average
        .max(estimate.margin.unwrap_or(0.0))
        .clamp(limit / 1000.0, limit / 10.0);
    let idle = estimate.idle_rss.unwrap_or(0).min(rss);
    let room = ((limit - idle as f64) / per_message).floor().max(1.0) as u64;
    let fits = ((limit - rss as f64) / per_message).floor().max(0.0) as u64;
    Some(Fit {
        allowance: fits.saturating_sub(recently_admitted),
        room,
    })
}

#[derive(Default)]
struct LoopState {
    windows: [RateWindow; 2],
    drain: DrainMeter,
    last_size: u64,
}

/// Sense, decide, apply.
///
/// `memory_held`: when receives waited on the memory ceiling since the last tick, the room it
/// measured (see [`Ceiling`]).
fn tick(
    parts: &mut ServiceParts,
    config: &ThrottlingConfig,
    st: &mut LoopState,
    memory_held: Option<u64>,
) -> Arc<Snapshot> {
    let now = parts.clock.now();
    let readings = Readings {
        process_memory_held: memory_held,
        ..sense(parts, config, st, now)
    };
    let queues = parts.probe.queues();
    let loads: Vec<QueueLoad> = queues.iter().map(|q| q.load.clone()).collect();
    let (decision, thresholds) = {
        let mut controller = parts.control.controller();
        let decision = controller.tick(now, &readings, &loads);
        (decision, *controller.thresholds())
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
    let (decision, readings, thresholds) =
        (&snapshot.decision, &snapshot.readings, &snapshot.thresholds);
    for direction in Direction::ALL {
        let d = decision.direction(direction);
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn idle(rss: u64) -> Estimate {
        Estimate {
            idle_rss: Some(rss),
            margin: None,
        }
    }

    #[test]
    fn the_ceiling_stops_at_the_threshold_but_never_the_last_message() {
        let threshold = 100 * MIB;
        let at = |rss, in_process| fit(threshold, rss, in_process, idle(20 * MIB), 0);
        assert_eq!(at(100 * MIB, 3).map(|f| f.allowance), Some(0));
        assert_eq!(at(130 * MIB, 3).map(|f| f.allowance), Some(0));
        assert_eq!(at(120 * MIB, 0), None, "nothing in process: no limit");
    }

    #[test]
    fn the_ceiling_admits_what_fits_and_measures_the_room() {
        let threshold = 100 * MIB;
        // 10 in process hold 80 MiB above an idle 10 MiB: 8 MiB each; 10 MiB left fits one,
        // and the threshold has room for 11 such messages above the idle process.
        let f = fit(threshold, 90 * MIB, 10, idle(10 * MIB), 0).unwrap();
        assert_eq!(
            f,
            Fit {
                allowance: 1,
                room: 11
            }
        );
        // ... and none once one was admitted and is not resident yet.
        let f = fit(threshold, 90 * MIB, 10, idle(10 * MIB), 1).unwrap();
        assert_eq!(f.allowance, 0);
        // Far below the threshold the same arithmetic: a burst of costly receives cannot
        // start all at once (4 in process at 4 MiB each, 44 MiB left: 11 more).
        let f = fit(threshold, 56 * MIB, 4, idle(40 * MIB), 0).unwrap();
        assert_eq!(
            f,
            Fit {
                allowance: 11,
                room: 15
            }
        );
        // RSS no higher than the idle process: the messages hold nothing measurable, so a
        // burst of them is not held back (a thousandth of the threshold each).
        let f = fit(threshold, 14 * MIB, 14, idle(14 * MIB), 15).unwrap();
        assert_eq!(f.allowance, 860 - 15);
        // With no idle reading the estimate is a twentieth of the threshold (5 MiB).
        let f = fit(threshold, 80 * MIB, 4, Estimate::default(), 0).unwrap();
        assert_eq!(
            f,
            Fit {
                allowance: 4,
                room: 20
            }
        );
    }

    #[test]
    fn what_the_latest_receives_added_outweighs_a_cheap_average() {
        let threshold = 100 * MIB;
        // 60 cheap messages hold 12 MiB above an idle 30 MiB (0.2 MiB each), but the latest
        // receives added 6 MiB each: 58 MiB left fits 9 of those, not 290 cheap ones.
        let cheap = fit(threshold, 42 * MIB, 60, idle(30 * MIB), 0).unwrap();
        assert_eq!(cheap.allowance, 290);
        let costly = Estimate {
            margin: Some(6.0 * MIB as f64),
            ..idle(30 * MIB)
        };
        let f = fit(threshold, 42 * MIB, 60, costly, 0).unwrap();
        assert_eq!(
            f,
            Fit {
                allowance: 9,
                room: 11
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_margin_is_the_rise_over_the_receives_admitted_a_settle_time_before() {
        let mut ceiling = Ceiling::default();
        let step = CEILING_INTERVAL;
        let mut rss = 40 * MIB;
        // Two receives admitted per read for 100 ms; each shows 4 MiB a settle time later.
        let mut last = None;
        let mut admitted = 0;
        for read in 0..20u64 {
            let now = tokio::time::Instant::now();
            let shown = read.saturating_sub(CEILING_SETTLE.as_millis() as u64 / 5);
            rss = 40 * MIB + shown * 2 * 4 * MIB;
            last = ceiling.margin(now, rss, admitted);
            admitted += 2;
            tokio::time::advance(step).await;
        }
        let margin = last.expect("a margin once the window is full");
        assert!(
            (margin - 4.0 * MIB as f64).abs() < 0.5 * MIB as f64,
            "about 4 MiB per receive: {} MiB (rss {} MiB)",
            margin / MIB as f64,
            rss / MIB
        );
        // Receives admitted while RSS holds still (others freed as much): no margin.
        for _ in 0..20 {
            last = ceiling.margin(tokio::time::Instant::now(), rss, admitted);
            admitted += 2;
            tokio::time::advance(step).await;
        }
        assert_eq!(last, None);
    }

    #[test]
    fn drain_is_inflow_minus_growth() {
        let mut m = DrainMeter::default();
        let s = Duration::from_secs_f64;
        assert_eq!(m.record(s(0.0), 0, 1000), None);
        // 600 published per second, backlog grows 300 per second: drain 300/s.
        let mut last = None;
        for i in 1..=8 {
            let t = i as f64 * 0.5;
            last = m.record(s(t), (t * 600.0) as u64, 1000 + (t * 300.0) as u64);
        }
        assert_eq!(last, Some(300.0));
        // Nothing published, backlog shrinking 100/s: drain 100/s.
        for i in 9..=16 {
            let t = i as f64 * 0.5;
            last = m.record(s(t), 2400, 2200 - ((t - 4.0) * 100.0) as u64);
        }
        assert_eq!(last, Some(100.0));
    }
}
