//! The throttling controller: readings in, decisions out. No I/O and no clock of its own: the
//! caller passes the time of each tick, so tests drive hours of behaviour in microseconds.
//!
//! Per tick it
//!
//! 1. evaluates every condition against its threshold with hysteresis: a condition becomes
//!    active when its value rises above the threshold and clears only when it falls below
//!    threshold x `resume_ratio`;
//! 2. picks each direction's state: the active condition of highest [`Condition::rank`];
//! 3. applies the delay law: while a resource condition (or a forced override) of severity
//!    `s` holds, the delay starts at `initial_delay` and doubles every `100 / s` seconds, up to
//!    `max_delay`; with none, it halves every sample and drops to zero below 1 ms;
//! 4. paces a direction with an active rate imbalance: admissions spaced
//!    `1 / (outgoing rate x overdrive)` seconds apart;
//! 5. under memory, in-process or thread pressure, shrinks every queue's concurrency limit
//!    multiplicatively (floor 1), and grows it back by a fixed step per sample when clear.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::rates::RateReading;
use super::{Condition, Direction, state_name};
use crate::config::{OverrideMode, ThrottlingConfig};

/// Delays below this decay straight to zero.
const DELAY_FLOOR: Duration = Duration::from_millis(1);

/// What the machine looks like, for thresholds given per CPU or as a share of memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MachineFacts {
    /// Physical memory (or the cgroup limit, when lower), bytes.
    pub total_memory: u64,
    /// CPUs available to the process.
    pub cpus: u64,
}

/// Resolved thresholds; None = condition off.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Thresholds {
    /// Bytes of process RSS.
    pub process_memory: Option<u64>,
    /// Bytes of system used memory.
    pub system_memory: Option<u64>,
    /// In-process messages.
    pub in_process: Option<u64>,
    /// Threads.
    pub threads: Option<u64>,
    /// Messages in the host's queues.
    pub database_size: Option<u64>,
    /// Connections in use.
    pub database_sessions: Option<u64>,
}

impl Thresholds {
    /// Applies the settings to this machine.
    pub fn resolve(config: &ThrottlingConfig, machine: MachineFacts) -> Self {
        let per_cpu = |v: u64| (v > 0).then(|| v.saturating_mul(machine.cpus.max(1)));
        Thresholds {
            process_memory: config.process_memory.resolve(machine.total_memory),
            system_memory: config.system_memory.resolve(machine.total_memory),
            in_process: per_cpu(config.in_process_per_cpu),
            threads: per_cpu(config.threads_per_cpu),
            database_size: (config.database_size > 0).then_some(config.database_size),
            database_sessions: per_cpu(config.database_sessions_per_cpu),
        }
    }

    fn of(&self, condition: Condition) -> Option<u64> {
        match condition {
            Condition::ProcessMemory => self.process_memory,
            Condition::SystemMemory => self.system_memory,
            Condition::InProcess => self.in_process,
            Condition::Threads => self.threads,
            Condition::DatabaseSize => self.database_size,
            Condition::DatabaseSessions => self.database_sessions,
            Condition::RateImbalance | Condition::Override => None,
        }
    }
}

/// Sensor values for one tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Readings {
    /// Process resident memory, bytes.
    pub process_memory: u64,
    /// System used physical memory, bytes.
    pub system_memory_used: u64,
    /// Messages handed to handlers and not done.
    pub in_process: u64,
    /// Threads in the process.
    pub threads: u64,
    /// Messages in the host's queues.
    pub database_size: u64,
    /// Database connections in use.
    pub database_sessions: u64,
    /// Delivery rates.
    pub delivery: RateReading,
    /// Publishing rates.
    pub publishing: RateReading,
}

impl Readings {
    fn value(&self, condition: Condition) -> f64 {
        match condition {
            Condition::ProcessMemory => self.process_memory as f64,
            Condition::SystemMemory => self.system_memory_used as f64,
            Condition::InProcess => self.in_process as f64,
            Condition::Threads => self.threads as f64,
            Condition::DatabaseSize => self.database_size as f64,
            Condition::DatabaseSessions => self.database_sessions as f64,
            Condition::RateImbalance | Condition::Override => 0.0,
        }
    }

    fn rates(&self, direction: Direction) -> RateReading {
        match direction {
            Direction::Delivery => self.delivery,
            Direction::Publishing => self.publishing,
        }
    }
}

/// One condition as seen by one direction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
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
pub struct DirectionDecision {
    /// Which direction.
    pub direction: Direction,
    /// BizTalk state code (0 = not throttling).
    pub state: u8,
    /// BizTalk state name.
    pub state_name: &'static str,
    /// Wait per admission.
    #[serde(serialize_with = "as_secs")]
    pub delay: Duration,
    /// Spacing between admissions when pacing a rate imbalance.
    #[serde(serialize_with = "as_secs_opt")]
    pub pace: Option<Duration>,
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

fn as_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

fn as_secs_opt<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// Everything decided in one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// Clock time of the tick.
    #[serde(serialize_with = "as_secs")]
    pub at: Duration,
    /// Delivery.
    pub delivery: DirectionDecision,
    /// Publishing.
    pub publishing: DirectionDecision,
    /// Effective concurrency limit per queue (<= its max).
    pub queue_limits: BTreeMap<String, u32>,
    /// True while delivery pressure is shrinking the limits.
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

#[derive(Debug, Clone, Default)]
struct DirectionState {
    rate_active: bool,
    delay_secs: f64,
    state: u8,
    since: Duration,
}

/// The controller. Feed it [`Readings`] every sample interval.
#[derive(Debug, Clone)]
pub struct Controller {
    config: ThrottlingConfig,
    thresholds: Thresholds,
    resource_active: BTreeMap<Condition, bool>,
    directions: [DirectionState; 2],
    limits: BTreeMap<String, u32>,
    last_tick: Option<Duration>,
}

const RESOURCE_CONDITIONS: [Condition; 6] = [
    Condition::ProcessMemory,
    Condition::SystemMemory,
    Condition::InProcess,
    Condition::Threads,
    Condition::DatabaseSize,
    Condition::DatabaseSessions,
];

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
            Condition::RateImbalance => 0,
        }
    }

    fn direction_config(&self, direction: Direction) -> &crate::config::DirectionConfig {
        match direction {
            Direction::Delivery => &self.config.delivery,
            Direction::Publishing => &self.config.publishing,
        }
    }

    /// One sample: `now` is the clock time, `queues` every receiving queue with its max.
    pub fn tick(
        &mut self,
        now: Duration,
        readings: &Readings,
        queues: &[(String, u32)],
    ) -> Decision {
        let dt = self
            .last_tick
            .map(|t| now.saturating_sub(t).as_secs_f64())
            .unwrap_or(0.0);
        self.last_tick = Some(now);
        let resume = self.config.resume_ratio;

        for condition in RESOURCE_CONDITIONS {
            let threshold = self.thresholds.of(condition);
            let value = readings.value(condition);
            let active = self.resource_active.entry(condition).or_insert(false);
            *active = match threshold {
                None => false,
                Some(t) => hysteresis(*active, value, t as f64, resume),
            };
        }

        let delivery = self.decide(Direction::Delivery, now, dt, readings);
        let publishing = self.decide(Direction::Publishing, now, dt, readings);

        let shrinking = self.config.enabled
            && self.config.delivery.override_mode != OverrideMode::Never
            && delivery
                .conditions
                .iter()
                .any(|c| c.active && c.condition.shrinks_concurrency());
        let mut limits = BTreeMap::new();
        for (name, max) in queues {
            let max = (*max).max(1);
            let current = self.limits.get(name).copied().unwrap_or(max).min(max);
            let next = if shrinking {
                ((current as f64 * self.config.concurrency_decrease_ratio).floor() as u32).max(1)
            } else {
                current
                    .saturating_add(self.config.concurrency_increase_step)
                    .min(max)
            };
            limits.insert(name.clone(), next);
        }
        self.limits = limits.clone();

        Decision {
            at: now,
            delivery,
            publishing,
            queue_limits: limits,
            shrinking,
        }
    }

    fn decide(
        &mut self,
        direction: Direction,
        now: Duration,
        dt: f64,
        readings: &Readings,
    ) -> DirectionDecision {
        let dir_config = self.direction_config(direction).clone();
        let resume = self.config.resume_ratio;
        let rates = readings.rates(direction);
        let rate_limit = rates.outgoing_per_sec * dir_config.overdrive_percent as f64 / 100.0;

        let idx = direction.index();
        let rate_active = rates.samples >= dir_config.min_samples
            && hysteresis(
                self.directions[idx].rate_active,
                rates.incoming_per_sec,
                rate_limit,
                resume,
            );
        self.directions[idx].rate_active = rate_active;

        let mut conditions = Vec::new();
        for condition in Condition::ALL {
            let Some(state) = condition.state_code(direction) else {
                continue;
            };
            let (active, value, threshold) = match condition {
                Condition::RateImbalance => (rate_active, rates.incoming_per_sec, rate_limit),
                Condition::Override => {
                    let forced = dir_config.override_mode == OverrideMode::Throttle;
                    (forced, if forced { 1.0 } else { 0.0 }, 1.0)
                }
                other => (
                    self.resource_active.get(&other).copied().unwrap_or(false),
                    readings.value(other),
                    self.thresholds.of(other).unwrap_or(0) as f64,
                ),
            };
            conditions.push(ConditionStatus {
                condition,
                state,
                active,
                value,
                threshold,
            });
        }

        let applies = self.config.enabled && dir_config.override_mode != OverrideMode::Never;
        let top = if applies {
            conditions
                .iter()
                .filter(|c| c.active)
                .max_by_key(|c| c.condition.rank())
                .map(|c| c.condition)
        } else {
            None
        };
        let severity = top.map(|c| self.severity(c, direction)).unwrap_or(0);
        let initial = self.config.initial_delay.as_secs_f64();
        let max_delay = dir_config.max_delay.as_secs_f64();

        let st = &mut self.directions[idx];
        let state = top.and_then(|c| c.state_code(direction)).unwrap_or(0);
        if state != st.state || st.since > now {
            st.state = state;
            st.since = now;
        }
        st.delay_secs = match top {
            _ if !applies => 0.0,
            Some(c) if c != Condition::RateImbalance => {
                if st.delay_secs <= 0.0 {
                    initial.min(max_delay)
                } else {
                    (st.delay_secs * 2f64.powf(dt * severity as f64 / 100.0)).min(max_delay)
                }
            }
            _ => {
                let halved = if dt > 0.0 {
                    st.delay_secs / 2.0
                } else {
                    st.delay_secs
                };
                if halved < DELAY_FLOOR.as_secs_f64() {
                    0.0
                } else {
                    halved
                }
            }
        };
        let pace = (applies && rate_active).then(|| {
            if rate_limit > 0.0 {
                Duration::from_secs_f64((1.0 / rate_limit).min(max_delay))
            } else {
                dir_config.max_delay
            }
        });

        DirectionDecision {
            direction,
            state,
            state_name: state_name(direction, state),
            delay: Duration::from_secs_f64(st.delay_secs),
            pace,
            state_duration: now.saturating_sub(st.since),
            override_mode: dir_config.override_mode,
            conditions,
        }
    }
}

/// Active above `threshold`; once active, stays active until below `threshold x resume`.
fn hysteresis(active: bool, value: f64, threshold: f64, resume: f64) -> bool {
    if active {
        value >= threshold * resume
    } else {
        value > threshold
    }
}

#[cfg(test)]
mod tests;
