//! An open receive of the memory transport: invisible to others until it commits, back at its place
//! when it rolls back or drops.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::message::OutgoingMessage;
use crate::transport::{HeldKey, Payload, QueueName, Received, TransportError};

use super::queue::{Holds, QueueState, StoredMessage};
use super::{Session, Shared, lock, stored_from};

pub(super) struct MemoryReceived {
    pub(super) shared: Arc<Shared>,
    pub(super) queue_name: QueueName,
    pub(super) queue: Arc<Mutex<QueueState>>,
    pub(super) seq: u64,
    /// Its ordering key and stage, busy until this receive ends.
    pub(super) holds: Holds,
    /// The row as stored minus its body (which is in the payload); None once finished.
    pub(super) stored: Option<StoredMessage>,
    pub(super) payload: Payload,
    pub(super) pending_sends: Vec<(QueueName, StoredMessage)>,
    /// False in transaction mode `none`: the message was deleted for good on receive.
    pub(super) restore_on_drop: bool,
    /// The simulated database session this receive holds until it ends.
    pub(super) session: Session,
    /// A send inside this unit of work failed: like a database, refuse to commit it.
    pub(super) failed: bool,
}

impl MemoryReceived {
    pub(super) fn finish(&mut self, restore: bool) {
        let Some(mut stored) = self.stored.take() else {
            return;
        };
        self.shared.open_receives.fetch_sub(1, Ordering::Relaxed);
        self.session = None;
        let restored = restore && self.restore_on_drop;
        {
            let mut queue = lock(&self.queue);
            if restored {
                if let Payload::Message(m) = &mut self.payload {
                    stored.body = std::mem::take(&mut m.body);
                }
                queue.ready.insert(self.seq, stored);
            }
            // Back in place (or gone) before the key and stage are free: the next receive
            // sees the row it must take first, or wait for.
            queue.release(&self.holds);
        }
        // A message back in its queue, or a key or stage freed, is work for an idle receiver.
        if restored || self.holds.key.is_some() || self.holds.stage.is_some() {
            self.shared.arrived(&self.queue_name);
        }
    }
}

impl Drop for MemoryReceived {
    fn drop(&mut self) {
        self.finish(true);
    }
}

#[async_trait]
impl Received for MemoryReceived {
    fn payload(&self) -> &Payload {
        &self.payload
    }

    async fn send(
        &mut self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let stored = match stored_from(message)
            .and_then(|stored| self.shared.check(queue, &stored).map(|()| stored))
        {
            Ok(stored) => stored,
            Err(e) => {
                self.failed = true;
                return Err(e);
            }
        };
        if self.restore_on_drop {
            self.pending_sends.push((queue.clone(), stored));
            Ok(())
        } else {
            self.shared.insert(queue, stored)
        }
    }

    async fn dead_letter(&mut self, queue: &QueueName) -> Result<(), TransportError> {
        let Some(stored) = &self.stored else {
            return Err(TransportError::database("receive already ended"));
        };
        let mut copy = stored.clone();
        copy.expires = None;
        if let Payload::Message(m) = &self.payload {
            copy.body = m.body.clone();
        }
        self.shared.queue(queue)?;
        self.pending_sends.push((queue.clone(), copy));
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<(), TransportError> {
        if self.failed {
            self.pending_sends.clear();
            self.finish(true);
            return Err(TransportError::aborted(&self.queue_name));
        }
        for (queue, message) in std::mem::take(&mut self.pending_sends) {
            self.shared.insert(&queue, message)?;
        }
        self.finish(false);
        Ok(())
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), TransportError> {
        self.pending_sends.clear();
        self.finish(true);
        Ok(())
    }

    async fn hold(&mut self, key: &str, reason: &str) -> Result<(), TransportError> {
        let id = self.payload.id();
        let mut queue = lock(&self.queue);
        if !queue.held.iter().any(|h| h.message_id == id) {
            queue.held.push(HeldKey {
                key: key.to_string(),
                message_id: id,
                reason: reason.to_string(),
                held_at: chrono::Utc::now()
                    .format("%Y-%m-%d %H:%M:%S%.3f")
                    .to_string(),
            });
        }
        Ok(())
    }
}
