//! The count behind the failed-messages gauges: how many messages wait in an error queue, by
//! the queue they failed in, and in how many groups. A host counts its error queues every
//! `failed_messages.count_interval` (see [`run_census`]), so a dashboard and an alert see a
//! backlog grow without anyone opening the console.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{FailedMessages, Filter};
use crate::metrics::Metrics;
use crate::transport::{QueueName, TransportError};

/// The `source` label of messages that failed in a queue this host does not receive from, or
/// whose headers do not say where they failed: rows other endpoints wrote must not grow the
/// label set without bound.
pub const OTHER_SOURCE: &str = "other";

/// One count of an error queue.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Census {
    /// Messages by the queue they failed in: every known source (at 0 when none failed
    /// there) and [`OTHER_SOURCE`].
    pub by_source: BTreeMap<String, u64>,
    /// Distinct groups ([`super::Group`]) among them.
    pub groups: u64,
}

impl FailedMessages {
    /// Counts the messages in error queue `queue`, naming the sources in `known` and
    /// counting the rest as [`OTHER_SOURCE`]. Reads headers only, a page at a time, and
    /// keeps one group id per group.
    pub async fn census(
        &self,
        queue: &QueueName,
        known: &[QueueName],
    ) -> Result<Census, TransportError> {
        let names: Vec<String> = known.iter().map(|q| q.to_string()).collect();
        let mut by_source: BTreeMap<String, u64> = names.iter().map(|n| (n.clone(), 0)).collect();
        by_source.insert(OTHER_SOURCE.to_string(), 0);
        let mut groups = HashSet::new();
        self.visit(queue, &Filter::default(), false, |_, cause| {
            let source = cause
                .source
                .as_ref()
                .filter(|s| names.contains(s))
                .map_or(OTHER_SOURCE, |s| s.as_str());
            if let Some(n) = by_source.get_mut(source) {
                *n += 1;
            }
            groups.insert(cause.group_id());
        })
        .await?;
        Ok(Census {
            by_source,
            groups: groups.len() as u64,
        })
    }
}

/// What a host's census counts: each error queue with the host's queues that send there.
#[derive(Debug, Clone)]
pub struct CensusPlan {
    /// Error queue -> the input queues whose failures it holds (the named sources).
    pub error_queues: BTreeMap<QueueName, Vec<QueueName>>,
}

/// Counts every error queue of `plan` at once and then every `interval()` (read each round, so
/// a reload applies; zero = wait and ask again), writing the gauges, until `stop`. A count
/// that fails is logged and leaves the gauges as they were: the next round tries again.
pub async fn run_census(
    failed: FailedMessages,
    plan: CensusPlan,
    metrics: Metrics,
    interval: impl Fn() -> Duration,
    stop: CancellationToken,
) {
    /// How often a census that is turned off looks whether a reload turned it on.
    const OFF_RECHECK: Duration = Duration::from_secs(5);
    loop {
        if !interval().is_zero() {
            for (queue, known) in &plan.error_queues {
                let started = Instant::now();
                match failed.census(queue, known).await {
                    Ok(census) => metrics.failed_census(
                        queue.as_str(),
                        &census.by_source,
                        census.groups,
                        started.elapsed(),
                    ),
                    Err(e) => tracing::warn!(
                        error_queue = %queue, error = %e,
                        "could not count the failed messages; the gauges keep their last count"
                    ),
                }
            }
        }
        let wait = match interval() {
            d if d.is_zero() => OFF_RECHECK,
            d => d,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
