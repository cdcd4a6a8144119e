//! The subscription table on PostgreSQL, with the statements of NServiceBus's PostgreSQL
//! transport (`PostgreSqlConstants`): created if missing (`fillfactor=100`, no autovacuum),
//! subscribe as `INSERT ... ON CONFLICT (Endpoint, Topic) DO UPDATE`, the distinct addresses
//! of a set of topics, and unsubscribe by key.

use async_trait::async_trait;

use super::PostgresTransport;
use super::admin::create_under_lock;
use super::connection::map_error;
use crate::message::OutgoingMessage;
use crate::transport::{QueueName, Subscription, Subscriptions, TransportError};

/// An error of a statement on the subscription table: a missing table is named as such.
fn on_table(e: tokio_postgres::Error, table: &str) -> TransportError {
    match map_error(e, None) {
        TransportError::QueueNotFound(_) => crate::transport::subscriptions::missing_table(table),
        other => other,
    }
}

#[async_trait]
impl Subscriptions for PostgresTransport {
    fn subscription_table(&self) -> String {
        self.inner.subscription_table.clone()
    }

    async fn create_subscription_table(&self) -> Result<(), TransportError> {
        let table = &self.inner.subscription_table;
        let schema = &self.inner.subscription_schema;
        let create = format!(
            "CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {table} (
    QueueAddress VARCHAR(200) NOT NULL,
    Endpoint VARCHAR(200) NOT NULL,
    Topic VARCHAR(200) NOT NULL,
    PRIMARY KEY (Endpoint, Topic)
) WITH (fillfactor=100, autovacuum_enabled=off, toast.autovacuum_enabled=off)"
        );
        let mut client = self.inner.client().await?;
        create_under_lock(&mut client, table, &[&create])
            .await
            .map_err(|e| on_table(e, table))
    }

    async fn subscribe(
        &self,
        endpoint: &str,
        topic: &str,
        queue_address: &str,
    ) -> Result<(), TransportError> {
        let table = &self.inner.subscription_table;
        let sql = format!(
            "INSERT INTO {table} (QueueAddress, Topic, Endpoint) VALUES ($1, $2, $3) \
             ON CONFLICT (Endpoint, Topic) DO UPDATE SET QueueAddress = $1"
        );
        let client = self.inner.client().await?;
        client
            .execute(&sql, &[&queue_address, &topic, &endpoint])
            .await
            .map_err(|e| on_table(e, table))?;
        Ok(())
    }

    async fn unsubscribe(&self, endpoint: &str, topic: &str) -> Result<bool, TransportError> {
        let table = &self.inner.subscription_table;
        let sql = format!("DELETE FROM {table} WHERE Endpoint = $1 AND Topic = $2");
        let client = self.inner.client().await?;
        let removed = client
            .execute(&sql, &[&endpoint, &topic])
            .await
            .map_err(|e| on_table(e, table))?;
        Ok(removed > 0)
    }

    async fn subscribers(&self, topics: &[String]) -> Result<Vec<String>, TransportError> {
        let table = &self.inner.subscription_table;
        // NServiceBus lists the topics as `IN (@Topic_0, ...)`; an array is the same set.
        let sql = format!("SELECT DISTINCT QueueAddress FROM {table} WHERE Topic = ANY($1)");
        let client = self.inner.client().await?;
        let rows = client
            .query(&sql, &[&topics])
            .await
            .map_err(|e| on_table(e, table))?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    async fn all_subscriptions(&self) -> Result<Vec<Subscription>, TransportError> {
        let table = &self.inner.subscription_table;
        let sql =
            format!("SELECT Endpoint, Topic, QueueAddress FROM {table} ORDER BY Topic, Endpoint");
        let client = self.inner.client().await?;
        let rows = client
            .query(&sql, &[])
            .await
            .map_err(|e| on_table(e, table))?;
        Ok(rows
            .iter()
            .map(|r| Subscription {
                endpoint: r.get(0),
                topic: r.get(1),
                queue_address: r.get(2),
            })
            .collect())
    }

    async fn deliver(&self, copies: &[(QueueName, OutgoingMessage)]) -> Result<(), TransportError> {
        if copies.is_empty() {
            return Ok(());
        }
        let client = self.inner.client().await?;
        let inner = &self.inner;
        let (client, delivered) = inner
            .answered("a publish", client, async |c| {
                c.batch_execute("BEGIN")
                    .await
                    .map_err(|e| map_error(e, None))?;
                for (queue, message) in copies {
                    inner.send_on(c, queue, message).await?;
                }
                c.batch_execute("COMMIT")
                    .await
                    .map_err(|e| map_error(e, None))
            })
            .await?;
        if delivered.is_err() {
            // The transaction is still open on this connection: end it before it is reused.
            let _ = client.batch_execute("ROLLBACK").await;
        }
        delivered
    }
}
