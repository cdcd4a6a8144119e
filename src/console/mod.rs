//! The live console: one page on the admin endpoint that shows why the host throttles.
//!
//! The page (`page.html`, `console.js`, `console.css`, compiled into the binary: no network,
//! no build step) polls `GET /console/data?after=N` once a second. Each answer carries the
//! `/status` document of that moment, which the page shows as it is (so the page and `/status`
//! agree on every number), and the history samples it has not seen yet, from which it draws
//! the last ten minutes. The history is kept here, server-side, in a bounded ring, so a page
//! opened late still shows what happened before it was opened.
//!
//! This module knows the status document and nothing of the host or the HTTP server: the
//! admin endpoint records a sample every [`SAMPLE_INTERVAL`] and serves the assets.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::states::Condition;
use crate::status::{DirectionStatus, HostStatus};

/// How often a history sample is taken.
pub(crate) const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// How much history is kept (and drawn): ten minutes.
pub(crate) const HISTORY: Duration = Duration::from_secs(600);
/// Samples in the ring.
pub(crate) const CAPACITY: usize = (HISTORY.as_secs() / SAMPLE_INTERVAL.as_secs()) as usize;

/// The page.
pub(crate) const PAGE_HTML: &str = include_str!("page.html");
/// Its script (served from the admin address: the page runs no inline script).
pub(crate) const SCRIPT_JS: &str = include_str!("console.js");
/// Its icon (without one, browsers ask for /favicon.ico and log the 404 as an error).
pub(crate) const ICON_SVG: &str = include_str!("icon.svg");
/// Its style sheet.
pub(crate) const STYLE_CSS: &str = include_str!("console.css");
/// The Content-Security-Policy the console's responses carry: everything from the admin
/// address itself, no inline script or style, no framing.
pub(crate) const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One direction at one sample.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct DirectionPoint {
    /// BizTalk state code.
    pub state: u8,
    /// Delay per admission, seconds.
    pub delay_seconds: f64,
    /// Admissions per second allowed, when pacing.
    pub pace_messages_per_second: Option<f64>,
    /// Incoming rate, messages/s.
    pub incoming_per_second: f64,
    /// Outgoing rate, messages/s.
    pub outgoing_per_second: f64,
}

impl DirectionPoint {
    fn of(direction: &DirectionStatus) -> Self {
        DirectionPoint {
            state: direction.state,
            delay_seconds: direction.delay_seconds,
            pace_messages_per_second: direction.pace_messages_per_second,
            incoming_per_second: direction.incoming_per_second,
            outgoing_per_second: direction.outgoing_per_second,
        }
    }

    fn idle() -> Self {
        DirectionPoint {
            state: 0,
            delay_seconds: 0.0,
            pace_messages_per_second: None,
            incoming_per_second: 0.0,
            outgoing_per_second: 0.0,
        }
    }
}

/// One sensor as a percentage of its threshold (sensors that are off are left out).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct ConditionPoint {
    /// Which condition the sensor feeds.
    pub condition: Condition,
    /// Value as a percentage of the threshold.
    pub percent: f64,
}

/// One receiving queue at one sample.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct QueuePoint {
    /// Queue name.
    pub name: String,
    /// Effective concurrency limit.
    pub limit: u32,
    /// Receives and handlers running.
    pub in_flight: u32,
    /// Last known depth.
    pub depth: u64,
    /// Messages handled successfully since start (rates are differences of these).
    pub succeeded_total: u64,
    /// Messages moved to the error queue since start.
    pub failed_total: u64,
}

/// What the charts need of one status document.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Sample {
    /// Position in the ring's history, from 1; the page asks for samples after the last it has.
    pub seq: u64,
    /// Wall-clock time, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// Delivery.
    pub delivery: DirectionPoint,
    /// Publishing.
    pub publishing: DirectionPoint,
    /// Every sensor that is on.
    pub conditions: Vec<ConditionPoint>,
    /// Every receiving queue.
    pub queues: Vec<QueuePoint>,
}

impl Sample {
    /// The sample of `status`, numbered `seq`, taken at `unix_ms`.
    pub(crate) fn of(status: &HostStatus, seq: u64, unix_ms: u64) -> Self {
        let throttling = status.throttling.as_ref();
        Sample {
            seq,
            unix_ms,
            delivery: throttling
                .map_or_else(DirectionPoint::idle, |t| DirectionPoint::of(&t.delivery)),
            publishing: throttling
                .map_or_else(DirectionPoint::idle, |t| DirectionPoint::of(&t.publishing)),
            conditions: throttling
                .map(|t| {
                    t.resources
                        .iter()
                        .filter_map(|r| {
                            Some(ConditionPoint {
                                condition: r.condition,
                                percent: r.percent_of_threshold?,
                            })
                        })
                        .collect()
                })
                .unwrap_or_default(),
            queues: status
                .queues
                .iter()
                .map(|q| QueuePoint {
                    name: q.name.clone(),
                    limit: q.limit,
                    in_flight: q.in_flight,
                    depth: q.depth,
                    succeeded_total: q.succeeded_total,
                    failed_total: q.failed_total,
                })
                .collect(),
        }
    }
}

/// The last [`CAPACITY`] samples, oldest first.
#[derive(Debug)]
pub(crate) struct History {
    ring: Mutex<(u64, VecDeque<Sample>)>,
    capacity: usize,
}

impl Default for History {
    fn default() -> Self {
        History::with_capacity(CAPACITY)
    }
}

impl History {
    /// A ring of `capacity` samples (at least one).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        History {
            ring: Mutex::new((0, VecDeque::with_capacity(capacity))),
            capacity,
        }
    }

    /// Records `status` as the next sample, taken now; the oldest goes when the ring is full.
    pub(crate) fn record(&self, status: &HostStatus) {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut guard = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let (last, ring) = &mut *guard;
        *last += 1;
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(Sample::of(status, *last, unix_ms));
    }

    /// The samples numbered above `seq`, oldest first (all of them for 0, or when `seq` is
    /// ahead of the ring: the page saw an earlier host on this address).
    pub(crate) fn after(&self, seq: u64) -> Vec<Sample> {
        let guard = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let (last, ring) = &*guard;
        let seq = if seq > *last { 0 } else { seq };
        ring.iter().filter(|s| s.seq > seq).cloned().collect()
    }

    /// Samples held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).1.len()
    }

    /// True before the first sample.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What `GET /console/data` answers.
#[derive(Debug, Serialize)]
pub(crate) struct ConsoleData {
    /// The `/status` document of this moment.
    pub status: HostStatus,
    /// Samples after the one the page asked from.
    pub samples: Vec<Sample>,
    /// Seconds of history the ring holds when full.
    pub history_seconds: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConcurrencyModel, OverrideMode, TransactionMode};
    use crate::status::{QueueStatus, ResourceStatus, ThrottlingStatus};

    fn direction(state: u8, delay: f64) -> DirectionStatus {
        DirectionStatus {
            state,
            state_name: "x",
            delay_seconds: delay,
            pacing_interval_seconds: None,
            pace_messages_per_second: None,
            recovering: false,
            explanation: None,
            state_duration_seconds: 1.0,
            override_mode: OverrideMode::None,
            override_scope: Default::default(),
            active_conditions: vec![],
            incoming_per_second: 10.0,
            outgoing_per_second: 9.0,
            samples: 3,
        }
    }

    fn status(depth: u64) -> HostStatus {
        HostStatus {
            host: "h".into(),
            instance: "i".into(),
            transport: "memory".into(),
            transaction_mode: TransactionMode::ReceiveOnly,
            uptime_seconds: 1.0,
            receiving: true,
            in_process: 0,
            database_silent_seconds: None,
            throttling: Some(ThrottlingStatus {
                sampled_at_seconds: 1.0,
                enabled: true,
                delivery: direction(4, 0.25),
                publishing: direction(0, 0.0),
                resources: vec![
                    ResourceStatus {
                        condition: Condition::ProcessMemory,
                        value: 150.0,
                        threshold: Some(100.0),
                        resume_below: Some(90.0),
                        percent_of_threshold: Some(150.0),
                        active: true,
                        text: String::new(),
                    },
                    ResourceStatus {
                        condition: Condition::Threads,
                        value: 10.0,
                        threshold: None,
                        resume_below: None,
                        percent_of_threshold: None,
                        active: false,
                        text: String::new(),
                    },
                ],
            }),
            queues: vec![QueueStatus {
                name: "orders".into(),
                model: ConcurrencyModel::Fixed,
                max: 8,
                limit: 4,
                fleet: None,
                in_flight: 3,
                peak_in_flight: 8,
                leads: true,
                delayed_moves: crate::delayed::DelayedMoves::Moving,
                depth,
                loops: 8,
                circuit_breaker: "closed",
                error_queue: "error".into(),
                error_queue_depth: 2,
                succeeded_total: 100,
                failed_total: 1,
                downstream: Default::default(),
            }],
        }
    }

    #[test]
    fn a_sample_carries_what_the_charts_draw() {
        let s = Sample::of(&status(7), 5, 1_000);
        assert_eq!(s.seq, 5);
        assert_eq!(s.delivery.state, 4);
        assert_eq!(s.delivery.delay_seconds, 0.25);
        assert_eq!(s.delivery.incoming_per_second, 10.0);
        assert_eq!(
            s.conditions,
            vec![ConditionPoint {
                condition: Condition::ProcessMemory,
                percent: 150.0
            }],
            "a sensor that is off has no percentage and is left out"
        );
        assert_eq!(s.queues[0].limit, 4);
        assert_eq!(s.queues[0].depth, 7);
        assert_eq!(s.queues[0].failed_total, 1);
    }

    #[test]
    fn before_the_first_tick_both_directions_show_state_0() {
        let mut st = status(0);
        st.throttling = None;
        let s = Sample::of(&st, 1, 0);
        assert_eq!(s.delivery, DirectionPoint::idle());
        assert!(s.conditions.is_empty());
    }

    #[test]
    fn the_ring_keeps_the_newest_and_answers_from_a_sequence_number() {
        let history = History::with_capacity(3);
        assert!(history.is_empty());
        for depth in 1..=5 {
            history.record(&status(depth));
        }
        assert_eq!(history.len(), 3, "bounded");
        let all = history.after(0);
        assert_eq!(
            all.iter().map(|s| s.seq).collect::<Vec<_>>(),
            vec![3, 4, 5],
            "oldest dropped first"
        );
        assert_eq!(all[2].queues[0].depth, 5);
        assert_eq!(
            history.after(4).iter().map(|s| s.seq).collect::<Vec<_>>(),
            vec![5]
        );
        assert!(history.after(5).is_empty(), "nothing new");
        assert_eq!(
            history.after(99).len(),
            3,
            "a page that saw a later sequence (an earlier host) gets everything again"
        );
    }
}
