//! Every metric the host exports, described once.
//!
//! [`METRICS`] is the catalogue: name, type, unit, help text and labels. Code never writes a
//! metric name: it asks [`Metrics`] for typed handles ([`QueueMetrics`], [`HostMetrics`]) once
//! and records through them, which costs an atomic operation and no lookup on the hot path.
//!
//! Each host owns its own Prometheus registry (no process-global recorder), so several hosts
//! in one process (tests, load runs) do not mix their numbers.

use std::sync::Arc;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::states::{Condition, Direction};

/// Prefix of every metric name.
pub const PREFIX: &str = "throttlehost_";

/// Kind of a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic counter.
    Counter,
    /// Gauge.
    Gauge,
    /// Histogram with buckets.
    Histogram,
}

/// One entry of the catalogue.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Name without [`PREFIX`].
    pub name: &'static str,
    /// Kind.
    pub kind: Kind,
    /// Base unit, if any.
    pub unit: Option<Unit>,
    /// Help text.
    pub help: &'static str,
    /// Label names.
    pub labels: &'static [&'static str],
}

const fn def(
    name: &'static str,
    kind: Kind,
    unit: Option<Unit>,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricDef {
    MetricDef {
        name,
        kind,
        unit,
        help,
        labels,
    }
}

use Kind::{Counter as C, Gauge as G, Histogram as H};

/// The catalogue of every metric, in the order of DESIGN section 6.
pub const METRICS: &[MetricDef] = &[
    def(
        "throttling_state",
        G,
        None,
        &["direction"],
        "BizTalk throttling state code (0 not throttling, 1/2 rate, 3 in-process, 4 process memory, 5 system memory, 6 database size, 8 sessions, 9 threads, 10/11 override)",
    ),
    def(
        "throttling_delay_seconds",
        G,
        Some(Unit::Seconds),
        &["direction"],
        "Wait imposed on each admission: the delay plus one pacing interval",
    ),
    def(
        "throttling_state_duration_seconds",
        G,
        Some(Unit::Seconds),
        &["direction"],
        "Seconds since the direction entered its current state",
    ),
    def(
        "throttling_override",
        G,
        None,
        &["direction"],
        "User override: 0 none, 1 throttle, 2 never",
    ),
    def(
        "throttling_recovering",
        G,
        None,
        &["direction"],
        "1 while the cause has cleared and the direction's actions (delay, pace, reduced limits) are relaxing",
    ),
    def(
        "throttling_pace_messages_per_second",
        G,
        None,
        &["direction"],
        "Admissions per second allowed while pacing (0 = not pacing)",
    ),
    def(
        "throttling_waiting",
        G,
        None,
        &["direction"],
        "Requests waiting in the direction's admission now (a delay, a pace or a held ceiling): receives for delivery, sends for publishing",
    ),
    def(
        "throttling_condition_active",
        G,
        None,
        &["direction", "condition"],
        "1 while the condition is active (after hysteresis), else 0",
    ),
    def(
        "process_memory_bytes",
        G,
        Some(Unit::Bytes),
        &[],
        "Resident memory of this process",
    ),
    def(
        "process_memory_threshold_bytes",
        G,
        Some(Unit::Bytes),
        &[],
        "Process memory threshold (0 = off)",
    ),
    def(
        "system_memory_used_bytes",
        G,
        Some(Unit::Bytes),
        &[],
        "Physical memory used on the machine",
    ),
    def(
        "system_memory_threshold_bytes",
        G,
        Some(Unit::Bytes),
        &[],
        "System memory threshold (0 = off)",
    ),
    def(
        "in_process_messages",
        G,
        None,
        &[],
        "Messages handed to handlers and not done",
    ),
    def(
        "in_process_messages_threshold",
        G,
        None,
        &[],
        "In-process messages threshold (0 = off)",
    ),
    def("threads", G, None, &[], "Threads in this process"),
    def(
        "threads_threshold",
        G,
        None,
        &[],
        "Thread count threshold (0 = off)",
    ),
    def(
        "database_size_messages",
        G,
        None,
        &[],
        "Messages in the queues this host receives from and publishes to",
    ),
    def(
        "database_size_threshold",
        G,
        None,
        &[],
        "Database size threshold (0 = off)",
    ),
    def(
        "database_sessions",
        G,
        None,
        &[],
        "Database connections in use",
    ),
    def(
        "database_sessions_threshold",
        G,
        None,
        &[],
        "Database sessions threshold (0 = off)",
    ),
    def(
        "rate_messages_per_second",
        G,
        None,
        &["direction", "side"],
        "Incoming and outgoing message rates over the sampling window",
    ),
    def(
        "concurrency_limit",
        G,
        None,
        &["queue"],
        "Effective concurrency limit of the queue (<= max)",
    ),
    def(
        "fleet_share",
        G,
        None,
        &["queue"],
        "This instance's share of the queue's fleet-wide limit (fleet_max), as its last share round set it",
    ),
    def(
        "concurrency_max",
        G,
        None,
        &["queue"],
        "Configured MaximumConcurrencyLevel of the queue",
    ),
    def(
        "in_flight",
        G,
        None,
        &["queue"],
        "Receives and handlers of the queue running now",
    ),
    def(
        "receive_loops",
        G,
        None,
        &["queue"],
        "Receive loops (fixed, adaptive) or peekers (monitor) of the queue",
    ),
    def(
        "queue_depth",
        G,
        None,
        &["queue"],
        "Estimated messages waiting in the queue (last peek)",
    ),
    def(
        "ordered_keys_in_flight",
        G,
        None,
        &["queue"],
        "Keys of an ordered queue with a message in flight on this host",
    ),
    def(
        "ordered_waiting",
        G,
        None,
        &["queue"],
        "Messages of an ordered queue that may not run yet (key busy or previous stage unfinished), among the oldest `lookahead`, at the last depth read",
    ),
    def(
        "delayed_messages",
        G,
        None,
        &["queue"],
        "Messages in the queue's delayed table (delayed sends and delayed retries), read by its mover; they count in the database size",
    ),
    def(
        "delayed_next_due_seconds",
        G,
        Some(Unit::Seconds),
        &["queue"],
        "Seconds until the earliest message of the queue's delayed table is due (0 when none waits)",
    ),
    def(
        "lock_conflicts_total",
        C,
        None,
        &["queue", "kind"],
        "Lock conflicts on the queue's tables that were handled, by kind: lock_timeout (a Babelfish claim or delayed mover passed over a row another transaction holds), deadlock (a statement chosen as deadlock victim, retried)",
    ),
    def(
        "delayed_moved_total",
        C,
        None,
        &["queue"],
        "Due messages the mover moved from the delayed table into the queue",
    ),
    def(
        "delayed_moves_failing",
        G,
        None,
        &["queue"],
        "1 while the mover's statements on the queue's delayed table fail (due delayed messages are not moved in), else 0",
    ),
    def(
        "downstream_state",
        G,
        None,
        &["queue"],
        "What the queue's downstream guards do: 0 nothing, 12 outage mode (one message at a time with a pause), 13 latency-aware limit below max",
    ),
    def(
        "consecutive_failures",
        G,
        None,
        &["queue"],
        "Failed handler attempts in a row on the queue (outage mode starts at outage.consecutive_failures)",
    ),
    def(
        "outage_pause_seconds",
        G,
        Some(Unit::Seconds),
        &["queue"],
        "Pause between attempts while the queue is in outage mode (0 outside it)",
    ),
    def(
        "latency_limit",
        G,
        None,
        &["queue"],
        "The latency-aware concurrency limit (absent unless latency_limit.enabled)",
    ),
    def(
        "latency_baseline_seconds",
        G,
        Some(Unit::Seconds),
        &["queue"],
        "The running mean handler latency the latency-aware limit steers by",
    ),
    def(
        "ordered_held_keys",
        G,
        None,
        &["queue"],
        "Keys of an ordered queue held by a message that failed after its retries (`failed_key = \"hold\"`), read every 5 s: each waits for `throttlehost queues release`",
    ),
    def(
        "circuit_breaker_open",
        G,
        None,
        &["queue"],
        "1 while repeated transport errors hold the queue's receiver back",
    ),
    def(
        "messages_received_total",
        C,
        None,
        &["queue"],
        "Messages taken from the queue",
    ),
    def(
        "messages_processed_total",
        C,
        None,
        &["queue", "outcome"],
        "Message attempts by outcome: success, retry, delayed_retry (stored for a later attempt), forwarded (sent on from a delayed table), error (moved to the error queue), expired, poison",
    ),
    def(
        "messages_published_total",
        C,
        None,
        &["queue"],
        "Messages this host wrote to the queue",
    ),
    def(
        "receive_attempts_total",
        C,
        None,
        &["queue", "result"],
        "Receive statements by result: message, empty, error",
    ),
    def(
        "failed_messages_handled_total",
        C,
        None,
        &["queue", "action"],
        "Failed messages an operator sent back (action retried) or removed (deleted), by error queue",
    ),
    def(
        "failed_messages",
        G,
        None,
        &["queue", "source"],
        "Failed messages waiting in the error queue, by the queue they failed in (this host's queues by name, the rest as other), as last counted (failed_messages.count_interval)",
    ),
    def(
        "failed_message_groups",
        G,
        None,
        &["queue"],
        "Groups of failed messages (exception type, message, source queue) in the error queue, as last counted",
    ),
    def(
        "failed_messages_count_seconds",
        G,
        Some(Unit::Seconds),
        &["queue"],
        "How long the last count of the error queue's failed messages took",
    ),
    def(
        "config_reloads_total",
        C,
        None,
        &["result"],
        "Configuration reloads by result: success, error",
    ),
    def(
        "handler_duration_seconds",
        H,
        Some(Unit::Seconds),
        &["queue"],
        "Duration of one handler attempt",
    ),
    def(
        "throttling_wait_seconds",
        H,
        Some(Unit::Seconds),
        &["direction"],
        "Time an admission waited for throttling",
    ),
    def(
        "host_info",
        G,
        None,
        &["host", "instance", "transport", "version"],
        "Always 1; identifies the host instance",
    ),
    def(
        "build_info",
        G,
        None,
        &["version", "commit"],
        "Always 1; the version and commit this binary was built from",
    ),
    def(
        "throttling_samples_total",
        C,
        None,
        &[],
        "Samples the throttling controller has taken (one per throttling.sample_interval; stops growing when the controller stalls)",
    ),
];

const HANDLER_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

static METADATA: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, None);

/// A host's metric registry.
#[derive(Clone)]
pub struct Metrics {
    recorder: Arc<PrometheusRecorder>,
    handle: PrometheusHandle,
    reloads_succeeded: Counter,
    reloads_failed: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric described and histograms bucketed.
    pub fn new() -> Self {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full(full_name("handler_duration_seconds")),
                HANDLER_BUCKETS,
            )
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(full_name("throttling_wait_seconds")),
                    WAIT_BUCKETS,
                )
            })
            .expect("bucket lists are non-empty constants");
        let recorder = builder.build_recorder();
        for m in METRICS {
            let name = KeyName::from(full_name(m.name));
            let help = SharedString::from(m.help);
            match m.kind {
                Kind::Counter => recorder.describe_counter(name, m.unit, help),
                Kind::Gauge => recorder.describe_gauge(name, m.unit, help),
                Kind::Histogram => recorder.describe_histogram(name, m.unit, help),
            }
        }
        let handle = recorder.handle();
        let recorder = Arc::new(recorder);
        // Host-wide counters are registered now, so they are exported at 0 before their first
        // event (queue counters are registered with their queue).
        let reload = |result: &'static str| {
            recorder.register_counter(
                &Self::key("config_reloads_total", &[("result", result)]),
                &METADATA,
            )
        };
        Metrics {
            reloads_succeeded: reload("success"),
            reloads_failed: reload("error"),
            recorder,
            handle,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Drains histogram buffers; call every few seconds.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
        let labels: Vec<Label> = labels
            .iter()
            .map(|(k, v)| Label::new(*k, v.to_string()))
            .collect();
        Key::from_parts(full_name(name), labels)
    }

    fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        debug_assert!(is_defined(name, Kind::Counter, labels));
        self.recorder
            .register_counter(&Self::key(name, labels), &METADATA)
    }

    fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        debug_assert!(is_defined(name, Kind::Gauge, labels));
        self.recorder
            .register_gauge(&Self::key(name, labels), &METADATA)
    }

    fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        debug_assert!(is_defined(name, Kind::Histogram, labels));
        self.recorder
            .register_histogram(&Self::key(name, labels), &METADATA)
    }

    /// Handles for one receiving queue.
    pub fn queue(&self, queue: &str) -> QueueMetrics {
        let q = [("queue", queue)];
        let processed = |outcome: &str| {
            self.counter(
                "messages_processed_total",
                &[("queue", queue), ("outcome", outcome)],
            )
        };
        let attempts = |result: &str| {
            self.counter(
                "receive_attempts_total",
                &[("queue", queue), ("result", result)],
            )
        };
        QueueMetrics {
            received: self.counter("messages_received_total", &q),
            success: processed("success"),
            retry: processed("retry"),
            error: processed("error"),
            delayed_retry: processed("delayed_retry"),
            forwarded: processed("forwarded"),
            delayed_messages: self.gauge("delayed_messages", &q),
            delayed_next_due: self.gauge("delayed_next_due_seconds", &q),
            delayed_moved: self.counter("delayed_moved_total", &q),
            delayed_moves_failing: self.gauge("delayed_moves_failing", &q),
            lock_timeouts: self.counter(
                "lock_conflicts_total",
                &[("queue", queue), ("kind", "lock_timeout")],
            ),
            deadlocks: self.counter(
                "lock_conflicts_total",
                &[("queue", queue), ("kind", "deadlock")],
            ),
            downstream_state: self.gauge("downstream_state", &q),
            consecutive_failures: self.gauge("consecutive_failures", &q),
            outage_pause: self.gauge("outage_pause_seconds", &q),
            latency_limit: self.gauge("latency_limit", &q),
            latency_baseline: self.gauge("latency_baseline_seconds", &q),
            expired: processed("expired"),
            poison: processed("poison"),
            receive_message: attempts("message"),
            receive_empty: attempts("empty"),
            receive_error: attempts("error"),
            handler_duration: self.histogram("handler_duration_seconds", &q),
            concurrency_limit: self.gauge("concurrency_limit", &q),
            concurrency_max: self.gauge("concurrency_max", &q),
            fleet_share: self.gauge("fleet_share", &q),
            in_flight: self.gauge("in_flight", &q),
            receive_loops: self.gauge("receive_loops", &q),
            queue_depth: self.gauge("queue_depth", &q),
            ordered_keys_in_flight: self.gauge("ordered_keys_in_flight", &q),
            ordered_waiting: self.gauge("ordered_waiting", &q),
            ordered_held_keys: self.gauge("ordered_held_keys", &q),
            circuit_breaker_open: self.gauge("circuit_breaker_open", &q),
        }
    }

    /// Registers the published-messages counter of a destination queue (callers keep it).
    pub fn published(&self, queue: &str) -> Counter {
        self.counter("messages_published_total", &[("queue", queue)])
    }

    /// Counts `n` failed messages of error queue `queue` that an operator retried or
    /// deleted (`action`: `retried`, `deleted`). The label set is bounded by the configured
    /// error queues the routes act on and the two actions.
    pub fn failed_handled(&self, queue: &str, action: &'static str, n: u64) {
        self.counter(
            "failed_messages_handled_total",
            &[("queue", queue), ("action", action)],
        )
        .increment(n);
    }

    /// Writes one count of error queue `queue`: the messages by source, the groups, and the
    /// time the count took. The sources are the host's queues and `other`, so the label set
    /// stays bounded whatever rows others wrote.
    pub fn failed_census(
        &self,
        queue: &str,
        by_source: &std::collections::BTreeMap<String, u64>,
        groups: u64,
        took: std::time::Duration,
    ) {
        for (source, n) in by_source {
            self.gauge("failed_messages", &[("queue", queue), ("source", source)])
                .set(*n as f64);
        }
        self.gauge("failed_message_groups", &[("queue", queue)])
            .set(groups as f64);
        self.gauge("failed_messages_count_seconds", &[("queue", queue)])
            .set(took.as_secs_f64());
    }

    /// Counts a configuration reload (`success` or `error`).
    pub fn config_reload(&self, success: bool) {
        if success {
            self.reloads_succeeded.increment(1)
        } else {
            self.reloads_failed.increment(1)
        }
    }

    /// Handles for the host-wide gauges.
    pub fn host(&self) -> HostMetrics {
        let direction = |d: Direction| {
            let dl = [("direction", d.name())];
            DirectionMetrics {
                state: self.gauge("throttling_state", &dl),
                delay: self.gauge("throttling_delay_seconds", &dl),
                state_duration: self.gauge("throttling_state_duration_seconds", &dl),
                override_mode: self.gauge("throttling_override", &dl),
                recovering: self.gauge("throttling_recovering", &dl),
                pace_rate: self.gauge("throttling_pace_messages_per_second", &dl),
                waiting: self.gauge("throttling_waiting", &dl),
                conditions: Condition::ALL
                    .iter()
                    .filter(|c| c.state_code(d).is_some())
                    .map(|c| {
                        (
                            *c,
                            self.gauge(
                                "throttling_condition_active",
                                &[("direction", d.name()), ("condition", c.name())],
                            ),
                        )
                    })
                    .collect(),
                incoming: self.gauge(
                    "rate_messages_per_second",
                    &[("direction", d.name()), ("side", "incoming")],
                ),
                outgoing: self.gauge(
                    "rate_messages_per_second",
                    &[("direction", d.name()), ("side", "outgoing")],
                ),
                wait: self.histogram("throttling_wait_seconds", &dl),
            }
        };
        HostMetrics {
            delivery: direction(Direction::Delivery),
            publishing: direction(Direction::Publishing),
            process_memory: self.gauge("process_memory_bytes", &[]),
            process_memory_threshold: self.gauge("process_memory_threshold_bytes", &[]),
            system_memory: self.gauge("system_memory_used_bytes", &[]),
            system_memory_threshold: self.gauge("system_memory_threshold_bytes", &[]),
            in_process: self.gauge("in_process_messages", &[]),
            in_process_threshold: self.gauge("in_process_messages_threshold", &[]),
            threads: self.gauge("threads", &[]),
            threads_threshold: self.gauge("threads_threshold", &[]),
            database_size: self.gauge("database_size_messages", &[]),
            database_size_threshold: self.gauge("database_size_threshold", &[]),
            database_sessions: self.gauge("database_sessions", &[]),
            database_sessions_threshold: self.gauge("database_sessions_threshold", &[]),
            samples: self.counter("throttling_samples_total", &[]),
        }
    }

    /// Sets the `host_info` gauge to 1 for these labels, and `build_info` for this build.
    pub fn host_info(&self, host: &str, instance: &str, transport: &str) {
        self.gauge(
            "build_info",
            &[("version", crate::VERSION), ("commit", crate::COMMIT)],
        )
        .set(1.0);
        self.gauge(
            "host_info",
            &[
                ("host", host),
                ("instance", instance),
                ("transport", transport),
                ("version", crate::VERSION),
            ],
        )
        .set(1.0);
    }
}

fn full_name(name: &str) -> String {
    format!("{PREFIX}{name}")
}

fn is_defined(name: &str, kind: Kind, labels: &[(&'static str, &str)]) -> bool {
    METRICS.iter().any(|m| {
        m.name == name
            && m.kind == kind
            && m.labels.len() == labels.len()
            && m.labels.iter().zip(labels).all(|(a, (b, _))| a == b)
    })
}

/// Per-queue handles.
#[derive(Clone)]
pub struct QueueMetrics {
    /// Messages taken from the queue.
    pub received: Counter,
    /// Handled successfully.
    pub success: Counter,
    /// Failed attempts that will be retried.
    pub retry: Counter,
    /// Moved to the error queue.
    pub error: Counter,
    /// Stored in the delayed table for a delayed retry.
    pub delayed_retry: Counter,
    /// Sent on from a delayed table to the queue it was for.
    pub forwarded: Counter,
    /// Messages in the delayed table.
    pub delayed_messages: Gauge,
    /// Seconds until the next delayed message is due.
    pub delayed_next_due: Gauge,
    /// Due messages moved in.
    pub delayed_moved: Counter,
    /// 1 while the mover's statements fail.
    pub delayed_moves_failing: Gauge,
    /// Rows passed over because another transaction held them (Babelfish claims, movers).
    pub lock_timeouts: Counter,
    /// Statements chosen as deadlock victims and retried.
    pub deadlocks: Counter,
    /// 0, 12 (outage mode) or 13 (latency-limited).
    pub downstream_state: Gauge,
    /// Failed attempts in a row.
    pub consecutive_failures: Gauge,
    /// Outage pause.
    pub outage_pause: Gauge,
    /// Latency-aware limit.
    pub latency_limit: Gauge,
    /// Latency baseline.
    pub latency_baseline: Gauge,
    /// Dropped as expired.
    pub expired: Counter,
    /// Unparseable rows moved to the error queue.
    pub poison: Counter,
    /// Receives that returned a message.
    pub receive_message: Counter,
    /// Receives that found nothing.
    pub receive_empty: Counter,
    /// Receives that failed.
    pub receive_error: Counter,
    /// Handler attempt duration.
    pub handler_duration: Histogram,
    /// Effective limit.
    pub concurrency_limit: Gauge,
    /// Configured max.
    pub concurrency_max: Gauge,
    /// This instance's share of the fleet-wide limit.
    pub fleet_share: Gauge,
    /// Running now.
    pub in_flight: Gauge,
    /// Loops or peekers.
    pub receive_loops: Gauge,
    /// Last known depth.
    pub queue_depth: Gauge,
    /// Keys with a message in flight here (ordered queues).
    pub ordered_keys_in_flight: Gauge,
    /// Messages waiting for their key or stage (ordered queues).
    pub ordered_waiting: Gauge,
    /// Keys held by a failed message (ordered queues with `failed_key = "hold"`).
    pub ordered_held_keys: Gauge,
    /// Circuit breaker open.
    pub circuit_breaker_open: Gauge,
}

/// Handles for one throttling direction.
#[derive(Clone)]
pub struct DirectionMetrics {
    /// State code.
    pub state: Gauge,
    /// Delay seconds.
    pub delay: Gauge,
    /// State duration seconds.
    pub state_duration: Gauge,
    /// Override code.
    pub override_mode: Gauge,
    /// 1 while relaxing after the cause cleared.
    pub recovering: Gauge,
    /// Paced admissions per second.
    pub pace_rate: Gauge,
    /// Requests waiting in the admission.
    pub waiting: Gauge,
    /// One gauge per applicable condition.
    pub conditions: Vec<(Condition, Gauge)>,
    /// Incoming rate.
    pub incoming: Gauge,
    /// Outgoing rate.
    pub outgoing: Gauge,
    /// Admission waits.
    pub wait: Histogram,
}

/// Host-wide handles.
#[derive(Clone)]
pub struct HostMetrics {
    /// Delivery direction.
    pub delivery: DirectionMetrics,
    /// Publishing direction.
    pub publishing: DirectionMetrics,
    /// RSS.
    pub process_memory: Gauge,
    /// RSS threshold.
    pub process_memory_threshold: Gauge,
    /// System used memory.
    pub system_memory: Gauge,
    /// Its threshold.
    pub system_memory_threshold: Gauge,
    /// In-process messages.
    pub in_process: Gauge,
    /// Its threshold.
    pub in_process_threshold: Gauge,
    /// Threads.
    pub threads: Gauge,
    /// Its threshold.
    pub threads_threshold: Gauge,
    /// Database size.
    pub database_size: Gauge,
    /// Its threshold.
    pub database_size_threshold: Gauge,
    /// Sessions.
    pub database_sessions: Gauge,
    /// Its threshold.
    pub database_sessions_threshold: Gauge,
    /// Controller samples taken.
    pub samples: Counter,
}

impl HostMetrics {
    /// The handles of one direction.
    pub fn direction(&self, d: Direction) -> &DirectionMetrics {
        match d {
            Direction::Delivery => &self.delivery,
            Direction::Publishing => &self.publishing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed_in_output() {
        let mut names: Vec<&str> = METRICS.iter().map(|m| m.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), METRICS.len());
        let m = Metrics::new();
        let q = m.queue("orders");
        q.received.increment(3);
        q.handler_duration.record(0.003);
        m.host().delivery.state.set(4.0);
        let text = m.render();
        assert!(
            text.contains("throttlehost_messages_received_total{queue=\"orders\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("throttlehost_throttling_state{direction=\"delivery\"} 4"),
            "{text}"
        );
        assert!(
            text.contains(
                "throttlehost_handler_duration_seconds_bucket{queue=\"orders\",le=\"0.005\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("# HELP throttlehost_throttling_state BizTalk"),
            "{text}"
        );
    }

    #[test]
    fn two_registries_do_not_share_values() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.queue("q").received.increment(1);
        assert!(
            !b.render()
                .contains("messages_received_total{queue=\"q\"} 1")
        );
    }
}
