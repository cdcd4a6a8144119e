//! Incoming and outgoing rates per direction over a sliding sampling window.
//!
//! The hot path only bumps two monotonic counters ([`RateCounters`]). Each sample the
//! controller's loop snapshots them into a [`RateWindow`], which keeps the snapshots of the
//! last window and derives rates from the oldest one still inside it. What counts:
//!
//! | direction  | incoming                 | outgoing                  |
//! |------------|--------------------------|---------------------------|
//! | delivery   | messages received        | messages done (any outcome) |
//! | publishing | sends requested (offered, before any throttling wait) | inserts completed |
//!
//! Publishing counts a request when it is made, not when it clears the throttle: a paced
//! publisher keeps showing the rate it offers, so pacing cannot hide the imbalance that caused
//! it and cancel itself.
//!
//! Besides the sampling-window rates (BizTalk's, for the rate condition), each reading carries
//! the rates over the last [`RECENT`] seconds: pacing is set from those, so a pace follows
//! what the consumers do now, not a 15-second average.
//!
//! [`DrainMeter`] measures how fast the stored backlog drains (what publishing is paced
//! against), from what was published and how the backlog grew.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Monotonic counters bumped on the hot path.
#[derive(Debug, Default)]
pub struct RateCounters {
    incoming: AtomicU64,
    outgoing: AtomicU64,
}

impl RateCounters {
    /// Counts one incoming message.
    #[inline]
    pub fn incoming(&self) {
        self.incoming.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one outgoing message.
    #[inline]
    pub fn outgoing(&self) {
        self.outgoing.fetch_add(1, Ordering::Relaxed);
    }

    /// (incoming, outgoing) totals so far.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.incoming.load(Ordering::Relaxed),
            self.outgoing.load(Ordering::Relaxed),
        )
    }
}

/// Rates over the current window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RateReading {
    /// Incoming messages per second.
    pub incoming_per_sec: f64,
    /// Outgoing messages per second.
    pub outgoing_per_sec: f64,
    /// Incoming messages inside the window: BizTalk's "samples". Below the minimum, rate
    /// throttling does not apply.
    pub samples: u64,
    /// Incoming messages per second over the last [`RECENT`].
    pub recent_incoming_per_sec: f64,
    /// Outgoing messages per second over the last [`RECENT`].
    pub recent_outgoing_per_sec: f64,
    /// Incoming messages per second since the snapshot before this one (over the last
    /// sample): what a pace in force over that sample let in.
    pub last_incoming_per_sec: f64,
    /// Requests waiting in the admission now (set by the service, not by the window).
    pub waiting: u64,
}

/// The short window pacing is computed over.
pub(crate) const RECENT: Duration = Duration::from_secs(2);

/// Snapshots of counter totals covering the sampling window.
#[derive(Debug, Default)]
pub struct RateWindow {
    snapshots: VecDeque<(Duration, u64, u64)>,
}

impl RateWindow {
    /// Adds a snapshot taken at `now` and returns the rates over the last `window`.
    pub fn record(&mut self, now: Duration, totals: (u64, u64), window: Duration) -> RateReading {
        let last_incoming_per_sec = self.snapshots.back().map_or(0.0, |&(t0, in0, _)| {
            let elapsed = now.saturating_sub(t0).as_secs_f64();
            match elapsed > 0.0 {
                true => totals.0.saturating_sub(in0) as f64 / elapsed,
                false => 0.0,
            }
        });
        self.snapshots.push_back((now, totals.0, totals.1));
        let start = now.saturating_sub(window.max(RECENT));
        // Keep exactly one snapshot at or before the window start as the baseline.
        while self.snapshots.len() > 1 && self.snapshots[1].0 <= start {
            self.snapshots.pop_front();
        }
        let (incoming_per_sec, outgoing_per_sec, samples) = self.rates_since(now, totals, window);
        let (recent_incoming_per_sec, recent_outgoing_per_sec, _) =
            self.rates_since(now, totals, RECENT);
        RateReading {
            incoming_per_sec,
            outgoing_per_sec,
            samples,
            recent_incoming_per_sec,
            recent_outgoing_per_sec,
            last_incoming_per_sec,
            waiting: 0,
        }
    }

    /// (incoming/s, outgoing/s, incoming count) from the newest snapshot at or before
    /// `now - span` (or the oldest kept) to `totals`.
    fn rates_since(&self, now: Duration, totals: (u64, u64), span: Duration) -> (f64, f64, u64) {
        let start = now.saturating_sub(span);
        let base = self
            .snapshots
            .iter()
            .rev()
            .find(|s| s.0 <= start)
            .or(self.snapshots.front())
            .copied();
        let Some((t0, in0, out0)) = base else {
            return (0.0, 0.0, 0);
        };
        let elapsed = now.saturating_sub(t0).as_secs_f64();
        if elapsed <= 0.0 {
            return (0.0, 0.0, 0);
        }
        let incoming = totals.0.saturating_sub(in0);
        let outgoing = totals.1.saturating_sub(out0);
        (
            incoming as f64 / elapsed,
            outgoing as f64 / elapsed,
            incoming,
        )
    }
}

/// How far back the backlog's drain rate is measured.
const DRAIN_WINDOW: Duration = Duration::from_secs(3);

/// Estimates how fast the stored backlog drains: messages published minus growth of the
/// backlog, over the last few seconds. It covers consumers in other hosts too.
#[derive(Debug, Default)]
pub(crate) struct DrainMeter {
    history: VecDeque<(Duration, u64, u64)>,
}

impl DrainMeter {
    /// `published`: publishing's outgoing total; `size`: the database size now.
    pub(crate) fn record(&mut self, now: Duration, published: u64, size: u64) -> Option<f64> {
        self.history.push_back((now, published, size));
        while self.history.len() > 2 && self.history[1].0 + DRAIN_WINDOW <= now {
            self.history.pop_front();
        }
        let (t0, p0, s0) = *self.history.front()?;
        let elapsed = now.saturating_sub(t0).as_secs_f64();
        if elapsed < 0.5 {
            return None;
        }
        let inflow = published.saturating_sub(p0) as f64;
        let growth = size as f64 - s0 as f64;
        Some(((inflow - growth) / elapsed).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn rates_cover_the_window_only() {
        let mut w = RateWindow::default();
        let window = s(15.0);
        // 100 in / 50 out per second for 30 s, sampled every 0.5 s.
        let mut last = RateReading::default();
        for i in 0..=60 {
            let t = i as f64 * 0.5;
            last = w.record(s(t), ((t * 100.0) as u64, (t * 50.0) as u64), window);
        }
        assert!((last.incoming_per_sec - 100.0).abs() < 1e-9, "{last:?}");
        assert!((last.outgoing_per_sec - 50.0).abs() < 1e-9);
        assert_eq!(last.samples, 1500);
        // Traffic stops: after one more window the rates are zero.
        for i in 61..=92 {
            last = w.record(s(i as f64 * 0.5), (3000, 1500), window);
        }
        assert_eq!(last.incoming_per_sec, 0.0);
        assert_eq!(last.samples, 0);
    }

    #[test]
    fn a_young_window_uses_the_time_it_has() {
        let mut w = RateWindow::default();
        w.record(s(0.0), (0, 0), s(15.0));
        let r = w.record(s(2.0), (40, 20), s(15.0));
        assert_eq!(r.incoming_per_sec, 20.0);
        assert_eq!(r.outgoing_per_sec, 10.0);
        assert_eq!(r.samples, 40);
    }

    #[test]
    fn recent_rates_follow_a_change_within_two_seconds() {
        let mut w = RateWindow::default();
        let window = s(15.0);
        let mut last = RateReading::default();
        // 50 out per second for 20 s, then 200 per second for 3 s.
        let mut out = 0u64;
        for i in 0..=46 {
            let t = i as f64 * 0.5;
            out += if t <= 20.0 { 25 } else { 100 };
            last = w.record(s(t), (out, out), window);
        }
        assert!(
            (last.recent_outgoing_per_sec - 200.0).abs() < 1e-9,
            "{last:?}"
        );
        assert!(
            last.outgoing_per_sec < 100.0,
            "the 15 s window lags: {last:?}"
        );
    }

    #[test]
    fn first_snapshot_has_no_rate() {
        let mut w = RateWindow::default();
        assert_eq!(w.record(s(1.0), (5, 5), s(15.0)), RateReading::default());
    }

    #[test]
    fn drain_is_inflow_minus_growth() {
        let mut m = DrainMeter::default();
        assert_eq!(m.record(s(0.0), 0, 1000), None);
        // 600 published per second, backlog grows 300 per second: drain 300/s.
        let mut last = None;
        for i in 1..=8 {
            let t = i as f64 * 0.5;
            last = m.record(s(t), (t * 600.0) as u64, 1000 + (t * 300.0) as u64);
        }
        assert_eq!(last, Some(300.0));
        // Nothing published, backlog shrinking 100/s: drain 100/s.
        for i in 9..=16 {
            let t = i as f64 * 0.5;
            last = m.record(s(t), 2400, 2200 - ((t - 4.0) * 100.0) as u64);
        }
        assert_eq!(last, Some(100.0));
    }
}
