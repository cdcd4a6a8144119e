//! Typed handles: the counters, gauges and histograms of a queue, a direction and the host,
//! registered once and recorded through without a lookup.

use metrics::{Counter, Gauge, Histogram};

use crate::states::{Condition, Direction};

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
    /// 1 while no instance receiving from the queue moves its delayed table.
    pub delayed_unmoved: Gauge,
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

impl QueueMetrics {
    /// Handles that record nothing: for a queue whose series are not exported
    /// (`metrics = false`), so a host of many queues keeps its series to those it charts.
    pub(crate) fn unexported() -> Self {
        QueueMetrics {
            received: Counter::noop(),
            success: Counter::noop(),
            retry: Counter::noop(),
            error: Counter::noop(),
            delayed_retry: Counter::noop(),
            forwarded: Counter::noop(),
            delayed_messages: Gauge::noop(),
            delayed_next_due: Gauge::noop(),
            delayed_moved: Counter::noop(),
            delayed_moves_failing: Gauge::noop(),
            delayed_unmoved: Gauge::noop(),
            lock_timeouts: Counter::noop(),
            deadlocks: Counter::noop(),
            downstream_state: Gauge::noop(),
            consecutive_failures: Gauge::noop(),
            outage_pause: Gauge::noop(),
            latency_limit: Gauge::noop(),
            latency_baseline: Gauge::noop(),
            expired: Counter::noop(),
            poison: Counter::noop(),
            receive_message: Counter::noop(),
            receive_empty: Counter::noop(),
            receive_error: Counter::noop(),
            handler_duration: Histogram::noop(),
            concurrency_limit: Gauge::noop(),
            concurrency_max: Gauge::noop(),
            fleet_share: Gauge::noop(),
            in_flight: Gauge::noop(),
            receive_loops: Gauge::noop(),
            queue_depth: Gauge::noop(),
            ordered_keys_in_flight: Gauge::noop(),
            ordered_waiting: Gauge::noop(),
            ordered_held_keys: Gauge::noop(),
            circuit_breaker_open: Gauge::noop(),
        }
    }
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
