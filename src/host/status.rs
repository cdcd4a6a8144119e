//! The `/status` document: per direction the BizTalk state, delay and every active condition
//! with its value and threshold; every sensor with its threshold; per queue the model, max,
//! effective limit, in flight, depth and loops.

use serde::Serialize;

use super::HostInner;
use crate::config::{ConcurrencyModel, OverrideMode, TransactionMode};
use crate::throttling::controller::{ConditionStatus, DirectionDecision};
use crate::throttling::{Condition, Direction};

/// The whole document.
#[derive(Debug, Clone, Serialize)]
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
pub struct ThrottlingStatus {
    /// Master switch.
    pub enabled: bool,
    /// Delivery.
    pub delivery: DirectionStatus,
    /// Publishing.
    pub publishing: DirectionStatus,
    /// Every sensor with its threshold (0 = off), active or not.
    pub resources: Vec<ResourceStatus>,
}

/// One direction.
#[derive(Debug, Clone, Serialize)]
pub struct DirectionStatus {
    /// BizTalk state code.
    pub state: u8,
    /// BizTalk state name.
    pub state_name: &'static str,
    /// Delay per admission, seconds.
    pub delay_seconds: f64,
    /// Pacing interval, seconds (rate imbalance), if pacing.
    pub pacing_interval_seconds: Option<f64>,
    /// Seconds in the current state.
    pub state_duration_seconds: f64,
    /// User override.
    #[serde(rename = "override")]
    pub override_mode: OverrideMode,
    /// Active conditions with value and threshold.
    pub active_conditions: Vec<ConditionStatus>,
    /// Incoming rate, messages/s.
    pub incoming_per_second: f64,
    /// Outgoing rate, messages/s.
    pub outgoing_per_second: f64,
    /// Incoming messages in the sampling window.
    pub samples: u64,
}

/// One sensor.
#[derive(Debug, Clone, Serialize)]
pub struct ResourceStatus {
    /// Condition it feeds.
    pub condition: Condition,
    /// Current value.
    pub value: f64,
    /// Threshold; 0 = off.
    pub threshold: f64,
    /// Active after hysteresis.
    pub active: bool,
}

/// One receiving queue.
#[derive(Debug, Clone, Serialize)]
pub struct QueueStatus {
    /// Name.
    pub name: String,
    /// Concurrency model.
    pub model: ConcurrencyModel,
    /// Configured MaximumConcurrencyLevel.
    pub max: u32,
    /// Effective limit now (throttling may shrink it).
    pub limit: u32,
    /// Receives and handlers running now.
    pub in_flight: u32,
    /// Most in flight at once since start.
    pub peak_in_flight: u32,
    /// Last known depth.
    pub depth: u64,
    /// Loops or peekers.
    pub loops: u32,
    /// Circuit breaker: closed, armed or open.
    pub circuit_breaker: &'static str,
    /// Error queue.
    pub error_queue: String,
}

fn direction_status(
    d: &DirectionDecision,
    rates: crate::throttling::rates::RateReading,
) -> DirectionStatus {
    DirectionStatus {
        state: d.state,
        state_name: d.state_name,
        delay_seconds: d.delay.as_secs_f64(),
        pacing_interval_seconds: d.pace.map(|p| p.as_secs_f64()),
        state_duration_seconds: d.state_duration.as_secs_f64(),
        override_mode: d.override_mode,
        active_conditions: d.active().copied().collect(),
        incoming_per_second: rates.incoming_per_sec,
        outgoing_per_second: rates.outgoing_per_sec,
        samples: rates.samples,
    }
}

pub(super) fn build(host: &HostInner) -> HostStatus {
    let config = host.config();
    let throttling = host.control.snapshot().map(|s| {
        let d = &s.decision;
        let mut resources: Vec<ResourceStatus> = Vec::new();
        for dir in [&d.delivery, &d.publishing] {
            for c in &dir.conditions {
                let shared = !matches!(c.condition, Condition::RateImbalance | Condition::Override);
                if shared && !resources.iter().any(|r| r.condition == c.condition) {
                    resources.push(ResourceStatus {
                        condition: c.condition,
                        value: c.value,
                        threshold: c.threshold,
                        active: c.active,
                    });
                }
            }
        }
        ThrottlingStatus {
            enabled: s.enabled,
            delivery: direction_status(d.direction(Direction::Delivery), s.readings.delivery),
            publishing: direction_status(d.direction(Direction::Publishing), s.readings.publishing),
            resources,
        }
    });
    HostStatus {
        host: config.host.name.clone(),
        instance: host.instance.clone(),
        transport: host.transport.describe(),
        transaction_mode: config.transport.transaction_mode,
        uptime_seconds: host.started.elapsed().as_secs_f64(),
        receiving: host.is_receiving(),
        in_process: host.in_process(),
        throttling,
        queues: host
            .queues
            .iter()
            .map(|q| {
                let settings = q.settings();
                QueueStatus {
                    name: q.name.to_string(),
                    model: q.model,
                    max: settings.max,
                    limit: q.gate.effective(),
                    in_flight: q.gate.in_flight(),
                    peak_in_flight: q.gate.peak(),
                    depth: q.depth.get(),
                    loops: q.loops(),
                    circuit_breaker: q.breaker.describe(),
                    error_queue: q.error_queue.to_string(),
                }
            })
            .collect(),
    }
}
