//! Messages in flight across every process of a run, from the ledger's start and end events
//! (stamped by the wall clock all processes of the machine share): the most at once, and,
//! when a peer was killed, how long the others took to fill its place again. This is how a
//! run checks a fleet-wide limit (`fleet_max`) from outside the hosts.

use std::collections::HashMap;

use serde::Serialize;
use uuid::Uuid;

/// What the run saw of the fleet's messages in flight.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FleetInFlight {
    /// The most handlers running at once, summed over every process.
    pub peak: u32,
    /// Seconds after a peer was killed until the processes left had as many in flight as
    /// the most in the 2 s before the kill (None: no kill, or never again).
    pub refilled_after_kill_seconds: Option<f64>,
}

/// Every handling's start and end, per process.
#[derive(Debug, Default)]
pub struct InFlightSpans {
    /// Handlings running: (process, row id) to their start.
    open: HashMap<(usize, Uuid), u64>,
    /// Ended handlings: start and end.
    closed: Vec<(u64, u64)>,
    /// The killed processes and when, in nanoseconds of the wall clock: their events may
    /// still be on their way through the pipe.
    killed: HashMap<usize, u64>,
}

/// How far before a kill the level to refill is read.
const BEFORE_KILL_NS: u64 = 2_000_000_000;

impl InFlightSpans {
    /// Process `source` began handling `id` at `at`.
    pub fn began(&mut self, source: usize, id: Uuid, at: u64) {
        match self.killed.get(&source) {
            // Reported after the kill, begun before it: it ran until the kill at most.
            Some(kill) => self.closed.push((at, at.max(*kill))),
            None => {
                self.open.insert((source, id), at);
            }
        }
    }

    /// Process `source` ended handling `id` at `at`.
    pub fn ended(&mut self, source: usize, id: Uuid, at: u64) {
        if let Some(start) = self.open.remove(&(source, id)) {
            self.closed.push((start, at.max(start)));
        }
    }

    /// Process `source` was killed at `at`: what it was handling ended then.
    pub fn killed(&mut self, source: usize, at: u64) {
        self.killed.insert(source, at);
        let mine: Vec<(usize, Uuid)> = self
            .open
            .keys()
            .filter(|(process, _)| *process == source)
            .copied()
            .collect();
        for key in mine {
            self.ended(key.0, key.1, at);
        }
    }

    /// The peak, and the refill after a kill. Handlings still open count until the end.
    pub fn summary(&self) -> FleetInFlight {
        let mut events: Vec<(u64, i32)> = Vec::with_capacity(2 * self.closed.len());
        for (start, end) in &self.closed {
            events.push((*start, 1));
            events.push((*end, -1));
        }
        events.extend(self.open.values().map(|start| (*start, 1)));
        // At one instant an end comes before a start: a slot handed straight on is not two.
        events.sort_unstable();
        // The refill is timed from the last kill.
        let killed_at = self.killed.values().max().copied();
        let mut running = 0i32;
        let mut peak = 0i32;
        let mut before_kill = 0i32;
        let mut refilled = None;
        for (at, delta) in events {
            running += delta;
            peak = peak.max(running);
            match killed_at {
                Some(k) if at <= k && at + BEFORE_KILL_NS >= k => {
                    before_kill = before_kill.max(running)
                }
                Some(k)
                    if at > k
                        && refilled.is_none()
                        && before_kill > 0
                        && running >= before_kill =>
                {
                    refilled = Some((at - k) as f64 / 1e9);
                }
                _ => {}
            }
        }
        FleetInFlight {
            peak: peak.max(0) as u32,
            refilled_after_kill_seconds: refilled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    #[test]
    fn the_peak_sums_processes_and_a_slot_handed_on_counts_once() {
        let mut s = InFlightSpans::default();
        s.began(0, id(1), 0);
        s.began(1, id(2), 5 * MS);
        s.ended(0, id(1), 10 * MS);
        s.began(2, id(3), 10 * MS);
        s.ended(1, id(2), 20 * MS);
        s.ended(2, id(3), 30 * MS);
        assert_eq!(s.summary().peak, 2);
    }

    #[test]
    fn a_killed_process_ends_its_handlings_and_the_refill_is_timed() {
        let mut s = InFlightSpans::default();
        // Three processes, one message each, from 0 ms.
        for p in 0..3 {
            s.began(p, id(p as u128), 0);
        }
        s.ended(2, id(2), 800 * MS);
        s.killed(2, 1000 * MS);
        // Its last start comes through the pipe after the kill: it ends at the kill.
        s.began(2, id(9), 900 * MS);
        // The two left end theirs and start two each, one of them 1.5 s after the kill.
        s.ended(0, id(0), 1100 * MS);
        s.ended(1, id(1), 1100 * MS);
        s.began(0, id(10), 1200 * MS);
        s.began(1, id(11), 1200 * MS);
        s.began(1, id(12), 2500 * MS);
        let summary = s.summary();
        assert_eq!(summary.peak, 3);
        assert_eq!(summary.refilled_after_kill_seconds, Some(1.5));
    }
}
