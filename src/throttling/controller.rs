//! The throttling controller: readings in, decisions out. No I/O and no clock of its own: the
//! caller passes the time of each tick, so tests drive hours of behaviour in microseconds.
//!
//! Per tick it
//!
//! 1. **evaluates** every condition against its threshold with hysteresis: a condition becomes
//!    active when its value rises above the threshold and clears only when it falls below
//!    threshold x `resume_ratio` (the resume line);
//! 2. **limits** every queue (delivery): under memory, in-process or thread pressure the limit
//!    is cut from what is *in flight*, aiming the resource at midway between resume line and
//!    threshold; it is held while the resource is above the resume line and grows back below
//!    it, fast when far below and by steps near it (`law::cut`, `law::grow`);
//! 3. **delays** each direction by a law proportional to the overage and integral over its
//!    persistence, scaled by severity and capped (`law::delay`); a cleared cause relaxes the
//!    delay over a few samples instead of keeping it;
//! 4. **paces** publishing under database size, sessions or memory against the backlog's
//!    measured drain rate, so an open-loop publisher settles the backlog at the threshold
//!    (`law::paced_rate`), and paces a rate imbalance at the recent outgoing rate x
//!    overdrive; pacing needs a measured rate and relaxes gradually;
//! 5. **reports the truth**: a direction shows the state of its cause while any action
//!    (delay, pace, limit below max) is in effect, flagged `recovering` once the cause cleared.
//!
//! This file is the face: the controller's state and its tick. The rooms: `readings` (what a
//! tick reads), `decision` (what it decides), `conditions` (1), `limits` (2), `state` (3, 5)
//! and `pace` (4).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

mod conditions;
mod decision;
mod limits;
mod pace;
mod readings;
mod state;

pub use decision::{ConditionStatus, Decision, DirectionDecision};
pub use readings::{
    CEILING_GUARDED, CeilingHolds, DownstreamGuards, GuardCondition, MachineFacts, Readings,
    Thresholds,
};

use self::conditions::{Latch, resource_conditions};
use super::rates::RateReading;
use super::{Condition, Direction};
use crate::config::{OverrideMode, ThrottlingConfig};
use crate::names::QueueName;

#[derive(Debug, Clone, Default)]
struct DirectionState {
    rate: Latch,
    /// No rate imbalance engages before this: its sampling window still holds time another
    /// cause throttled the direction (requests waiting out that throttling are not an
    /// imbalance of their own).
    rate_quiet_until: Duration,
    /// Overage-seconds accumulated by the delay law's integral term.
    integral: f64,
    delay: Duration,
    /// Messages per second admitted while pacing; None = not pacing.
    pace_rate: Option<f64>,
    /// Messages queued when a rate pace took hold: what queues up beyond it while the pace
    /// holds and relaxes is held back by the pace, and is let in before the pace ends.
    queued_at_pace: Option<u64>,
    /// Publishing after database size: senders that wait for each admission use the relaxing
    /// pace, so it is held (see [`Controller::relaxed_pace`]).
    pace_in_use: bool,
    /// Delivery only: since when the window has held enough receives and no completion (see
    /// [`Controller::outgoing_judged`]).
    nothing_done_since: Option<Duration>,
    /// The condition whose actions are in effect (kept while they relax).
    cause: Option<Condition>,
    /// Since when no condition has been active while `cause` is kept (see `min_dwell`).
    cause_clear_since: Option<Duration>,
    state: u8,
    since: Duration,
}

/// One receiving queue as the controller sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueLoad {
    /// Queue name.
    pub name: QueueName,
    /// Configured MaximumConcurrencyLevel.
    pub max: u32,
    /// Messages being received or processed now (not receivers waiting out a delay).
    pub in_flight: u32,
}

impl QueueLoad {
    /// A queue with nothing in flight.
    pub fn idle(name: QueueName, max: u32) -> Self {
        QueueLoad {
            name,
            max,
            in_flight: 0,
        }
    }
}

/// The controller. Feed it [`Readings`] every sample interval.
#[derive(Debug, Clone)]
pub struct Controller {
    config: ThrottlingConfig,
    thresholds: Thresholds,
    resource_active: BTreeMap<Condition, Latch>,
    directions: [DirectionState; 2],
    limits: BTreeMap<QueueName, u32>,
    last_tick: Option<Duration>,
    /// When a shrinking condition last held the limits (over or above its resume line).
    last_pressure: Option<Duration>,
    /// Each resource's value at the last tick with nothing in process: the part of a value
    /// that does not grow with the messages in flight.
    idle_values: BTreeMap<Condition, f64>,
    /// Messages stored at the last tick, to tell whether the backlog grows.
    last_database_size: Option<u64>,
}

/// For this long after a shrinking condition last held the limits, a limit grows from what is
/// in flight (at most twice it plus a step), not from itself: right after an episode the
/// resource can dip far below its line while little is in flight, and a limit grown from
/// itself would let a burst start at once that the next sample sees too late.
const AFTER_PRESSURE: Duration = Duration::from_secs(2);

/// What one direction's decision this tick depends on besides its conditions.
struct DirectionTick<'a> {
    direction: Direction,
    now: Duration,
    /// Seconds since the last tick.
    dt: f64,
    /// Throttling applies to this direction (enabled, not overridden to never).
    applies: bool,
    rates: RateReading,
    /// How fast the stored backlog drains, when measured.
    drain: Option<f64>,
    /// The stored backlog grew since the last tick.
    backlog_growing: bool,
    /// Messages waiting in the receiving queues (delivery; 0 for publishing).
    queued: u64,
    /// Publishing, when it relaxes from database sessions and delivery has no other cause:
    /// the sessions' mean since the last tick and their threshold, to let the sends that
    /// waited out the episode in by ([`law::session_release_rate`]).
    sessions_release: Option<(f64, f64)>,
    config: &'a crate::config::DirectionConfig,
}

impl Controller {
    /// A controller with these settings and resolved thresholds.
    pub fn new(config: ThrottlingConfig, thresholds: Thresholds) -> Self {
        Controller {
            config,
            thresholds,
            resource_active: BTreeMap::new(),
            directions: Default::default(),
            limits: BTreeMap::new(),
            last_tick: None,
            last_pressure: None,
            idle_values: BTreeMap::new(),
            last_database_size: None,
        }
    }

    /// Replaces the settings (hot reload); state, delays and limits carry over.
    pub fn reconfigure(&mut self, config: ThrottlingConfig, thresholds: Thresholds) {
        self.config = config;
        self.thresholds = thresholds;
    }

    /// The settings in force.
    pub fn config(&self) -> &ThrottlingConfig {
        &self.config
    }

    /// The thresholds in force.
    pub fn thresholds(&self) -> &Thresholds {
        &self.thresholds
    }

    /// Sets one direction's override (admin API); lasts until the next reconfigure.
    pub fn set_override(&mut self, direction: Direction, mode: OverrideMode) {
        match direction {
            Direction::Delivery => self.config.delivery.override_mode = mode,
            Direction::Publishing => self.config.publishing.override_mode = mode,
        }
    }

    fn severity(&self, condition: Condition, direction: Direction) -> u32 {
        let s = &self.config.severity;
        match condition {
            Condition::ProcessMemory => s.process_memory,
            Condition::SystemMemory => s.system_memory,
            Condition::InProcess => s.in_process,
            Condition::Threads => s.threads,
            Condition::DatabaseSize => s.database_size,
            Condition::DatabaseSessions => s.database_sessions,
            Condition::Override => self.direction_config(direction).override_severity,
            Condition::RateImbalance
            | Condition::DownstreamOutage
            | Condition::DownstreamLatency => 0,
        }
    }

    fn direction_config(&self, direction: Direction) -> &crate::config::DirectionConfig {
        match direction {
            Direction::Delivery => &self.config.delivery,
            Direction::Publishing => &self.config.publishing,
        }
    }

    fn applies(&self, direction: Direction) -> bool {
        self.config.enabled && self.direction_config(direction).override_mode != OverrideMode::Never
    }

    /// One sample: `now` is the clock time, `queues` every receiving queue with its max and
    /// what it has in flight.
    pub fn tick(&mut self, now: Duration, readings: &Readings, queues: &[QueueLoad]) -> Decision {
        let dt = self
            .last_tick
            .map(|t| now.saturating_sub(t).as_secs_f64())
            .unwrap_or(0.0);
        self.last_tick = Some(now);
        self.evaluate(now, readings);
        if readings.in_process == 0 {
            for condition in resource_conditions() {
                self.idle_values
                    .insert(condition, readings.value(condition));
            }
        }
        let pressure = self.limit_pressure(readings);
        if pressure.over.is_some() || pressure.holding {
            self.last_pressure = Some(now);
        }
        let after_pressure = self
            .last_pressure
            .is_some_and(|at| now.saturating_sub(at) <= AFTER_PRESSURE);
        let (queue_limits, limits_reduced) = self.limit_queues(&pressure, queues, after_pressure);
        let delivery = self.decide(Direction::Delivery, now, dt, readings, limits_reduced);
        let publishing = self.decide(Direction::Publishing, now, dt, readings, false);
        self.last_database_size = Some(readings.database_size);
        Decision {
            at: now,
            delivery,
            publishing,
            queue_limits,
            shrinking: pressure.holding && self.applies(Direction::Delivery),
        }
    }
}

#[cfg(test)]
mod tests;
