//! Failed messages: what an operator does with an error queue (BizTalk's suspended
//! instances, ServicePulse's failed messages). See what failed, grouped by cause; look at one
//! message in full; send messages back to the queue they failed in (or another), each in the
//! transaction that removes it from the error queue; remove them; export them as JSON lines
//! and import such a file into a queue.
//!
//! Built on the transport's [`FailedStore`] ability, which browses an error queue without
//! taking its rows, so ServiceControl or another host reading the same queue loses nothing.
//! Grouping reads the headers of every selected row (bodies are left in the database) and
//! groups in this process: see `docs/guide/src/failed-messages.md` for what that costs.

mod cause;
mod census;
mod retry;
mod view;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::transport::failed::{FailedStore, StoredRow};
use crate::transport::{QueueName, Transport, TransportError};

pub use cause::Cause;
pub use census::{Census, CensusPlan, OTHER_SOURCE, run_census};
pub use retry::{RETRIED_AT_HEADER, RETRY_COUNT_HEADER, retried_message};
pub use view::{BodyView, MessageView};

/// Rows read per round trip while scanning an error queue.
const PAGE: u32 = 5_000;

/// Which failed messages a request is about. Empty: all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Filter {
    /// Only these native ids.
    pub ids: Vec<Uuid>,
    /// Only messages of this group ([`Group::id`]).
    pub group: Option<String>,
    /// Only messages that failed in this queue (`NServiceBus.FailedQ`, any address form).
    pub source: Option<String>,
    /// Only messages that failed at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only messages that failed before this time.
    pub until: Option<DateTime<Utc>>,
}

impl Filter {
    /// True when it selects every message.
    pub fn is_all(&self) -> bool {
        self == &Filter::default()
    }
}

/// Failed messages that share a cause: the exception type, the first line of its message and
/// the queue they failed in.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Group {
    /// A short id for the group, the same on every host and every run.
    pub id: String,
    /// What they have in common.
    pub cause: Cause,
    /// How many.
    pub count: u64,
    /// The earliest time of failure.
    pub first: Option<DateTime<Utc>>,
    /// The latest time of failure.
    pub last: Option<DateTime<Utc>>,
    /// One of them (its native id).
    pub example: Uuid,
}

/// One failed message in a list.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Summary {
    /// Its native id (the row's `Id`).
    pub id: Uuid,
    /// Its logical id (`NServiceBus.MessageId`), when the headers say.
    pub message_id: Option<String>,
    /// Why it failed.
    pub cause: Cause,
    /// Its group's id.
    pub group: String,
    /// When it failed.
    pub failed_at: Option<DateTime<Utc>>,
}

/// A page of failed messages.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Page {
    /// The messages, oldest first.
    pub messages: Vec<Summary>,
    /// How many match the filter in all.
    pub total: u64,
}

/// The failed-messages tool over one transport.
#[derive(Clone)]
pub struct FailedMessages {
    transport: Arc<dyn Transport>,
}

impl FailedMessages {
    /// The tool for `transport`; refused when it cannot browse its error queues.
    pub fn new(transport: Arc<dyn Transport>) -> Result<Self, TransportError> {
        if transport.failed_store().is_none() {
            return Err(TransportError::Unsupported {
                what: "this transport cannot browse an error queue",
                setting: "transport.kind",
            });
        }
        Ok(FailedMessages { transport })
    }

    fn store(&self) -> &dyn FailedStore {
        // Checked in `new`.
        self.transport
            .failed_store()
            .expect("a transport with a failed store")
    }

    /// The queue a source filter or a `FailedQ` value names, as this transport reaches it.
    fn resolve(&self, address: &str) -> Option<QueueName> {
        self.transport.resolve_address(address)
    }

    /// Hands `each` every row of `queue` that `filter` selects, with its cause, oldest first,
    /// reading a page at a time (bodies only when `with_body`): what is not kept is dropped
    /// page by page.
    async fn visit(
        &self,
        queue: &QueueName,
        filter: &Filter,
        with_body: bool,
        mut each: impl FnMut(StoredRow, Cause),
    ) -> Result<(), TransportError> {
        if !filter.ids.is_empty() {
            for row in self.store().read(queue, &filter.ids).await? {
                let cause = Cause::of(&row.headers, |a| self.resolve(a));
                each(row, cause);
            }
            return Ok(());
        }
        let source = filter.source.as_deref().map(|s| {
            self.resolve(s)
                .map_or_else(|| s.to_string(), |q| q.to_string())
        });
        let mut after = 0;
        loop {
            let rows = self.store().browse(queue, after, PAGE, with_body).await?;
            let Some(last) = rows.last() else {
                return Ok(());
            };
            after = last.position;
            for row in rows {
                let cause = Cause::of(&row.headers, |a| self.resolve(a));
                let failed_at = cause.failed_at;
                let keep = filter.group.as_ref().is_none_or(|g| *g == cause.group_id())
                    && source
                        .as_ref()
                        .is_none_or(|s| cause.source.as_deref() == Some(s))
                    && filter
                        .since
                        .is_none_or(|t| failed_at.is_some_and(|f| f >= t))
                    && filter
                        .until
                        .is_none_or(|t| failed_at.is_some_and(|f| f < t));
                if keep {
                    each(row, cause);
                }
            }
        }
    }

    /// The id and cause of every row of `queue` that `filter` selects, oldest first.
    async fn scan(
        &self,
        queue: &QueueName,
        filter: &Filter,
    ) -> Result<Vec<(Uuid, Cause)>, TransportError> {
        let mut selected = Vec::new();
        self.visit(queue, filter, false, |row, cause| {
            selected.push((row.id, cause))
        })
        .await?;
        Ok(selected)
    }

    /// The groups of the messages `filter` selects in `queue`, largest first.
    pub async fn groups(
        &self,
        queue: &QueueName,
        filter: &Filter,
    ) -> Result<Vec<Group>, TransportError> {
        let mut groups: BTreeMap<String, Group> = BTreeMap::new();
        for (example, cause) in self.scan(queue, filter).await? {
            let id = cause.group_id();
            let failed_at = cause.failed_at;
            let group = groups.entry(id.clone()).or_insert_with(|| Group {
                id,
                cause: cause.clone(),
                count: 0,
                first: failed_at,
                last: failed_at,
                example,
            });
            group.count += 1;
            // Option's order puts None first: the earliest known time is the min of the
            // known ones.
            group.first = match (group.first, failed_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            group.last = group.last.max(failed_at);
        }
        let mut groups: Vec<Group> = groups.into_values().collect();
        groups.sort_by(|a, b| b.count.cmp(&a.count).then(a.id.cmp(&b.id)));
        Ok(groups)
    }

    /// The messages `filter` selects, `limit` of them from `offset`, oldest first.
    pub async fn list(
        &self,
        queue: &QueueName,
        filter: &Filter,
        offset: usize,
        limit: usize,
    ) -> Result<Page, TransportError> {
        let selected = self.scan(queue, filter).await?;
        let total = selected.len() as u64;
        let messages = selected
            .into_iter()
            .skip(offset)
            .take(limit)
            .map(|(id, cause)| Summary {
                id,
                message_id: cause.message_id.clone(),
                group: cause.group_id(),
                failed_at: cause.failed_at,
                cause,
            })
            .collect();
        Ok(Page { messages, total })
    }

    /// One message in full; None when it is not (or no longer) in `queue`.
    pub async fn show(
        &self,
        queue: &QueueName,
        id: Uuid,
        body_limit: usize,
    ) -> Result<Option<MessageView>, TransportError> {
        let row = self.store().read(queue, &[id]).await?.into_iter().next();
        Ok(row.map(|row| {
            let cause = Cause::of(&row.headers, |a| self.resolve(a));
            MessageView::of(&row, cause, body_limit)
        }))
    }

    /// The native ids `filter` selects.
    pub async fn select(
        &self,
        queue: &QueueName,
        filter: &Filter,
    ) -> Result<Vec<Uuid>, TransportError> {
        Ok(self
            .scan(queue, filter)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect())
    }

    /// Deletes the messages `filter` selects; returns how many were deleted.
    pub async fn delete(&self, queue: &QueueName, filter: &Filter) -> Result<u64, TransportError> {
        let ids = self.select(queue, filter).await?;
        self.delete_ids(queue, &ids).await
    }

    /// Deletes the messages with these ids (already selected); returns how many were deleted.
    pub async fn delete_ids(&self, queue: &QueueName, ids: &[Uuid]) -> Result<u64, TransportError> {
        let mut deleted = 0;
        for chunk in ids.chunks(PAGE as usize) {
            deleted += self.store().remove(queue, chunk).await?;
        }
        Ok(deleted)
    }

    /// The rows `filter` selects in `queue`, bodies included, with their causes: for export.
    /// One pass: each page is read with its bodies and filtered as it comes.
    pub async fn rows(
        &self,
        queue: &QueueName,
        filter: &Filter,
    ) -> Result<Vec<(StoredRow, Cause)>, TransportError> {
        let mut full = Vec::new();
        self.visit(queue, filter, true, |row, cause| full.push((row, cause)))
            .await?;
        Ok(full)
    }

    /// Sends the messages with these ids back to where they failed (or to `to`), in batches
    /// of `batch`, each batch in one transaction with their removal from `queue`. `admit` is
    /// waited before each message (the host's publishing admission paces retries like any
    /// other send); `progress` hears the running total after each batch, and `stop` ends the
    /// run between batches. A message whose source cannot be told and no `to` is given stays.
    pub async fn retry(
        &self,
        queue: &QueueName,
        ids: &[Uuid],
        to: Option<&QueueName>,
        batch: usize,
        run: &retry::RetryRun<'_>,
    ) -> Result<retry::Retried, TransportError> {
        retry::run(self, queue, ids, to, batch, run).await
    }
}

pub use retry::{Retried, RetryRun};
