//! How a queue's idle receivers learn that messages came: the transport's arrivals, the
//! depth reads made elsewhere, and the rare safety-net peek behind them.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::QueueRuntime;

/// How often an idle queue whose arrivals are told of is still peeked by itself. Rows that
/// come without an insert (a crashed host's messages rolled back) are found sooner by the
/// depth reads the host makes anyway, a few statements for all its queues every
/// `database_size_refresh` ([`QueueRuntime::depth_read`]); this is the safety net behind
/// them, rare enough that a thousand idle queues cost some three statements a second.
pub(crate) const NOTIFIED_PEEK_INTERVAL: Duration = Duration::from_secs(300);

/// [`QueueRuntime::first_peek`] when no depth waits for the first peek.
pub(super) const NOT_READ: u64 = u64::MAX;

impl QueueRuntime {
    /// The depth one read of all the host's queues found just before the receivers started
    /// (`start` as for a peek): the first peek takes it instead of sending a statement of its
    /// own. A host of 1 000 queues otherwise began with 1 000 peeks, and on PostgreSQL its
    /// first message was handled three quarters of a second after it was ready; the read of
    /// every depth is five statements.
    pub(crate) fn seed_first_peek(&self, depth: u64, start: crate::depth::ReadStart) {
        self.peeked(depth, start);
        self.first_peek
            .store(depth.min(NOT_READ - 1), Ordering::Relaxed);
    }

    /// The depth seeded by [`QueueRuntime::seed_first_peek`], once.
    pub(super) fn take_first_peek(&self) -> Option<u64> {
        match self.first_peek.swap(NOT_READ, Ordering::Relaxed) {
            NOT_READ => None,
            depth => Some(depth),
        }
    }

    /// Messages may have arrived (the transport said so): an idle receiver looks now instead
    /// of at its next peek. Kept until a receiver waits, so an arrival between two waits is
    /// not lost.
    pub(crate) fn arrived(&self) {
        self.arrivals.notify_one();
        self.share_wanted.notify_one();
    }

    /// A depth read made elsewhere (the probe's read of every queue, a leader's heartbeat)
    /// found `depth` messages: receivers sleeping out the long safety interval peek now.
    pub(crate) fn depth_read(&self, depth: u64) {
        if depth > 0 && self.peeks_rarely() {
            self.arrived();
        }
    }

    /// Whether the transport tells of every arrival on this queue from now on (true), or
    /// may miss some (false: the listening connection failed).
    pub(crate) fn set_arrivals_notified(&self, notified: bool) {
        let was = self.arrivals_notified.swap(notified, Ordering::Relaxed);
        if was && !notified {
            // Receivers sleeping out the long safety interval go back to peeking.
            self.arrived();
        }
    }

    /// Whether an idle receiver may peek only as a safety net: every arrival on this queue
    /// is told of now, and the last peek found it empty (rows that wait for their key or
    /// stage, or that another host rolled back, become receivable without an insert, so a
    /// queue that holds any keeps peeking at its interval).
    pub(crate) fn peeks_rarely(&self) -> bool {
        self.arrivals_notified.load(Ordering::Relaxed)
            && self.last_peek_empty.load(Ordering::Relaxed)
    }

    /// Whether a receive that found this queue empty tells as much as a peek would: every
    /// arrival is told of, and receives pass over no row a peek counts (an ordered queue's
    /// receive passes over rows that wait for their key or stage).
    pub(crate) fn empty_receive_settles(&self) -> bool {
        self.arrivals_notified.load(Ordering::Relaxed) && self.ordering().is_none()
    }

    /// Whether the last peek found no message this host could take.
    pub(crate) fn last_seen_empty(&self) -> bool {
        self.last_peek_empty.load(Ordering::Relaxed)
    }

    /// The longest an idle receiver waits between peeks: the queue's `peek_interval`, or
    /// [`NOTIFIED_PEEK_INTERVAL`] while it peeks rarely ([`QueueRuntime::peeks_rarely`]), so a
    /// thousand idle queues do not cost a thousand statements a second.
    pub(crate) fn idle_peek_interval(&self) -> Duration {
        let interval = self.settings().peek_interval;
        match self.peeks_rarely() {
            true => interval.max(NOTIFIED_PEEK_INTERVAL),
            false => interval,
        }
    }

    /// Completes at the next arrival, for the loop that shares fleet-wide limits (an idle
    /// instance holds no share and asks for one when messages come).
    pub(crate) fn share_wanted(&self) -> tokio::sync::futures::Notified<'_> {
        self.share_wanted.notified()
    }

    /// Completes at the next arrival ([`QueueRuntime::arrived`]), or at once for one that came
    /// while nobody waited.
    pub(crate) fn arrival(&self) -> tokio::sync::futures::Notified<'_> {
        self.arrivals.notified()
    }
}
