//! The catalogue: every metric's name, type, unit, labels and help text, in the order the
//! documentation lists them.

use metrics::Unit;

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

pub(super) const fn def(
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
        "1 while no condition is active and the direction's actions (delay, pace, reduced limits) are relaxing",
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
        "delayed_unmoved",
        G,
        None,
        &["queue"],
        "1 while no instance alive that receives from the queue moves its delayed table (delayed delivery is off on each: delayed messages sent to it wait), else 0",
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
        "events_published_total",
        C,
        None,
        &["topic"],
        "Events published, by topic (the first 100 topics this process publishes have a label each, later ones count as other)",
    ),
    def(
        "event_copies_total",
        C,
        None,
        &["topic"],
        "Copies of published events stored in subscribers' queues, by topic",
    ),
    def(
        "events_without_subscribers_total",
        C,
        None,
        &["topic"],
        "Events published to a topic nobody subscribed to (stored nowhere, not an error), by topic",
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
