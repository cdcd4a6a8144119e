//! The memory transport's error queues, browsed and edited in place ([`FailedStore`]).

use async_trait::async_trait;
use uuid::Uuid;

use super::{MemoryTransport, lock};
use crate::transport::failed::{FailedStore, MoveOut, StoredRow};
use crate::transport::headers::serialize_headers;
use crate::transport::{QueueName, TransportError};

#[async_trait]
impl FailedStore for MemoryTransport {
    async fn browse(
        &self,
        queue: &QueueName,
        after: i64,
        limit: u32,
        with_body: bool,
    ) -> Result<Vec<StoredRow>, TransportError> {
        let queue = self.shared.queue(queue)?;
        let state = lock(&queue);
        // Positions are sequence numbers plus one (sequences start at 0, positions after 0).
        let from = u64::try_from(after).unwrap_or(0);
        Ok(state
            .ready
            .range(from..)
            .take(limit as usize)
            .map(|(seq, m)| StoredRow {
                position: i64::try_from(*seq + 1).unwrap_or(i64::MAX),
                id: m.id,
                headers: serialize_headers(&m.headers),
                body: if with_body {
                    m.body.clone()
                } else {
                    Vec::new()
                },
            })
            .collect())
    }

    async fn read(
        &self,
        queue: &QueueName,
        ids: &[Uuid],
    ) -> Result<Vec<StoredRow>, TransportError> {
        let queue = self.shared.queue(queue)?;
        let state = lock(&queue);
        Ok(state
            .ready
            .iter()
            .filter(|(_, m)| ids.contains(&m.id))
            .map(|(seq, m)| StoredRow {
                position: i64::try_from(*seq + 1).unwrap_or(i64::MAX),
                id: m.id,
                headers: serialize_headers(&m.headers),
                body: m.body.clone(),
            })
            .collect())
    }

    async fn move_out(
        &self,
        queue: &QueueName,
        moves: &[MoveOut],
    ) -> Result<Vec<Uuid>, TransportError> {
        // Checked before anything is taken, so an error leaves every row where it was.
        let mut prepared = Vec::with_capacity(moves.len());
        for m in moves {
            let row = self.shared.stored_from(&m.message)?;
            self.shared.check(&m.to, &row)?;
            prepared.push((m.id, m.to.clone(), row));
        }
        let taken: Vec<Uuid> = {
            let source = self.shared.queue(queue)?;
            let mut state = lock(&source);
            let seqs: Vec<u64> = state
                .ready
                .iter()
                .filter(|(_, m)| prepared.iter().any(|(id, _, _)| *id == m.id))
                .map(|(seq, _)| *seq)
                .collect();
            seqs.iter()
                .filter_map(|seq| state.ready.remove(seq))
                .map(|m| m.id)
                .collect()
        };
        for (id, to, message) in prepared {
            if taken.contains(&id) {
                self.shared.insert(&to, message)?;
            }
        }
        Ok(taken)
    }

    async fn remove(&self, queue: &QueueName, ids: &[Uuid]) -> Result<u64, TransportError> {
        let queue = self.shared.queue(queue)?;
        let mut state = lock(&queue);
        let before = state.ready.len();
        state.ready.retain(|_, m| !ids.contains(&m.id));
        Ok((before - state.ready.len()) as u64)
    }
}
