//! PostgreSQL's error queues, browsed and edited in place ([`FailedStore`]). Reads take no
//! locks (a row a receive holds is still read); deletes pass over rows a receive holds
//! (`FOR UPDATE SKIP LOCKED`), so the tool never waits behind another reader of the queue.

use async_trait::async_trait;
use tokio_postgres::Row;
use uuid::Uuid;

use super::{PostgresTransport, map_error};
use crate::transport::failed::{FailedStore, MoveOut, StoredRow, by_destination};
use crate::transport::{QueueName, TransportError};

fn stored_row(row: &Row) -> Result<StoredRow, TransportError> {
    let get = |e: tokio_postgres::Error| TransportError::database(e.to_string());
    Ok(StoredRow {
        position: row.try_get::<_, i64>(0).map_err(get)?,
        id: row.try_get(1).map_err(get)?,
        headers: row.try_get(2).map_err(get)?,
        body: row
            .try_get::<_, Option<Vec<u8>>>(3)
            .map_err(get)?
            .unwrap_or_default(),
    })
}

/// Rows of `table` with these ids that no receive holds, locked for this transaction.
fn free_rows(table: &str) -> String {
    format!("SELECT Seq FROM {table} WHERE Id = ANY($1) FOR UPDATE SKIP LOCKED")
}

#[async_trait]
impl FailedStore for PostgresTransport {
    async fn browse(
        &self,
        queue: &QueueName,
        after: i64,
        limit: u32,
        with_body: bool,
    ) -> Result<Vec<StoredRow>, TransportError> {
        let st = self.inner.statements(queue)?;
        // `q.Seq`, the column: an ORDER BY of the bigint output would sort the whole table.
        let body = if with_body { "q.Body" } else { "NULL::bytea" };
        let sql = format!(
            "SELECT q.Seq::bigint AS position, q.Id, q.Headers, {body} FROM {} q WHERE q.Seq > $1::bigint ORDER BY q.Seq LIMIT $2",
            st.table
        );
        let limit = i64::from(limit);
        let client = self.inner.client().await?;
        let (_, rows) = self
            .inner
            .answered("a browse of an error queue", client, async |c| {
                let stmt = c.prepare_cached(&sql).await?;
                c.query(&stmt, &[&after, &limit]).await
            })
            .await?;
        rows.map_err(|e| map_error(e, Some(queue)))?
            .iter()
            .map(stored_row)
            .collect()
    }

    async fn read(
        &self,
        queue: &QueueName,
        ids: &[Uuid],
    ) -> Result<Vec<StoredRow>, TransportError> {
        let st = self.inner.statements(queue)?;
        let sql = format!(
            "SELECT q.Seq::bigint AS position, q.Id, q.Headers, q.Body FROM {} q WHERE q.Id = ANY($1) ORDER BY q.Seq",
            st.table
        );
        let client = self.inner.client().await?;
        let (_, rows) = self
            .inner
            .answered("a read of failed messages", client, async |c| {
                c.query(&sql, &[&ids]).await
            })
            .await?;
        rows.map_err(|e| map_error(e, Some(queue)))?
            .iter()
            .map(stored_row)
            .collect()
    }

    async fn move_out(
        &self,
        queue: &QueueName,
        moves: &[MoveOut],
    ) -> Result<Vec<Uuid>, TransportError> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        let st = self.inner.statements(queue)?;
        let ids: Vec<Uuid> = moves.iter().map(|m| m.id).collect();
        let take = format!(
            "DELETE FROM {table} WHERE Seq IN ({free}) RETURNING Id",
            table = st.table,
            free = free_rows(&st.table)
        );
        let client = self.inner.client().await?;
        let inner = &self.inner;
        let (client, moved) = inner
            .answered("a move of failed messages", client, async |c| {
                c.batch_execute("BEGIN")
                    .await
                    .map_err(|e| map_error(e, Some(queue)))?;
                let taken: Vec<Uuid> = c
                    .query(&take, &[&ids])
                    .await
                    .map_err(|e| map_error(e, Some(queue)))?
                    .iter()
                    .filter_map(|r| r.try_get(0).ok())
                    .collect();
                // Each destination's messages in one statement, in the error queue's order.
                for (to, messages) in by_destination(moves, &taken) {
                    inner.send_many_on(c, to, &messages).await?;
                }
                c.batch_execute("COMMIT")
                    .await
                    .map_err(|e| map_error(e, Some(queue)))?;
                Ok::<_, TransportError>(taken)
            })
            .await?;
        if moved.is_err() {
            // The transaction is still open on this connection: end it before it is reused.
            let _ = client.batch_execute("ROLLBACK").await;
        }
        moved
    }

    async fn remove(&self, queue: &QueueName, ids: &[Uuid]) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let sql = format!(
            "DELETE FROM {table} WHERE Seq IN ({free})",
            table = st.table,
            free = free_rows(&st.table)
        );
        let client = self.inner.client().await?;
        let (_, removed) = self
            .inner
            .answered("a delete of failed messages", client, async |c| {
                c.execute(&sql, &[&ids]).await
            })
            .await?;
        removed.map_err(|e| map_error(e, Some(queue)))
    }
}
