//! Queue administration, key ordering and batch receives of the memory transport.

use std::sync::Arc;

use async_trait::async_trait;

use crate::config::OrderingConfig;
use crate::transport::{HeldKey, QueueAdmin, QueueName, Received, TransportError};

use super::{MemoryTransport, lock};

#[async_trait]
impl QueueAdmin for MemoryTransport {
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        lock(&self.shared.queues).entry(queue.clone()).or_default();
        Ok(())
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let mut state = lock(&state);
        let now = self.shared.now();
        let before = state.ready.len();
        state.ready.retain(|_, m| m.expires.is_none_or(|e| e > now));
        Ok((before - state.ready.len()) as u64)
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let mut state = lock(&state);
        let n = state.ready.len() as u64;
        state.ready.clear();
        Ok(n)
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        let mut names: Vec<String> = lock(&self.shared.queues)
            .keys()
            .map(|q| q.to_string())
            .collect();
        names.sort();
        Ok(names)
    }
}

#[async_trait]
impl crate::transport::KeyOrdering for MemoryTransport {
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError> {
        crate::transport::check_orderable(self.mode, queue)?;
        let state = self.shared.queue(queue)?;
        lock(&state).ordering = ordering.is_ordered().then(|| Arc::new(ordering.clone()));
        Ok(())
    }

    async fn hold(
        &self,
        queue: &QueueName,
        id: uuid::Uuid,
        key: &str,
        reason: &str,
    ) -> Result<(), TransportError> {
        let state = self.shared.queue(queue)?;
        let mut queue = lock(&state);
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

    async fn is_held(&self, queue: &QueueName, key: &str) -> Result<bool, TransportError> {
        let state = self.shared.queue(queue)?;
        let held = lock(&state).held.iter().any(|h| h.key == key);
        Ok(held)
    }

    async fn held_keys(&self, queue: &QueueName) -> Result<Vec<HeldKey>, TransportError> {
        let state = self.shared.queue(queue)?;
        let held = lock(&state).held.clone();
        Ok(held)
    }

    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let mut state = lock(&state);
        let before = state.held.len();
        state.held.retain(|h| key.is_some_and(|k| h.key != k));
        Ok((before - state.held.len()) as u64)
    }

    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError> {
        let state = self.shared.queue(queue)?;
        let waiting = lock(&state).waiting();
        Ok(waiting)
    }
}

#[async_trait]
impl crate::transport::BatchReceive for MemoryTransport {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let state = self.shared.queue(queue)?;
        if lock(&state).ordering.is_some() {
            return Err(crate::transport::refuse_ordered_batch(queue));
        }
        crate::transport::batch::EachOnItsOwn::receive(self, queue, max).await
    }
}
