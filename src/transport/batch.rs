//! Batch receive: one unit of work that removed several rows, handed out as one [`Received`]
//! per message so the dispatcher handles each exactly as it handles a single receive.
//!
//! A message's sends and its dead-letter copy are kept with it until it ends. When the last
//! message of the batch ends, the messages that committed have their rows written in the
//! batch's transaction, and the transaction commits once. If any message rolled back (or was
//! dropped, or a write failed) the whole batch rolls back: every row returns to its place,
//! and every message of the batch reports that its commit did not happen. Each message's
//! `commit` and `rollback` return only when the batch has ended, so the messages of a batch
//! must be ended concurrently (the receivers run each in a task of its own).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::watch;
use uuid::Uuid;

use super::row::{ReceivedRow, kept_row};
use super::{Payload, QueueName, Received, Transport, TransportError};
use crate::message::OutgoingMessage;

/// The open transaction of a batch: what its messages write, and how it ends.
#[async_trait]
pub(crate) trait BatchWork: Send {
    /// Inserts messages into `queue`, in the order given, inside the transaction (with as
    /// few statements as the server allows).
    async fn insert_many(
        &mut self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError>;

    /// Inserts the received row `id` as it was received (same id, raw headers and body, no
    /// expiry): `row` is its headers and body, `None` when the work keeps them itself.
    async fn insert_raw(
        &mut self,
        queue: &QueueName,
        id: Uuid,
        row: Option<(&str, &[u8])>,
    ) -> Result<(), TransportError>;

    /// Commits: the batch's rows are gone, the inserts appear.
    async fn commit(self: Box<Self>) -> Result<(), TransportError>;

    /// Rolls back: every row is back at its place, the inserts vanish.
    async fn rollback(self: Box<Self>) -> Result<(), TransportError>;
}

/// A write the messages of the batch asked for, done when the batch commits. Consecutive
/// sends to one queue are kept together, so they go out as one multi-row insert (the
/// batch's outbox: a forward handler's copies of 32 messages are one statement).
enum Write {
    Messages(QueueName, Vec<OutgoingMessage>),
    Raw(QueueName, Uuid, Option<(String, Vec<u8>)>),
}

/// Appends `write` to `writes`, joining sends to the queue the last sends went to.
fn append(writes: &mut Vec<Write>, write: Write) {
    let write = match (writes.last_mut(), write) {
        (Some(Write::Messages(last, kept)), Write::Messages(queue, more)) if *last == queue => {
            kept.extend(more);
            return;
        }
        (_, write) => write,
    };
    writes.push(write);
}

/// What the messages of one batch share.
struct Batch {
    state: Mutex<BatchState>,
    /// The batch's end: `None` until it ended, then whether it committed (the error's text
    /// when not).
    ended: watch::Sender<Option<Result<(), String>>>,
}

struct BatchState {
    work: Option<Box<dyn BatchWork>>,
    /// Messages not ended yet.
    open: usize,
    /// A message rolled back, was dropped or could not be written: the batch rolls back.
    roll_back: bool,
    writes: Vec<Write>,
}

/// Hands out the messages of a batch: `rows` were removed by `work`'s transaction, oldest
/// first. An empty batch ends its transaction at once.
pub(crate) async fn split(
    work: Box<dyn BatchWork>,
    rows: Vec<ReceivedRow>,
) -> Result<Vec<Box<dyn Received>>, TransportError> {
    if rows.is_empty() {
        work.rollback().await?;
        return Ok(Vec::new());
    }
    let batch = Arc::new(Batch {
        state: Mutex::new(BatchState {
            work: Some(work),
            open: rows.len(),
            roll_back: false,
            writes: Vec::new(),
        }),
        ended: watch::Sender::new(None),
    });
    Ok(rows
        .into_iter()
        .map(|(payload, raw)| {
            Box::new(BatchMessage {
                batch: batch.clone(),
                payload,
                raw,
                writes: Vec::new(),
                ended: false,
            }) as Box<dyn Received>
        })
        .collect())
}

impl Batch {
    fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        // Every change below completes under the lock: a poisoned state is still whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One message ended (`writes`: it committed with these; `None`: it rolled back). The
    /// last one gets the transaction to finish and what to write in it.
    fn end_one(
        &self,
        writes: Option<Vec<Write>>,
    ) -> Option<(Box<dyn BatchWork>, Vec<Write>, bool)> {
        let mut state = self.lock();
        match writes {
            Some(writes) => {
                for write in writes {
                    append(&mut state.writes, write);
                }
            }
            None => state.roll_back = true,
        }
        state.open -= 1;
        if state.open > 0 {
            return None;
        }
        let work = state.work.take()?;
        Some((work, std::mem::take(&mut state.writes), state.roll_back))
    }

    /// Writes what the committed messages asked for and ends the transaction.
    async fn finish(
        &self,
        mut work: Box<dyn BatchWork>,
        writes: Vec<Write>,
        roll_back: bool,
    ) -> Result<(), TransportError> {
        let result = if roll_back {
            work.rollback().await.and(Err(TransportError::database(
                "a message of its batch rolled back, so the whole batch returned to the queue",
            )))
        } else {
            match write_all(work.as_mut(), &writes).await {
                Ok(()) => work.commit().await,
                Err(e) => {
                    let _ = work.rollback().await;
                    Err(e)
                }
            }
        };
        self.ended
            .send_replace(Some(result.as_ref().map(|_| ()).map_err(|e| e.to_string())));
        result
    }

    /// Waits for the batch to end; how it ended.
    async fn outcome(&self) -> Result<(), TransportError> {
        let mut ended = self.ended.subscribe();
        // The sender lives in `self`: the channel cannot close while this waits.
        let outcome = ended
            .wait_for(Option::is_some)
            .await
            .map(|o| o.clone())
            .ok()
            .flatten();
        match outcome {
            Some(Ok(())) => Ok(()),
            Some(Err(reason)) => Err(TransportError::database(format!(
                "the batch this message was received in did not commit: {reason}"
            ))),
            None => Err(TransportError::database(
                "the batch ended without an outcome",
            )),
        }
    }

    /// This message ended; the last one finishes the batch, the others wait for that.
    async fn end(&self, writes: Option<Vec<Write>>) -> Result<(), TransportError> {
        match self.end_one(writes) {
            Some((work, writes, roll_back)) => self.finish(work, writes, roll_back).await,
            None => self.outcome().await,
        }
    }
}

async fn write_all(work: &mut dyn BatchWork, writes: &[Write]) -> Result<(), TransportError> {
    for write in writes {
        match write {
            Write::Messages(queue, messages) => work.insert_many(queue, messages).await?,
            Write::Raw(queue, id, row) => {
                let row = row.as_ref().map(|(h, b)| (h.as_str(), b.as_slice()));
                work.insert_raw(queue, *id, row).await?
            }
        }
    }
    Ok(())
}

/// One message of a batch.
struct BatchMessage {
    batch: Arc<Batch>,
    payload: Payload,
    raw: Option<(String, Vec<u8>)>,
    writes: Vec<Write>,
    ended: bool,
}

impl Drop for BatchMessage {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Dropped without an end (a cancelled handler, shutdown's deadline): the batch rolls
        // back. When this was the last message, dropping the transaction rolls it back.
        if let Some((work, _, _)) = self.batch.end_one(None) {
            drop(work);
            self.batch.ended.send_replace(Some(Err(
                "a message of the batch was dropped before it ended".into(),
            )));
        }
    }
}

#[async_trait]
impl Received for BatchMessage {
    fn payload(&self) -> &Payload {
        &self.payload
    }

    async fn send(
        &mut self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        // What can be checked now is checked now, so the message's own failure is its own.
        super::ttbr_millis(message)?;
        append(
            &mut self.writes,
            Write::Messages(queue.clone(), vec![message.clone()]),
        );
        Ok(())
    }

    async fn dead_letter(&mut self, queue: &QueueName) -> Result<(), TransportError> {
        let row = kept_row(&self.payload, &self.raw);
        self.writes
            .push(Write::Raw(queue.clone(), self.payload.id(), row));
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<(), TransportError> {
        self.ended = true;
        let writes = std::mem::take(&mut self.writes);
        self.batch.end(Some(writes)).await
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), TransportError> {
        self.ended = true;
        match self.batch.end(None).await {
            // The rollback itself worked: this message is back in the queue.
            Err(TransportError::Database { .. }) | Ok(()) => Ok(()),
            Err(other) => Err(other),
        }
    }
}

/// Several single receives, each its own unit of work, as one batch: the form for a
/// transport without a statement that removes several rows at once (the memory transport).
/// They commit one after the other at the batch's end, or all roll back.
pub(crate) struct EachOnItsOwn(pub Vec<Box<dyn Received>>);

impl EachOnItsOwn {
    /// Receives up to `max` messages from `queue`, each with [`Transport::receive`].
    pub(crate) async fn receive<T: Transport + ?Sized>(
        transport: &T,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let mut received = Vec::new();
        while received.len() < max {
            match transport.receive(queue).await {
                Ok(Some(r)) => received.push(r),
                Ok(None) => break,
                Err(e) if received.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        if received.len() <= 1 {
            return Ok(received);
        }
        let rows = received
            .iter()
            .map(|r| (r.payload().clone(), None))
            .collect();
        split(Box::new(EachOnItsOwn(received)), rows).await
    }
}

#[async_trait]
impl BatchWork for EachOnItsOwn {
    async fn insert_many(
        &mut self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        for message in messages {
            self.0[0].send(queue, message).await?;
        }
        Ok(())
    }

    async fn insert_raw(
        &mut self,
        queue: &QueueName,
        id: Uuid,
        _row: Option<(&str, &[u8])>,
    ) -> Result<(), TransportError> {
        // Each receive dead-letters its own row, with its raw form.
        match self.0.iter_mut().find(|r| r.payload().id() == id) {
            Some(received) => received.dead_letter(queue).await,
            None => Err(TransportError::database(format!(
                "message {id} is not part of this batch"
            ))),
        }
    }

    async fn commit(self: Box<Self>) -> Result<(), TransportError> {
        for received in self.0 {
            received.commit().await?;
        }
        Ok(())
    }

    async fn rollback(self: Box<Self>) -> Result<(), TransportError> {
        let mut result = Ok(());
        for received in self.0 {
            result = result.and(received.rollback().await);
        }
        result
    }
}

/// A transport that can receive many messages in one unit of work (`receive_batch`).
#[async_trait::async_trait]
pub trait BatchReceive: Send + Sync {
    /// Removes up to `max` of the oldest messages not locked by other receivers, oldest
    /// first, in one unit of work, and hands out one [`Received`] per message. The batch
    /// commits once, when every message of it has ended, and rolls back whole (every row back
    /// at its place) if any message rolled back or was dropped; so a crash mid-batch returns
    /// all of it. Each message's commit or rollback returns only when the batch has ended:
    /// end them concurrently. Empty when the queue has nothing. PostgreSQL and SQL Server
    /// remove the rows with one statement; the memory transport takes single receives and ends
    /// them together (`EachOnItsOwn`).
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError>;
}
