//! Finding arrivals by looking, for a transport that cannot announce them (SQL Server has no
//! notification a host can listen to): once a second, one read of every idle queue's depth,
//! in as few statements as the transport can (200 queues per statement), wakes the queues
//! found holding messages. While these reads succeed, the idle receivers of the queues they
//! cover peek by themselves only as the rare safety net, as PostgreSQL's notified queues do:
//! a thousand idle queues cost some five statements a second, not a thousand, and a message
//! is still found within a second.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::receive::QueueRuntime;
use crate::transport::{QueueName, Transport};

/// How often the idle queues are read. A queue whose `peek_interval` is shorter is left to
/// peek by itself at its own interval.
pub(super) const SCAN_INTERVAL: Duration = Duration::from_secs(1);

/// Whether the scan covers `q`: its peek interval is not shorter than the scan's.
fn scanned(q: &QueueRuntime) -> bool {
    q.settings().peek_interval >= SCAN_INTERVAL
}

/// Reads the idle queues of `queues` every [`SCAN_INTERVAL`] until `stop`.
pub(super) async fn run(
    queues: Vec<Arc<QueueRuntime>>,
    transport: Arc<dyn Transport>,
    stop: CancellationToken,
) {
    let scanned: Vec<Arc<QueueRuntime>> = queues.into_iter().filter(|q| scanned(q)).collect();
    if scanned.is_empty() {
        return;
    }
    let mut ticks = tokio::time::interval(SCAN_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        scan(&scanned, transport.as_ref()).await;
    }
}

/// One round: the queues whose last peek found them empty are read; each read that succeeds
/// lets its queue peek rarely and wakes it when it holds messages, and each that fails sends
/// its queue back to peeking at its own interval. A queue with messages peeks by itself.
async fn scan(queues: &[Arc<QueueRuntime>], transport: &dyn Transport) {
    let idle: Vec<&Arc<QueueRuntime>> = queues.iter().filter(|q| q.last_seen_empty()).collect();
    if idle.is_empty() {
        return;
    }
    let names: Vec<QueueName> = idle.iter().map(|q| q.name().clone()).collect();
    let starts: Vec<_> = idle.iter().map(|q| q.depth().read_started()).collect();
    let depths = transport.peek_depths(&names).await;
    for ((q, start), depth) in idle.into_iter().zip(starts).zip(depths) {
        match depth {
            Ok(depth) => {
                // Fresh for the database size too, so the probe need not read it again; this
                // process's sends during the read stay on top.
                q.depth().set_read(depth, start);
                q.set_arrivals_notified(true);
                q.depth_read(depth);
            }
            Err(e) => {
                q.set_arrivals_notified(false);
                tracing::debug!(queue = %q.name(), error = %e, "the arrival scan could not read the queue");
            }
        }
    }
}
