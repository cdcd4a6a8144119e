//! Host throttling, modelled on BizTalk Server's: sensors and rate meters feed a controller
//! that decides, every sample interval, a state, a delay and concurrency limits for the two
//! directions:
//!
//! * **delivery**: messages taken from queues and handed to handlers;
//! * **publishing**: messages this host writes to queues.
//!
//! Data flow: [`sensors`] and [`rates`] -> [`controller`] (pure, clock injected) ->
//! [`admission`] (the waits applied before each receive and each insert) and the queues'
//! concurrency gates. [`service`] runs that loop inside a host.

pub mod admission;
pub mod controller;
pub mod rates;
pub mod sensors;
pub mod service;

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use self::admission::Admission;
use self::rates::RateCounters;

/// One of the two directions BizTalk throttles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Queue -> handler (BizTalk "message delivery", outbound).
    Delivery,
    /// Sends -> queue (BizTalk "message publishing", inbound).
    Publishing,
}

impl Direction {
    /// Both directions, delivery first.
    pub const ALL: [Direction; 2] = [Direction::Delivery, Direction::Publishing];

    /// Label value used in metrics and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Delivery => "delivery",
            Direction::Publishing => "publishing",
        }
    }

    /// Position in per-direction arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Parses `delivery` / `publishing`.
    pub fn parse(s: &str) -> Option<Direction> {
        match s {
            "delivery" => Some(Direction::Delivery),
            "publishing" => Some(Direction::Publishing),
            _ => None,
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A throttling condition. Each maps to a BizTalk state code in the directions it applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Condition {
    /// Incoming rate above outgoing rate x overdrive (states 1 / 2).
    RateImbalance,
    /// Process resident memory above its threshold (state 4).
    ProcessMemory,
    /// System used physical memory above its threshold (state 5).
    SystemMemory,
    /// Messages handed to handlers and not done above threshold (delivery state 3).
    InProcess,
    /// Process thread count above threshold (state 9).
    Threads,
    /// Messages in this host's queues above threshold (publishing state 6).
    DatabaseSize,
    /// Database connections in use above threshold (publishing state 8).
    DatabaseSessions,
    /// User override = throttle (delivery state 10, publishing state 11).
    Override,
}

impl Condition {
    /// Every condition, in a fixed order (used for metrics and reports).
    pub const ALL: [Condition; 8] = [
        Condition::RateImbalance,
        Condition::ProcessMemory,
        Condition::SystemMemory,
        Condition::InProcess,
        Condition::Threads,
        Condition::DatabaseSize,
        Condition::DatabaseSessions,
        Condition::Override,
    ];

    /// Label value used in metrics and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Condition::RateImbalance => "rate_imbalance",
            Condition::ProcessMemory => "process_memory",
            Condition::SystemMemory => "system_memory",
            Condition::InProcess => "in_process",
            Condition::Threads => "threads",
            Condition::DatabaseSize => "database_size",
            Condition::DatabaseSessions => "database_sessions",
            Condition::Override => "override",
        }
    }

    /// The BizTalk state code this condition shows in `direction`, or None where it does not
    /// apply (in-process is delivery only; database size and sessions are publishing only).
    pub fn state_code(self, direction: Direction) -> Option<u8> {
        use Direction::*;
        match (self, direction) {
            (Condition::RateImbalance, Delivery) => Some(1),
            (Condition::RateImbalance, Publishing) => Some(2),
            (Condition::InProcess, Delivery) => Some(3),
            (Condition::InProcess, Publishing) => None,
            (Condition::ProcessMemory, _) => Some(4),
            (Condition::SystemMemory, _) => Some(5),
            (Condition::DatabaseSize, Publishing) => Some(6),
            (Condition::DatabaseSize, Delivery) => None,
            (Condition::DatabaseSessions, Publishing) => Some(8),
            (Condition::DatabaseSessions, Delivery) => None,
            (Condition::Threads, _) => Some(9),
            (Condition::Override, Delivery) => Some(10),
            (Condition::Override, Publishing) => Some(11),
        }
    }

    /// Rank among active conditions; the highest decides a direction's state. BizTalk's
    /// documented order: process memory > in-process > threads > database size > all others.
    /// Among the others: system memory > database sessions > override > rate imbalance.
    pub fn rank(self) -> u8 {
        match self {
            Condition::ProcessMemory => 7,
            Condition::InProcess => 6,
            Condition::Threads => 5,
            Condition::DatabaseSize => 4,
            Condition::SystemMemory => 3,
            Condition::DatabaseSessions => 2,
            Condition::Override => 1,
            Condition::RateImbalance => 0,
        }
    }

    /// Conditions under which delivery also shrinks every queue's concurrency limit (BizTalk
    /// shrinks its thread pools for these).
    pub fn shrinks_concurrency(self) -> bool {
        matches!(
            self,
            Condition::ProcessMemory
                | Condition::SystemMemory
                | Condition::InProcess
                | Condition::Threads
        )
    }
}

/// BizTalk's name for a state code in a direction.
pub fn state_name(direction: Direction, code: u8) -> &'static str {
    match (direction, code) {
        (_, 0) => "not throttling",
        (Direction::Delivery, 1) => "imbalanced delivery rate",
        (Direction::Publishing, 2) => "imbalanced publishing rate",
        (Direction::Delivery, 3) => "high in-process message count",
        (_, 4) => "process memory pressure",
        (_, 5) => "system memory pressure",
        (Direction::Publishing, 6) => "database growth",
        (Direction::Publishing, 8) => "high database session count",
        (_, 9) => "high thread count",
        (Direction::Delivery, 10) => "user override on delivery",
        (Direction::Publishing, 11) => "user override on publishing",
        _ => "unknown",
    }
}

/// What the hot paths share with the controller: each direction's admission and rate
/// counters. The receivers and the publisher hold it; the throttling service sets it.
#[derive(Debug, Default)]
pub struct Throttle {
    /// Waited before each receive.
    pub delivery: Admission,
    /// Waited before each insert.
    pub publishing: Admission,
    /// Received / done.
    pub delivery_rates: RateCounters,
    /// Send requests / inserts done.
    pub publishing_rates: RateCounters,
}

impl Throttle {
    /// Admissions that record their waits in these histograms.
    pub fn new(delivery_wait: metrics::Histogram, publishing_wait: metrics::Histogram) -> Self {
        Throttle {
            delivery: Admission::new(delivery_wait),
            publishing: Admission::new(publishing_wait),
            delivery_rates: RateCounters::default(),
            publishing_rates: RateCounters::default(),
        }
    }

    /// One direction's admission.
    pub fn admission(&self, direction: Direction) -> &Admission {
        match direction {
            Direction::Delivery => &self.delivery,
            Direction::Publishing => &self.publishing,
        }
    }

    /// One direction's rate counters.
    pub fn rates(&self, direction: Direction) -> &RateCounters {
        match direction {
            Direction::Delivery => &self.delivery_rates,
            Direction::Publishing => &self.publishing_rates,
        }
    }
}

/// A monotonic clock, injected so tests can drive hours of controller behaviour instantly.
pub trait Clock: Send + Sync + 'static {
    /// Time since an arbitrary fixed origin.
    fn now(&self) -> Duration;
}

/// The real clock: tokio's monotonic time (which tests may pause and advance).
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_condition_has_biztalk_codes_where_it_applies() {
        let codes: Vec<(Option<u8>, Option<u8>)> = Condition::ALL
            .iter()
            .map(|c| {
                (
                    c.state_code(Direction::Delivery),
                    c.state_code(Direction::Publishing),
                )
            })
            .collect();
        assert_eq!(
            codes,
            vec![
                (Some(1), Some(2)),
                (Some(4), Some(4)),
                (Some(5), Some(5)),
                (Some(3), None),
                (Some(9), Some(9)),
                (None, Some(6)),
                (None, Some(8)),
                (Some(10), Some(11)),
            ]
        );
    }

    #[test]
    fn documented_ranking_holds() {
        use Condition::*;
        assert!(ProcessMemory.rank() > InProcess.rank());
        assert!(InProcess.rank() > Threads.rank());
        assert!(Threads.rank() > DatabaseSize.rank());
        for other in [SystemMemory, DatabaseSessions, Override, RateImbalance] {
            assert!(DatabaseSize.rank() > other.rank(), "{other:?}");
        }
    }
}
