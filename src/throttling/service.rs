//! The throttling loop of a running host: every sample interval it reads the sensors and the
//! host's counters, runs the [`Controller`], applies the decision (admission delays and
//! pacing, queue limits) and publishes it (metrics, the status snapshot).
//!
//! Database size comes from the queues' last known depths. Receivers refresh those as they
//! work (every peek, every empty receive); a depth older than `database_size_refresh` is peeked
//! again in the background, so a tick never waits on the database and an idle monitor queue
//! costs no extra statement.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::controller::{Controller, Decision, MachineFacts, Readings, Thresholds};
use super::rates::RateWindow;
use super::sensors::ResourceSensor;
use super::{Clock, Direction, Throttle};
use crate::config::{OverrideMode, ThrottlingConfig};
use crate::dispatch::Dispatcher;
use crate::metrics::{HostMetrics, Metrics};
use crate::publish::Publisher;
use crate::receive::{DepthCell, QueueRuntime};
use crate::transport::{QueueName, Transport};

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
}

/// The host's handle on its throttling: settings, overrides, the latest snapshot.
pub struct ThrottleControl {
    controller: Mutex<Controller>,
    machine: MachineFacts,
    snapshot: ArcSwapOption<Snapshot>,
    reconfigured: tokio::sync::Notify,
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
    }

    /// The settings in force (overrides included).
    pub fn config(&self) -> ThrottlingConfig {
        self.controller().config().clone()
    }

    /// The latest snapshot (None before the first tick).
    pub fn snapshot(&self) -> Option<Arc<Snapshot>> {
        self.snapshot.load_full()
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
    /// In-process count.
    pub dispatcher: Arc<Dispatcher>,
    /// Sessions and depth refreshes.
    pub transport: Arc<dyn Transport>,
    /// Receiving queues.
    pub queues: Vec<Arc<QueueRuntime>>,
    /// Publish targets.
    pub publisher: Arc<Publisher>,
    /// Error queues (left out of database size unless configured).
    pub error_queues: HashSet<QueueName>,
    /// Metric registry.
    pub metrics: Metrics,
}

/// Runs the loop until `stop` is cancelled.
pub async fn run(mut parts: ServiceParts, stop: CancellationToken) {
    let host_metrics = parts.metrics.host();
    let mut windows = [RateWindow::default(), RateWindow::default()];
    let refreshing = Arc::new(AtomicBool::new(false));
    let target_depths: Arc<Mutex<HashMap<QueueName, Arc<DepthCell>>>> = Arc::default();
    let mut last_upkeep = parts.clock.now();
    loop {
        let config = parts.control.config();
        tick(
            &mut parts,
            &config,
            &host_metrics,
            &mut windows,
            &refreshing,
            &target_depths,
        );
        let now = parts.clock.now();
        if now.saturating_sub(last_upkeep) >= Duration::from_secs(5) {
            parts.metrics.upkeep();
            last_upkeep = now;
        }
        let reconfigured = parts.control.reconfigured.notified();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(config.sample_interval) => {}
            _ = reconfigured => {}
        }
    }
}

fn tick(
    parts: &mut ServiceParts,
    config: &ThrottlingConfig,
    metrics: &HostMetrics,
    windows: &mut [RateWindow; 2],
    refreshing: &Arc<AtomicBool>,
    target_depths: &Arc<Mutex<HashMap<QueueName, Arc<DepthCell>>>>,
) {
    let now = parts.clock.now();
    let resources = parts.sensor.read();
    let database_size = database_size(parts, config, refreshing, target_depths);
    let mut readings = Readings {
        process_memory: resources.process_memory,
        system_memory_used: resources.system_memory_used,
        in_process: parts.dispatcher.in_process(),
        threads: resources.threads,
        database_size,
        database_sessions: parts.transport.connections_in_use(),
        ..Readings::default()
    };
    for direction in Direction::ALL {
        let window = match direction {
            Direction::Delivery => config.delivery.sampling_window,
            Direction::Publishing => config.publishing.sampling_window,
        };
        let reading = windows[direction.index()].record(
            now,
            parts.throttle.rates(direction).totals(),
            window,
        );
        match direction {
            Direction::Delivery => readings.delivery = reading,
            Direction::Publishing => readings.publishing = reading,
        }
    }
    let maxes: Vec<(String, u32)> = parts
        .queues
        .iter()
        .map(|q| (q.name.to_string(), q.settings().max))
        .collect();
    let (decision, thresholds) = {
        let mut controller = parts.control.controller();
        let decision = controller.tick(now, &readings, &maxes);
        (decision, *controller.thresholds())
    };

    for direction in Direction::ALL {
        let d = decision.direction(direction);
        parts.throttle.admission(direction).set(d.delay, d.pace);
        let m = metrics.direction(direction);
        m.state.set(d.state as f64);
        m.delay.set(d.effective_wait().as_secs_f64());
        m.state_duration.set(d.state_duration.as_secs_f64());
        m.override_mode.set(d.override_mode.code() as f64);
        for (condition, gauge) in &m.conditions {
            let active = d
                .conditions
                .iter()
                .any(|c| c.condition == *condition && c.active);
            gauge.set(if active { 1.0 } else { 0.0 });
        }
        let rates = match direction {
            Direction::Delivery => readings.delivery,
            Direction::Publishing => readings.publishing,
        };
        m.incoming.set(rates.incoming_per_sec);
        m.outgoing.set(rates.outgoing_per_sec);
    }
    for q in &parts.queues {
        if let Some(limit) = decision.queue_limits.get(q.name.as_str()) {
            q.gate.set_limit(*limit);
            q.metrics.concurrency_limit.set(q.gate.effective() as f64);
        }
        q.metrics.in_flight.set(q.gate.in_flight() as f64);
        q.metrics.receive_loops.set(q.loops() as f64);
        q.metrics.queue_depth.set(q.depth.get() as f64);
    }
    let off = |t: Option<u64>| t.unwrap_or(0) as f64;
    metrics.process_memory.set(readings.process_memory as f64);
    metrics
        .process_memory_threshold
        .set(off(thresholds.process_memory));
    metrics
        .system_memory
        .set(readings.system_memory_used as f64);
    metrics
        .system_memory_threshold
        .set(off(thresholds.system_memory));
    metrics.in_process.set(readings.in_process as f64);
    metrics.in_process_threshold.set(off(thresholds.in_process));
    metrics.threads.set(readings.threads as f64);
    metrics.threads_threshold.set(off(thresholds.threads));
    metrics.database_size.set(readings.database_size as f64);
    metrics
        .database_size_threshold
        .set(off(thresholds.database_size));
    metrics
        .database_sessions
        .set(readings.database_sessions as f64);
    metrics
        .database_sessions_threshold
        .set(off(thresholds.database_sessions));

    parts.control.snapshot.store(Some(Arc::new(Snapshot {
        enabled: config.enabled,
        decision,
        readings,
        thresholds,
        machine: parts.control.machine,
    })));
}

/// Sums the last known depths and starts a background refresh of stale ones.
fn database_size(
    parts: &ServiceParts,
    config: &ThrottlingConfig,
    refreshing: &Arc<AtomicBool>,
    target_depths: &Arc<Mutex<HashMap<QueueName, Arc<DepthCell>>>>,
) -> u64 {
    let counts = |name: &QueueName| {
        config.database_size_includes_error_queue || !parts.error_queues.contains(name)
    };
    let receiving: HashSet<&QueueName> = parts.queues.iter().map(|q| &q.name).collect();
    let mut stale: Vec<(QueueName, Arc<DepthCell>)> = Vec::new();
    let mut total = 0u64;
    let is_stale = |cell: &DepthCell| cell.age().is_none_or(|a| a >= config.database_size_refresh);
    for q in &parts.queues {
        if counts(&q.name) {
            total += q.depth.get();
        }
    }
    {
        let mut targets = target_depths.lock().unwrap_or_else(|e| e.into_inner());
        for name in parts.publisher.targets() {
            if receiving.contains(&name) || !counts(&name) {
                continue;
            }
            let cell = targets.entry(name.clone()).or_default().clone();
            total += cell.get();
            if is_stale(&cell) {
                stale.push((name, cell));
            }
        }
    }
    // Receiving queues refresh their own depth while they work; a fixed or adaptive queue
    // busy with a backlog does not peek, so refresh it here when its depth goes stale.
    for q in &parts.queues {
        if counts(&q.name) && is_stale(&q.depth) {
            stale.push((q.name.clone(), Arc::new(DepthCell::default())));
        }
    }
    if !stale.is_empty() && !refreshing.swap(true, Ordering::AcqRel) {
        let transport = parts.transport.clone();
        let queues = parts.queues.clone();
        let refreshing = refreshing.clone();
        tokio::spawn(async move {
            for (name, cell) in stale {
                match transport.peek_depth(&name).await {
                    Ok(depth) => match queues.iter().find(|q| q.name == name) {
                        Some(q) => q.depth.set(depth),
                        None => cell.set(depth),
                    },
                    Err(e) => tracing::debug!(queue = %name, error = %e, "depth refresh failed"),
                }
            }
            refreshing.store(false, Ordering::Release);
        });
    }
    total
}
