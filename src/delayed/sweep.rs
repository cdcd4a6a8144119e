//! The sweeper: one task per host that reads every delayed table the host leads in a few
//! statements per interval ([`DelayedDelivery::sweep`], 200 tables each) and tells each
//! table's mover when something in it is due. Without it every mover polled its own table,
//! backing off to once a minute: a thousand idle queues cost some seventeen statements a
//! second for nothing, and each empty move fired the queue's insert trigger. A message stored
//! by another process (an NServiceBus endpoint, another host) is now found within
//! [`SWEEP_INTERVAL`] instead of within the back-off's minute.
//!
//! [`DelayedDelivery::sweep`]: crate::transport::DelayedDelivery::sweep

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{MovesHealth, Wake};
use crate::metrics::QueueMetrics;
use crate::transport::{DelayedReading, QueueName, Transport};

/// How often the sweeper reads the delayed tables this host leads.
pub(crate) const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// One delayed table the sweeper reads, and where it tells what it found.
pub(crate) struct SweptTable {
    /// The queue whose delayed table it is.
    pub queue: QueueName,
    /// Its mover's wake-up.
    pub wake: Arc<Wake>,
    /// Whether this host leads the queue (only a leader's tables are read).
    pub leads: Arc<AtomicBool>,
    /// Messages in the table as last read (the database size counts them).
    pub waiting: Arc<AtomicU64>,
    /// The queue's gauges of its delayed table.
    pub metrics: Arc<QueueMetrics>,
    /// Whether its mover's own moves fail: such a table is left out of the sweep (one
    /// missing table fails the statement it is in) and its mover polls it with its back-off.
    pub health: Arc<MovesHealth>,
}

impl SweptTable {
    /// What a sweep read of the table: the gauges, and the mover woken when something is due
    /// before the next sweep.
    fn found(&self, reading: DelayedReading) {
        super::record_table(
            &self.waiting,
            &self.metrics,
            reading.waiting,
            reading.next_due_in,
        );
        if let Some(due) = reading.next_due_in.filter(|due| *due <= SWEEP_INTERVAL) {
            self.wake.due_in(due);
        }
    }
}

/// Reads the tables this host leads at once and every [`SWEEP_INTERVAL`] until `stop`,
/// leaving out those whose movers fail. A sweep that fails (a missing table fails the
/// statement it is in) wakes every mover it was for, once per run of failures: each moves, or
/// finds and reports its own table's error and is left out of the next sweep.
pub(crate) async fn run_sweeper(
    transport: Arc<dyn Transport>,
    tables: Vec<SweptTable>,
    stop: CancellationToken,
) {
    let Some(delayed) = transport.delayed_delivery() else {
        return;
    };
    let mut failing = false;
    loop {
        let leading: Vec<&SweptTable> = tables
            .iter()
            .filter(|t| t.leads.load(Ordering::Relaxed) && !t.health.is_failing())
            .collect();
        if !leading.is_empty() {
            let names: Vec<QueueName> = leading.iter().map(|t| t.queue.clone()).collect();
            match delayed.sweep(&names).await {
                Ok(readings) => {
                    if failing {
                        tracing::info!("the sweep of delayed tables works again");
                        failing = false;
                    }
                    for (table, reading) in leading.iter().zip(readings) {
                        table.found(reading);
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e,
                            "cannot sweep the delayed tables; each mover looks at its own");
                        failing = true;
                        for table in &leading {
                            table.wake.due_in(Duration::ZERO);
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(SWEEP_INTERVAL) => {}
        }
    }
}
