//! Key ordering: the held-keys table and holding a failed key.

use std::sync::Arc;

use async_trait::async_trait;
use deadpool_postgres::Object;

use crate::config::{FailedKey, OrderingConfig};
use crate::transport::{HeldKey, QueueName, TransportError};

use super::admin::create_under_lock;
use super::connection::map_error;
use super::statements::{held_statements, quote_ident};
use super::{Inner, PostgresTransport, QueueStatements};

impl Inner {
    /// The held-keys table of this schema, created when missing (under an advisory lock on
    /// its name: concurrent `CREATE TABLE IF NOT EXISTS` can still collide).
    pub(super) async fn ensure_held_table(&self, queue: &QueueName) -> Result<(), TransportError> {
        let held = held_statements(&quote_ident(&self.schema));
        let mut client = self.client().await?;
        create_under_lock(&mut client, &held.table, &[&held.create])
            .await
            .map_err(|e| map_error(e, Some(queue)))
    }

    /// Whether this schema has a held-keys table (queues that never held a key have none).
    pub(super) async fn has_held_table(&self, client: &Object) -> Result<bool, TransportError> {
        let held = held_statements(&quote_ident(&self.schema));
        client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&held.table])
            .await
            .map(|row| row.get(0))
            .map_err(|e| map_error(e, None))
    }
}

#[async_trait]
impl crate::transport::KeyOrdering for PostgresTransport {
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError> {
        crate::transport::check_orderable(self.inner.mode, queue)?;
        // Validates the name, as every statement of the queue does.
        self.inner.statements(queue)?;
        let plain = QueueStatements::new(&self.inner.schema, queue, &self.inner.delayed_suffix);
        let statements = match ordering.is_ordered() {
            true => plain.with_ordering(ordering),
            false => plain,
        };
        self.inner.ensure_indexes(queue, &statements).await?;
        if ordering.failed_key == FailedKey::Hold && ordering.key_header().is_some() {
            self.inner.ensure_held_table(queue).await?;
        }
        self.inner
            .statements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.clone(), Arc::new(statements));
        Ok(())
    }

    /// On a connection of its own and committed at once: the receive still holds the row.
    async fn hold(
        &self,
        queue: &QueueName,
        id: uuid::Uuid,
        key: &str,
        reason: &str,
    ) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let held = held_statements(&quote_ident(&self.inner.schema));
        let client = self.inner.client().await?;
        client
            .execute(&held.insert, &[&st.table, &id, &key, &reason])
            .await
            .map(|_| ())
            .map_err(|e| map_error(e, Some(queue)))
    }

    async fn is_held(&self, queue: &QueueName, key: &str) -> Result<bool, TransportError> {
        let st = self.inner.statements(queue)?;
        let held = held_statements(&quote_ident(&self.inner.schema));
        let client = self.inner.client().await?;
        client
            .query_opt(&held.is_held, &[&st.table, &key])
            .await
            .map(|row| row.is_some())
            .map_err(|e| map_error(e, Some(queue)))
    }

    async fn held_keys(&self, queue: &QueueName) -> Result<Vec<HeldKey>, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        if !self.inner.has_held_table(&client).await? {
            return Ok(Vec::new());
        }
        let held = held_statements(&quote_ident(&self.inner.schema));
        let rows = client
            .query(&held.list, &[&st.table])
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        Ok(rows
            .iter()
            .map(|r| HeldKey {
                key: r.get(0),
                message_id: r.get(1),
                reason: r.get(2),
                held_at: r.get(3),
            })
            .collect())
    }

    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        if !self.inner.has_held_table(&client).await? {
            return Ok(0);
        }
        let held = held_statements(&quote_ident(&self.inner.schema));
        let released = match key {
            Some(key) => client.execute(&held.release, &[&st.table, &key]).await,
            None => client.execute(&held.release_all, &[&st.table]).await,
        };
        released.map_err(|e| map_error(e, Some(queue)))
    }

    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError> {
        let st = self.inner.statements(queue)?;
        match &st.waiting {
            Some(sql) => self.inner.count(queue, "a count", sql).await.map(Some),
            None => Ok(None),
        }
    }
}
