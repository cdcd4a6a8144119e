//! Delayed tables in memory: stored with their due time, moved into their queue when due.

use std::collections::BTreeMap;
use std::time::SystemTime;

use async_trait::async_trait;

use crate::config::DEFAULT_DELAYED_TABLE_SUFFIX;
use crate::transport::delayed::{DelayedDelivery, DelayedReading, Moved};
use crate::transport::{QueueName, TransportError};

use super::queue::StoredMessage;
use super::{MemoryTransport, lock};

/// A queue's delayed table: messages by due time, then by arrival. A move happens under its
/// lock, so movers never overlap.
#[derive(Default)]
pub(super) struct DelayedTable {
    pub(super) rows: BTreeMap<(SystemTime, u64), StoredMessage>,
    pub(super) next: u64,
}

/// The error for `queue`'s missing delayed table, named as the SQL transports name it.
pub(super) fn no_delayed_table(queue: &QueueName) -> TransportError {
    TransportError::DelayedTableNotFound {
        queue: queue.to_string(),
        table: format!("{queue}.{DEFAULT_DELAYED_TABLE_SUFFIX}"),
    }
}

#[async_trait]
impl DelayedDelivery for MemoryTransport {
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError> {
        lock(&self.shared.delayed).entry(queue.clone()).or_default();
        Ok(())
    }

    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError> {
        let target = self.shared.queue(queue)?;
        let _session = self.statement().await?;
        let now = self.shared.now();
        let due: Vec<StoredMessage> = {
            let mut tables = lock(&self.shared.delayed);
            let table = tables
                .get_mut(queue)
                .ok_or_else(|| TransportError::QueueNotFound(format!("{queue}.Delayed")))?;
            let keys: Vec<(SystemTime, u64)> = table
                .rows
                .range(..(now, u64::MAX))
                .take(batch as usize)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| table.rows.remove(k)).collect()
        };
        let moved = due.len() as u64;
        {
            let mut state = lock(&target);
            for message in due {
                let seq = state.next_seq;
                state.next_seq += 1;
                state.ready.insert(seq, message);
            }
        }
        if moved > 0 {
            self.shared.arrived(queue);
        }
        let tables = lock(&self.shared.delayed);
        let table = tables.get(queue);
        Ok(Moved {
            moved,
            next_due_in: table
                .and_then(|t| t.rows.keys().next())
                .map(|(due, _)| due.duration_since(now).unwrap_or_default()),
            waiting: table.map_or(0, |t| t.rows.len() as u64),
            busy: false,
        })
    }

    async fn sweep(&self, queues: &[QueueName]) -> Result<Vec<DelayedReading>, TransportError> {
        let _session = self.statement().await?;
        let now = self.shared.now();
        let tables = lock(&self.shared.delayed);
        queues
            .iter()
            .map(|queue| {
                let table = tables.get(queue).ok_or_else(|| no_delayed_table(queue))?;
                Ok(DelayedReading {
                    waiting: table.rows.len() as u64,
                    next_due_in: table
                        .rows
                        .keys()
                        .next()
                        .map(|(due, _)| due.duration_since(now).unwrap_or_default()),
                })
            })
            .collect()
    }

    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError> {
        lock(&self.shared.delayed)
            .get(queue)
            .map(|t| t.rows.len() as u64)
            .ok_or_else(|| no_delayed_table(queue))
    }

    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError> {
        Ok(lock(&self.shared.delayed).contains_key(queue))
    }

    fn delayed_table(&self, queue: &QueueName) -> String {
        format!("{queue}.{DEFAULT_DELAYED_TABLE_SUFFIX}")
    }
}
