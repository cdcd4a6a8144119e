//! Pacing publishing: the drain law under database size, sessions or memory, the rate law under
//! imbalance, and relaxing a pace a closed-loop sender still uses.

use std::time::Duration;

use crate::throttling::law;
use crate::throttling::rates::RateReading;
use crate::throttling::{Condition, Direction};

use super::conditions::condition_overage;
use super::{ConditionStatus, Controller, DirectionTick, Readings};

impl DirectionTick<'_> {
    /// Whether `c` paces publishing against the backlog's drain instead of delaying it.
    pub(super) fn paced_by_drain(&self, c: &ConditionStatus) -> bool {
        self.direction == Direction::Publishing
            && c.condition.paces_publishing()
            && self.drain.is_some()
    }

    /// The drain law's rate for a pace relaxing from database size (`cause`), if it is.
    pub(super) fn database_size_release(
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
    pub(super) fn drain_paced_rate(&self, c: &ConditionStatus, resume_ratio: f64) -> Option<f64> {
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
pub(super) fn pace_in_use(rates: &RateReading, (p, in_use): (f64, bool), waiting: u64) -> bool {
    let sent = rates.last_incoming_per_sec;
    match in_use {
        true => sent >= law::PACE_STILL_USED_SHARE * p,
        false => waiting > 0 && sent >= law::PACE_USED_SHARE * p,
    }
}

impl Controller {
    /// What publishing lets the sends that waited out a database-sessions episode in by, when
    /// that is what it relaxes from ([`DirectionTick::sessions_release`]). Not while
    /// delivery has another cause: its receivers then drain what that cause allows, and the
    /// sessions' mean says nothing of what publishing adds.
    pub(super) fn sessions_release(
        &self,
        direction: Direction,
        readings: &Readings,
    ) -> Option<(f64, f64)> {
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
}

impl Controller {
    /// The pace: the strictest of drain pacing and rate pacing, relaxing when neither holds.
    /// Returns the interval between admissions, if any.
    pub(super) fn update_pace(
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
    pub(super) fn relaxed_pace(
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
        let (next, ends_at, needs_headroom) = self.release_line(tick, cause, (p, next), offered);
        let next = ((needs_headroom && next < 2.0 * offered)
            || !passes_within_a_sample(ends_at)
            || held_by_use)
            .then_some(next);
        (next, held_by_use)
    }

    /// The pace a release after `cause` may grow to from `next` (`p` before), the pace at
    /// which it ends, and whether it also waits for headroom over what is `offered`.
    ///
    /// Each release after a cause that would engage again if let in at once has its own line
    /// and its own end (the two are never both the relaxing cause); any other pace ends once
    /// new requests pass with room to spare and those still waiting would pass within one
    /// sample at this pace anyway (no burst at the end).
    fn release_line(
        &self,
        tick: &DirectionTick,
        cause: Option<Condition>,
        (p, next): (f64, f64),
        offered: f64,
    ) -> (f64, f64, bool) {
        let rates = tick.rates;
        match (cause, tick.sessions_release) {
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
        }
    }
}
