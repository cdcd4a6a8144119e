//! A queue's depth as the host knows it: the last count read from the database, plus the
//! messages this host stored into the queue and took out of it since that read began. Reads
//! cost a statement, so they come every few seconds (every tick near the database size
//! threshold); the counters keep the number current in between, so database size engages on
//! the tick it crosses rather than a read later. Messages moved by other hosts show at the
//! next read.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One queue's depth. Shared (`Arc`) by the publisher (arrivals), the dispatcher
/// (departures), the receivers and the throttling probe (reads).
#[derive(Debug)]
pub(crate) struct DepthCell {
    origin: Instant,
    read: AtomicU64,
    at_ms: AtomicU64,
    /// Arrivals minus departures since the last read began.
    changes: AtomicI64,
}

impl Default for DepthCell {
    fn default() -> Self {
        DepthCell {
            origin: Instant::now(),
            read: AtomicU64::new(0),
            at_ms: AtomicU64::new(u64::MAX),
            changes: AtomicI64::new(0),
        }
    }
}

/// Where a read began, so changes during the read are neither lost nor counted twice.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadStart(i64);

impl DepthCell {
    /// Call before issuing a count statement; pass the result to [`DepthCell::set_read`].
    pub(crate) fn read_started(&self) -> ReadStart {
        ReadStart(self.changes.load(Ordering::Acquire))
    }

    /// Records a count whose statement began at `start`: changes since then stay on top.
    pub(crate) fn set_read(&self, depth: u64, start: ReadStart) {
        self.read.store(depth, Ordering::Release);
        self.changes.fetch_sub(start.0, Ordering::AcqRel);
        self.at_ms
            .store(self.origin.elapsed().as_millis() as u64, Ordering::Release);
    }

    /// Records that a read was tried and failed: the value stays, the age starts again, so a
    /// queue that cannot be read (an error queue not created yet) is not read every tick.
    pub(crate) fn read_failed(&self) {
        self.at_ms
            .store(self.origin.elapsed().as_millis() as u64, Ordering::Release);
    }

    /// Records a depth known right now (an empty receive: 0).
    pub(crate) fn set(&self, depth: u64) {
        self.set_read(depth, self.read_started());
    }

    /// This host stored a message into the queue.
    pub(crate) fn arrived(&self) {
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// A message left the queue for good (handled, moved to the error queue, expired).
    pub(crate) fn departed(&self) {
        self.changes.fetch_sub(1, Ordering::AcqRel);
    }

    /// The depth now: the last read plus the changes since (never below 0).
    pub(crate) fn get(&self) -> u64 {
        let read = self.read.load(Ordering::Acquire) as i64;
        (read + self.changes.load(Ordering::Acquire)).max(0) as u64
    }

    /// How old the last read is; None if never read.
    pub(crate) fn age(&self) -> Option<Duration> {
        match self.at_ms.load(Ordering::Acquire) {
            u64::MAX => None,
            at => Some(
                self.origin
                    .elapsed()
                    .saturating_sub(Duration::from_millis(at)),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_ages() {
        let d = DepthCell::default();
        assert_eq!(d.age(), None);
        d.set(7);
        assert_eq!(d.get(), 7);
        assert!(d.age().unwrap() < Duration::from_secs(1));
    }

    #[test]
    fn arrivals_and_departures_move_the_depth_between_reads() {
        let d = DepthCell::default();
        d.set(100);
        for _ in 0..30 {
            d.arrived();
        }
        for _ in 0..10 {
            d.departed();
        }
        assert_eq!(d.get(), 120);
        d.set(50);
        assert_eq!(d.get(), 50, "a read replaces the estimate");
        for _ in 0..60 {
            d.departed();
        }
        assert_eq!(d.get(), 0, "never below 0");
    }

    #[test]
    fn changes_during_a_read_are_kept_once() {
        let d = DepthCell::default();
        d.set(10);
        d.arrived(); // before the read: the count includes it
        let start = d.read_started();
        d.arrived(); // during the read: whether the count saw it is unknown; kept on top
        d.set_read(11, start);
        assert_eq!(d.get(), 12);
    }
}
