//! Every metric the host exports, described once.
//!
//! [`METRICS`] is the catalogue: name, type, unit, help text and labels. Code never writes a
//! metric name: it asks [`Metrics`] for typed handles ([`QueueMetrics`], [`HostMetrics`]) once
//! and records through them, which costs an atomic operation and no lookup on the hot path.
//!
//! Each host owns its own Prometheus registry (no process-global recorder), so several hosts
//! in one process (tests, load runs) do not mix their numbers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, OnceLock, RwLock};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::states::{Condition, Direction};

mod catalogue;
mod handles;
mod queue_series;

pub use catalogue::{Kind, METRICS, MetricDef, PREFIX};
pub(crate) use handles::{DirectionMetrics, HostMetrics, QueueMetrics};
use queue_series::QueueSeries;

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
    /// Queues whose series are not exported (`metrics = false`): their handles record
    /// nothing, and the failed-message census counts them as `other`.
    unexported: Arc<RwLock<HashSet<String>>>,
    /// The receiving queues' series, outside the exporter's registry (see `queue_series`).
    queues: Arc<QueueSeries>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric described and histograms bucketed.
    pub fn new() -> Self {
        // A queue's histogram is kept beside the registry, with its buckets (`queue_series`).
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full(full_name("throttling_wait_seconds")),
                WAIT_BUCKETS,
            )
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
            unexported: Arc::default(),
            queues: Arc::default(),
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut text = self.handle.render();
        self.queues.render(&mut text);
        text
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
        Key::from_parts(key_name(name), labels)
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

    /// Keeps `queue`'s series out of the export from now on: handles asked for later record
    /// nothing. Called at start, before the queue's handles are made.
    pub(crate) fn leave_out_queue(&self, queue: &str) {
        self.unexported
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_string());
    }

    fn exports(&self, queue: &str) -> bool {
        !self
            .unexported
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(queue)
    }

    /// Handles for one receiving queue. The ordering gauges are exported only for a queue
    /// that keeps key order (`ordered`): on others they would be a constant 0, three series
    /// per queue on a host of many.
    pub fn queue(&self, queue: &str, ordered: bool) -> QueueMetrics {
        if !self.exports(queue) {
            return QueueMetrics::unexported();
        }
        self.queues
            .of(queue, |cells| Self::queue_handles(cells, ordered))
    }

    fn queue_handles(cells: &mut queue_series::Cells<'_>, ordered: bool) -> QueueMetrics {
        let processed = "messages_processed_total";
        let attempts = "receive_attempts_total";
        let ordered_gauge = |cells: &mut queue_series::Cells<'_>, name| match ordered {
            true => cells.gauge(name),
            false => Gauge::noop(),
        };
        QueueMetrics {
            received: cells.counter("messages_received_total", None),
            success: cells.counter(processed, Some(("outcome", "success"))),
            retry: cells.counter(processed, Some(("outcome", "retry"))),
            error: cells.counter(processed, Some(("outcome", "error"))),
            delayed_retry: cells.counter(processed, Some(("outcome", "delayed_retry"))),
            forwarded: cells.counter(processed, Some(("outcome", "forwarded"))),
            delayed_messages: cells.gauge("delayed_messages"),
            delayed_next_due: cells.gauge("delayed_next_due_seconds"),
            delayed_moved: cells.counter("delayed_moved_total", None),
            delayed_moves_failing: cells.gauge("delayed_moves_failing"),
            delayed_unmoved: cells.gauge("delayed_unmoved"),
            lock_timeouts: cells.counter("lock_conflicts_total", Some(("kind", "lock_timeout"))),
            deadlocks: cells.counter("lock_conflicts_total", Some(("kind", "deadlock"))),
            downstream_state: cells.gauge("downstream_state"),
            consecutive_failures: cells.gauge("consecutive_failures"),
            outage_pause: cells.gauge("outage_pause_seconds"),
            latency_limit: cells.gauge("latency_limit"),
            latency_baseline: cells.gauge("latency_baseline_seconds"),
            expired: cells.counter(processed, Some(("outcome", "expired"))),
            poison: cells.counter(processed, Some(("outcome", "poison"))),
            receive_message: cells.counter(attempts, Some(("result", "message"))),
            receive_empty: cells.counter(attempts, Some(("result", "empty"))),
            receive_error: cells.counter(attempts, Some(("result", "error"))),
            handler_duration: cells.histogram("handler_duration_seconds", HANDLER_BUCKETS),
            concurrency_limit: cells.gauge("concurrency_limit"),
            concurrency_max: cells.gauge("concurrency_max"),
            fleet_share: cells.gauge("fleet_share"),
            in_flight: cells.gauge("in_flight"),
            receive_loops: cells.gauge("receive_loops"),
            queue_depth: cells.gauge("queue_depth"),
            ordered_keys_in_flight: ordered_gauge(cells, "ordered_keys_in_flight"),
            ordered_waiting: ordered_gauge(cells, "ordered_waiting"),
            ordered_held_keys: ordered_gauge(cells, "ordered_held_keys"),
            circuit_breaker_open: cells.gauge("circuit_breaker_open"),
        }
    }

    /// Registers the published-messages counter of a destination queue (callers keep it).
    pub fn published(&self, queue: &str) -> Counter {
        if !self.exports(queue) {
            return Counter::noop();
        }
        self.counter("messages_published_total", &[("queue", queue)])
    }

    /// Counts one published event of `topic` (a label the publisher keeps bounded) and the
    /// copies stored for its subscribers; an event without subscribers is counted as such.
    pub fn event_published(&self, topic: &str, copies: u64) {
        let label = [("topic", topic)];
        self.counter("events_published_total", &label).increment(1);
        match copies {
            0 => self
                .counter("events_without_subscribers_total", &label)
                .increment(1),
            n => self.counter("event_copies_total", &label).increment(n),
        }
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
        by_source: &BTreeMap<String, u64>,
        groups: u64,
        took: std::time::Duration,
    ) {
        let mut labelled: BTreeMap<&str, u64> = BTreeMap::new();
        for (source, n) in by_source {
            let label = match self.exports(source) {
                true => source.as_str(),
                false => "other",
            };
            *labelled.entry(label).or_default() += n;
        }
        for (source, n) in labelled {
            self.gauge("failed_messages", &[("queue", queue), ("source", source)])
                .set(n as f64);
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
            &[
                ("version", crate::version::VERSION),
                ("commit", crate::version::COMMIT),
            ],
        )
        .set(1.0);
        self.gauge(
            "host_info",
            &[
                ("host", host),
                ("instance", instance),
                ("transport", transport),
                ("version", crate::version::VERSION),
            ],
        )
        .set(1.0);
    }
}

fn full_name(name: &str) -> String {
    format!("{PREFIX}{name}")
}

/// `name` with the prefix, as a key name the registry copies for free: the catalogue's names
/// are made once per process and kept (a bounded set), where an owned name was one more
/// allocation for every series of every queue.
fn key_name(name: &'static str) -> KeyName {
    static NAMES: OnceLock<HashMap<&'static str, &'static str>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        METRICS
            .iter()
            .map(|m| (m.name, &*Box::leak(full_name(m.name).into_boxed_str())))
            .collect()
    });
    match names.get(name) {
        Some(full) => KeyName::from_const_str(full),
        None => KeyName::from(full_name(name)),
    }
}

fn is_defined(name: &str, kind: Kind, labels: &[(&'static str, &str)]) -> bool {
    METRICS.iter().any(|m| {
        m.name == name
            && m.kind == kind
            && m.labels.len() == labels.len()
            && m.labels.iter().zip(labels).all(|(a, (b, _))| a == b)
    })
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
        let q = m.queue("orders", false);
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
    fn only_an_ordered_queue_exports_the_ordering_gauges() {
        let m = Metrics::new();
        m.queue("plain", false).ordered_waiting.set(3.0);
        m.queue("keyed", true).ordered_waiting.set(3.0);
        m.queue("keyed", true).lock_timeouts.increment(2);
        let text = m.render();
        assert!(
            text.contains("throttlehost_ordered_waiting{queue=\"keyed\"} 3"),
            "{text}"
        );
        assert!(!text.contains("ordered_waiting{queue=\"plain\"}"), "{text}");
        assert!(
            text.contains("throttlehost_queue_depth{queue=\"plain\"} 0"),
            "{text}"
        );
        assert!(
            text.contains(
                "throttlehost_lock_conflicts_total{queue=\"keyed\",kind=\"lock_timeout\"} 2"
            ),
            "{text}"
        );
    }

    #[test]
    fn two_registries_do_not_share_values() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.queue("q", false).received.increment(1);
        assert!(
            !b.render()
                .contains("messages_received_total{queue=\"q\"} 1")
        );
    }
}
