//! An open receive of the memory transport: invisible to others until it commits, back at its place
//! when it rolls back or drops.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::message::OutgoingMessage;
use crate::transport::{CommitAndReceive, Payload, QueueName, Received, Transport, TransportError};

use super::queue::{Holds, QueueState, StoredMessage};
use super::{MemoryTransport, Session, lock};

pub(super) struct MemoryReceived {
    /// The transport it came from: its store, and where the next receive comes from.
    pub(super) transport: MemoryTransport,
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
        self.transport
            .shared
            .open_receives
            .fetch_sub(1, Ordering::Relaxed);
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
            self.transport.shared.arrived(&self.queue_name);
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
        let stored = match self
            .transport
            .shared
            .stored_from(message)
            .and_then(|stored| self.transport.shared.check(queue, &stored).map(|()| stored))
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
            self.transport.shared.insert(queue, stored)
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
        self.transport.shared.queue(queue)?;
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
            self.transport.shared.insert(&queue, message)?;
        }
        self.finish(false);
        Ok(())
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), TransportError> {
        self.pending_sends.clear();
        self.finish(true);
        Ok(())
    }

    /// No round trip to save here, but the next receive comes along as on the SQL stores,
    /// so that memory hosts run the receive loop's follow-on path as production hosts do.
    async fn commit_and_receive(self: Box<Self>, queue: &QueueName) -> CommitAndReceive {
        let transport = self.transport.clone();
        let committed = self.commit().await;
        let next = match committed {
            Ok(()) => Some(transport.receive(queue).await),
            Err(_) => None,
        };
        CommitAndReceive { committed, next }
    }
}
