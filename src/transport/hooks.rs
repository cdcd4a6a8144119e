//! What a transport tells its host beyond the message path: how long the database has been
//! silent, the lock conflicts it handled itself, and when messages arrive. One ability
//! ([`HostHooks`]), reached like the others through an accessor
//! ([`super::Transport::host_hooks`]).

use std::sync::Arc;
use std::time::Duration;

use super::QueueName;

/// What a transport tells its host beyond the message path. Every method has a default: a
/// transport implements what it can tell.
pub trait HostHooks: Send + Sync {
    /// How long the database has not answered while statements waited, once that is at
    /// least [`super::silence::SILENT_AFTER`]; None while it answers (or when the transport
    /// cannot tell).
    fn silent_for(&self) -> Option<Duration> {
        None
    }

    /// From now on, reports the lock conflicts this transport handles itself to `sink`
    /// (default: a transport that has none ignores it).
    fn report_conflicts_to(&self, _sink: Arc<dyn ConflictSink>) {}

    /// From now on, tells `sink` when messages arrive on `queues`. Returns whether it tells
    /// of every arrival, other processes' sends included; a transport that cannot (the
    /// default, which tells of none) leaves the host to look for them, reading its idle
    /// queues' depths every second. Call it inside the runtime: a transport may start a task
    /// that listens; it ends with the transport.
    fn wake_on_arrival(&self, _queues: &[QueueName], _sink: Arc<dyn ArrivalSink>) -> bool {
        false
    }
}

/// Where a transport reports the lock conflicts it handled itself (a row passed over because
/// another transaction holds it, a deadlock victim retried), so they are counted by queue
/// instead of logged one by one.
pub trait ConflictSink: Send + Sync {
    /// A statement on `queue`'s tables gave up on a row another transaction holds.
    fn lock_timeout(&self, queue: &QueueName);
    /// A statement on `queue`'s tables was chosen as a deadlock victim and retried.
    fn deadlock(&self, queue: &QueueName);
}

/// Where a transport says that messages may have arrived on a queue this host receives (the
/// database notified it, or this process sent them), so idle receivers look at once instead
/// of at their next peek. A hint, never the only way to find messages: receivers still peek.
pub trait ArrivalSink: Send + Sync {
    /// Messages may have arrived on `queue`.
    fn arrived(&self, queue: &QueueName);

    /// From now on every arrival on `queue` is told of (`notified`), or some may be missed
    /// (the listening connection failed). Idle receivers of a notified queue peek rarely.
    fn listening(&self, queue: &QueueName, notified: bool) {
        let _ = (queue, notified);
    }
}
