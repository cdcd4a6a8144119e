//! The `/status` document: per direction the BizTalk state, delay, pace and every active
//! condition, with the state explained in words (cause in units, actions, what ends it); every
//! sensor with its threshold and resume line ("off" when off); per queue the model, max,
//! effective limit, in flight, depth and loops. The host builds it (`host/status.rs`); the
//! admin endpoint serves it and `throttlehost status` prints it.

use serde::Serialize;

use crate::config::{ConcurrencyModel, OverrideMode, TransactionMode};
use crate::states::Condition;
use crate::throttling::controller::ConditionStatus;
use crate::throttling::explain::Explanation;

/// The whole document.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct HostStatus {
    /// `[host] name`.
    pub host: String,
    /// Instance id.
    pub instance: String,
    /// Transport description (no secrets).
    pub transport: String,
    /// Transaction mode.
    pub transaction_mode: TransactionMode,
    /// Seconds since start.
    pub uptime_seconds: f64,
    /// True until shutdown begins.
    pub receiving: bool,
    /// Messages handed to handlers and not done.
    pub in_process: u64,
    /// Seconds the database has not answered while statements waited; null while it
    /// answers (shown after a few seconds of silence, long before statements time out).
    pub database_silent_seconds: Option<f64>,
    /// Throttling; None until the first sample.
    pub throttling: Option<ThrottlingStatus>,
    /// Receiving queues.
    pub queues: Vec<QueueStatus>,
}

impl HostStatus {
    /// True when either direction is in a throttling state.
    pub fn is_throttling(&self) -> bool {
        self.throttling
            .as_ref()
            .is_some_and(|t| t.delivery.state != 0 || t.publishing.state != 0)
    }
}

/// Throttling at the last sample.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct ThrottlingStatus {
    /// When the sample was taken, seconds on the controller's clock: two documents with the
    /// same value show the same sample.
    pub sampled_at_seconds: f64,
    /// Master switch.
    pub enabled: bool,
    /// Delivery.
    pub delivery: DirectionStatus,
    /// Publishing.
    pub publishing: DirectionStatus,
    /// Every sensor with its threshold, active or not.
    pub resources: Vec<ResourceStatus>,
}

/// One direction.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct DirectionStatus {
    /// BizTalk state code.
    pub state: u8,
    /// BizTalk state name.
    pub state_name: &'static str,
    /// Delay per admission, seconds.
    pub delay_seconds: f64,
    /// Pacing interval, seconds, if pacing.
    pub pacing_interval_seconds: Option<f64>,
    /// Admissions per second allowed, if pacing.
    pub pace_messages_per_second: Option<f64>,
    /// No condition is active and the actions are relaxing (the state stays on its last
    /// cause until they have; the value may be under its line because of them).
    pub recovering: bool,
    /// The state in words: cause in units, actions, what ends it. Absent at state 0.
    pub explanation: Option<Explanation>,
    /// Seconds in the current state.
    pub state_duration_seconds: f64,
    /// User override.
    #[serde(rename = "override")]
    pub override_mode: OverrideMode,
    /// Where the override came from: the configuration, this instance, or the fleet.
    pub override_scope: OverrideScope,
    /// Active conditions with value and threshold.
    pub active_conditions: Vec<ConditionStatus>,
    /// Incoming rate, messages/s.
    pub incoming_per_second: f64,
    /// Outgoing rate, messages/s.
    pub outgoing_per_second: f64,
    /// Incoming messages in the sampling window.
    pub samples: u64,
}

/// Where a direction's override came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OverrideScope {
    /// The configuration file (`override` of the direction; none unless set there).
    #[default]
    Configured,
    /// `PUT /throttling/{direction}/override` on this instance.
    Local,
    /// A fleet order (`?scope=fleet` on any instance), applied at a heartbeat.
    Fleet,
}

/// One sensor.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct ResourceStatus {
    /// Condition it feeds.
    pub condition: Condition,
    /// Current value.
    pub value: f64,
    /// Threshold; null when the condition is off.
    pub threshold: Option<f64>,
    /// Below this value an active condition clears (threshold x resume_ratio); null when off.
    pub resume_below: Option<f64>,
    /// Value as a percentage of the threshold; null when off.
    pub percent_of_threshold: Option<f64>,
    /// Active after hysteresis.
    pub active: bool,
    /// The value, threshold and resume line in words and units ("off" when off).
    pub text: String,
}

/// A queue's fleet-wide limit as this instance holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct FleetShareStatus {
    /// `concurrency.fleet_max`: in flight across every instance at most.
    pub fleet_max: u32,
    /// What this instance may have in flight of it now (0 until its first share round).
    pub share: u32,
}

/// One receiving queue.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct QueueStatus {
    /// Name.
    pub name: String,
    /// Concurrency model.
    pub model: ConcurrencyModel,
    /// Configured MaximumConcurrencyLevel.
    pub max: u32,
    /// Effective limit now (throttling, the downstream guards and a fleet share may shrink it).
    pub limit: u32,
    /// The queue's fleet-wide limit (`concurrency.fleet_max`) and this instance's share of it
    /// now; None without one.
    pub fleet: Option<FleetShareStatus>,
    /// Receives and handlers running now.
    pub in_flight: u32,
    /// Most in flight at once since start.
    pub peak_in_flight: u32,
    /// Last known depth.
    pub depth: u64,
    /// Loops or peekers.
    pub loops: u32,
    /// This instance does the queue's background reading in the fleet (polls its delayed
    /// table, reads its depth for the others); true when alone.
    pub leads: bool,
    /// Whether its delayed table is moved: `moving`, `failing` (this instance's moves fail)
    /// or `nobody` (no instance alive that receives from it moves it; delayed messages wait).
    pub delayed_moves: crate::delayed::DelayedMoves,
    /// Circuit breaker: closed, armed or open.
    pub circuit_breaker: &'static str,
    /// Error queue.
    pub error_queue: String,
    /// Last known depth of the error queue (read every 30 s, kept current by this host's moves).
    pub error_queue_depth: u64,
    /// Messages handled successfully since start.
    pub succeeded_total: u64,
    /// Messages moved to the error queue since start (after their retries, or as poison rows).
    pub failed_total: u64,
    /// Its downstream guards: outage mode (failures in a row, pause) and the latency-aware
    /// limit (limit, mean and recent latency, the line a rise is judged by).
    pub downstream: crate::queue::DownstreamReading,
}
