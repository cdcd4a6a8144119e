//! SQL Server's error queues, browsed and edited in place ([`FailedStore`]). Reads pass over
//! rows a receive holds (`READPAST`: they are in flight, not failed); deletes and moves too,
//! so the tool never waits behind another reader of the queue. Ids go in as parameters, at
//! most [`IDS_PER_STATEMENT`] a statement (SQL Server takes 2 100 parameters).

use async_trait::async_trait;
use tiberius::{Row, ToSql};
use uuid::Uuid;

use super::{SqlServerTransport, int_at, is_server_error, map_error};
use crate::transport::failed::{FailedStore, MoveOut, StoredRow, by_destination};
use crate::transport::{QueueName, TransportError, unit_of_work::SqlStore};

/// Ids bound in one statement.
const IDS_PER_STATEMENT: usize = 1_000;

fn stored_row(row: &Row) -> StoredRow {
    StoredRow {
        position: int_at(row, 0).unwrap_or(0),
        id: row.get::<Uuid, _>(1).unwrap_or_default(),
        headers: row.get::<&str, _>(2).unwrap_or_default().to_string(),
        body: row
            .get::<&[u8], _>(3)
            .map(<[u8]>::to_vec)
            .unwrap_or_default(),
    }
}

/// `@P{first}, @P{first+1}, ...` for `n` parameters.
fn placeholders(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("@P{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn params(ids: &[Uuid]) -> Vec<&dyn ToSql> {
    ids.iter().map(|id| id as &dyn ToSql).collect()
}

impl SqlServerTransport {
    /// Runs a statement of `queue` and returns its first result's rows.
    async fn rows_of(
        &self,
        queue: &QueueName,
        sql: &str,
        params: &[&dyn ToSql],
    ) -> Result<Vec<Row>, TransportError> {
        let mut conn = self.inner.conn().await?;
        let rows = async { conn.query(sql, params).await?.into_first_result().await }.await;
        rows.map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })
    }
}

#[async_trait]
impl FailedStore for SqlServerTransport {
    async fn browse(
        &self,
        queue: &QueueName,
        after: i64,
        limit: u32,
        with_body: bool,
    ) -> Result<Vec<StoredRow>, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let body = if with_body {
            "Body"
        } else {
            "CAST(NULL AS varbinary(max))"
        };
        let sql = format!(
            "SELECT TOP(@P2) CAST(RowVersion AS bigint), Id, Headers, {body} FROM {table} WITH (READPAST) WHERE RowVersion > @P1 ORDER BY RowVersion"
        );
        let limit = i64::from(limit);
        let rows = self.rows_of(queue, &sql, &[&after, &limit]).await?;
        Ok(rows.iter().map(stored_row).collect())
    }

    async fn read(
        &self,
        queue: &QueueName,
        ids: &[Uuid],
    ) -> Result<Vec<StoredRow>, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut rows = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let sql = format!(
                "SELECT CAST(RowVersion AS bigint), Id, Headers, Body FROM {table} WITH (READPAST) WHERE Id IN ({}) ORDER BY RowVersion",
                placeholders(1, chunk.len())
            );
            rows.extend(
                self.rows_of(queue, &sql, &params(chunk))
                    .await?
                    .iter()
                    .map(stored_row),
            );
        }
        Ok(rows)
    }

    async fn move_out(
        &self,
        queue: &QueueName,
        moves: &[MoveOut],
    ) -> Result<Vec<Uuid>, TransportError> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        if moves.len() > IDS_PER_STATEMENT {
            return Err(TransportError::InvalidMessage(format!(
                "at most {IDS_PER_STATEMENT} failed messages move in one transaction"
            )));
        }
        let table = self.inner.statements(queue).table.clone();
        let ids: Vec<Uuid> = moves.iter().map(|m| m.id).collect();
        let take = format!(
            "DELETE FROM {table} WITH (READPAST) OUTPUT deleted.Id WHERE Id IN ({})",
            placeholders(1, ids.len())
        );
        let mut conn = self.inner.conn().await?;
        conn.run_batch("BEGIN TRAN;").await.map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })?;
        let moved = async {
            let params = params(&ids);
            let taken: Vec<Uuid> = conn
                .query(take.as_str(), &params)
                .await
                .map_err(|e| map_error(e, Some(queue)))?
                .into_first_result()
                .await
                .map_err(|e| map_error(e, Some(queue)))?
                .iter()
                .filter_map(|r| r.get::<Uuid, _>(0))
                .collect();
            // Each destination's messages in one statement, in the error queue's order.
            for (to, messages) in by_destination(moves, &taken) {
                self.inner.send_many_on(&mut conn, to, &messages).await?;
            }
            Ok::<_, TransportError>(taken)
        }
        .await;
        self.inner
            .end(conn, queue, moved.is_ok(), moved.is_err())
            .await?;
        moved
    }

    async fn remove(&self, queue: &QueueName, ids: &[Uuid]) -> Result<u64, TransportError> {
        let table = self.inner.statements(queue).table.clone();
        let mut removed = 0;
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let sql = format!(
                "DELETE FROM {table} WITH (READPAST) WHERE Id IN ({}); SELECT CAST(@@ROWCOUNT AS bigint);",
                placeholders(1, chunk.len())
            );
            let rows = self.rows_of(queue, &sql, &params(chunk)).await?;
            removed += rows.first().and_then(|r| int_at(r, 0)).unwrap_or(0).max(0) as u64;
        }
        Ok(removed)
    }
}
