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
//!    it, fast when far below and by steps near it ([`law::cut`], [`law::grow`]);
//! 3. **delays** each direction by a law proportional to the overage and integral over its
//!    persistence, scaled by severity and capped ([`law::delay`]); a cleared cause relaxes the
//!    delay over a few samples instead of keeping it;
//! 4. **paces** publishing under database size, sessions or memory against the backlog's
//!    measured drain rate, so an open-loop publisher settles the backlog at the threshold
//!    ([`law::paced_rate`]), and paces a rate imbalance at the recent outgoing rate x
//!    overdrive; pacing needs a measured rate and relaxes gradually;
//! 5. **reports the truth**: a direction shows the state of its cause while any action
//!    (delay, pace, limit below max) is in effect, flagged `recovering` once the cause cleared.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::law;
use super::rates::RateReading;
use super::{Condition, Direction, state_name};
use crate::config::{OverrideMode, ThrottlingConfig};

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

    /// The threshold of one condition (None: off, or not a resource condition).
    pub fn of(&self, condition: Condition) -> Option<u64> {
        match condition {
            Condition::ProcessMemory => self.process_memory,
            Condition::SystemMemory => self.system_memory,
            Condition::InProcess => self.in_process,
            Condition::Threads => self.threads,
            Condition::DatabaseSize => self.database_size,
            Condition::DatabaseSessions => self.database_sessions,
            Condition::RateImbalance
            | Condition::Override
            | Condition::DownstreamOutage
            | Condition::DownstreamLatency => None,
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
    /// Database connections in use, averaged over the delivery ceiling's reads since the
    /// last tick, when it guards them.
    pub database_sessions_mean: Option<f64>,
    /// Messages waiting in this host's receiving queues that have room below their limits
    /// (their last known depths): the backlog a delivery pace can be holding back.
    pub queued: u64,
    /// How fast the stored backlog drains (messages/s over the last seconds), when known:
    /// what publishing is paced against under publishing pressure.
    pub database_drain_per_sec: Option<f64>,
    /// Delivery rates.
    pub delivery: RateReading,
    /// Publishing rates.
    pub publishing: RateReading,
    /// What the delivery ceiling measured for each guarded resource on which it held receives
    /// back since the last tick (see [`CeilingHolds`]).
    pub held: CeilingHolds,
    /// What the queues' downstream guards do (outage mode, the latency-aware limit).
    pub downstream: DownstreamGuards,
}

/// The queues' downstream guards as delivery conditions: the worst queue of each kind. The
/// queues decide when they are on (`queue::downstream`); the controller shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DownstreamGuards {
    /// Outage mode: failed attempts in a row against `consecutive_failures`.
    pub outage: GuardCondition,
    /// Latency-aware limit: the last interval's latency (ms) against the line it rose past.
    pub latency: GuardCondition,
}

/// One downstream guard: on or off, with the value and threshold it is judged by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GuardCondition {
    /// On (decided by the queue).
    pub active: bool,
    /// Its value.
    pub value: f64,
    /// Its threshold.
    pub threshold: f64,
}

impl DownstreamGuards {
    /// The guard a downstream condition shows.
    pub fn of(&self, condition: Condition) -> GuardCondition {
        match condition {
            Condition::DownstreamLatency => self.latency,
            _ => self.outage,
        }
    }
}

/// The resources the delivery ceiling guards between ticks: each grows with the messages in
/// process (memory they hold, in the process and so on the machine; blocking threads they
/// occupy; connections they keep open; the count itself), so it can be bounded by how many
/// receives start.
pub const CEILING_GUARDED: [Condition; 5] = [
    Condition::ProcessMemory,
    Condition::SystemMemory,
    Condition::Threads,
    Condition::DatabaseSessions,
    Condition::InProcess,
];

/// For each resource of [`CEILING_GUARDED`] on which the ceiling held receives back since the
/// last tick, because they would take it past its threshold: how many messages in process
/// fit under the threshold at what each one costs now.
///
/// A held condition is acting, so it shows as active (throttling that acts is never state
/// 0), and the delivery limits are cut to the tightest room of an estimated cost
/// ([`CeilingHolds::tightest`]), so that the limit an operator sees is the concurrency the
/// resource allows, not a number the ceiling quietly undercuts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CeilingHolds {
    /// Messages in process that process memory has room for.
    pub process_memory: Option<u64>,
    /// Messages in process that the machine's memory has room for.
    pub system_memory: Option<u64>,
    /// Messages in process that the thread threshold has room for.
    pub threads: Option<u64>,
    /// Messages in process that the database session threshold has room for.
    pub database_sessions: Option<u64>,
    /// Messages in process that the in-process threshold has room for: the threshold.
    pub in_process: Option<u64>,
}

impl CeilingHolds {
    /// The room measured for `condition`, when the ceiling held receives back on it.
    pub fn of(&self, condition: Condition) -> Option<u64> {
        let mut copy = *self;
        copy.slot(condition).and_then(|slot| *slot)
    }

    /// Records a hold on `condition` with this room (the largest seen since the last tick:
    /// the ceiling's estimate only grows as messages turn out cheaper).
    pub fn record(&mut self, condition: Condition, room: u64) {
        if let Some(slot) = self.slot(condition) {
            *slot = Some(slot.map_or(room, |r| r.max(room)));
        }
    }

    fn slot(&mut self, condition: Condition) -> Option<&mut Option<u64>> {
        match condition {
            Condition::ProcessMemory => Some(&mut self.process_memory),
            Condition::SystemMemory => Some(&mut self.system_memory),
            Condition::Threads => Some(&mut self.threads),
            Condition::DatabaseSessions => Some(&mut self.database_sessions),
            Condition::InProcess => Some(&mut self.in_process),
            _ => None,
        }
    }

    /// The smallest room among the held resources whose cost per message the ceiling
    /// estimates and for which `counts` (the condition is active). The in-process count is
    /// left out: its room is the threshold, exact, and the ceiling holds all queues together
    /// to it, so the busiest queues take what idle ones do not use. Cut to it, each queue's
    /// limit was a share of the threshold by its max, and a host whose maxes add up above the
    /// threshold showed every limit below its max in state 0.
    pub fn tightest(&self, counts: impl Fn(Condition) -> bool) -> Option<u64> {
        CEILING_GUARDED
            .into_iter()
            .filter(|c| *c != Condition::InProcess && counts(*c))
            .filter_map(|c| self.of(c))
            .min()
    }
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
            Condition::DownstreamOutage => self.downstream.outage.value,
            Condition::DownstreamLatency => self.downstream.latency.value,
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
    /// The cause has cleared and its actions are relaxing (the state shows the cause until
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
    pub queue_limits: BTreeMap<String, u32>,
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
    pub name: String,
    /// Configured MaximumConcurrencyLevel.
    pub max: u32,
    /// Messages being received or processed now (not receivers waiting out a delay).
    pub in_flight: u32,
}

impl QueueLoad {
    /// A queue with nothing in flight.
    pub fn idle(name: &str, max: u32) -> Self {
        QueueLoad {
            name: name.to_string(),
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
    limits: BTreeMap<String, u32>,
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

/// The conditions measured against a resource threshold (all but rate imbalance, the
/// override and the queues' downstream guards).
fn resource_conditions() -> impl Iterator<Item = Condition> {
    Condition::ALL.into_iter().filter(|c| {
        !matches!(c, Condition::RateImbalance | Condition::Override) && !c.acted_by_queue()
    })
}

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

impl DirectionTick<'_> {
    /// Whether `c` paces publishing against the backlog's drain instead of delaying it.
    fn paced_by_drain(&self, c: &ConditionStatus) -> bool {
        self.direction == Direction::Publishing
            && c.condition.paces_publishing()
            && self.drain.is_some()
    }

    /// The drain law's rate for a pace relaxing from database size (`cause`), if it is.
    fn database_size_release(
        &self,
        conditions: &[ConditionStatus],
        cause: Option<Condition>,
        resume_ratio: f64,
    ) -> Option<f64> {
        let relaxing_from = conditions.iter().find(|c| {
            Some(c.condition) == cause
                && c.condition == Condition::DatabaseSize
                && self.paced_by_drain(c)
        })?;
        self.drain_paced_rate(relaxing_from, resume_ratio)
    }

    /// The rate the drain law paces `c` at: its own overage's, except for database size once
    /// its cause has ended (sends offered now below the drain: what is left is the sends that
    /// waited out the episode). Those are let in toward a setpoint below the resume line
    /// ([`law::release_rate`]) instead of at the threshold, so the depth falls through the
    /// line while they go in and the condition clears meanwhile: the state ends when the last
    /// of them is in, not a fall through the band, `resume_after` and `min_dwell` later.
    fn drain_paced_rate(&self, c: &ConditionStatus, resume_ratio: f64) -> Option<f64> {
        let drain = self.drain?;
        Some(
            if c.condition == Condition::DatabaseSize && self.rates.recent_incoming_per_sec < drain
            {
                law::release_rate(drain, c.value, c.threshold, resume_ratio)
            } else {
                law::paced_rate(drain, condition_overage(c))
            },
        )
    }
}

/// Whether senders use a relaxing pace `p` (`in_use` at the last tick), with `waiting`
/// requests on it now: see `Controller::relaxed_pace`.
fn pace_in_use(rates: &RateReading, (p, in_use): (f64, bool), waiting: u64) -> bool {
    let sent = rates.last_incoming_per_sec;
    match in_use {
        true => sent >= law::PACE_STILL_USED_SHARE * p,
        false => waiting > 0 && sent >= law::PACE_USED_SHARE * p,
    }
}

/// Where the delivery limits stand this tick.
struct LimitPressure {
    /// Worst value / threshold among shrinking conditions above their threshold.
    over: Option<f64>,
    /// A shrinking condition is active (above its resume line).
    holding: bool,
    /// 1 - value / resume line of the tightest shrinking condition (1 when none is on).
    headroom: f64,
    /// Above [`law::APPROACH_SHARE`] of a threshold: the share the messages in flight may grow
    /// by before a resource that scales with them reaches its resume line.
    approach: Option<f64>,
    /// Messages in process that the tightest guarded resource has room for, when the delivery
    /// ceiling held receives back (see [`CeilingHolds`]).
    ceiling_room: Option<u64>,
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

    /// Hysteresis of every resource condition, in value and in time ([`Latch`]).
    fn evaluate(&mut self, now: Duration, readings: &Readings) {
        let resume = self.config.resume_ratio;
        let resume_after = self.config.resume_after;
        for condition in resource_conditions() {
            let threshold = self.thresholds.of(condition);
            let value = readings.value(condition);
            let latch = self.resource_active.entry(condition).or_default();
            let held = readings.held.of(condition).is_some();
            match threshold {
                None => *latch = Latch::default(),
                // A hold is reported for the whole interval since the last tick. One made
                // early in it, by a resource that has fallen below half its threshold since,
                // is over: counted, it showed the condition for one tick after its cause had
                // gone (state 10 -> 4 -> 10 as an override began in `mixed`).
                Some(t) => {
                    let t = t as f64;
                    let over = (held && value >= t * law::APPROACH_SHARE) || value > t;
                    latch.update(now, over, value >= t * resume, resume_after);
                }
            }
        }
    }

    fn limit_pressure(&self, readings: &Readings) -> LimitPressure {
        let resume = self.config.resume_ratio;
        let mut pressure = LimitPressure {
            over: None,
            holding: false,
            headroom: 1.0,
            approach: None,
            // Only holds that count as pressure (their condition active: see `evaluate`) cut
            // the limits. A hold on a resource below half its threshold is not shown, so it
            // must not cut either: after `demo`'s memory phase the allocator kept RSS just under
            // half its threshold, the ceiling's noisy estimate held a few receives now and
            // then, and the limits sat at 5-24 of 64 for good, the state saying "recovering"
            // (in state 0 before states were made to tell the truth).
            ceiling_room: readings.held.tightest(|c| {
                self.resource_active
                    .get(&c)
                    .is_some_and(|latch| latch.active)
            }),
        };
        for condition in resource_conditions() {
            let Some(threshold) = self.thresholds.of(condition) else {
                continue;
            };
            if !condition.shrinks_concurrency() || threshold == 0 {
                continue;
            }
            let ratio = readings.value(condition) / threshold as f64;
            let active = self
                .resource_active
                .get(&condition)
                .is_some_and(|latch| latch.active);
            if active {
                pressure.holding = true;
                if ratio > 1.0 {
                    pressure.over = Some(pressure.over.map_or(ratio, |o| o.max(ratio)));
                }
            }
            // Only what the messages in process add can grow with them: the part of the
            // value above what it read with nothing in process (a machine's memory used by
            // everything else is not ours to shrink). Headroom is measured on that part:
            // measured on the whole value, a machine whose other processes sit near the line
            // gave the limit a step a sample, 47 samples from 1 back to 48 (12 s).
            let base = self.idle_values.get(&condition).copied().unwrap_or(0.0);
            let ours = readings.value(condition) - base;
            let line = resume * threshold as f64 - base;
            let headroom = if line > 0.0 {
                1.0 - ours.max(0.0) / line
            } else {
                0.0
            };
            pressure.headroom = pressure.headroom.min(headroom);
            if ratio >= law::APPROACH_SHARE && ours > 0.0 {
                let room = (line / ours).max(0.0);
                pressure.approach = Some(pressure.approach.map_or(room, |r: f64| r.min(room)));
            }
        }
        pressure
    }

    /// Each queue's limit: cut from in flight while over, held while above the resume line,
    /// grown back below it; max at once when delivery is not throttled. Also says whether any
    /// limit is below its max (an action in effect).
    ///
    /// The in-process count plays no part here: it *is* the messages in flight, so the
    /// delivery ceiling holds all queues together at its threshold, exactly, between ticks,
    /// and the busiest queues take the room idle ones leave. (A share of the threshold per
    /// queue by its max left limits below max in state 0; cutting the limits for it made a
    /// sawtooth of one-second episodes on a permanent backlog.)
    fn limit_queues(
        &mut self,
        pressure: &LimitPressure,
        queues: &[QueueLoad],
        after_pressure: bool,
    ) -> (BTreeMap<String, u32>, bool) {
        let applies = self.applies(Direction::Delivery);
        let resume = self.config.resume_ratio;
        let total_max: u64 = queues.iter().map(|q| q.max.max(1) as u64).sum();
        // A queue's part of a bound on all queues' messages together, by its max.
        let share = |bound: Option<u64>, max: u32| match bound {
            Some(total) if applies && total_max > 0 => {
                let share = total as f64 * max as f64 / total_max as f64;
                (share.ceil() as u32).max(1)
            }
            _ => u32::MAX,
        };
        let mut limits = BTreeMap::new();
        let mut reduced = false;
        for q in queues {
            let max = q.max.max(1);
            let current = self.limits.get(&q.name).copied().unwrap_or(max).min(max);
            let next = match pressure.over {
                _ if !applies => max,
                // A cut already made is still draining: wait for it before cutting again.
                Some(_) if q.in_flight > current => current,
                Some(ratio) => law::cut(
                    q.in_flight,
                    current,
                    ratio,
                    resume,
                    self.config.concurrency_decrease_ratio,
                ),
                None if pressure.holding => current,
                None => {
                    let step = self.config.concurrency_increase_step;
                    let mut grown = law::grow(current, max, pressure.headroom, step);
                    if after_pressure && q.in_flight > 0 {
                        grown = grown.min(current.max(q.in_flight.saturating_mul(2) + step));
                    }
                    // Only a queue that uses its whole limit (a backlog waits behind it) could
                    // carry the resource up with a bigger limit. An idle queue has nothing in
                    // flight whose growth the cap could bound: capping it would pin its limit
                    // at one for good (a resource above half its threshold for reasons of its
                    // own, such as system memory). A queue below its limit is not held by it:
                    // capped, its limit stayed at 7-19 of 64 after `demo`'s memory phase, with
                    // RSS kept just above half the threshold by the allocator, and the state
                    // said "recovering" for good. Between ticks the ceiling guards the resource
                    // against a burst either way.
                    match pressure.approach {
                        Some(room) if q.in_flight > 0 && q.in_flight >= current => {
                            grown.min(law::approach_cap(q.in_flight, room, step))
                        }
                        _ => grown,
                    }
                }
            };
            // What the guarded resources have room for, while the ceiling holds receives back.
            let next = next
                .min(max)
                .min(share(pressure.ceiling_room, q.max.max(1)));
            reduced |= next < max;
            limits.insert(q.name.clone(), next);
        }
        self.limits = limits.clone();
        (limits, reduced)
    }

    /// One direction's decision: delay, pace and state, from its conditions.
    fn decide(
        &mut self,
        direction: Direction,
        now: Duration,
        dt: f64,
        readings: &Readings,
        limits_reduced: bool,
    ) -> DirectionDecision {
        let config = self.direction_config(direction).clone();
        let conditions = self.conditions(direction, now, readings, &config);
        let applies = self.applies(direction);
        let tick = DirectionTick {
            direction,
            now,
            dt,
            applies,
            rates: readings.rates(direction),
            drain: readings.database_drain_per_sec.filter(|d| *d > 0.0),
            backlog_growing: self
                .last_database_size
                .is_some_and(|last| readings.database_size > last),
            queued: match direction {
                Direction::Delivery => readings.queued,
                Direction::Publishing => 0,
            },
            sessions_release: self.sessions_release(direction, readings),
            config: &config,
        };
        let top = conditions
            .iter()
            .filter(|c| applies && c.active)
            .max_by_key(|c| c.condition.rank())
            .copied();
        self.update_delay(&tick, top);
        let pace = self.update_pace(&tick, &conditions);
        self.update_state(&tick, top, conditions, pace, limits_reduced)
    }

    /// What publishing lets the sends that waited out a database-sessions episode in by, when
    /// that is what it relaxes from ([`DirectionTick::sessions_release`]). Not while
    /// delivery has another cause: its receivers then drain what that cause allows, and the
    /// sessions' mean says nothing of what publishing adds.
    fn sessions_release(&self, direction: Direction, readings: &Readings) -> Option<(f64, f64)> {
        let relaxing = self.directions[direction.index()].cause;
        let delivery = self.directions[Direction::Delivery.index()].cause;
        let threshold = self.thresholds.database_sessions? as f64;
        (direction == Direction::Publishing
            && relaxing == Some(Condition::DatabaseSessions)
            && delivery.is_none_or(|c| c == Condition::DatabaseSessions))
        .then(|| {
            let mean = readings
                .database_sessions_mean
                .unwrap_or(readings.database_sessions as f64);
            (mean, threshold)
        })
    }

    /// The delay: the top condition's, unless it paces instead; relaxing when none holds.
    fn update_delay(&mut self, tick: &DirectionTick, top: Option<ConditionStatus>) {
        let cause = top.filter(|c| {
            c.condition != Condition::RateImbalance
                && !c.condition.acted_by_queue()
                && !tick.paced_by_drain(c)
        });
        let severity = cause.map_or(0, |c| self.severity(c.condition, tick.direction));
        let initial = self.config.initial_delay;
        let st = &mut self.directions[tick.direction.index()];
        match cause {
            Some(c) => {
                let e = condition_overage(&c);
                let cap = tick.config.max_delay.as_secs_f64();
                st.integral = law::integrate(st.integral, e, tick.dt, cap, severity);
                st.delay = law::delay(initial, severity, e, st.integral, tick.config.max_delay);
            }
            None => {
                st.integral = 0.0;
                st.delay = if tick.applies {
                    law::relax_delay(st.delay)
                } else {
                    Duration::ZERO
                };
            }
        }
    }

    /// The pace: the strictest of drain pacing and rate pacing, relaxing when neither holds.
    /// Returns the interval between admissions, if any.
    fn update_pace(
        &mut self,
        tick: &DirectionTick,
        conditions: &[ConditionStatus],
    ) -> Option<Duration> {
        let rates = tick.rates;
        let mut target: Option<f64> = None;
        let mut rate_paced = false;
        for c in conditions.iter().filter(|c| tick.applies && c.active) {
            let rate = if tick.paced_by_drain(c) {
                tick.drain_paced_rate(c, self.config.resume_ratio)
            } else if c.condition == Condition::RateImbalance {
                rate_paced = true;
                Some(rates.recent_outgoing_per_sec * tick.config.overdrive_percent as f64 / 100.0)
                    .filter(|r| *r > 0.0)
            } else {
                None
            };
            if let Some(r) = rate {
                target = Some(target.map_or(r, |t: f64| t.min(r)));
            }
        }
        let st = &mut self.directions[tick.direction.index()];
        if rate_paced {
            st.queued_at_pace.get_or_insert(tick.queued);
        }
        // Requests waiting on the pace: in the admission, and (delivery) the messages that
        // queued up beyond what was queued when a rate pace took hold. Receivers wait in the
        // admission only for messages they were started for; without the queued ones, a pace
        // that relaxed ended with 190 messages held back in the queue, and they were all
        // received within half a second. (Only queues with room count: a queue at its limit
        // holds its own backlog; see `Readings::queued`.)
        let held_back = st
            .queued_at_pace
            .map_or(0, |base| tick.queued.saturating_sub(base));
        let waiting = rates.waiting.max(held_back);
        let next = match (tick.applies, target, st.pace_rate) {
            (false, _, _) => None,
            (true, Some(t), _) => Some(t),
            (true, None, Some(p)) => {
                // Copied out: `st` borrows `self` mutably until here.
                let (cause, in_use) = (st.cause, st.pace_in_use);
                let (next, in_use) =
                    self.relaxed_pace(tick, conditions, cause, (p, in_use), waiting);
                self.directions[tick.direction.index()].pace_in_use = in_use;
                next
            }
            (true, None, None) => None,
        };
        let st = &mut self.directions[tick.direction.index()];
        if next.is_none() || target.is_some() {
            st.pace_in_use = false;
        }
        st.pace_rate = next;
        if st.pace_rate.is_none() {
            st.queued_at_pace = None;
        }
        st.pace_rate
            .and_then(|r| law::pace_interval(r, tick.config.max_delay))
    }

    /// The pace after its causes have cleared, from `p` so far (`in_use` when senders were
    /// using it), with `waiting` requests on it; None once it ends. Also says whether it is
    /// in use now.
    fn relaxed_pace(
        &self,
        tick: &DirectionTick,
        conditions: &[ConditionStatus],
        cause: Option<Condition>,
        (p, in_use): (f64, bool),
        waiting: u64,
    ) -> (Option<f64>, bool) {
        let rates = tick.rates;
        let mut next = p * law::PACE_RELAX_GROWTH;
        let passes_within_a_sample = |rate: f64| waiting as f64 <= rate * tick.dt.max(0.05);
        // After a cause that paces against the drain, the requests that waited it out
        // are let in no faster than the backlog drains, with room to spare only as far
        // as its resource is below the threshold (the drain law, not a free release),
        // while the stored backlog grows. While it does not, or once those left would
        // pass within a sample at the pace so far, the pace opens by itself: the drain
        // is measured from what is let in, so with the backlog keeping up a pace capped
        // at the drain would hardly grow and never end.
        //
        // Only after database size: the backlog is its resource. After memory or
        // sessions, a backlog that grows because another cause holds delivery (slow
        // handlers filling the in-process count) would keep publishing paced, and its
        // state showing memory, for as long as that other cause lasts.
        //
        // Senders that wait for each admission before their next send (a retry of failed
        // messages, a handler sending in a loop) never leave more than one request each
        // waiting, so "those left would pass within a sample" holds for them however much
        // they want to send: let the pace open on that alone and a retry of 50 000 went in at
        // 14 000 a second, twice the threshold within a sample. What tells their demand is
        // that they use the pace: one waits on it now, and over the last sample they sent
        // nearly all it let in (the two-second window would lag a pace that moves by 4x in a
        // tick); once in use, it stays so while they send at least half of it (between two
        // transactions of a retry nobody waits for a moment, and one tick seen so let the
        // pace grow past what they had been sending). Their demand beyond it is unknown, so
        // while they use it the pace stays at the drain law's rate, which holds the depth at
        // or under the threshold; it relaxes as after any cause once they stop.
        let pace_used = pace_in_use(&rates, (p, in_use), waiting);
        let mut held_by_use = false;
        if let Some(capped) =
            tick.database_size_release(conditions, cause, self.config.resume_ratio)
        {
            if pace_used {
                next = next.min(capped);
                held_by_use = true;
            } else if tick.backlog_growing && !passes_within_a_sample(p) {
                next = next.min(capped);
            }
        }
        let offered = rates.recent_incoming_per_sec.max(1.0);
        // Each release after a cause that would engage again if let in at once has its own
        // line and its own end (the two are never both the relaxing cause); any other pace
        // ends once new requests pass with room to spare and those still waiting would pass
        // within one sample at this pace anyway (no burst at the end).
        let (next, ends_at, needs_headroom) = match (cause, tick.sessions_release) {
            // After a rate imbalance, what the pace held back goes in at the resume line
            // (recent outgoing x overdrive x resume ratio), and the pace ends once what is
            // left would pass within a sample at that line. Opened by half a sample, the
            // pace let a held-back queue in at four times the completions' rate, the
            // window's incoming ran past the line again, and the state engaged a second
            // time (`delivery-burst`: 110 received in one sample, state 0 after 11 s).
            // What waits is the measure of need here, not the offered rate: a paced
            // direction's incoming is what the pace lets in.
            (Some(Condition::RateImbalance), _) => {
                let line = rates.recent_outgoing_per_sec * tick.config.overdrive_percent as f64
                    / 100.0
                    * self.config.resume_ratio;
                // With nothing completed lately there is no line: hold where it is.
                let next = if line > 0.0 { next.min(line) } else { p };
                (next, next, false)
            }
            // After database sessions, the sends that waited the episode out take
            // connections from the receivers they fill: let in as the pace opened, each
            // batch of them filled the receivers back to the threshold, and the state
            // engaged again (twice in `database-sessions`). They go in at what holds the
            // sessions' mean below the resume line, never below twice what is offered
            // now (a host whose load keeps the mean above it would otherwise stay paced
            // for good), and the pace ends only once no more wait than arrive within a
            // sample: ended when those waiting would pass within a sample at the pace,
            // it let 80-90 in at once, and those engaged it.
            (_, Some((mean, threshold))) => {
                let resume = self.config.resume_ratio;
                let release = law::session_release_rate(p, mean, threshold, resume);
                (next.min(release.max(2.0 * offered)), offered, true)
            }
            _ => (next, next, true),
        };
        let next = ((needs_headroom && next < 2.0 * offered)
            || !passes_within_a_sample(ends_at)
            || held_by_use)
            .then_some(next);
        (next, held_by_use)
    }

    /// The state: the top cause, or the last cause while its actions relax.
    fn update_state(
        &mut self,
        tick: &DirectionTick,
        top: Option<ConditionStatus>,
        conditions: Vec<ConditionStatus>,
        pace: Option<Duration>,
        limits_reduced: bool,
    ) -> DirectionDecision {
        let (direction, now) = (tick.direction, tick.now);
        let st = &mut self.directions[direction.index()];
        let acting = !st.delay.is_zero() || pace.is_some() || limits_reduced;
        // A measured cause is shown for `min_dwell` after it cleared, even with nothing left
        // to relax: one that comes back meanwhile goes on in the same state. An override is
        // an operator's word and ends when they say.
        if top.is_some() || st.cause.is_none() {
            st.cause_clear_since = None;
        }
        let dwelling = top.is_none()
            && st.cause.is_some_and(|c| c != Condition::Override)
            && now.saturating_sub(*st.cause_clear_since.get_or_insert(now)) < self.config.min_dwell;
        let (cause, recovering) = match top {
            Some(c) => (Some(c.condition), false),
            None if tick.applies && st.cause.is_some() && (acting || dwelling) => (st.cause, true),
            None => (None, false),
        };
        if cause.is_none() {
            st.cause_clear_since = None;
        }
        st.cause = cause;
        if cause.is_some_and(|c| c != Condition::RateImbalance) {
            st.rate_quiet_until = now + tick.config.sampling_window;
            st.rate = Latch::default();
        }
        let state = cause.and_then(|c| c.state_code(direction)).unwrap_or(0);
        if state != st.state || st.since > now {
            st.state = state;
            st.since = now;
        }
        DirectionDecision {
            direction,
            state,
            state_name: state_name(direction, state),
            recovering,
            cause,
            delay: st.delay,
            pace,
            pace_rate: pace.and(st.pace_rate),
            state_duration: now.saturating_sub(st.since),
            override_mode: tick.config.override_mode,
            conditions,
        }
    }

    /// The outgoing rate a rate imbalance is judged against, if any, and whether a value over
    /// it may engage the condition: the window's measured rate once it holds `min_samples`
    /// incoming messages and a completion.
    ///
    /// Delivery is also judged before anything has completed (a cold start with a backlog and
    /// slow handlers, where the window's rates would show the imbalance only a handler latency
    /// later, then engage 5 or more samples late): the outgoing rate reads as under one message
    /// per window, the least the window measures, so any receives over it count. It may engage
    /// once nothing has completed for a whole sample since the window held enough receives, so
    /// a batch received between one tick and its first completion is not an imbalance.
    /// Publishing is not: a bulk send's requests are all counted before its single insert
    /// completes, so nothing completed there is the insert in progress.
    fn outgoing_judged(
        &mut self,
        direction: Direction,
        now: Duration,
        rates: &RateReading,
        dir_config: &crate::config::DirectionConfig,
    ) -> Option<(f64, bool)> {
        let st = &mut self.directions[direction.index()];
        let enough = rates.samples >= dir_config.min_samples;
        let nothing_done =
            direction == Direction::Delivery && enough && rates.outgoing_per_sec == 0.0;
        if !nothing_done {
            st.nothing_done_since = None;
        }
        if nothing_done {
            let since = *st.nothing_done_since.get_or_insert(now);
            let floor = 1.0 / dir_config.sampling_window.as_secs_f64();
            Some((floor, now > since))
        } else {
            (enough && rates.outgoing_per_sec > 0.0).then_some((rates.outgoing_per_sec, true))
        }
    }

    /// Every condition that applies to `direction`, with its value, threshold and activity.
    fn conditions(
        &mut self,
        direction: Direction,
        now: Duration,
        readings: &Readings,
        dir_config: &crate::config::DirectionConfig,
    ) -> Vec<ConditionStatus> {
        let rates = readings.rates(direction);
        let idx = direction.index();
        let outgoing = self.outgoing_judged(direction, now, &rates, dir_config);
        let rate_limit = outgoing.map_or(0.0, |(rate, _)| {
            rate * dir_config.overdrive_percent as f64 / 100.0
        });
        // Judged only with enough samples, an outgoing rate to judge against, and outside the
        // quiet window after another cause; otherwise it reads as off (threshold 0), not as a
        // value over a line nobody is watching.
        let rate_judged = now >= self.directions[idx].rate_quiet_until && outgoing.is_some();
        let may_engage = outgoing.is_some_and(|(_, confirmed)| confirmed);
        let resume_after = self.config.resume_after;
        let rate = &mut self.directions[idx].rate;
        let rate_active = if rate_judged {
            rate.update(
                now,
                may_engage && rates.incoming_per_sec > rate_limit,
                rates.incoming_per_sec >= rate_limit * self.config.resume_ratio,
                resume_after,
            )
        } else {
            *rate = Latch::default();
            false
        };
        let mut conditions = Vec::new();
        for condition in Condition::ALL {
            let Some(state) = condition.state_code(direction) else {
                continue;
            };
            let (active, value, threshold) = match condition {
                Condition::RateImbalance => (
                    rate_active,
                    rates.incoming_per_sec,
                    if rate_judged { rate_limit } else { 0.0 },
                ),
                Condition::Override => {
                    let forced = dir_config.override_mode == OverrideMode::Throttle;
                    (forced, if forced { 1.0 } else { 0.0 }, 1.0)
                }
                Condition::DownstreamOutage | Condition::DownstreamLatency => {
                    let g = readings.downstream.of(condition);
                    (g.active, g.value, g.threshold)
                }
                other => (
                    self.resource_active
                        .get(&other)
                        .is_some_and(|latch| latch.active),
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
        // Another cause taking the direction at this tick starts the rate's quiet window now
        // (see `rate_quiet_until`): a rate not yet engaged is not judged while it holds.
        let other_active = conditions
            .iter()
            .any(|c| c.active && c.condition != Condition::RateImbalance);
        if other_active && !rate_active && self.applies(direction) {
            self.directions[idx].rate = Latch::default();
            if let Some(rate) = conditions
                .iter_mut()
                .find(|c| c.condition == Condition::RateImbalance)
            {
                rate.threshold = 0.0;
            }
        }
        conditions
    }
}

/// The overage a condition feeds the delay law: a forced override counts as 100 % over.
fn condition_overage(c: &ConditionStatus) -> f64 {
    match c.condition {
        Condition::Override => 1.0,
        _ => law::overage(c.value, c.threshold),
    }
}

/// Active above `threshold`; once active, stays active until below `threshold x resume`.
/// A condition's activity, with hysteresis in value and in time: it engages when its value
/// passes the threshold, and clears once the value has stayed below the resume line for
/// `resume_after` (`ThrottlingConfig::resume_after`), so a value that the control itself
/// holds at its line, dipping under it for a sample now and then, is one episode, not a
/// flip per dip, whatever the resume ratio (at 1.0 there is no band in value at all).
#[derive(Debug, Clone, Copy, Default)]
struct Latch {
    active: bool,
    /// While active: since when the value has been below the resume line.
    below_since: Option<Duration>,
}

impl Latch {
    /// Updates the latch at `now`: `over`, the value is past its threshold (or the condition
    /// acts on its own account); `above_resume`, the value is at or above the resume line.
    fn update(
        &mut self,
        now: Duration,
        over: bool,
        above_resume: bool,
        resume_after: Duration,
    ) -> bool {
        if over || (self.active && above_resume) {
            self.active = true;
            self.below_since = None;
        } else if self.active {
            let since = *self.below_since.get_or_insert(now);
            if now.saturating_sub(since) >= resume_after {
                *self = Latch::default();
            }
        }
        self.active
    }
}

#[cfg(test)]
mod tests;
