//! What a tick decides: each direction's state, delay, pace and conditions, and the queues' limits.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::config::OverrideMode;
use crate::names::QueueName;
use crate::throttling::{Condition, Direction};

/// One condition as seen by one direction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ConditionStatus {
    /// Which condition.
    pub condition: Condition,
    /// The BizTalk state code it shows in this direction.
    pub state: u8,
    /// Active after hysteresis.
    pub active: bool,
    /// Current value (rate: incoming messages/s; override: 1 when forced).
    pub value: f64,
    /// Threshold (rate: outgoing x overdrive; override: 1); 0 = off.
    pub threshold: f64,
}

/// A direction's decision for one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DirectionDecision {
    /// Which direction.
    pub direction: Direction,
    /// BizTalk state code (0 = not throttling).
    pub state: u8,
    /// BizTalk state name.
    pub state_name: &'static str,
    /// No condition is active and the actions are relaxing (the state shows the cause until
    /// no delay, no pace and no reduced limit is left).
    pub recovering: bool,
    /// The condition whose actions are in effect.
    pub cause: Option<Condition>,
    /// Wait per admission.
    #[serde(serialize_with = "as_secs")]
    pub delay: Duration,
    /// Spacing between admissions when pacing a rate imbalance.
    #[serde(serialize_with = "as_secs_opt")]
    pub pace: Option<Duration>,
    /// Admissions per second allowed while pacing.
    pub pace_rate: Option<f64>,
    /// Time since the direction entered its current state (BizTalk "state duration").
    #[serde(serialize_with = "as_secs")]
    pub state_duration: Duration,
    /// The user override in force.
    pub override_mode: OverrideMode,
    /// Every condition that applies to this direction, active or not.
    pub conditions: Vec<ConditionStatus>,
}

impl DirectionDecision {
    /// The wait an admission sees right now: the delay plus one pacing interval.
    pub fn effective_wait(&self) -> Duration {
        self.delay + self.pace.unwrap_or_default()
    }

    /// Active conditions only.
    pub fn active(&self) -> impl Iterator<Item = &ConditionStatus> {
        self.conditions.iter().filter(|c| c.active)
    }
}

pub(super) fn as_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

pub(super) fn as_secs_opt<S: serde::Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// Everything decided in one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Decision {
    /// Clock time of the tick.
    #[serde(serialize_with = "as_secs")]
    pub at: Duration,
    /// Delivery.
    pub delivery: DirectionDecision,
    /// Publishing.
    pub publishing: DirectionDecision,
    /// Effective concurrency limit per queue (<= its max).
    pub queue_limits: BTreeMap<QueueName, u32>,
    /// True while a memory, in-process or thread condition holds the limits down.
    pub shrinking: bool,
}

impl Decision {
    /// The decision for one direction.
    pub fn direction(&self, direction: Direction) -> &DirectionDecision {
        match direction {
            Direction::Delivery => &self.delivery,
            Direction::Publishing => &self.publishing,
        }
    }
}
