//! One receiving queue's state, shared by its receiver (which takes messages off it), the
//! dispatcher (which handles them and counts their failures) and the throttling probe (which
//! reads its load and sets its limit): settings that reload, the concurrency gate, the circuit
//! breaker, the depth and the failure memory. It depends on none of them, and holds no
//! handler (the dispatcher keeps those). Every field is private: its users reach it through
//! what they do with it (count an event, remember a failure, start a loop) or, for the parts
//! with intent methods of their own (the gate, the depth, the breaker, the downstream guards),
//! through an accessor.

mod arrivals;
pub(crate) mod breaker;
pub(crate) mod downstream;
pub(crate) mod gate;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;
use uuid::Uuid;

pub(crate) use self::breaker::CircuitBreaker;
pub(crate) use self::downstream::{DownstreamGuard, DownstreamReading};
pub(crate) use self::gate::ConcurrencyGate;
use crate::config::{
    ConcurrencyModel, FailedKey, LatencyLimitConfig, OrderingConfig, OutageConfig, QueueConfig,
    TransactionMode,
};
pub(crate) use crate::depth::DepthCell;
use crate::metrics::QueueMetrics;
use crate::names::QueueName;
use crate::throttling::controller::QueueLoad;
use crate::throttling::service::QueueReading;
use crate::transport::{Transport, TransportError};

/// How old an error queue's depth may get before it is read again. Nothing throttles on it
/// (it is shown, not guarded), so one statement per half minute is enough.
pub(crate) const ERROR_DEPTH_MAX_AGE: Duration = Duration::from_secs(30);

/// Message ids whose failure counts are remembered (NServiceBus `FailureInfoStorage`).
const FAILURE_MEMORY: usize = 10_000;

/// Messages that left a queue for good since start, by how they left: what the console's
/// processed and failed rates are computed from (the Prometheus counters cannot be read back).
#[derive(Debug, Default)]
pub(crate) struct OutcomeCounts {
    succeeded: AtomicU64,
    failed: AtomicU64,
}

impl OutcomeCounts {
    /// A handler succeeded and its receive committed.
    pub(crate) fn succeeded(&self) {
        self.succeeded.fetch_add(1, Ordering::Relaxed);
    }

    /// The message went to the error queue (after its retries, or as a poison row).
    pub(crate) fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// (succeeded, failed) so far.
    pub(crate) fn totals(&self) -> (u64, u64) {
        (
            self.succeeded.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// How many of a queue's next receives take one message instead of a batch: set after a
/// batch failed to commit, so a message that cannot commit fails on its own.
#[derive(Debug, Default)]
pub(crate) struct SingleReceives(AtomicU32);

impl SingleReceives {
    /// True (and one fewer left) while single receives are due.
    pub(crate) fn take_one(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }

    /// At least the next `n` receives take one message each.
    pub(crate) fn set(&self, n: u32) {
        self.0.fetch_max(n, Ordering::AcqRel);
    }
}

/// The settings of a queue that may change while it runs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct QueueSettings {
    /// MaximumConcurrencyLevel.
    pub max: u32,
    /// Peek interval / longest idle back-off.
    pub peek_interval: Duration,
    /// Adaptive ramp-up threshold.
    pub ramp_up_after: u32,
    /// Adaptive ramp-down threshold.
    pub ramp_down_after: u32,
    /// Immediate retries.
    pub immediate_retries: u32,
    /// Handler attempt time limit.
    pub handler_timeout: Option<Duration>,
    /// Messages one receive may take in one transaction.
    pub receive_batch: u32,
    /// Delayed retries after the immediate ones (0: none).
    pub delayed_retries: u32,
    /// Delay of delayed retry n: n x this.
    pub delayed_retry_increment: Duration,
    /// Outage mode settings.
    pub outage: OutageConfig,
    /// Latency-aware limit settings.
    pub latency_limit: LatencyLimitConfig,
    /// The queue's fleet-wide limit, shared with the other instances (`fleet::share`).
    pub fleet_max: Option<u32>,
}

impl QueueSettings {
    /// Receivers needed to keep `limit` messages in flight: one per batch while batches can
    /// form (`batching`: nothing throttles delivery), else one per message, since every
    /// throttled receive takes a single message after its own wait.
    pub(crate) fn receivers_for(&self, limit: u32, batching: bool) -> u32 {
        match batching {
            true => limit.div_ceil(self.receive_batch.max(1)).max(1),
            false => limit.max(1),
        }
    }

    /// Settings of a configured queue; `max` overrides the concurrency (instance queues);
    /// `mode` decides whether delayed retries can be taken at all.
    pub(crate) fn from_config(config: &QueueConfig, max: u32, mode: TransactionMode) -> Self {
        let can_retry = mode != TransactionMode::None
            && !config.ordering.is_ordered()
            && config.delayed_delivery.enabled;
        QueueSettings {
            delayed_retries: config.recoverability.effective_delayed_retries(can_retry),
            delayed_retry_increment: config.recoverability.delayed_retry_increment,
            outage: config.outage.clone(),
            latency_limit: config.latency_limit.clone(),
            max,
            peek_interval: config.concurrency.peek_interval,
            ramp_up_after: config.concurrency.ramp_up_after,
            ramp_down_after: config.concurrency.ramp_down_after,
            immediate_retries: config.immediate_retries,
            handler_timeout: config.handler_timeout,
            receive_batch: config.concurrency.receive_batch,
            fleet_max: config.concurrency.fleet_max,
        }
    }

    /// The same settings for a queue only this instance receives from (an instance queue):
    /// no fleet-wide limit.
    pub(crate) fn local_only(self) -> Self {
        QueueSettings {
            fleet_max: None,
            ..self
        }
    }
}

/// Everything about one receiving queue.
pub(crate) struct QueueRuntime {
    /// The queue.
    name: QueueName,
    /// Where failed and poison messages go.
    error_queue: QueueName,
    /// Its concurrency model (changing it needs a restart).
    model: ConcurrencyModel,
    settings: ArcSwap<QueueSettings>,
    /// The concurrency gate (max and throttling limit).
    gate: Arc<ConcurrencyGate>,
    /// Receive loops (fixed, adaptive) or peekers (monitor) running.
    loops: AtomicU32,
    /// Last known depth (shared with the throttling probe, which refreshes it when stale).
    depth: Arc<DepthCell>,
    /// The error queue's last known depth, shared by the queues that use that error queue:
    /// this host's moves keep it current, the throttling probe reads it again every
    /// [`ERROR_DEPTH_MAX_AGE`].
    error_depth: Arc<DepthCell>,
    /// Messages that left the queue, by outcome.
    outcomes: OutcomeCounts,
    /// Metric handles, shared with the queue's delayed mover and the host's sweeper (a set of
    /// handles is ~35 pointers; a copy each was a kilobyte per queue).
    metrics: Arc<QueueMetrics>,
    /// How receives keep order (per key, stages); None for an unordered queue. Fixed at
    /// start: the transport's receive statements are built from it.
    ordering: Option<OrderingConfig>,
    /// Transport-error circuit breaker.
    breaker: CircuitBreaker,
    /// Failure counts per message id.
    failures: FailureMemory,
    /// Receives still to take one message each after a batch failed to commit.
    single_receives: SingleReceives,
    /// Outage mode and the latency-aware limit.
    downstream: DownstreamGuard,
    /// The queue whose delayed table holds this queue's delayed retries (itself, or the queue
    /// an instance queue belongs to); None when delayed delivery is off for it.
    delayed_home: Option<QueueName>,
    /// Due messages the mover of this queue's delayed table moves per transaction.
    delayed_batch: u32,
    /// Messages in this queue's delayed table, as its mover last read them (they count in the
    /// database size: they will join the queue).
    delayed_waiting: Arc<AtomicU64>,
    /// Whether its delayed table is moved (the mover's failures, the fleet's leads).
    delayed_health: Arc<crate::delayed::MovesHealth>,
    /// This instance does the queue's background reading: its delayed mover polls and its
    /// depth is read for database size (true unless another instance leads it, see
    /// `fleet::lead`).
    leads: Arc<AtomicBool>,
    reconfigured: Notify,
    arrivals: Notify,
    /// The transport tells of every message that arrives on this queue (a PostgreSQL table
    /// with the insert trigger, while the listening connection is up): idle receivers then
    /// peek only as a rare safety net ([`arrivals::NOTIFIED_PEEK_INTERVAL`]).
    arrivals_notified: AtomicBool,
    /// The last peek found no message this host could take: rows that wait (for their key,
    /// their stage, a hold) become receivable without an insert, so a queue peeks rarely
    /// only while it was last seen empty.
    last_peek_empty: AtomicBool,
    /// The depth the read of every queue at start found, until the first peek takes it
    /// ([`arrivals::NOT_READ`] when none is waiting).
    first_peek: AtomicU64,
    share_wanted: Notify,
    receiver_alive: AtomicBool,
}

impl QueueRuntime {
    /// Builds a queue's runtime state.
    /// `error_depth` is the error queue's depth cell, shared by every queue that sends its
    /// failures there (so the table is read once however many queues use it).
    pub(crate) fn new(
        name: QueueName,
        error_queue: QueueName,
        error_depth: Arc<DepthCell>,
        model: ConcurrencyModel,
        settings: QueueSettings,
        metrics: QueueMetrics,
    ) -> Self {
        metrics.concurrency_max.set(settings.max as f64);
        metrics.concurrency_limit.set(settings.max as f64);
        let gate = ConcurrencyGate::new(settings.max);
        if settings.fleet_max.is_some() {
            // Nothing is received before the first share round grants some of the limit.
            gate.set_fleet_share(0);
        }
        QueueRuntime {
            downstream: DownstreamGuard::new(
                &settings.outage,
                &settings.latency_limit,
                settings.max,
            ),
            delayed_home: None,
            delayed_batch: 100,
            delayed_waiting: Arc::default(),
            delayed_health: Arc::default(),
            leads: Arc::new(AtomicBool::new(true)),
            breaker: CircuitBreaker::new(name.as_str(), metrics.circuit_breaker_open.clone()),
            gate: Arc::new(gate),
            name,
            error_queue,
            model,
            settings: ArcSwap::from_pointee(settings),
            loops: AtomicU32::new(0),
            depth: Arc::default(),
            error_depth,
            outcomes: OutcomeCounts::default(),
            metrics: Arc::new(metrics),
            ordering: None,
            failures: FailureMemory::default(),
            single_receives: SingleReceives::default(),
            reconfigured: Notify::new(),
            arrivals: Notify::new(),
            arrivals_notified: AtomicBool::new(false),
            last_peek_empty: AtomicBool::new(false),
            first_peek: AtomicU64::new(arrivals::NOT_READ),
            share_wanted: Notify::new(),
            receiver_alive: AtomicBool::new(false),
        }
    }

    /// The same queue, receiving in the order `ordering` asks for (when it asks for any).
    pub(crate) fn with_ordering(mut self, ordering: &OrderingConfig) -> Self {
        self.ordering = ordering.is_ordered().then(|| ordering.clone());
        self
    }

    /// The same queue, storing its delayed retries in `home`'s delayed table, whose mover
    /// (when `home` is this queue) moves `batch` messages per transaction.
    pub(crate) fn with_delayed_home(mut self, home: Option<QueueName>, batch: u32) -> Self {
        self.delayed_home = home;
        self.delayed_batch = batch;
        self
    }

    /// The queue.
    pub(crate) fn name(&self) -> &QueueName {
        &self.name
    }

    /// Where its failed and poison messages go.
    pub(crate) fn error_queue(&self) -> &QueueName {
        &self.error_queue
    }

    /// Its concurrency model (changing it needs a restart).
    pub(crate) fn model(&self) -> ConcurrencyModel {
        self.model
    }

    /// How its receives keep order; None for an unordered queue.
    pub(crate) fn ordering(&self) -> Option<&OrderingConfig> {
        self.ordering.as_ref()
    }

    /// The queue whose delayed table holds its delayed retries; None when delayed delivery is
    /// off for it.
    pub(crate) fn delayed_home(&self) -> Option<&QueueName> {
        self.delayed_home.as_ref()
    }

    /// Due messages its delayed table's mover moves per transaction.
    pub(crate) fn delayed_batch(&self) -> u32 {
        self.delayed_batch
    }

    /// The count of messages waiting in its delayed table, which its mover keeps.
    pub(crate) fn delayed_waiting(&self) -> &Arc<AtomicU64> {
        &self.delayed_waiting
    }

    /// Whether its delayed table is moved, shared with its mover.
    pub(crate) fn delayed_health(&self) -> &Arc<crate::delayed::MovesHealth> {
        &self.delayed_health
    }

    /// Whether its delayed table is moved, as `/status` tells it.
    pub(crate) fn delayed_moves(&self) -> crate::delayed::DelayedMoves {
        self.delayed_health.reading()
    }

    /// Nobody alive that receives from the queue moves its delayed table (true), or somebody
    /// does; said once at WARN when it becomes so.
    pub(crate) fn set_delayed_unmoved(&self, unmoved: bool) {
        self.metrics
            .delayed_unmoved
            .set(if unmoved { 1.0 } else { 0.0 });
        if self.delayed_health.set_unmoved(unmoved) && unmoved {
            tracing::warn!(queue = %self.name,
                "no instance receiving from this queue moves its delayed table (delayed delivery is off on each): delayed messages sent to it wait until one does");
        }
    }

    /// The concurrency gate (max, throttling, guard and fleet limits).
    pub(crate) fn gate(&self) -> &Arc<ConcurrencyGate> {
        &self.gate
    }

    /// The last known depth.
    pub(crate) fn depth(&self) -> &Arc<DepthCell> {
        &self.depth
    }

    /// The error queue's last known depth (shared by the queues that use that error queue).
    pub(crate) fn error_depth(&self) -> &Arc<DepthCell> {
        &self.error_depth
    }

    /// The transport-error circuit breaker.
    pub(crate) fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// Outage mode and the latency-aware limit.
    pub(crate) fn downstream(&self) -> &DownstreamGuard {
        &self.downstream
    }

    /// Receives still to take one message each after a batch failed to commit.
    pub(crate) fn single_receives(&self) -> &SingleReceives {
        &self.single_receives
    }

    /// The queue's metric handles.
    pub(crate) fn metrics(&self) -> &Arc<QueueMetrics> {
        &self.metrics
    }

    /// Messages this queue holds in the database: its depth and those in its delayed table,
    /// as its mover last read them (they will join the queue).
    pub(crate) fn stored(&self) -> u64 {
        self.depth.get() + self.delayed_waiting.load(Ordering::Relaxed)
    }

    /// The gauges a read of an ordered queue's depth also sets: messages waiting behind a key
    /// in flight, and the keys held after a failure (None where they do not apply).
    pub(crate) fn ordered_gauges(&self) -> (Option<metrics::Gauge>, Option<metrics::Gauge>) {
        let ordering = self.ordering.as_ref();
        let waiting = ordering.map(|_| self.metrics.ordered_waiting.clone());
        let held = ordering
            .filter(|o| o.failed_key == FailedKey::Hold)
            .map(|_| self.metrics.ordered_held_keys.clone());
        (waiting, held)
    }

    /// (succeeded, failed) messages since start.
    pub(crate) fn outcome_totals(&self) -> (u64, u64) {
        self.outcomes.totals()
    }

    /// Counts one event of a message of this queue.
    pub(crate) fn count(&self, event: QueueEvent) {
        let m = &self.metrics;
        let counter = match event {
            QueueEvent::Received => &m.received,
            QueueEvent::Succeeded => &m.success,
            QueueEvent::Retried => &m.retry,
            QueueEvent::DelayedRetry => &m.delayed_retry,
            QueueEvent::Forwarded => &m.forwarded,
            QueueEvent::Failed => &m.error,
            QueueEvent::Expired => &m.expired,
            QueueEvent::Poison => &m.poison,
        };
        counter.increment(1);
    }

    /// Records how long one handler attempt took.
    pub(crate) fn handler_took(&self, took: Duration) {
        self.metrics.handler_duration.record(took.as_secs_f64());
    }

    /// Failed attempts remembered for message `id`.
    pub(crate) fn failed_attempts(&self, id: Uuid) -> u32 {
        self.failures.attempts(id)
    }

    /// Remembers that message `id` has failed `attempts` times.
    pub(crate) fn remember_failed_attempts(&self, id: Uuid, attempts: u32) {
        self.failures.record(id, attempts);
    }

    /// Forgets message `id`'s failures (it succeeded or left the queue).
    pub(crate) fn forget_failed_attempts(&self, id: Uuid) {
        self.failures.forget(id);
    }

    /// A receive loop (or the peeker) started.
    pub(crate) fn loop_started(&self) {
        self.loops.fetch_add(1, Ordering::Relaxed);
    }

    /// Receive loops (or the peeker) now running: `n`.
    pub(crate) fn set_loops(&self, n: u32) {
        self.loops.store(n, Ordering::Relaxed);
    }

    /// One more receive loop, if fewer than `limit` run (adaptive ramp-up); true if added.
    pub(crate) fn add_loop_below(&self, limit: u32) -> bool {
        self.loops
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// One receive loop fewer, unless it is the last (adaptive ramp-down); true if removed.
    pub(crate) fn remove_loop_but_last(&self) -> bool {
        self.loops
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n > 1).then_some(n - 1)
            })
            .is_ok()
    }

    /// A receive loop (or the peeker) ended.
    pub(crate) fn loop_ended(&self) {
        self.loops.fetch_sub(1, Ordering::Relaxed);
    }

    /// Whether this instance does the queue's background reading (see `fleet::lead`).
    pub(crate) fn leads(&self) -> bool {
        self.leads.load(Ordering::Relaxed)
    }

    /// This instance does (or no longer does) the queue's background reading.
    pub(crate) fn set_leads(&self, leads: bool) {
        self.leads.store(leads, Ordering::Relaxed);
    }

    /// The lead flag, for the delayed mover, which polls only while it is set.
    pub(crate) fn lead_flag(&self) -> &Arc<AtomicBool> {
        &self.leads
    }

    /// Applies the downstream guards' limit to the gate (after an attempt changed it).
    pub(crate) fn apply_guard_limit(&self) {
        self.gate.set_guard_limit(self.downstream.limit());
        self.metrics
            .concurrency_limit
            .set(self.gate.effective() as f64);
    }

    /// The settings in force.
    pub(crate) fn settings(&self) -> Arc<QueueSettings> {
        self.settings.load_full()
    }

    /// Applies new settings (config reload): a new max reaches the gate at once.
    pub(crate) fn reconfigure(&self, settings: QueueSettings) {
        self.gate.set_max(settings.max);
        match (self.settings().fleet_max, settings.fleet_max) {
            (None, Some(_)) => self.gate.set_fleet_share(0),
            (Some(_), None) => self.gate.set_fleet_share(u32::MAX),
            _ => {}
        }
        self.downstream
            .reconfigure(&settings.outage, &settings.latency_limit, settings.max);
        self.gate.set_guard_limit(self.downstream.limit());
        self.metrics.concurrency_max.set(settings.max as f64);
        self.settings.store(Arc::new(settings));
        self.reconfigured.notify_waiters();
    }

    /// Resolves at the next [`QueueRuntime::reconfigure`] (create it before checking).
    pub(crate) fn reconfigured(&self) -> tokio::sync::futures::Notified<'_> {
        self.reconfigured.notified()
    }

    /// The flag the receiver keeps set while it runs.
    pub(crate) fn receiver_alive_flag(&self) -> &AtomicBool {
        &self.receiver_alive
    }

    /// Whether the queue's receiver (peeker, loop supervisor or first loop) is running: false
    /// before it starts, after receiving stopped, and after it panicked.
    pub(crate) fn receiver_alive(&self) -> bool {
        self.receiver_alive.load(Ordering::Acquire)
    }

    /// Loops or peekers running now.
    pub(crate) fn loops(&self) -> u32 {
        self.loops.load(Ordering::Relaxed)
    }

    /// Peeks the queue's depth through `transport`: records it in the depth cell and lets
    /// the circuit breaker count the result. Only an empty queue proves receiving works: with
    /// rows waiting, a peek can succeed while every receive fails, and must not disarm the
    /// breaker. Err is the pause before trying again.
    pub(crate) async fn peek(&self, transport: &dyn Transport) -> Result<u64, Duration> {
        if let Some(depth) = self.take_first_peek() {
            return Ok(depth);
        }
        let start = self.depth.read_started();
        match transport.peek_depth(&self.name).await {
            Ok(depth) => {
                self.peeked(depth, start);
                Ok(depth)
            }
            Err(e) => {
                self.metrics.receive_error.increment(1);
                Err(self.breaker.failure(&e))
            }
        }
    }

    /// Records a peek's `depth`, read by a statement that began at `start`.
    fn peeked(&self, depth: u64, start: crate::depth::ReadStart) {
        if depth == 0 {
            self.breaker.success();
        }
        self.last_peek_empty.store(depth == 0, Ordering::Relaxed);
        self.depth.set_read(depth, start);
    }

    /// Counts a receive's result: the receive counters, the circuit breaker, and an empty
    /// receive's proof that the queue holds nothing this host could take.
    pub(crate) fn observe_receive(
        &self,
        result: Result<bool, &TransportError>,
    ) -> Option<Duration> {
        match result {
            Ok(got) => {
                if got {
                    self.metrics.receive_message.increment(1);
                } else {
                    self.metrics.receive_empty.increment(1);
                    self.depth.set(0);
                }
                self.breaker.success();
                None
            }
            Err(e) if e.is_deadlock() => {
                self.metrics.deadlocks.increment(1);
                tracing::debug!(queue = %self.name, error = %e, "receive was a deadlock victim; retrying");
                Some(Duration::ZERO)
            }
            Err(e) => {
                self.metrics.receive_error.increment(1);
                Some(self.breaker.failure(e))
            }
        }
    }

    /// A message left the queue with `outcome`: the depth, the outcome counts, and the error
    /// queue's depth when it went there.
    pub(crate) fn record_outcome(&self, outcome: Outcome) {
        self.depth.departed();
        match outcome {
            Outcome::Success => self.outcomes.succeeded(),
            Outcome::Error | Outcome::Poison => {
                self.outcomes.failed();
                self.error_depth.arrived();
            }
            Outcome::Expired => {}
        }
    }

    /// What the controller reads of this queue each tick.
    pub(crate) fn reading(&self) -> QueueReading {
        QueueReading {
            load: QueueLoad {
                name: self.name.clone(),
                max: self.settings().max,
                in_flight: self.gate.in_flight(),
            },
            depth: self.depth.get(),
            limit: self.gate.effective(),
            downstream_limit: Some(self.downstream.limit()).filter(|l| *l != u32::MAX),
            fleet_share: Some(self.gate.fleet_share()).filter(|s| *s != u32::MAX),
        }
    }

    /// The controller's limit for this queue, applied to the gate; the queue's gauges follow.
    pub(crate) fn set_throttling_limit(&self, limit: u32) {
        self.gate.set_limit(limit);
        self.export_gauges();
    }

    /// Writes the queue's gauges: its limit, in flight, loops, depth and downstream guards.
    fn export_gauges(&self) {
        let m = &self.metrics;
        m.concurrency_limit.set(self.gate.effective() as f64);
        m.in_flight.set(self.gate.in_flight() as f64);
        m.receive_loops.set(self.loops() as f64);
        m.queue_depth.set(self.depth.get() as f64);
        let d = self.downstream.reading();
        let state = if d.outage {
            crate::states::OUTAGE_STATE
        } else if d.latency_limiting {
            crate::states::LATENCY_STATE
        } else {
            0
        };
        m.downstream_state.set(f64::from(state));
        m.consecutive_failures
            .set(f64::from(d.consecutive_failures));
        m.outage_pause.set(d.pause.as_secs_f64());
        if let Some(limit) = d.latency_limit {
            m.latency_limit.set(f64::from(limit));
            m.latency_baseline.set(d.latency_mean);
        }
    }
}

/// What happened to one message of a queue, for its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueEvent {
    /// Taken from the queue for a handler.
    Received,
    /// Its handler succeeded and the receive committed.
    Succeeded,
    /// An attempt failed; another follows at once.
    Retried,
    /// Stored in a delayed table for a later attempt.
    DelayedRetry,
    /// Sent on from a delayed table to another queue.
    Forwarded,
    /// Moved to the error queue after its retries.
    Failed,
    /// Dropped: its time to be received had passed.
    Expired,
    /// Its row could not be read; moved to the error queue as it was.
    Poison,
}

/// How a message left its queue (reported after the commit succeeded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler succeeded.
    Success,
    /// Moved to the error queue after its retries.
    Error,
    /// Dropped because its time-to-be-received had passed.
    Expired,
    /// Its row could not be parsed; moved to the error queue unchanged.
    Poison,
}

/// Failure counts per message id, bounded; oldest forgotten first.
#[derive(Debug, Default)]
pub(crate) struct FailureMemory {
    entries: Mutex<(HashMap<Uuid, u32>, VecDeque<Uuid>)>,
    len: AtomicUsize,
}

impl FailureMemory {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<Uuid, u32>, VecDeque<Uuid>)> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Failed attempts recorded for `id`.
    pub(crate) fn attempts(&self, id: Uuid) -> u32 {
        if self.len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.lock().0.get(&id).copied().unwrap_or(0)
    }

    /// Records that `id` has failed `attempts` times.
    pub(crate) fn record(&self, id: Uuid, attempts: u32) {
        let mut guard = self.lock();
        let (map, order) = &mut *guard;
        if map.insert(id, attempts).is_none() {
            order.push_back(id);
            if order.len() > FAILURE_MEMORY
                && let Some(old) = order.pop_front()
            {
                map.remove(&old);
            }
        }
        self.len.store(map.len(), Ordering::Relaxed);
    }

    /// Forgets `id` (it succeeded or left the queue).
    pub(crate) fn forget(&self, id: Uuid) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut guard = self.lock();
        let (map, order) = &mut *guard;
        if map.remove(&id).is_some() {
            order.retain(|x| *x != id);
        }
        self.len.store(map.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_memory_is_bounded_and_forgets() {
        let m = FailureMemory::default();
        let first = Uuid::new_v4();
        m.record(first, 2);
        assert_eq!(m.attempts(first), 2);
        for _ in 0..FAILURE_MEMORY {
            m.record(Uuid::new_v4(), 1);
        }
        assert_eq!(m.attempts(first), 0, "oldest evicted");
        let x = Uuid::new_v4();
        m.record(x, 3);
        m.forget(x);
        assert_eq!(m.attempts(x), 0);
    }
}
