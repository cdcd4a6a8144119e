//! Key ordering: the held-keys table and the ordered receive.

use std::sync::Arc;

use async_trait::async_trait;
use uuid::Uuid;

use crate::config::{FailedKey, OrderingConfig};
use crate::transport::{HeldKey, QueueName, TransportError};

use super::connection::{is_server_error, map_error};
use super::statements::{bracket, held_statements};
use super::{Inner, QueueStatements, SqlServerTransport};

impl Inner {
    /// The held-keys statements of this transport's schema.
    pub(super) fn held(&self) -> crate::transport::HeldStatements {
        held_statements(&bracket(&self.schema))
    }

    /// The held-keys table of this schema, created when missing.
    pub(super) async fn ensure_held_table(&self, queue: &QueueName) -> Result<(), TransportError> {
        let mut conn = self.conn().await?;
        match conn.run_batch(&self.held().create).await {
            Ok(()) => Ok(()),
            // Another host created it between the check and the CREATE.
            Err(tiberius::error::Error::Server(t)) if t.code() == 2714 => Ok(()),
            Err(e) => {
                conn.broken |= !is_server_error(&e);
                Err(map_error(e, Some(queue)))
            }
        }
    }
}

#[async_trait]
impl crate::transport::KeyOrdering for SqlServerTransport {
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError> {
        crate::transport::check_orderable(self.inner.mode, queue)?;
        let plain = QueueStatements::new(
            &self.inner.schema,
            queue,
            self.inner.dialect,
            &self.inner.delayed_suffix,
        );
        let statements = match ordering.is_ordered() {
            false => plain,
            true => plain.with_ordering(ordering),
        };
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
        id: Uuid,
        key: &str,
        reason: &str,
    ) -> Result<(), TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut conn = self.inner.conn().await?;
        let insert = self.inner.held().insert;
        let result = conn
            .execute(insert.as_str(), &[&table.as_str(), &id, &key, &reason])
            .await;
        result.map(|_| ()).map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })
    }

    async fn is_held(&self, queue: &QueueName, key: &str) -> Result<bool, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut conn = self.inner.conn().await?;
        let is_held = self.inner.held().is_held;
        let row = async {
            conn.query(is_held.as_str(), &[&table.as_str(), &key])
                .await?
                .into_row()
                .await
        }
        .await;
        row.map(|row| row.is_some()).map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })
    }

    async fn held_keys(&self, queue: &QueueName) -> Result<Vec<HeldKey>, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut conn = self.inner.conn().await?;
        let rows = async {
            conn.query(&self.inner.held().list, &[&table.as_str()])
                .await?
                .into_first_result()
                .await
        }
        .await;
        let rows = match rows {
            Ok(rows) => rows,
            // 208: no held-keys table, so nothing was ever held here.
            Err(tiberius::error::Error::Server(t)) if t.code() == 208 => return Ok(Vec::new()),
            Err(e) => {
                conn.broken |= !is_server_error(&e);
                return Err(map_error(e, Some(queue)));
            }
        };
        Ok(rows
            .iter()
            .map(|r| HeldKey {
                key: r.get::<&str, _>(0).unwrap_or_default().to_string(),
                message_id: r.get::<Uuid, _>(1).unwrap_or_default(),
                reason: r.get::<&str, _>(2).unwrap_or_default().to_string(),
                held_at: r.get::<&str, _>(3).unwrap_or_default().to_string(),
            })
            .collect())
    }

    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut conn = self.inner.conn().await?;
        let held = self.inner.held();
        let released = match key {
            Some(key) => {
                let params: &[&dyn tiberius::ToSql] = &[&table.as_str(), &key];
                self.inner
                    .count(&mut conn, queue, &held.release, params)
                    .await
            }
            None => {
                let params: &[&dyn tiberius::ToSql] = &[&table.as_str()];
                self.inner
                    .count(&mut conn, queue, &held.release_all, params)
                    .await
            }
        };
        match released {
            // No held-keys table: nothing was ever held here.
            Err(TransportError::QueueNotFound(_)) => Ok(0),
            other => other,
        }
    }

    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError> {
        let st = self.inner.statements(queue);
        let Some(sql) = &st.waiting else {
            return Ok(None);
        };
        // A pooled connection between receives holds no application lock, so the count's
        // lock tests see every receive's locks (see `statements::ordered_waiting`).
        let mut conn = self.inner.conn().await?;
        self.inner.count(&mut conn, queue, sql, &[]).await.map(Some)
    }
}
