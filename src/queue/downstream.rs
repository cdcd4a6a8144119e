//! A queue's guards for what its handler calls: outage mode and the latency-aware limit.
//!
//! The host's controller guards the host's own resources; these guard the downstream a
//! queue's handler depends on, from what the handler's attempts show. Both set the queue's
//! guard limit on its gate (`ConcurrencyGate::set_guard_limit`), so the effective limit is the
//! lowest of the configured max, the controller's limit and theirs.
//!
//! - **Outage mode** (NServiceBus 8's "system outage" rate limiting): after
//!   `consecutive_failures` different messages failed in a row on the queue (by logical id,
//!   so one bad message retried again and again counts once), one message at a time with a
//!   pause before each attempt (immediate retries included), the pause doubling while failures
//!   go on up to `max_pause`. The first success ends it, and the limit grows back one step per
//!   success (doubling), so a recovered downstream gets no burst.
//! - **Latency-aware limit** (additive increase, multiplicative decrease on latency, as
//!   Vector's adaptive request concurrency, against an unloaded baseline as Envoy's gradient
//!   controller keeps one): once per interval (the baseline latency, at least 50 ms), +1 when
//!   the limit was used and the interval's mean latency stayed within `tolerance` of the
//!   baseline; x `decrease_ratio` (at least -1) when it rose past it or an attempt timed out,
//!   and then no increase for 20 intervals. A single call 1.5 x past the line (one that
//!   queued behind a full downstream) decides at once.
//!   The baseline is the lowest interval mean seen, drifting up 0.2 % an interval so that a
//!   downstream that became slower for good is followed: a limit cut brings latency back to
//!   the baseline, a saturated latency is never learnt as healthy.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{LatencyLimitConfig, OutageConfig};

/// How far the baseline drifts up per interval without a lower reading.
const BASELINE_DRIFT: f64 = 0.002;

/// A single call this many times past the line is taken as queueing behind a full
/// downstream (it waited about a whole call of another), and decides the interval at once.
const QUEUED_FACTOR: f64 = 1.5;

/// Intervals without an increase after a cut: a limit that found the knee stays under it
/// most of the time instead of probing past it every other interval (Zeebe's stabilizing
/// AIMD does the same).
const HOLD_AFTER_CUT: u32 = 20;

/// Shortest interval between two latency decisions: a handler of microseconds would otherwise
/// decide on every message, on too few latencies to average.
const MIN_INTERVAL: Duration = Duration::from_millis(50);

/// What the guards say about a queue now, for metrics, `/status` and the controller.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct DownstreamReading {
    /// Outage mode is on.
    pub outage: bool,
    /// Different messages that failed in a row.
    pub consecutive_failures: u32,
    /// Messages failing in a row that start outage mode (0: never).
    pub failure_threshold: u32,
    /// The pause before the next attempt in outage mode.
    #[serde(serialize_with = "secs")]
    pub pause: Duration,
    /// The latency-aware limit, when enabled.
    pub latency_limit: Option<u32>,
    /// The latency-aware limit is below the queue's max (it is holding concurrency back).
    pub latency_limiting: bool,
    /// The unloaded handler latency the limit steers by (its baseline), seconds.
    pub latency_mean: f64,
    /// The latency of the last interval, seconds.
    pub latency_recent: f64,
    /// The line above which latency counts as risen, seconds.
    pub latency_line: f64,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

#[derive(Debug)]
struct OutageState {
    /// The messages (logical ids) that failed since the last success, up to the threshold.
    failing: std::collections::HashSet<String>,
    consecutive: u32,
    active: bool,
    pause: Duration,
    /// No attempt starts before this while in outage mode.
    next_attempt: Instant,
    /// After an outage: the limit grows back from 1, doubling per success, to this.
    regrowing: Option<u32>,
}

#[derive(Debug)]
struct LatencyState {
    limit: u32,
    /// The lowest interval mean latency seen, drifting up (seconds).
    baseline: Option<f64>,
    /// The limit held the queue back at the last decision (below max, used or cut).
    limiting: bool,
    decided_at: Instant,
    /// Intervals left before the limit may grow again after a cut.
    hold: u32,
    /// This interval: sum and count of latencies, whether the limit was reached, whether an
    /// attempt timed out.
    sum: f64,
    count: u32,
    reached_limit: bool,
    back_pressure: bool,
    interval_ends: Instant,
    recent: f64,
}

/// A queue's downstream guards. Cheap to call on every attempt.
#[derive(Debug)]
pub(crate) struct DownstreamGuard {
    outage_config: Mutex<OutageConfig>,
    latency_config: Mutex<LatencyLimitConfig>,
    max: Mutex<u32>,
    outage: Mutex<OutageState>,
    latency: Mutex<LatencyState>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What an attempt's outcome changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing the gate needs to hear.
    None,
    /// The guard limit changed: apply [`DownstreamGuard::limit`].
    Limit,
}

impl DownstreamGuard {
    /// Guards for a queue of `max` with these settings.
    pub(crate) fn new(outage: &OutageConfig, latency: &LatencyLimitConfig, max: u32) -> Self {
        let now = Instant::now();
        DownstreamGuard {
            outage_config: Mutex::new(outage.clone()),
            latency_config: Mutex::new(latency.clone()),
            max: Mutex::new(max.max(1)),
            outage: Mutex::new(OutageState {
                failing: Default::default(),
                consecutive: 0,
                active: false,
                pause: outage.pause,
                next_attempt: now,
                regrowing: None,
            }),
            latency: Mutex::new(LatencyState {
                limit: latency.initial.clamp(latency.min.max(1), max.max(1)),
                baseline: None,
                limiting: false,
                decided_at: now,
                hold: 0,
                sum: 0.0,
                count: 0,
                reached_limit: false,
                back_pressure: false,
                interval_ends: now,
                recent: 0.0,
            }),
        }
    }

    /// New settings (config reload); the state carries over.
    pub(crate) fn reconfigure(
        &self,
        outage: &OutageConfig,
        latency: &LatencyLimitConfig,
        max: u32,
    ) {
        *lock(&self.outage_config) = outage.clone();
        *lock(&self.latency_config) = latency.clone();
        *lock(&self.max) = max.max(1);
        let mut l = lock(&self.latency);
        l.limit = l.limit.clamp(latency.min.max(1), max.max(1));
    }

    /// The limit the guards set on the queue's gate (`u32::MAX`: none).
    pub(crate) fn limit(&self) -> u32 {
        let outage = {
            let o = lock(&self.outage);
            match (o.active, o.regrowing) {
                (true, _) => 1,
                (false, Some(n)) => n,
                (false, None) => u32::MAX,
            }
        };
        let latency = match lock(&self.latency_config).enabled {
            true => lock(&self.latency).limit,
            false => u32::MAX,
        };
        outage.min(latency)
    }

    /// Whether outage mode is on.
    pub(crate) fn in_outage(&self) -> bool {
        lock(&self.outage).active
    }

    /// Waits out the outage pause before an attempt (returns at once outside outage mode).
    /// Attempts of the queue are spaced by the pause however many wait.
    pub(crate) async fn before_attempt(&self) {
        let at = {
            let mut o = lock(&self.outage);
            if !o.active {
                return;
            }
            let at = o.next_attempt.max(Instant::now());
            o.next_attempt = at + o.pause;
            at
        };
        tokio::time::sleep_until(at).await;
    }

    /// A handler attempt succeeded after `latency`, with `in_flight` of the queue's messages in
    /// flight (itself included).
    pub(crate) fn succeeded(&self, latency: Duration, in_flight: u32) -> Change {
        let mut change = Change::None;
        {
            let mut o = lock(&self.outage);
            // The common case, a success with nothing to undo, takes one lock.
            if o.consecutive == 0 && !o.active && o.regrowing.is_none() {
                drop(o);
                return match self.observe_latency(latency, in_flight, false) {
                    true => Change::Limit,
                    false => Change::None,
                };
            }
            let pause = lock(&self.outage_config).pause;
            let max = *lock(&self.max);
            o.consecutive = 0;
            o.failing.clear();
            if o.active {
                o.active = false;
                o.pause = pause;
                o.next_attempt = Instant::now();
                o.regrowing = Some(2.min(max));
                change = Change::Limit;
            } else if let Some(n) = o.regrowing {
                let next = n.saturating_mul(2);
                o.regrowing = (next < max).then_some(next);
                change = Change::Limit;
            }
        }
        if self.observe_latency(latency, in_flight, false) {
            change = Change::Limit;
        }
        change
    }

    /// A handler attempt of `message` (its logical id) failed; `timed_out` when it ran past
    /// the handler timeout (latency back pressure too).
    pub(crate) fn failed(
        &self,
        message: &str,
        latency: Duration,
        in_flight: u32,
        timed_out: bool,
    ) -> Change {
        let mut change = Change::None;
        {
            let config = lock(&self.outage_config).clone();
            let mut o = lock(&self.outage);
            if (o.failing.len() as u32) < config.consecutive_failures.max(1)
                && o.failing.insert(message.to_string())
            {
                o.consecutive = o.failing.len() as u32;
            }
            if o.active {
                o.pause = (o.pause * 2).min(config.max_pause.max(config.pause));
            } else if config.consecutive_failures > 0
                && o.consecutive >= config.consecutive_failures
            {
                o.active = true;
                o.regrowing = None;
                o.pause = config.pause;
                o.next_attempt = Instant::now() + config.pause;
                change = Change::Limit;
            }
        }
        if timed_out && self.observe_latency(latency, in_flight, true) {
            change = Change::Limit;
        }
        change
    }

    /// Feeds one latency into the current interval and decides at its end; true when the
    /// limit changed.
    fn observe_latency(&self, latency: Duration, in_flight: u32, back_pressure: bool) -> bool {
        let config = {
            let config = lock(&self.latency_config);
            if !config.enabled {
                return false;
            }
            config.clone()
        };
        let max = *lock(&self.max);
        let now = Instant::now();
        let mut l = lock(&self.latency);
        l.sum += latency.as_secs_f64();
        l.count += 1;
        l.reached_limit |= in_flight >= l.limit;
        l.back_pressure |= back_pressure;
        // One call that queued behind a full downstream (far past the line, right after the
        // limit grew) decides at once: waiting for the interval's mean would let a whole
        // interval of calls queue.
        let queued = l.hold == 0
            && l.baseline.is_some_and(|b| {
                latency.as_secs_f64() > b * (1.0 + config.tolerance) * QUEUED_FACTOR
            });
        l.back_pressure |= queued;
        if now < l.interval_ends && !queued {
            return false;
        }
        let current = l.sum / f64::from(l.count.max(1));
        let before = l.limit;
        let baseline = l
            .baseline
            .map_or(current, |b| (b * (1.0 + BASELINE_DRIFT)).min(current));
        l.baseline = Some(baseline);
        let line = baseline * (1.0 + config.tolerance);
        let reached = l.reached_limit;
        if l.limit > config.min.max(1) && (l.back_pressure || current > line) {
            let cut = (f64::from(l.limit) * config.decrease_ratio).floor() as u32;
            l.limit = cut.clamp(config.min.max(1), l.limit - 1);
            l.hold = HOLD_AFTER_CUT;
        } else if l.hold > 0 {
            l.hold -= 1;
        } else if l.limit < max && reached && current <= line {
            l.limit += 1;
        }
        l.limiting = l.limit < max && (reached || l.limit < before);
        l.decided_at = now;
        l.recent = current;
        let interval = Duration::from_secs_f64(baseline).max(MIN_INTERVAL);
        l.interval_ends = now + interval;
        (l.sum, l.count, l.reached_limit, l.back_pressure) = (0.0, 0, false, false);
        l.limit != before
    }

    /// What the guards say now.
    pub(crate) fn reading(&self) -> DownstreamReading {
        let o = lock(&self.outage);
        let threshold = lock(&self.outage_config).consecutive_failures;
        let latency_config = lock(&self.latency_config).clone();
        let max = *lock(&self.max);
        let l = lock(&self.latency);
        let baseline = l.baseline.unwrap_or(0.0);
        // Limiting only while it has lately decided: an idle queue holds nothing back.
        let recent = l.decided_at.elapsed() <= Duration::from_secs(2).max(MIN_INTERVAL * 4);
        DownstreamReading {
            outage: o.active,
            consecutive_failures: o.consecutive,
            failure_threshold: threshold,
            pause: if o.active { o.pause } else { Duration::ZERO },
            latency_limit: latency_config.enabled.then_some(l.limit),
            latency_limiting: latency_config.enabled && l.limiting && l.limit < max && recent,
            latency_mean: baseline,
            latency_recent: l.recent,
            latency_line: baseline * (1.0 + latency_config.tolerance),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outage(n: u32) -> OutageConfig {
        OutageConfig {
            consecutive_failures: n,
            pause: Duration::from_secs(1),
            max_pause: Duration::from_secs(4),
        }
    }

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn a_run_of_failures_starts_outage_mode_and_a_success_ends_it_without_a_burst() {
        let g = DownstreamGuard::new(&outage(3), &LatencyLimitConfig::default(), 16);
        assert_eq!(g.limit(), u32::MAX);
        assert_eq!(g.failed("a", MS, 8, false), Change::None);
        assert_eq!(
            g.failed("a", MS, 8, false),
            Change::None,
            "the same message again"
        );
        g.failed("b", MS, 8, false);
        assert_eq!(g.failed("c", MS, 8, false), Change::Limit);
        assert!(g.in_outage());
        assert_eq!(g.limit(), 1, "one message at a time");
        // Attempts are spaced by the pause, and the pause doubles while failures go on.
        let start = Instant::now();
        g.before_attempt().await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        g.failed("c", MS, 1, false);
        g.before_attempt().await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        g.before_attempt().await;
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(4),
            "pause doubled to 2 s"
        );
        for _ in 0..5 {
            g.failed("c", MS, 1, false);
        }
        assert_eq!(
            g.reading().pause,
            Duration::from_secs(4),
            "bounded by max_pause"
        );
        // The first success ends it; the limit grows back 2, 4, 8, then none.
        assert_eq!(g.succeeded(MS, 1), Change::Limit);
        assert!(!g.in_outage());
        let limits: Vec<u32> = (0..4)
            .map(|_| {
                let l = g.limit();
                g.succeeded(MS, 1);
                l
            })
            .collect();
        assert_eq!(limits, vec![2, 4, 8, u32::MAX]);
        let before = Instant::now();
        g.before_attempt().await;
        assert_eq!(
            before.elapsed(),
            Duration::ZERO,
            "no pause outside outage mode"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn successes_between_failures_and_one_bad_message_keep_outage_mode_off() {
        let g = DownstreamGuard::new(&outage(3), &LatencyLimitConfig::default(), 8);
        for i in 0..50 {
            g.failed(&format!("x{i}"), MS, 2, false);
            g.failed(&format!("y{i}"), MS, 2, false);
            g.succeeded(MS, 2);
        }
        assert!(!g.in_outage());
        // One poisoned message failing alone, again and again, is not an outage.
        for _ in 0..100 {
            g.failed("poison", MS, 2, false);
        }
        assert!(!g.in_outage());
        assert_eq!(g.reading().consecutive_failures, 1);
        let off = DownstreamGuard::new(&outage(0), &LatencyLimitConfig::default(), 8);
        for i in 0..100 {
            off.failed(&i.to_string(), MS, 2, false);
        }
        assert!(!off.in_outage(), "0 switches it off");
    }

    /// A downstream that serves `capacity` calls at `base` each and queues the rest: latency
    /// is base x ceil(in flight / capacity). The limit settles near the capacity.
    #[tokio::test(start_paused = true)]
    async fn the_latency_limit_settles_near_a_saturated_downstreams_capacity() {
        let config = LatencyLimitConfig {
            enabled: true,
            ..LatencyLimitConfig::default()
        };
        let g = DownstreamGuard::new(&OutageConfig::default(), &config, 64);
        let (capacity, base) = (8u32, Duration::from_millis(20));
        let mut seen = Vec::new();
        for _ in 0..2000 {
            let in_flight = g.limit().min(64);
            let latency = base * in_flight.div_ceil(capacity);
            tokio::time::advance(latency / in_flight).await;
            g.succeeded(latency, in_flight);
            seen.push(g.limit());
        }
        let tail = &seen[seen.len() - 500..];
        let (lo, hi) = (*tail.iter().min().unwrap(), *tail.iter().max().unwrap());
        assert!(
            lo >= 7 && hi <= 9,
            "limit {lo}..{hi} should stay within 8 +- 1 once settled"
        );
    }
}
