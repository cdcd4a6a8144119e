//! Delivery limits: cut from what is in flight under memory, in-process or thread pressure, held,
//! and grown back.

use std::collections::BTreeMap;

use crate::names::QueueName;
use crate::throttling::Direction;
use crate::throttling::law;

use super::conditions::resource_conditions;
use super::{Controller, QueueLoad, Readings};

/// Where the delivery limits stand this tick.
pub(super) struct LimitPressure {
    /// Worst value / threshold among shrinking conditions above their threshold.
    pub(super) over: Option<f64>,
    /// A shrinking condition is active (above its resume line).
    pub(super) holding: bool,
    /// 1 - value / resume line of the tightest shrinking condition (1 when none is on).
    pub(super) headroom: f64,
    /// Above [`law::APPROACH_SHARE`] of a threshold: the share the messages in flight may grow
    /// by before a resource that scales with them reaches its resume line.
    pub(super) approach: Option<f64>,
    /// Messages in process that the tightest guarded resource has room for, when the delivery
    /// ceiling held receives back (see [`CeilingHolds`]).
    pub(super) ceiling_room: Option<u64>,
}

impl Controller {
    pub(super) fn limit_pressure(&self, readings: &Readings) -> LimitPressure {
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
    pub(super) fn limit_queues(
        &mut self,
        pressure: &LimitPressure,
        queues: &[QueueLoad],
        after_pressure: bool,
    ) -> (BTreeMap<QueueName, u32>, bool) {
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
                None => self.grown_limit(q, current, pressure, after_pressure),
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

    /// The limit `q` grows to from `current` with no resource over its line: by the growth
    /// law, no faster than twice what is in flight just after pressure, and capped on the
    /// approach to a threshold while the queue uses its whole limit.
    fn grown_limit(
        &self,
        q: &QueueLoad,
        current: u32,
        pressure: &LimitPressure,
        after_pressure: bool,
    ) -> u32 {
        let step = self.config.concurrency_increase_step;
        let mut grown = law::grow(current, q.max.max(1), pressure.headroom, step);
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
}
