//! The vocabulary of throttling that every layer shares: the two directions, the conditions,
//! their BizTalk state codes and names. It sits below throttling, metrics, status and the load
//! tool, so each of them can name a state without importing another.

use std::fmt;

use serde::Serialize;

/// One of the two directions BizTalk throttles.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize, PartialOrd, Ord,
)]
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
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize, PartialOrd, Ord,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
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
    /// Database connections in use above threshold (state 8; in delivery too, see
    /// [`Condition::state_code`]).
    DatabaseSessions,
    /// User override = throttle (delivery state 10, publishing state 11).
    Override,
    /// A queue's handler fails every attempt: the queue is in outage mode, one message at a
    /// time with a pause (delivery state 12). Acted on by the queue, not the controller.
    DownstreamOutage,
    /// A queue's handler latency rose above its baseline and the latency-aware limit holds
    /// the queue below its max (delivery state 13). Acted on by the queue.
    DownstreamLatency,
}

impl Condition {
    /// Every condition, in a fixed order (used for metrics and reports).
    pub const ALL: [Condition; 10] = [
        Condition::RateImbalance,
        Condition::ProcessMemory,
        Condition::SystemMemory,
        Condition::InProcess,
        Condition::Threads,
        Condition::DatabaseSize,
        Condition::DatabaseSessions,
        Condition::Override,
        Condition::DownstreamOutage,
        Condition::DownstreamLatency,
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
            Condition::DownstreamOutage => "downstream_outage",
            Condition::DownstreamLatency => "downstream_latency",
        }
    }

    /// The BizTalk state code this condition shows in `direction`, or None where it does not
    /// apply (in-process is delivery only; database size is publishing only).
    ///
    /// BizTalk counts database sessions against publishing only. Here a receive keeps its
    /// connection while its handler runs (`receive_only` and `sends_atomic_with_receive`), so
    /// most sessions in use are delivery's, and only delivery can give them back: the
    /// condition shows as state 8 in both directions.
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
            (Condition::DatabaseSessions, _) => Some(8),
            (Condition::Threads, _) => Some(9),
            (Condition::Override, Delivery) => Some(10),
            (Condition::Override, Publishing) => Some(11),
            (Condition::DownstreamOutage, Delivery) => Some(OUTAGE_STATE),
            (Condition::DownstreamLatency, Delivery) => Some(LATENCY_STATE),
            (Condition::DownstreamOutage | Condition::DownstreamLatency, Publishing) => None,
        }
    }

    /// Rank among active conditions; the highest decides a direction's state. BizTalk's
    /// documented order: process memory > in-process > threads > database size > all others.
    /// Among the others: system memory > database sessions > override > rate imbalance.
    ///
    /// The downstream conditions rank above rate imbalance and below the rest: they say what
    /// a queue does for what it calls, and any pressure on the host itself shows first.
    pub fn rank(self) -> u8 {
        match self {
            Condition::ProcessMemory => 9,
            Condition::InProcess => 8,
            Condition::Threads => 7,
            Condition::DatabaseSize => 6,
            Condition::SystemMemory => 5,
            Condition::DatabaseSessions => 4,
            Condition::Override => 3,
            Condition::DownstreamOutage => 2,
            Condition::DownstreamLatency => 1,
            Condition::RateImbalance => 0,
        }
    }

    /// Conditions a queue acts on by itself (its downstream guards): the controller shows
    /// them and takes no action of its own (no delay, no pace, no cut).
    pub fn acted_by_queue(self) -> bool {
        matches!(
            self,
            Condition::DownstreamOutage | Condition::DownstreamLatency
        )
    }

    /// Conditions that pace publishing against the backlog's drain rate (when it is measured)
    /// instead of delaying each send: what they guard grows with what is stored.
    pub fn paces_publishing(self) -> bool {
        matches!(
            self,
            Condition::ProcessMemory
                | Condition::SystemMemory
                | Condition::DatabaseSize
                | Condition::DatabaseSessions
        )
    }

    /// Conditions under which delivery also shrinks every queue's concurrency limit (BizTalk
    /// shrinks its thread pools for these; database sessions here too, because receives hold
    /// them). Not the in-process count: the delivery ceiling holds all queues together at its
    /// threshold exactly, so no queue's limit needs to give up what another does not use.
    pub fn shrinks_concurrency(self) -> bool {
        matches!(
            self,
            Condition::ProcessMemory
                | Condition::SystemMemory
                | Condition::Threads
                | Condition::DatabaseSessions
        )
    }
}

/// The delivery state a queue shows while in outage mode: a code past BizTalk's (which end
/// at 11), for a guard BizTalk does not have.
pub const OUTAGE_STATE: u8 = 12;
/// The delivery state a queue shows while its latency-aware limit holds it below its max.
pub const LATENCY_STATE: u8 = 13;

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
        (_, 8) => "high database session count",
        (_, 9) => "high thread count",
        (Direction::Delivery, 10) => "user override on delivery",
        (Direction::Publishing, 11) => "user override on publishing",
        (Direction::Delivery, OUTAGE_STATE) => "downstream outage",
        (Direction::Delivery, LATENCY_STATE) => "downstream latency",
        _ => "unknown",
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
                (Some(8), Some(8)),
                (Some(10), Some(11)),
                (Some(12), None),
                (Some(13), None),
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
