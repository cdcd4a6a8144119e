//! Batch receive (`receive_batch` above 1): a receiver holding one gate permit takes more
//! permits, as many as are free now and as delivery admits without a wait, and receives that
//! many messages in one transaction. Each message is then handled like a single receive, the
//! first by the receiver itself and the others in tasks of their own, each holding its
//! permit: in flight counts every message of the batch, and the effective limit bounds the
//! batch. So the batch shrinks with the throttling limit, and any delivery delay, pacing or
//! ceiling makes the receive a single one, waited for exactly as before.
//!
//! A batch whose commit failed (a send of one message that the database refused, a lost
//! connection) returned all its messages; the next `2 x receive_batch` receives of that queue
//! take one message each, so one message that cannot commit fails alone and goes its own
//! way (retries, error queue) instead of taking its batch-mates back with it again and again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;

use super::{QueueRuntime, ReceiveContext, ReceiveOutcome, account, process};
use crate::message::OutgoingMessage;
use crate::queue::gate::Permit;
use crate::transport::{Payload, QueueName, Received, TransportError};

/// Receives one message, or a batch when the queue asks for one and nothing throttles it.
/// The caller holds a gate permit for the first message and handles it; the rest are
/// handled here, in tasks.
pub(crate) async fn receive_some(
    q: &Arc<QueueRuntime>,
    ctx: &Arc<ReceiveContext>,
) -> ReceiveOutcome {
    let want = q.settings().receive_batch as usize;
    if want <= 1 || q.single_receives().take_one() {
        return super::receive(q, ctx).await;
    }
    let mut permits = Vec::new();
    while permits.len() + 1 < want {
        let Some(permit) = q.gate().try_acquire() else {
            break;
        };
        if !ctx.throttle.delivery.try_admit() {
            break;
        }
        permits.push(permit);
    }
    if permits.is_empty() {
        return super::receive(q, ctx).await;
    }
    // A transport without batch receive was refused at start for receive_batch above 1.
    let Some(batches) = ctx.transport.batch_receive() else {
        drop(permits);
        return super::receive(q, ctx).await;
    };
    let mut batch = match batches.receive_batch(q.name(), permits.len() + 1).await {
        Ok(batch) => batch,
        Err(e) => return account(q, Err(e)),
    };
    if batch.len() <= 1 {
        return account(q, Ok(batch.pop()));
    }
    if !super::within_limit(q) {
        // The limit shrank while the batch was out: none of it runs; dropping its messages
        // rolls the whole batch back (see `give_back_past_the_limit`).
        tracing::debug!(queue = %q.name(), messages = batch.len(), "a batch is given back: the queue's limit shrank while it was received");
        return ReceiveOutcome::GivenBack;
    }
    let ended = Arc::new(BatchEnd::default());
    let first = batch.remove(0);
    for (received, permit) in batch.into_iter().zip(permits) {
        let received = watched(received, &ended, q);
        let (q, ctx) = (q.clone(), ctx.clone());
        // Each message of the batch counts as a receive that returned one.
        q.observe_receive(Ok(true));
        ctx.tasks.clone().spawn(async move {
            let _permit: Permit = permit;
            process(&q, &ctx, received, || {}).await;
        });
    }
    account(q, Ok(Some(watched(first, &ended, q))))
}

/// Whether a batch's commit failed (noted once per batch).
#[derive(Default)]
struct BatchEnd(AtomicBool);

fn watched(
    received: Box<dyn Received>,
    ended: &Arc<BatchEnd>,
    q: &Arc<QueueRuntime>,
) -> Box<dyn Received> {
    Box::new(Watched {
        inner: received,
        ended: ended.clone(),
        q: q.clone(),
    })
}

/// A message of a batch whose commit, when it fails, makes the queue's next receives single.
struct Watched {
    inner: Box<dyn Received>,
    ended: Arc<BatchEnd>,
    q: Arc<QueueRuntime>,
}

#[async_trait]
impl Received for Watched {
    fn payload(&self) -> &Payload {
        self.inner.payload()
    }

    async fn send(
        &mut self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.inner.send(queue, message).await
    }

    async fn dead_letter(&mut self, queue: &QueueName) -> Result<(), TransportError> {
        self.inner.dead_letter(queue).await
    }

    async fn commit(self: Box<Self>) -> Result<(), TransportError> {
        let result = self.inner.commit().await;
        if result.is_err() && !self.ended.0.swap(true, Ordering::AcqRel) {
            let singles = self.q.settings().receive_batch.saturating_mul(2);
            self.q.single_receives().set(singles);
            tracing::warn!(queue = %self.q.name(), singles,
                "a batch could not commit and returned to the queue; receiving one message at a time for a while");
        }
        result
    }

    async fn rollback(self: Box<Self>) -> Result<(), TransportError> {
        self.inner.rollback().await
    }
}
