//! Delayed delivery: the `"<queue>.Delayed"` table NServiceBus keeps, and moving due rows into
//! their queue.

use std::time::Duration;

use async_trait::async_trait;

use crate::transport::delayed::{DelayedDelivery, DelayedReading, Moved, TABLES_PER_SWEEP};
use crate::transport::{QueueName, TransportError};

use super::admin::{existing_relations, is_concurrent_creation};
use super::connection::map_error;
use super::statements::DelayedRelations;
use super::statements::quote_ident;
use super::{PostgresTransport, QueueStatements};

/// Turns a driver error into a transport error that says what happened.
/// An error of a statement on `queue`'s delayed table `st`: a missing table is named as such.
pub(super) fn map_delayed_error(
    e: tokio_postgres::Error,
    queue: &QueueName,
    st: &QueueStatements,
) -> TransportError {
    match map_error(e, Some(queue)) {
        TransportError::QueueNotFound(_) => TransportError::DelayedTableNotFound {
            queue: queue.to_string(),
            table: st.delayed.table.clone(),
        },
        other => other,
    }
}

#[async_trait]
impl DelayedDelivery for PostgresTransport {
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let mut client = self.inner.client().await?;
        let schema = format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_ident(self.inner.schema_of(queue))
        );
        // The old table is adopted under the lock that creates the new one, in its
        // transaction: a host creating the table at the same time finds it complete.
        let result = async {
            let tx = client.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock(hashtext($1))",
                &[&st.delayed.table],
            )
            .await?;
            tx.batch_execute(&schema).await?;
            let mut adopted = None;
            if let Some(adopt) = &st.delayed.adopt_old() {
                // The DO block leaves its count in a setting the final SELECT reads.
                let rows = tx.simple_query(adopt).await?;
                adopted = rows.iter().find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => {
                        r.get(0).and_then(|v| v.parse::<u64>().ok())
                    }
                    _ => None,
                });
            }
            tx.batch_execute(&st.delayed.create()).await?;
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>(adopted)
        }
        .await;
        match result {
            Ok(Some(rows)) => {
                tracing::info!(
                    queue = %queue,
                    table = %st.delayed.table,
                    rows,
                    "adopted the delayed table this host used to name \"{queue}.delayed\": NServiceBus names it {}",
                    st.delayed.table
                );
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) if is_concurrent_creation(&e) => Ok(()),
            Err(e) => Err(map_delayed_error(e, queue, &st)),
        }
    }

    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let lock = format!("throttlehost.mover {}", st.delayed.table);
        let batch = i64::from(batch.max(1));
        let (_, row) = self
            .inner
            .answered("a move of due delayed messages", client, async |c| {
                let stmt = c.prepare_cached(&st.delayed.move_due).await?;
                c.query_one(&stmt, &[&batch, &lock]).await
            })
            .await?;
        let row = row.map_err(|e| map_delayed_error(e, queue, &st))?;
        let count = |i: usize| row.try_get::<_, i64>(i).unwrap_or(0).max(0) as u64;
        let got: bool = row.try_get(1).unwrap_or(false);
        let next_ms: Option<f64> = row.try_get(3).ok().flatten();
        Ok(Moved {
            moved: count(0),
            busy: !got,
            waiting: count(2),
            // A row written by anyone may be due in centuries: kept as it is, up to a bound
            // `Duration` holds (a u32 of milliseconds cut it to 49.7 days).
            next_due_in: next_ms
                .filter(|ms| ms.is_finite())
                .map(|ms| Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 1e12))),
        })
    }

    async fn sweep(&self, queues: &[QueueName]) -> Result<Vec<DelayedReading>, TransportError> {
        let mut readings = Vec::with_capacity(queues.len());
        for chunk in queues.chunks(TABLES_PER_SWEEP) {
            let mut reads = Vec::with_capacity(chunk.len());
            for (i, queue) in chunk.iter().enumerate() {
                let table = &self.inner.statements(queue)?.delayed.table;
                reads.push(format!(
                    "SELECT {i}::int, (SELECT count(*) FROM {table})::bigint, \
                     (SELECT (EXTRACT(EPOCH FROM (min(Due) - (now() AT TIME ZONE 'UTC')::timestamptz)) * 1000)::float8 \
                     FROM {table} WHERE isfinite(Due))"
                ));
            }
            let sql = reads.join(" UNION ALL ");
            let client = self.inner.client().await?;
            let (_, rows) = self
                .inner
                .answered("a sweep of delayed tables", client, async |c| {
                    // Prepared once per connection: the same tables every sweep.
                    let stmt = c.prepare_cached(&sql).await?;
                    c.query(&stmt, &[]).await
                })
                .await?;
            let rows = rows.map_err(|e| map_error(e, None))?;
            let mut chunk_readings = vec![DelayedReading::default(); chunk.len()];
            for row in rows {
                let i = row.try_get::<_, i32>(0).unwrap_or(0).max(0) as usize;
                if let Some(reading) = chunk_readings.get_mut(i) {
                    let next_ms: Option<f64> = row.try_get(2).ok().flatten();
                    *reading = DelayedReading {
                        waiting: row.try_get::<_, i64>(1).unwrap_or(0).max(0) as u64,
                        next_due_in: next_ms
                            .filter(|ms| ms.is_finite())
                            .map(|ms| Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 1e12))),
                    };
                }
            }
            readings.extend(chunk_readings);
        }
        Ok(readings)
    }

    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let (_, row) = self
            .inner
            .answered("a count of delayed messages", client, async |c| {
                c.query_one(&st.delayed.count, &[]).await
            })
            .await?;
        let n: i64 = row
            .map_err(|e| map_delayed_error(e, queue, &st))?
            .try_get(0)
            .unwrap_or(0);
        Ok(n.max(0) as u64)
    }

    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let (_, row) = self
            .inner
            .answered("a look-up of a delayed table", client, async |c| {
                c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&st.delayed.table])
                    .await
            })
            .await?;
        row.map_err(|e| map_error(e, Some(queue)))?
            .try_get(0)
            .map_err(|e| TransportError::database(e.to_string()))
    }

    /// The table and its index there, and no table of the old name left to adopt: one read
    /// of the catalogs for all of them.
    async fn delayed_in_place(
        &self,
        queues: &[QueueName],
    ) -> Result<std::collections::HashSet<QueueName>, TransportError> {
        let relations = queues
            .iter()
            .map(|q| Ok(self.inner.statements(q)?.delayed.relations()))
            .collect::<Result<Vec<DelayedRelations>, TransportError>>()?;
        let client = self.inner.client().await?;
        let wanted: Vec<(String, String)> = relations
            .iter()
            .flat_map(|r| r.present.iter().chain(&r.absent).cloned())
            .collect();
        let existing = existing_relations(&client, &wanted, None)
            .await
            .map_err(|e| map_error(e, None))?;
        Ok(queues
            .iter()
            .zip(&relations)
            .filter(|(_, r)| {
                r.present.iter().all(|p| existing.contains(p))
                    && r.absent.iter().all(|a| !existing.contains(a))
            })
            .map(|(queue, _)| queue.clone())
            .collect())
    }

    fn delayed_table(&self, queue: &QueueName) -> String {
        match self.inner.statements(queue) {
            Ok(st) => st.delayed.table.clone(),
            Err(_) => format!("{queue}.{}", self.inner.delayed_suffix),
        }
    }
}
