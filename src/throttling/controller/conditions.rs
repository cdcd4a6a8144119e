//! Conditions: each measured against its threshold with hysteresis, latched while active, ranked by
//! severity.

use std::time::Duration;

use crate::config::OverrideMode;
use crate::throttling::law;
use crate::throttling::rates::RateReading;
use crate::throttling::{Condition, Direction};

use super::{ConditionStatus, Controller, Readings};

impl Controller {
    /// Hysteresis of every resource condition, in value and in time ([`Latch`]).
    pub(super) fn evaluate(&mut self, now: Duration, readings: &Readings) {
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
}

impl Controller {
    /// Every condition that applies to `direction`, with its value, threshold and activity.
    pub(super) fn conditions(
        &mut self,
        direction: Direction,
        now: Duration,
        readings: &Readings,
        dir_config: &crate::config::DirectionConfig,
    ) -> Vec<ConditionStatus> {
        let rates = readings.rates(direction);
        let evidence = direction == Direction::Publishing || receives_wait_for_handlers(readings);
        let (rate_active, rate_judged, rate_limit) =
            self.rate_imbalance(direction, now, &rates, dir_config, evidence);
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
        self.quiet_rate_under_another_cause(direction, rate_active, &mut conditions);
        conditions
    }

    /// Another cause taking the direction at this tick starts the rate's quiet window now
    /// (see `rate_quiet_until`): a rate not yet engaged is not judged while it holds.
    fn quiet_rate_under_another_cause(
        &mut self,
        direction: Direction,
        rate_active: bool,
        conditions: &mut [ConditionStatus],
    ) {
        let other_active = conditions
            .iter()
            .any(|c| c.active && c.condition != Condition::RateImbalance);
        if other_active && !rate_active && self.applies(direction) {
            self.directions[direction.index()].rate = Latch::default();
            if let Some(rate) = conditions
                .iter_mut()
                .find(|c| c.condition == Condition::RateImbalance)
            {
                rate.threshold = 0.0;
            }
        }
    }

    /// The rate imbalance of `direction`: whether it is active, whether it is judged at all,
    /// and its line (outgoing x overdrive). It may engage only with `evidence` that the
    /// incoming side outruns the outgoing one (see [`receives_wait_for_handlers`]).
    fn rate_imbalance(
        &mut self,
        direction: Direction,
        now: Duration,
        rates: &RateReading,
        dir_config: &crate::config::DirectionConfig,
        evidence: bool,
    ) -> (bool, bool, f64) {
        let idx = direction.index();
        let outgoing = self.outgoing_judged(direction, now, rates, dir_config);
        let rate_limit = outgoing.map_or(0.0, |(rate, _)| {
            rate * dir_config.overdrive_percent as f64 / 100.0
        });
        // Judged only with enough samples, an outgoing rate to judge against, outside the
        // quiet window after another cause, and with evidence (or engaged: a pace holding
        // receives under the limits takes the evidence away, not the cause); otherwise it
        // reads as off (threshold 0), not as a value over a line nobody is watching.
        let st = &self.directions[idx];
        let rate_judged =
            now >= st.rate_quiet_until && outgoing.is_some() && (evidence || st.rate.active);
        let may_engage = evidence && outgoing.is_some_and(|(_, confirmed)| confirmed);
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
        (rate_active, rate_judged, rate_limit)
    }
}

/// Whether delivery's receives wait for its handlers: most of what is in process sits in
/// queues at their limit.
///
/// Over a window, receives minus completions is how much the count in process grew, so a
/// receive rate over overdrive x completions is the count in process growing. With room below
/// the limits that growth is the handlers' pipeline filling: at a steady load the count
/// settles at the receive rate x the handlers' latency (Little's law), and handlers of 200 ms
/// to 2 s read as an imbalance for up to 5 latencies after every start. Only a queue whose
/// receives the limit holds back is taking work faster than its handlers finish it: a
/// backlog at start received all at once, or more arriving than the limit / the latency.
fn receives_wait_for_handlers(readings: &Readings) -> bool {
    let at_limit = readings.in_process_at_limit;
    at_limit > 0 && at_limit.saturating_mul(2) >= readings.in_process
}

/// The conditions measured against a resource threshold (all but rate imbalance, the
/// override and the queues' downstream guards).
pub(super) fn resource_conditions() -> impl Iterator<Item = Condition> {
    Condition::ALL.into_iter().filter(|c| {
        !matches!(c, Condition::RateImbalance | Condition::Override) && !c.acted_by_queue()
    })
}

/// The overage a condition feeds the delay law: a forced override counts as 100 % over.
pub(super) fn condition_overage(c: &ConditionStatus) -> f64 {
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
pub(super) struct Latch {
    pub(super) active: bool,
    /// While active: since when the value has been below the resume line.
    pub(super) below_since: Option<Duration>,
}

impl Latch {
    /// Updates the latch at `now`: `over`, the value is past its threshold (or the condition
    /// acts on its own account); `above_resume`, the value is at or above the resume line.
    pub(super) fn update(
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
