//! Host throttling, modelled on BizTalk Server's: sensors and rate meters feed a controller
//! that decides, every sample interval, a state, a delay and concurrency limits for the two
//! directions:
//!
//! * **delivery**: messages taken from queues and handed to handlers;
//! * **publishing**: messages this host writes to queues.
//!
//! Data flow: [`sensors`] and `rates` -> [`controller`] (pure, clock injected) ->
//! `admission` (the waits applied before each receive and each insert) and the queues'
//! concurrency gates. `service` runs that loop inside a host; between ticks it runs the
//! `ceiling`, a hard bound on receives at the thresholds of the resources messages hold.

pub(crate) mod admission;
pub(crate) mod ceiling;
pub mod controller;
pub(crate) mod explain;
pub(crate) mod law;
pub(crate) mod policy;
pub mod quality;
pub(crate) mod rates;
pub mod sensors;
pub(crate) mod service;
#[cfg(test)]
mod simulation;

use std::time::Duration;

use self::admission::Admission;
use self::rates::RateCounters;

pub use self::service::Snapshot;
pub use crate::states::{Condition, Direction, LATENCY_STATE, OUTAGE_STATE, state_name};

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
