//! Control quality of a run, per episode: how fast the controller engaged after a resource
//! crossed its threshold, how far the resource overshot, how often the state flipped, and how
//! long the host took to return to "not throttling" once the cause ended.
//!
//! It works on a plain [`Tick`] timeline (one per controller tick), so it can be tested with
//! hand-built timelines. It sits below both of its users: the load tool scores real runs
//! with it (`load::record` makes the timeline from a run's samples), the simulation bed its
//! simulated ones.

use serde::Serialize;

use super::controller::Decision;
use super::{Condition, Direction};

/// One condition at one tick.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    /// Which condition.
    pub condition: Condition,
    /// The direction it is judged in (rate imbalance is judged in both).
    pub direction: Direction,
    /// Its value.
    pub value: f64,
    /// Its threshold (0 = off).
    pub threshold: f64,
    /// Active after hysteresis.
    pub active: bool,
}

/// One controller tick, reduced to what quality needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Tick {
    /// Seconds since the run started.
    pub t: f64,
    /// State code per direction (delivery, publishing).
    pub states: [u8; 2],
    /// Resource conditions of the direction each one is judged in.
    pub readings: Vec<Reading>,
}

/// The conditions quality is measured for, in every direction that shows them: each
/// direction's state is scored against its own causes (publishing under memory pressure is held
/// to the same bounds as delivery). For rate imbalance the value is the offered (incoming)
/// rate, which pacing cannot lower, so its peak is reported but not bounded (see
/// [`bounds_peak`]); engaging, flips and recovery are.
pub const GUARDED: [(Condition, Direction); 12] = [
    (Condition::RateImbalance, Direction::Delivery),
    (Condition::RateImbalance, Direction::Publishing),
    (Condition::ProcessMemory, Direction::Delivery),
    (Condition::ProcessMemory, Direction::Publishing),
    (Condition::SystemMemory, Direction::Delivery),
    (Condition::SystemMemory, Direction::Publishing),
    (Condition::InProcess, Direction::Delivery),
    (Condition::Threads, Direction::Delivery),
    (Condition::Threads, Direction::Publishing),
    (Condition::DatabaseSize, Direction::Publishing),
    (Condition::DatabaseSessions, Direction::Delivery),
    (Condition::DatabaseSessions, Direction::Publishing),
];
/// One episode of one condition.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Episode {
    /// The condition.
    pub condition: Condition,
    /// The direction it was judged in.
    pub direction: Direction,
    /// When the value first crossed the threshold (or the condition engaged, if earlier),
    /// seconds.
    pub crossed_at: f64,
    /// Ticks from the crossing to the condition being active (0 = the same tick), the slowest
    /// of the episode's crossings; None if one never engaged.
    pub engage_samples: Option<u32>,
    /// Highest value / threshold during the episode.
    pub peak_ratio: f64,
    /// State changes of the direction from just before the crossing to the end, re-crossings
    /// within [`SAME_EPISODE_WITHIN`] of the cause's end included.
    pub flips: u32,
    /// Seconds from the cause ending to state 0; None if the direction never returned to 0.
    /// The cause ends where the run says it does, independently of the controller: at the
    /// end of the phase that offered it ([`CauseSpan`]), or, where no phase says, at the last
    /// tick the value was at or above its resume line.
    pub recovery_seconds: Option<f64>,
}

/// When a run offered the cause of a condition: a scenario phase that names it in `causes`
/// (seconds on the run's clock). Recovery is measured from its end, not from what the
/// controller made of it: the memory ceiling holds memory under the resume line while the
/// cause goes on, and a draining backlog keeps database size over it after the cause ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CauseSpan {
    /// The condition the phase causes.
    pub condition: Condition,
    /// Phase start, seconds.
    pub start: f64,
    /// Phase end, seconds.
    pub end: f64,
}

/// Phases this close are one span of a cause (the runner starts a phase as the last ends).
const CONTIGUOUS: f64 = 0.5;

/// The end of the cause of `condition` for an episode round seen from `from` to `to`
/// seconds: the last run of back-to-back phases naming it that started by `to` and ended no
/// more than [`SAME_EPISODE_WITHIN`] before `from`.
fn cause_span_end(causes: &[CauseSpan], condition: Condition, from: f64, to: f64) -> Option<f64> {
    let mut spans: Vec<(f64, f64)> = Vec::new();
    for c in causes.iter().filter(|c| c.condition == condition) {
        match spans.last_mut() {
            Some(last) if c.start - last.1 <= CONTIGUOUS => last.1 = last.1.max(c.end),
            _ => spans.push((c.start, c.end)),
        }
    }
    spans
        .iter()
        .rev()
        .find(|(start, end)| *start <= to && *end >= from - SAME_EPISODE_WITHIN)
        .map(|(_, end)| *end)
}

/// A crossing this soon after the cause of an episode ended belongs to that episode: an
/// operator sees one cause flapping, not a new one, and a measure that started a new episode
/// at each re-crossing read a run that flipped 10 times as 5 clean episodes.
pub const SAME_EPISODE_WITHIN: f64 = 10.0;

/// Whether an episode's peak is held to a bound: not for rate imbalance, whose value is the
/// load offered to the host (a burst of sends is counted when it is requested).
pub fn bounds_peak(condition: Condition) -> bool {
    condition != Condition::RateImbalance
}

/// One controller decision at `t` seconds as a tick: the states, and the guarded conditions
/// of each direction.
pub fn tick(t: f64, d: &Decision) -> Tick {
    let readings = GUARDED
        .iter()
        .filter_map(|(condition, direction)| {
            d.direction(*direction)
                .conditions
                .iter()
                .find(|c| c.condition == *condition)
                .map(|c| Reading {
                    condition: *condition,
                    direction: *direction,
                    value: c.value,
                    threshold: c.threshold,
                    active: c.active,
                })
        })
        .collect();
    Tick {
        t,
        states: [d.delivery.state, d.publishing.state],
        readings,
    }
}

/// Every episode of every guarded condition in a timeline, in order of crossing, with the
/// phases that offered each cause.
pub fn episodes(ticks: &[Tick], resume_ratio: f64, causes: &[CauseSpan]) -> Vec<Episode> {
    let mut all = Vec::new();
    for (condition, direction) in GUARDED {
        let mut i = 0;
        let scoring = Scoring {
            condition,
            direction,
            resume_ratio,
            causes,
        };
        while let Some(e) = next_episode(ticks, &scoring, &mut i) {
            all.push(e);
        }
    }
    all.sort_by(|a, b| a.crossed_at.total_cmp(&b.crossed_at));
    all
}

fn reading(tick: &Tick, condition: Condition, direction: Direction) -> Option<&Reading> {
    tick.readings
        .iter()
        .find(|r| r.condition == condition && r.direction == direction && r.threshold > 0.0)
}

/// What one condition's episodes are scored by.
struct Scoring<'a> {
    condition: Condition,
    direction: Direction,
    resume_ratio: f64,
    causes: &'a [CauseSpan],
}

/// One condition's readings and one direction's states over a timeline, as its episodes
/// are read from them.
struct Timeline<'a> {
    ticks: &'a [Tick],
    condition: Condition,
    direction: Direction,
    /// The state code this condition shows in this direction.
    own: Option<u8>,
}

impl<'a> Timeline<'a> {
    fn new(ticks: &'a [Tick], scoring: &Scoring) -> Self {
        Timeline {
            ticks,
            condition: scoring.condition,
            direction: scoring.direction,
            own: scoring.condition.state_code(scoring.direction),
        }
    }

    fn state(&self, i: usize) -> u8 {
        self.ticks[i].states[self.direction.index()]
    }

    /// The value is past its threshold at tick `i`, or the condition engaged before it was
    /// (the memory ceiling acts ahead of the line): an episode starts at the first of either.
    fn over(&self, i: usize) -> bool {
        reading(&self.ticks[i], self.condition, self.direction)
            .is_some_and(|r| r.value > r.threshold || r.active)
    }

    /// The first tick from `from` at which the condition is active and the state not 0.
    fn engages(&self, from: usize) -> Option<usize> {
        (from..self.ticks.len()).find(|&i| {
            reading(&self.ticks[i], self.condition, self.direction).is_some_and(|r| r.active)
                && self.state(i) != 0
        })
    }

    /// Another cause, active at tick `i`, shows in this direction: this one has handed over
    /// (memory, then slow handlers filling the in-process count, are two causes, and the
    /// first has recovered when the second shows).
    fn handed_over(&self, i: usize) -> bool {
        let s = self.state(i);
        s != 0
            && Some(s) != self.own
            && self.ticks[i].readings.iter().any(|r| {
                r.direction == self.direction
                    && r.active
                    && r.condition.state_code(self.direction) == Some(s)
            })
    }

    /// The direction's state entering or leaving this condition's code from `start` to
    /// `last`. A hand-over to a higher-ranked cause that goes on past this one (an operator's
    /// override taking over) is one flip out, not a flap; a state swinging between causes
    /// counts every swing.
    fn flips(&self, start: usize, last: usize) -> u32 {
        let shows_own = |i: usize| Some(self.state(i)) == self.own;
        (start.max(1)..=last)
            .filter(|&i| shows_own(i) != shows_own(i - 1))
            .count() as u32
    }
}

/// Finds the episode starting at or after `*from`; leaves `*from` after its end.
fn next_episode(ticks: &[Tick], scoring: &Scoring, from: &mut usize) -> Option<Episode> {
    let timeline = Timeline::new(ticks, scoring);
    let start = (*from..ticks.len()).find(|&i| timeline.over(i))?;
    let engaged = timeline.engages(start);
    let mut peak: f64 = 0.0;
    let mut cause_end = ticks[start].t;
    let mut round = start;
    let mut engaged_now = engaged;
    // The slowest engagement of any crossing in the episode.
    let mut engage_samples = engaged.map(|e| (e - start) as u32);
    let (end, last) = loop {
        // This round ends at the first tick back at state 0 after engaging, or handed over.
        let end = engaged_now.and_then(|e| {
            (e..ticks.len()).find(|&i| timeline.state(i) == 0 || timeline.handed_over(i))
        });
        let last = end.unwrap_or(ticks.len() - 1);
        let (round_peak, round_cause_end) = scan(
            &ticks[round..=last],
            (scoring.condition, scoring.direction),
            scoring.resume_ratio,
        );
        peak = peak.max(round_peak);
        let by_value = round_cause_end.map(|i| ticks[round + i].t);
        cause_end = cause_span_end(
            scoring.causes,
            scoring.condition,
            ticks[round].t,
            ticks[last].t,
        )
        .or(by_value)
        .unwrap_or(cause_end);
        // A crossing soon after the cause ended is this episode going on.
        let again = end.and_then(|e| {
            (e + 1..ticks.len())
                .take_while(|&i| ticks[i].t - cause_end <= SAME_EPISODE_WITHIN)
                .find(|&i| timeline.over(i))
        });
        let Some(next) = again else {
            break (end, last);
        };
        round = next;
        engaged_now = timeline.engages(next);
        engage_samples = engage_samples
            .zip(engaged_now)
            .map(|(worst, e)| worst.max((e - next) as u32));
    };
    *from = last + 1;
    Some(Episode {
        condition: scoring.condition,
        direction: scoring.direction,
        crossed_at: ticks[start].t,
        engage_samples,
        peak_ratio: (peak * 1000.0).round() / 1000.0,
        flips: timeline.flips(start, last),
        recovery_seconds: end.map(|e| ((ticks[e].t - cause_end).max(0.0) * 10.0).round() / 10.0),
    })
}

/// Over `ticks`: the peak of value / threshold, and the last tick the value was at or above
/// its resume line (what the reading says of the cause, whatever the controller made of it).
fn scan(
    ticks: &[Tick],
    (condition, direction): (Condition, Direction),
    resume_ratio: f64,
) -> (f64, Option<usize>) {
    let mut peak: f64 = 0.0;
    let mut cause_end = None;
    for (i, tick) in ticks.iter().enumerate() {
        if let Some(r) = reading(tick, condition, direction) {
            peak = peak.max(r.value / r.threshold);
            if r.value >= r.threshold * resume_ratio {
                cause_end = Some(i);
            }
        }
    }
    (peak, cause_end)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A timeline of in-process values (threshold 100) and delivery states, 0.5 s apart.
    fn timeline(values: &[f64], states: &[u8]) -> Vec<Tick> {
        let mut active = false;
        values
            .iter()
            .zip(states)
            .enumerate()
            .map(|(i, (&value, &state))| {
                active = if active { value >= 90.0 } else { value > 100.0 };
                Tick {
                    t: i as f64 * 0.5,
                    states: [state, 0],
                    readings: vec![Reading {
                        condition: Condition::InProcess,
                        direction: Direction::Delivery,
                        value,
                        threshold: 100.0,
                        active,
                    }],
                }
            })
            .collect()
    }

    #[test]
    fn a_clean_episode() {
        let t = timeline(
            &[50.0, 90.0, 105.0, 110.0, 98.0, 95.0, 80.0, 40.0, 30.0, 30.0],
            &[0, 0, 3, 3, 3, 3, 3, 3, 0, 0],
        );
        let e = episodes(&t, 0.9, &[]);
        assert_eq!(e.len(), 1);
        let e = &e[0];
        assert_eq!(e.condition, Condition::InProcess);
        assert_eq!(e.crossed_at, 1.0);
        assert_eq!(e.engage_samples, Some(0));
        assert_eq!(e.peak_ratio, 1.1);
        assert_eq!(e.flips, 2);
        // Cause ended at t=2.5 (95 >= 90); state 0 at t=4.0.
        assert_eq!(e.recovery_seconds, Some(1.5));
    }

    #[test]
    fn a_late_engagement_an_overshoot_and_flapping_are_measured() {
        // Crosses at t=0.5, but the state only shows at t=2.0 (3 samples late); peaks at 2x;
        // flips 0 -> 3 -> 0 -> 3 -> 0.
        let t = timeline(
            &[
                50.0, 120.0, 150.0, 160.0, 200.0, 95.0, 92.0, 91.0, 30.0, 30.0,
            ],
            &[0, 0, 0, 3, 3, 0, 3, 3, 0, 0],
        );
        let e = &episodes(&t, 0.9, &[])[0];
        assert_eq!(e.engage_samples, Some(2));
        assert_eq!(e.peak_ratio, 2.0);
        // State 0 at t=2.5 while the condition is still active, and back to 3: the same
        // episode going on, four flips.
        assert_eq!(e.flips, 4);
        // A second crossing 1.5 s after the cause ended is the same cause flapping: one
        // episode with four flips.
        let t = timeline(
            &[50.0, 120.0, 101.0, 50.0, 101.0, 105.0, 50.0, 50.0],
            &[0, 3, 3, 0, 3, 3, 0, 0],
        );
        let all = episodes(&t, 0.9, &[]);
        assert_eq!(all.len(), 1, "one episode: {all:?}");
        assert_eq!(all[0].flips, 4);
        assert_eq!(all[0].recovery_seconds, Some(0.5));
        // Crossings more than 10 s apart are two episodes.
        let mut values = vec![50.0, 120.0, 50.0];
        let mut states = vec![0, 3, 0];
        values.extend([50.0; 21]);
        states.extend([0; 21]);
        values.extend([120.0, 50.0, 50.0]);
        states.extend([3, 0, 0]);
        let all = episodes(&timeline(&values, &states), 0.9, &[]);
        assert_eq!(all.len(), 2, "two episodes: {all:?}");
        assert!(all.iter().all(|e| e.flips == 2));
    }

    #[test]
    fn a_hand_over_to_a_higher_cause_is_one_flip_and_swinging_between_causes_counts() {
        // In-process (3) engages, an override (10) takes over, then all clears: in, out.
        let t = timeline(
            &[50.0, 120.0, 110.0, 95.0, 40.0, 30.0, 30.0],
            &[0, 3, 3, 10, 10, 10, 0],
        );
        assert_eq!(episodes(&t, 0.9, &[])[0].flips, 2);
        // Swinging 3 -> 4 -> 3 -> 4 -> 3 -> 0 flaps: every swing in or out of 3 counts.
        let t = timeline(
            &[50.0, 120.0, 110.0, 105.0, 104.0, 101.0, 40.0],
            &[0, 3, 4, 3, 4, 3, 0],
        );
        assert_eq!(episodes(&t, 0.9, &[])[0].flips, 6);
    }

    #[test]
    fn a_cause_that_hands_over_to_the_next_active_one_has_recovered() {
        // In-process (3) is held, then process memory (4) becomes active and shows while
        // in-process is still above its resume line: in-process recovered at the hand-over.
        let mut t = timeline(
            &[50.0, 120.0, 110.0, 105.0, 95.0, 40.0, 30.0],
            &[0, 3, 3, 4, 4, 4, 0],
        );
        for tick in &mut t[3..6] {
            tick.readings.push(Reading {
                condition: Condition::ProcessMemory,
                direction: Direction::Delivery,
                value: 110.0,
                threshold: 100.0,
                active: true,
            });
        }
        let e = &episodes(&t, 0.9, &[])[0];
        assert_eq!(e.condition, Condition::InProcess);
        assert_eq!(e.flips, 2);
        assert_eq!(e.recovery_seconds, Some(0.0));
    }

    #[test]
    fn an_episode_that_never_engages_or_never_recovers_says_so() {
        let t = timeline(&[50.0, 120.0, 130.0, 40.0], &[0, 0, 0, 0]);
        let e = &episodes(&t, 0.9, &[])[0];
        assert_eq!(e.engage_samples, None);
        assert_eq!(e.recovery_seconds, None);
        let t = timeline(&[50.0, 120.0, 130.0, 40.0], &[0, 3, 3, 3]);
        let e = &episodes(&t, 0.9, &[])[0];
        assert_eq!(e.engage_samples, Some(0));
        assert_eq!(e.recovery_seconds, None, "still throttled at the end");
    }

    #[test]
    fn recovery_is_measured_from_the_end_of_the_phase_that_offered_the_cause() {
        let cause = |end: f64| CauseSpan {
            condition: Condition::InProcess,
            start: 0.5,
            end,
        };
        // Held under the resume line from t=1.5 while the cause goes on until t=3.0; state 0
        // at t=4.0. By the value the cause ended at t=1.0, by the phase at t=3.0.
        let held = timeline(
            &[50.0, 120.0, 95.0, 80.0, 80.0, 80.0, 80.0, 40.0, 30.0, 30.0],
            &[0, 3, 3, 3, 3, 3, 3, 3, 0, 0],
        );
        assert_eq!(episodes(&held, 0.9, &[])[0].recovery_seconds, Some(3.0));
        assert_eq!(
            episodes(&held, 0.9, &[cause(3.0)])[0].recovery_seconds,
            Some(1.0)
        );
        // The cause ended at t=1.0 but the value drains slowly, over the resume line until
        // t=3.5; state 0 at t=4.5: 3.5 s after the cause, not 1.0 s after the value.
        let draining = timeline(
            &[
                50.0, 120.0, 110.0, 105.0, 100.0, 95.0, 92.0, 91.0, 50.0, 30.0,
            ],
            &[0, 3, 3, 3, 3, 3, 3, 3, 3, 0],
        );
        assert_eq!(episodes(&draining, 0.9, &[])[0].recovery_seconds, Some(1.0));
        assert_eq!(
            episodes(&draining, 0.9, &[cause(1.0)])[0].recovery_seconds,
            Some(3.5)
        );
        // Another condition's phase, or one long before, says nothing of this episode.
        let other = CauseSpan {
            condition: Condition::ProcessMemory,
            ..cause(1.0)
        };
        let long_before = CauseSpan {
            start: -30.0,
            end: -20.0,
            ..cause(0.0)
        };
        for causes in [[other], [long_before]] {
            assert_eq!(
                episodes(&draining, 0.9, &causes)[0].recovery_seconds,
                Some(1.0)
            );
        }
    }

    #[test]
    fn back_to_back_phases_of_one_cause_are_one_span() {
        let causes = [(0.0, 2.0), (2.1, 5.0), (9.0, 12.0)].map(|(start, end)| CauseSpan {
            condition: Condition::InProcess,
            start,
            end,
        });
        assert_eq!(
            cause_span_end(&causes, Condition::InProcess, 1.0, 4.0),
            Some(5.0)
        );
        assert_eq!(
            cause_span_end(&causes, Condition::InProcess, 9.5, 14.0),
            Some(12.0)
        );
        assert_eq!(cause_span_end(&causes, Condition::Threads, 1.0, 4.0), None);
    }

    #[test]
    fn no_crossing_no_episode() {
        let t = timeline(&[50.0, 99.0, 100.0, 60.0], &[0, 0, 0, 0]);
        assert!(episodes(&t, 0.9, &[]).is_empty());
    }
}
