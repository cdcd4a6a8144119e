//! A direction's decision: its delay, and the state it shows while any action is in effect.

use std::time::Duration;

use crate::throttling::law;
use crate::throttling::rates::RateReading;
use crate::throttling::{Condition, Direction, state_name};

use super::conditions::{Latch, condition_overage};
use super::{ConditionStatus, Controller, DirectionDecision, DirectionTick, Readings};

impl Controller {
    /// One direction's decision: delay, pace and state, from its conditions.
    pub(super) fn decide(
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
}

impl Controller {
    /// The delay: the top condition's, unless it paces instead; relaxing when none holds.
    pub(super) fn update_delay(&mut self, tick: &DirectionTick, top: Option<ConditionStatus>) {
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
}

impl Controller {
    /// The state: the top cause, or the last cause while its actions relax.
    pub(super) fn update_state(
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
    pub(super) fn outgoing_judged(
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
}
