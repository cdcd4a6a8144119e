//! The host's side of the throttling service: what the controller reads ([`HostProbe`]) and
//! where its limits go ([`LimitSink`]). The service never sees a receiver, dispatcher or
//! transport; this adapter does.
//!
//! Database size comes from the queues' last known depths. Receivers refresh those as they
//! work (every peek, every empty receive); a depth older than the age the service asks for is
//! peeked again in the background, on the host's runtime, so a tick never waits on the
//! database and an idle monitor queue costs no extra statement.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::config::FailedKey;
use crate::dispatch::Dispatcher;
use crate::publish::Publisher;
use crate::queue::{DepthCell, DownstreamReading, ERROR_DEPTH_MAX_AGE, QueueRuntime};
use crate::throttling::controller::{DownstreamGuards, GuardCondition};
use crate::throttling::service::{HostProbe, LimitSink, QueueReading};
use crate::transport::{QueueName, Transport};

/// Reads the host's counters for the controller and applies its limits.
pub(super) struct HostAdapter {
    pub(super) queues: Vec<Arc<QueueRuntime>>,
    /// The same queues by name: a tick sets every queue's limit, and finding each in the
    /// list was a thousand comparisons per queue on a host of a thousand.
    by_name: HashMap<QueueName, Arc<QueueRuntime>>,
    pub(super) dispatcher: Arc<Dispatcher>,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) publisher: Arc<Publisher>,
    /// Error queues (left out of database size unless configured).
    pub(super) error_queues: HashSet<QueueName>,
    pub(super) include_error_queues: bool,
    /// The host's runtime: depth refreshes run there, beside the transport's connections.
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) refreshing: Arc<AtomicBool>,
    /// When each queue that holds keys last had its held keys read.
    pub(super) held_read_at: std::sync::Mutex<HashMap<QueueName, std::time::Instant>>,
}

impl HostAdapter {
    /// The probe of a host's queues: depths, in-process count, sessions, downstream guards.
    pub(super) fn new(
        config: &crate::config::Config,
        queues: &[Arc<QueueRuntime>],
        dispatcher: &Arc<Dispatcher>,
        transport: &Arc<dyn Transport>,
        publisher: &Arc<Publisher>,
        error_queues: HashSet<QueueName>,
    ) -> Self {
        HostAdapter {
            queues: queues.to_vec(),
            by_name: queues
                .iter()
                .map(|q| (q.name().clone(), q.clone()))
                .collect(),
            dispatcher: dispatcher.clone(),
            transport: transport.clone(),
            publisher: publisher.clone(),
            error_queues,
            include_error_queues: config.throttling.database_size_includes_error_queue,
            runtime: tokio::runtime::Handle::current(),
            refreshing: Arc::default(),
            held_read_at: Default::default(),
        }
    }
}

/// How often the held keys of a queue with `failed_key = "hold"` are read: a hold is lifted
/// from another process (`throttlehost queues release`), and receivers keep the depth fresh,
/// so the depth's own refresh cannot be counted on to come.
const HELD_READ_INTERVAL: Duration = Duration::from_secs(5);

impl HostAdapter {
    fn counts(&self, name: &QueueName) -> bool {
        self.include_error_queues || !self.error_queues.contains(name)
    }

    /// Whether `q`'s held keys are due for a read (and, if so, counts it as read now).
    fn held_due(&self, q: &QueueRuntime) -> bool {
        if !q
            .ordering()
            .as_ref()
            .is_some_and(|o| o.failed_key == FailedKey::Hold)
        {
            return false;
        }
        let now = std::time::Instant::now();
        let mut read_at = self.held_read_at.lock().unwrap_or_else(|e| e.into_inner());
        match read_at.get(q.name()) {
            Some(at) if now.duration_since(*at) < HELD_READ_INTERVAL => false,
            _ => {
                read_at.insert(q.name().clone(), now);
                true
            }
        }
    }

    /// Reads the stale depths in the background (and, for an ordered queue holding messages,
    /// how many of them wait for their key or stage).
    fn refresh(&self, stale: Vec<StaleDepth>) {
        if stale.is_empty() || self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let transport = self.transport.clone();
        let refreshing = self.refreshing.clone();
        self.runtime.spawn(async move {
            // Every stale depth in as few statements as the transport can.
            let starts: Vec<_> = stale.iter().map(|s| s.cell.read_started()).collect();
            let names: Vec<QueueName> = stale.iter().map(|s| s.name.clone()).collect();
            let depths = transport.peek_depths(&names).await;
            for (
                (
                    StaleDepth {
                        name,
                        cell,
                        rare,
                        waiting,
                        held,
                        receiver,
                    },
                    start,
                ),
                depth,
            ) in stale.into_iter().zip(starts).zip(depths)
            {
                match depth {
                    Ok(depth) => {
                        cell.set_read(depth, start);
                        if let Some(q) = &receiver {
                            q.depth_read(depth);
                        }
                        read_order_gauges(transport.as_ref(), &name, depth, waiting, held).await;
                    }
                    Err(e) => {
                        if rare {
                            cell.read_failed();
                        }
                        tracing::debug!(queue = %name, error = %e, "depth refresh failed")
                    }
                }
            }
            refreshing.store(false, Ordering::Release);
        });
    }
}

/// An ordered queue's gauges of messages waiting for their key or stage and of held keys,
/// read after its depth (an empty queue has none of either: no statement for it).
async fn read_order_gauges(
    transport: &dyn Transport,
    name: &QueueName,
    depth: u64,
    waiting: Option<metrics::Gauge>,
    held: Option<metrics::Gauge>,
) {
    let ordering = transport.key_ordering();
    if let (Some(gauge), Some(ordering)) = (waiting, ordering) {
        // An empty queue has nothing waiting: no statement for it.
        match depth {
            0 => gauge.set(0.0),
            _ => match ordering.waiting_in_order(name).await {
                Ok(Some(n)) => gauge.set(n as f64),
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(queue = %name, error = %e, "counting the messages waiting for their order failed")
                }
            },
        }
    }
    if let (Some(gauge), Some(ordering)) = (held, ordering) {
        // A held message stays in its queue: none held in an empty one.
        match depth {
            0 => gauge.set(0.0),
            _ => match ordering.held_keys(name).await {
                Ok(keys) => gauge.set(keys.len() as f64),
                Err(e) => {
                    tracing::debug!(queue = %name, error = %e, "reading the held keys failed")
                }
            },
        }
    }
}

/// A depth cell due for a read.
struct StaleDepth {
    name: QueueName,
    cell: Arc<DepthCell>,
    /// Read rarely (error queues): a failed read waits its full age before the next try.
    rare: bool,
    /// An ordered queue's gauge of messages waiting for their key or stage.
    waiting: Option<metrics::Gauge>,
    /// An ordered queue's gauge of keys held by a failed message (`failed_key = "hold"`).
    held: Option<metrics::Gauge>,
    /// The receiving queue read, told what was found (None: an error or publishing target).
    receiver: Option<Arc<QueueRuntime>>,
}

impl StaleDepth {
    fn new(name: QueueName, cell: Arc<DepthCell>, rare: bool) -> Self {
        StaleDepth {
            name,
            cell,
            rare,
            waiting: None,
            held: None,
            receiver: None,
        }
    }
}

impl HostProbe for HostAdapter {
    fn in_process(&self) -> u64 {
        self.dispatcher.in_process()
    }

    fn database_sessions(&self) -> u64 {
        self.transport.connections_in_use()
    }

    fn queues(&self) -> Vec<QueueReading> {
        self.queues.iter().map(|q| q.reading()).collect()
    }

    fn database_size(&self, max_age: Duration) -> u64 {
        let is_stale = |cell: &DepthCell| cell.age().is_none_or(|a| a >= max_age);
        let mut stale = Vec::new();
        let mut total = 0u64;
        let receiving: HashSet<&QueueName> = self.queues.iter().map(|q| q.name()).collect();
        for q in self.queues.iter().filter(|q| self.counts(q.name())) {
            total += q.stored();
            // Far from the threshold, a queue another instance leads takes that instance's
            // reading with each heartbeat instead of a peek of its own.
            let read_here = max_age.is_zero() || q.leads();
            if (is_stale(q.depth()) && read_here) | self.held_due(q) {
                let mut read = StaleDepth::new(q.name().clone(), q.depth().clone(), false);
                (read.waiting, read.held) = q.ordered_gauges();
                read.receiver = Some(q.clone());
                stale.push(read);
            }
        }
        // Error queues are shown on the console, read rarely (they only grow by this host's
        // moves, which keep the cell current, or by other hosts'). Queues sharing an error
        // queue share its cell: it is read once.
        for q in &self.queues {
            let due = q
                .error_depth()
                .age()
                .is_none_or(|a| a >= ERROR_DEPTH_MAX_AGE);
            if due && !stale.iter().any(|s| Arc::ptr_eq(&s.cell, q.error_depth())) {
                stale.push(StaleDepth::new(
                    q.error_queue().clone(),
                    q.error_depth().clone(),
                    true,
                ));
            }
        }
        {
            for name in self.publisher.targets() {
                if receiving.contains(&name) || !self.counts(&name) {
                    continue;
                }
                let Some(cell) = self.publisher.depth(&name) else {
                    continue;
                };
                total += cell.get();
                if is_stale(&cell) {
                    stale.push(StaleDepth::new(name, cell, false));
                }
            }
        }
        self.refresh(stale);
        total
    }

    fn downstream(&self) -> DownstreamGuards {
        downstream_guards(self.queues.iter().map(|q| q.downstream().reading()))
    }
}

impl LimitSink for HostAdapter {
    fn set_limit(&self, queue: &QueueName, limit: u32) {
        if let Some(q) = self.by_name.get(queue) {
            q.set_throttling_limit(limit);
        }
    }
}

/// The worst queue of each downstream guard: an active one first (the most failures in a
/// row; the latency furthest over its line), else the closest to its line. A guard no queue
/// has on shows threshold 0 (off).
fn downstream_guards(readings: impl Iterator<Item = DownstreamReading>) -> DownstreamGuards {
    let mut guards = DownstreamGuards::default();
    // The default (threshold 0) stands for "no queue seen": any queue replaces it.
    let worse = |a: &GuardCondition, b: &GuardCondition| {
        a.threshold == 0.0 || (b.active, b.value - b.threshold) > (a.active, a.value - a.threshold)
    };
    for r in readings {
        let outage = GuardCondition {
            active: r.outage,
            value: f64::from(r.consecutive_failures),
            threshold: f64::from(r.failure_threshold),
        };
        if r.failure_threshold > 0 && worse(&guards.outage, &outage) {
            guards.outage = outage;
        }
        if r.latency_limit.is_some() {
            let latency = GuardCondition {
                active: r.latency_limiting,
                value: r.latency_recent * 1000.0,
                threshold: r.latency_line * 1000.0,
            };
            if worse(&guards.latency, &latency) {
                guards.latency = latency;
            }
        }
    }
    guards
}

/// Writes a queue's downstream guard gauges (outage mode, latency-aware limit).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_queue_shows_and_a_fine_one_still_shows_its_threshold() {
        let fine = DownstreamReading {
            failure_threshold: 20,
            ..DownstreamReading::default()
        };
        let g = downstream_guards([fine].into_iter());
        assert_eq!((g.outage.active, g.outage.threshold), (false, 20.0));
        let failing = DownstreamReading {
            outage: true,
            consecutive_failures: 25,
            ..fine
        };
        let g = downstream_guards([fine, failing, fine].into_iter());
        assert_eq!((g.outage.active, g.outage.value), (true, 25.0));
        assert_eq!(downstream_guards(std::iter::empty()).outage.threshold, 0.0);
    }
}
