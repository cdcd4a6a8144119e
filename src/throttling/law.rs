//! The control laws, as pure functions of numbers: how long a delay is, how far a concurrency
//! limit is cut or grown, how fast publishing is paced. [`super::controller`] decides *which*
//! law applies; this module says *how much*. Everything here is deterministic and unit-tested
//! with exact numbers; `docs/throttling-law.md` shows the curves.
//!
//! Words used throughout:
//!
//! * **overage** `e = value / threshold - 1`: 0 at the threshold, 0.1 at 10 % above it,
//!   negative below it;
//! * **resume line** `threshold x resume_ratio`: where an active condition clears;
//! * **target** `threshold x (1 + resume_ratio) / 2`: midway between the two, where a cut aims
//!   to put the resource.

use std::time::Duration;

/// Delay per unit of overage at severity 100 (the proportional gain).
pub(crate) const PROPORTIONAL_GAIN: Duration = Duration::from_millis(100);
/// Delay per unit of overage-second at severity 100 (the integral gain).
pub(crate) const INTEGRAL_GAIN: Duration = Duration::from_millis(100);
/// Below the threshold the integral unwinds by half every second (on top of the negative
/// overage it integrates), so a condition that is being held does not keep an old delay.
const INTEGRAL_HALF_LIFE_SECS: f64 = 1.0;
/// While relaxing after the cause cleared, the delay shrinks to this share per sample.
pub(crate) const RELAX_FACTOR: f64 = 0.25;
/// Delays below this are zero.
pub(crate) const DELAY_FLOOR: Duration = Duration::from_millis(1);
/// The deepest single cut of a concurrency limit: never below this share of what is in flight.
pub(crate) const DEEPEST_CUT: f64 = 0.25;
/// While relaxing, a pace's rate grows by this factor per sample.
pub(crate) const PACE_RELAX_GROWTH: f64 = 1.5;
/// A relaxing pace whose recent admissions reach this share of it is in use: its senders want
/// at least what it lets in (see `Controller::relaxed_pace`).
pub(crate) const PACE_USED_SHARE: f64 = 0.8;
/// ...and stays in use while they send at least this share of it.
pub(crate) const PACE_STILL_USED_SHARE: f64 = 0.5;
/// Publishing paced against the drain rate: admitted = drain x (1 - this x overage).
pub(crate) const PACE_GAIN: f64 = 2.0;
/// Bounds of the pacing factor: at most this share of the drain rate above the threshold
/// (never fully closed while the backlog drains)...
pub(crate) const PACE_FACTOR_MIN: f64 = 0.25;
/// ...and at most this share below it (the backlog may grow back to the threshold).
pub(crate) const PACE_FACTOR_MAX: f64 = 1.25;
/// Where database size is held while the sends that waited out its episode are let in, as a
/// share of its resume line: far enough below it that the condition clears meanwhile.
pub(crate) const RELEASE_SETPOINT: f64 = 0.97;
/// ...approached this many times as steeply as the threshold is held: the depth falls
/// through the resume line within a few seconds, so the condition's `resume_after` and the
/// state's `min_dwell` pass while the waiting sends still go in...
pub(crate) const RELEASE_GAIN: f64 = 15.0;
/// ...with the pace nearly closed while far above it (never fully: a pace of 0 is none).
pub(crate) const RELEASE_FACTOR_MIN: f64 = 0.05;

/// Above this share of its threshold a shrinking resource is approaching it: the limit may
/// not let the messages in flight grow past what would take the resource to its resume line.
pub(crate) const APPROACH_SHARE: f64 = 0.5;

/// The most a queue's limit may be while a resource approaches its threshold: the messages
/// in flight times `room` (how far the part of the value the messages add may grow before
/// the value reaches the resume line), at least `in_flight + step`. A step change
/// in what each message costs then shows up as a crossing of at most one tick's growth,
/// instead of the limit letting every waiting message in at once.
pub(crate) fn approach_cap(in_flight: u32, room: f64, step: u32) -> u32 {
    let by_room = (in_flight as f64 * room).floor() as u32;
    by_room.max(in_flight.saturating_add(step)).max(1)
}

/// `value / threshold - 1`.
pub(crate) fn overage(value: f64, threshold: f64) -> f64 {
    if threshold <= 0.0 {
        return 0.0;
    }
    value / threshold - 1.0
}

/// The integral term of the delay law after `dt` seconds at overage `e`: it grows with the
/// overage while above the threshold, unwinds (halving every second, plus the negative
/// overage) below it, never goes negative, and stops growing where it alone would reach
/// `cap_secs` (anti-windup).
pub(crate) fn integrate(integral: f64, e: f64, dt: f64, cap_secs: f64, severity: u32) -> f64 {
    let next = if e >= 0.0 {
        integral + e * dt
    } else {
        integral * 0.5f64.powf(dt / INTEGRAL_HALF_LIFE_SECS) + e * dt
    };
    let per_unit = INTEGRAL_GAIN.as_secs_f64() * severity as f64 / 100.0;
    let windup_cap = if per_unit > 0.0 {
        cap_secs / per_unit
    } else {
        f64::MAX
    };
    next.clamp(0.0, windup_cap)
}

/// The delay while a condition of `severity` holds at overage `e` with integral `integral`:
///
/// `delay = initial + severity / 100 x (P x max(e, 0) + I x integral)`, capped by `max`.
///
/// With the default gains (100 ms each) a memory condition (severity 500) 10 % over its
/// threshold gives 10 ms + 50 ms at once and 50 ms more per second it persists; database size
/// (severity 1) at 10 % gives 11 ms. A small overage gives a small delay.
pub(crate) fn delay(
    initial: Duration,
    severity: u32,
    e: f64,
    integral: f64,
    max: Duration,
) -> Duration {
    let scale = severity as f64 / 100.0;
    let secs = initial.as_secs_f64()
        + scale
            * (PROPORTIONAL_GAIN.as_secs_f64() * e.max(0.0)
                + INTEGRAL_GAIN.as_secs_f64() * integral);
    clamp_duration(secs, max)
}

/// One relaxing step of a delay after its cause cleared: a quarter per sample, then zero.
pub(crate) fn relax_delay(current: Duration) -> Duration {
    let next = current.mul_f64(RELAX_FACTOR);
    if next < DELAY_FLOOR {
        Duration::ZERO
    } else {
        next
    }
}

fn clamp_duration(secs: f64, max: Duration) -> Duration {
    if !secs.is_finite() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(max).min(max)
}

/// Where a cut aims, as a share of the threshold: midway between resume line and threshold.
pub(crate) fn target_share(resume_ratio: f64) -> f64 {
    (1.0 + resume_ratio) / 2.0
}

/// A cut of a queue's limit while a resource is above its threshold: the messages in flight
/// times `target / value` (so a resource that scales with the messages in flight lands on the
/// target), never gentler than `gentlest` and never deeper than [`DEEPEST_CUT`]; at least 1.
///
/// `ratio` is the worst `value / threshold` among the conditions above their threshold.
pub(crate) fn cut(in_flight: u32, limit: u32, ratio: f64, resume_ratio: f64, gentlest: f64) -> u32 {
    let base = in_flight.min(limit) as f64;
    let factor = (target_share(resume_ratio) / ratio.max(f64::MIN_POSITIVE))
        .min(gentlest)
        .max(DEEPEST_CUT);
    ((base * factor).floor() as u32).max(1)
}

/// Growth of a queue's limit while every shrinking resource is below its resume line.
///
/// `headroom = 1 - value / resume line` of the tightest resource (1 when none is measured):
/// far below the line the limit nearly doubles per sample (slow start); near it, it grows by
/// `step`. If the resource scales with the limit, `value x (1 + headroom)` never passes the
/// resume line, so growth approaches the line from below instead of overshooting.
pub(crate) fn grow(limit: u32, max: u32, headroom: f64, step: u32) -> u32 {
    let proportional = (limit as f64 * headroom.clamp(0.0, 1.0)).floor() as u32;
    limit.saturating_add(proportional.max(step)).min(max).max(1)
}

/// The rate publishing is paced to under a publishing-pressure condition: the measured drain
/// rate of the backlog times `1 - PACE_GAIN x overage`, bounded. At the threshold publishing
/// matches the drain, so the stored backlog stops growing; above it, less (it shrinks back);
/// between resume line and threshold, a little more (it settles at the threshold).
pub(crate) fn paced_rate(drain_per_sec: f64, e: f64) -> f64 {
    drain_per_sec * (1.0 - PACE_GAIN * e).clamp(PACE_FACTOR_MIN, PACE_FACTOR_MAX)
}

/// The rate the sends that waited out a database-size episode are let in at once its cause
/// has ended: the drain times `1 - PACE_GAIN x RELEASE_GAIN x e`, where `e` is the depth's
/// distance above [`RELEASE_SETPOINT`] of the resume line as a share of the threshold,
/// bounded. The depth falls at nearly the drain rate while far above the setpoint and
/// settles at it; the pace ends once what still waits would pass within a sample.
pub(crate) fn release_rate(
    drain_per_sec: f64,
    value: f64,
    threshold: f64,
    resume_ratio: f64,
) -> f64 {
    if threshold <= 0.0 {
        return drain_per_sec;
    }
    let e = (value - threshold * resume_ratio * RELEASE_SETPOINT) / threshold;
    drain_per_sec * (1.0 - PACE_GAIN * RELEASE_GAIN * e).clamp(RELEASE_FACTOR_MIN, PACE_FACTOR_MAX)
}

/// Where the sessions in use are held on average while the sends that waited out a
/// database-sessions episode are let in: this share of the resume line. A count of
/// connections moves by several within milliseconds (a receive takes one as it starts, a send
/// for the time of its insert), so its peaks stand well above its mean: at 0.75 of the line
/// they still reached the threshold in one release run of `database-sessions` in four, the
/// ceiling held receives, and the condition engaged again; at 0.6, in none of six.
pub(crate) const SESSION_RELEASE_SHARE: f64 = 0.6;

/// The pace the sends that waited out a database-sessions episode are let in at, from the
/// pace so far, once its cause has cleared: that pace times the ratio of
/// [`SESSION_RELEASE_SHARE`] of the resume line to the sessions' mean since the last tick
/// (the sessions in use grow in proportion to what is let in, by Little's law), bounded by
/// [`PACE_FACTOR_MIN`] below and the relaxing pace's own growth above.
pub(crate) fn session_release_rate(pace: f64, mean: f64, threshold: f64, resume_ratio: f64) -> f64 {
    let setpoint = threshold * resume_ratio * SESSION_RELEASE_SHARE;
    let ratio = if mean > 0.0 {
        setpoint / mean
    } else {
        PACE_RELAX_GROWTH
    };
    pace * ratio.clamp(PACE_FACTOR_MIN, PACE_RELAX_GROWTH)
}

/// The spacing of admissions for a rate, capped by `max`; None for no usable rate.
pub(crate) fn pace_interval(rate_per_sec: f64, max: Duration) -> Option<Duration> {
    if !(rate_per_sec.is_finite() && rate_per_sec > 0.0) {
        return None;
    }
    Some(clamp_duration(1.0 / rate_per_sec, max).max(Duration::from_nanos(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn delay_is_proportional_to_the_overage() {
        let max = Duration::from_secs(300);
        assert_eq!(delay(MS(10), 500, 0.0, 0.0, max), MS(10));
        assert_eq!(delay(MS(10), 500, 0.1, 0.0, max), MS(60));
        assert_eq!(delay(MS(10), 500, 1.0, 0.0, max), MS(510));
        assert_eq!(delay(MS(10), 1, 0.1, 0.0, max).as_micros(), 10_100);
        assert_eq!(delay(MS(10), 500, -0.05, 0.0, max), MS(10), "below: no P");
    }

    #[test]
    fn delay_grows_with_persistence_and_is_capped() {
        let max = Duration::from_secs(300);
        let mut integral = 0.0;
        for _ in 0..20 {
            integral = integrate(integral, 0.1, 0.5, max.as_secs_f64(), 500);
        }
        assert!((integral - 1.0).abs() < 1e-9, "10 s at 10 %: {integral}");
        assert_eq!(delay(MS(10), 500, 0.1, integral, max), MS(560));
        // Extreme and persistent: the cap holds and the integral does not wind up past it.
        let mut integral = 0.0;
        for _ in 0..10_000 {
            integral = integrate(integral, 10.0, 0.5, 300.0, 500);
        }
        assert_eq!(integral, 600.0, "300 s / (100 ms x 5)");
        assert_eq!(delay(MS(10), 500, 10.0, integral, max), max);
    }

    #[test]
    fn integral_unwinds_below_the_threshold() {
        let i = integrate(1.0, -0.05, 1.0, 300.0, 500);
        assert!((i - 0.45).abs() < 1e-9, "{i}");
        assert_eq!(integrate(0.01, -0.5, 1.0, 300.0, 500), 0.0);
    }

    #[test]
    fn no_jump_to_minutes_within_seconds_unless_extreme() {
        // 20 % over for 10 s at the highest default severity stays around a second.
        let mut integral = 0.0;
        for _ in 0..20 {
            integral = integrate(integral, 0.2, 0.5, 300.0, 500);
        }
        let d = delay(MS(10), 500, 0.2, integral, Duration::from_secs(300));
        assert!(d < Duration::from_millis(1200), "{d:?}");
    }

    #[test]
    fn relaxing_quarters_the_delay_then_ends() {
        let mut d = Duration::from_secs(300);
        let mut steps = 0;
        while !d.is_zero() {
            d = relax_delay(d);
            steps += 1;
        }
        assert_eq!(steps, 10, "300 s to zero in 10 samples (5 s at 500 ms)");
    }

    #[test]
    fn a_cut_aims_at_the_target_from_what_is_in_flight() {
        // 40 in flight, limit 64, resource at 1.9 x threshold: 40 x 0.95 / 1.9 = 20.
        assert_eq!(cut(40, 64, 1.9, 0.9, 0.9), 20);
        // Slightly over: the gentlest cut applies.
        assert_eq!(cut(40, 64, 1.01, 0.9, 0.9), 36);
        // Far over: never deeper than a quarter.
        assert_eq!(cut(40, 64, 10.0, 0.9, 0.9), 10);
        // Nothing in flight: limit 1, never 0.
        assert_eq!(cut(0, 64, 2.0, 0.9, 0.9), 1);
        // The limit below in-flight (an earlier cut not yet drained) is the base.
        assert_eq!(cut(40, 10, 1.9, 0.9, 0.9), 5);
    }

    #[test]
    fn growth_is_fast_far_below_and_by_steps_near_the_line() {
        assert_eq!(grow(1, 200, 1.0, 1), 2);
        assert_eq!(grow(50, 200, 1.0, 1), 100);
        assert_eq!(grow(50, 200, 0.5, 1), 75);
        assert_eq!(grow(50, 200, 0.01, 1), 51);
        assert_eq!(grow(150, 200, 1.0, 1), 200);
        // From 1 to 200 with full headroom: 8 samples (4 s at 500 ms).
        let mut l = 1;
        let mut n = 0;
        while l < 200 {
            l = grow(l, 200, 1.0, 1);
            n += 1;
        }
        assert_eq!(n, 8);
    }

    #[test]
    fn growth_against_a_proportional_resource_approaches_the_line_from_below() {
        // value = limit x 1 (per message), resume line 90: growth reaches the line from
        // below and passes it by no more than one step.
        let mut limit = 10u32;
        let mut samples = 0;
        while limit <= 90 {
            let headroom = 1.0 - limit as f64 / 90.0;
            limit = grow(limit, 1000, headroom, 1);
            samples += 1;
        }
        assert_eq!(limit, 91);
        assert!(samples <= 10, "{samples}");
    }

    #[test]
    fn near_a_threshold_in_flight_may_grow_only_to_the_resume_line() {
        // 5 in flight at 53 % of the threshold (resume line 90 %): room 1.7 -> 8.
        assert_eq!(approach_cap(5, 0.9 / 0.53, 1), 8);
        // At the line: one step more than in flight.
        assert_eq!(approach_cap(10, 1.0, 1), 11);
        assert_eq!(approach_cap(0, 1.5, 1), 1);
    }

    #[test]
    fn pacing_matches_the_drain_at_the_threshold() {
        assert_eq!(paced_rate(300.0, 0.0), 300.0);
        assert_eq!(paced_rate(300.0, 0.1), 240.0);
        assert_eq!(paced_rate(300.0, 1.0), 75.0, "floor: a quarter");
        assert_eq!(paced_rate(300.0, -0.05), 330.0);
        assert_eq!(paced_rate(300.0, -0.5), 375.0, "ceiling");
    }

    #[test]
    fn released_sends_take_the_depth_below_the_resume_line_and_settle_there() {
        // Threshold 1000, resume line 900, setpoint 873: at the line 0.027 x 30 below the
        // drain.
        assert_eq!(
            release_rate(100.0, 873.0, 1000.0, 0.9),
            100.0,
            "at the setpoint"
        );
        assert!((release_rate(100.0, 900.0, 1000.0, 0.9) - 19.0).abs() < 1e-9);
        assert_eq!(
            release_rate(100.0, 1000.0, 1000.0, 0.9),
            5.0,
            "nearly closed"
        );
        assert_eq!(release_rate(100.0, 500.0, 1000.0, 0.9), 125.0, "ceiling");
        assert_eq!(release_rate(100.0, 500.0, 0.0, 0.9), 100.0, "no threshold");
    }

    #[test]
    fn sends_released_after_a_sessions_episode_hold_their_mean_at_the_setpoint() {
        // Threshold 10, resume line 9, setpoint 5.4 sessions on average.
        let at = |mean| session_release_rate(200.0, mean, 10.0, 0.9);
        assert!((at(5.4) - 200.0).abs() < 1e-9, "at the setpoint: as before");
        assert!((at(7.2) - 150.0).abs() < 1e-9, "above it: in proportion");
        assert!((at(4.5) - 240.0).abs() < 1e-9, "below it: in proportion");
        assert_eq!(at(1.0), 300.0, "far below: the relaxing pace's own growth");
        assert_eq!(at(0.0), 300.0, "nothing in use");
        assert_eq!(at(40.0), 50.0, "far above: the pace's floor");
    }

    #[test]
    fn pace_interval_needs_a_rate() {
        let max = Duration::from_secs(300);
        assert_eq!(pace_interval(0.0, max), None);
        assert_eq!(pace_interval(f64::NAN, max), None);
        assert_eq!(pace_interval(100.0, max), Some(MS(10)));
        assert_eq!(pace_interval(0.001, max), Some(max));
    }
}
