//! What a load run recorded: its samples (one per controller tick), phases and message
//! accounting. The runner fills these in; the report, the chart and the quality measures read
//! them, so none of those depends on the runner. [`ticks`] and [`cause_spans`] turn a run into
//! what `throttling::quality` scores.

use std::sync::Arc;

use crate::throttling::quality::{CauseSpan, Tick, tick};
use crate::throttling::service::Snapshot;

/// One sample of the run.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Seconds since the run started.
    pub t: f64,
    /// Phase name (or "drain", "settle").
    pub phase: String,
    /// The controller's snapshot.
    pub snapshot: Arc<Snapshot>,
    /// Per receiving queue: (name, effective limit, in flight, depth).
    pub queues: Vec<(String, u32, u32, u64)>,
    /// Messages sent so far.
    pub sent: u64,
    /// Messages done so far (any outcome).
    pub done: u64,
    /// Calls the simulate handlers have taken so far (attempts, failed ones included).
    pub calls: u64,
    /// A queue is in outage mode.
    pub outage: bool,
}

/// Where a phase sits on the run's clock.
#[derive(Debug, Clone)]
pub struct PhaseSpan {
    /// Name.
    pub name: String,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
    /// The simulate handlers' call latencies in the phase, seconds, sorted.
    pub latencies: Vec<f32>,
    /// The conditions the phase's load causes (the scenario's `causes`).
    pub causes: Vec<crate::throttling::Condition>,
}

/// Message accounting of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Accounting {
    /// Messages accepted by the publish path (prefill included).
    pub sent: u64,
    /// Handled successfully (distinct ids when tracking).
    pub processed: u64,
    /// Moved to the error queue.
    pub in_error_queue: u64,
    /// Dropped as expired.
    pub expired: u64,
    /// Dead-lettered as poison.
    pub poison: u64,
    /// Sent but not seen leaving a queue, minus those still in a queue.
    pub lost: u64,
    /// Still in a receiving queue at the end (drain timed out).
    pub remaining: u64,
    /// Handled successfully more than once (at-least-once redeliveries).
    pub duplicated: u64,
    /// Sends the publish path refused (never entered a queue; not lost).
    pub send_failures: u64,
    /// Messages of a keyed backlog that started out of their key's order or beside another
    /// message of their key.
    pub order_violations: u64,
    /// The first of them, in words.
    pub first_order_violation: Option<String>,
    /// Messages of a staged backlog that started before the stage before theirs had ended.
    pub stage_violations: u64,
    /// The first of them, in words.
    pub first_stage_violation: Option<String>,
    /// Messages done by each process of the run: the run's own host first, then its peers
    /// (one entry unless the scenario sets `processes`).
    pub done_by_process: Vec<u64>,
    /// Peer processes that failed to run or stop cleanly, in words.
    pub peer_failures: Vec<String>,
    /// Messages in flight across the processes (kept when a queue has a fleet-wide limit).
    pub fleet_in_flight: Option<super::in_flight::FleetInFlight>,
}

/// Everything a run produced.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Scenario name.
    pub scenario: String,
    /// Transport description.
    pub transport: String,
    /// Samples, one per sample interval.
    pub samples: Vec<Sample>,
    /// The phases as they ran.
    pub phases: Vec<PhaseSpan>,
    /// Message accounting.
    pub accounting: Accounting,
    /// Seconds from the first phase to the last message done.
    pub busy_seconds: f64,
    /// Both directions were back at state 0 at the end.
    pub cleared: bool,
    /// The scenario's expectations.
    pub expect: super::scenario::Expect,
    /// Hysteresis ratio in force (the chart draws the resume line from it).
    pub resume_ratio: f64,
    /// The directions the scenario overrides to `never`: their episodes are reported but not
    /// held to any bound, since nothing throttles them by design.
    pub uncontrolled: Vec<crate::throttling::Direction>,
}

/// When a run's phases offered each cause (the scenario's `causes`).
pub fn cause_spans(phases: &[PhaseSpan]) -> Vec<CauseSpan> {
    phases
        .iter()
        .flat_map(|p| {
            p.causes.iter().map(|&condition| CauseSpan {
                condition,
                start: p.start,
                end: p.end,
            })
        })
        .collect()
}

/// Builds the tick timeline of a run.
pub fn ticks(samples: &[Sample]) -> Vec<Tick> {
    samples
        .iter()
        .map(|s| tick(s.t, &s.snapshot.decision))
        .collect()
}
