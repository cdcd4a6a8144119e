//! Delayed delivery: the `<queue>.Delayed` table NServiceBus keeps, and moving due rows into their
//! queue.

use async_trait::async_trait;
use chrono::NaiveDateTime;

use crate::transport::delayed::{DelayedDelivery, DelayedReading, Moved, TABLES_PER_SWEEP};
use crate::transport::unit_of_work::SqlStore;
use crate::transport::{QueueName, TransportError};

use super::connection::{int_at, map_error};
use super::{QueueStatements, SqlServerTransport};

/// An error of a statement on `queue`'s delayed table: a missing table is named as such.
pub(super) fn delayed_table_named(
    e: TransportError,
    queue: &QueueName,
    st: &QueueStatements,
) -> TransportError {
    match e {
        TransportError::QueueNotFound(_) => TransportError::DelayedTableNotFound {
            queue: queue.to_string(),
            table: st.delayed.table.clone(),
        },
        other => other,
    }
}

#[async_trait]
impl DelayedDelivery for SqlServerTransport {
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError> {
        self.inner.check_creatable(queue)?;
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        match conn.run_batch(&st.delayed.create).await {
            Ok(_) => Ok(()),
            Err(e) => {
                conn.broken = true;
                match e {
                    tiberius::error::Error::Server(t) if matches!(t.code(), 2714 | 1913) => Ok(()),
                    e => Err(delayed_table_named(map_error(e, Some(queue)), queue, &st)),
                }
            }
        }
    }

    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        let recoverable = self.inner.has_recoverable(&mut conn, queue, &st).await?;
        let sql = if recoverable {
            &st.delayed.move_due_with_recoverable
        } else {
            &st.delayed.move_due_without_recoverable
        };
        let batch = i64::from(batch.max(1));
        let answer = async { conn.query(sql.as_str(), &[&batch]).await?.into_row().await }.await;
        let row = match answer {
            Ok(row) => row,
            // Babelfish: another host's mover holds the due rows (see the statement). Any
            // other error: XACT_ABORT rolled the move back, the connection is closed.
            Err(e) => {
                let gave_up = self.inner.gave_up_on_held_row(&mut conn, queue, e).await;
                gave_up.map_err(|e| delayed_table_named(e, queue, &st))?;
                drop(conn);
                return Ok(Moved {
                    moved: 0,
                    busy: true,
                    waiting: self.delayed_count(queue).await?,
                    next_due_in: None,
                });
            }
        };
        let Some(row) = row else {
            return Err(TransportError::database(format!(
                "the move of `{queue}`'s due delayed messages returned nothing"
            )));
        };
        let count = |i: usize| int_at(&row, i).unwrap_or(0).max(0) as u64;
        let now: Option<NaiveDateTime> = row.try_get(3).ok().flatten();
        let next: Option<NaiveDateTime> = row.try_get(4).ok().flatten();
        if count(0) > 0 {
            // The move committed: due messages are in the queue now, not at the next peek.
            self.inner.arrived(queue);
        }
        Ok(Moved {
            moved: count(0),
            busy: count(1) == 0,
            waiting: count(2),
            next_due_in: now
                .zip(next)
                .map(|(now, next)| (next - now).to_std().unwrap_or_default()),
        })
    }

    async fn sweep(&self, queues: &[QueueName]) -> Result<Vec<DelayedReading>, TransportError> {
        let mut readings = Vec::with_capacity(queues.len());
        for chunk in queues.chunks(TABLES_PER_SWEEP) {
            let sql = chunk
                .iter()
                .enumerate()
                .map(|(i, queue)| {
                    let table = &self.inner.statements(queue).delayed.table;
                    format!(
                        "SELECT CAST({i} AS bigint), (SELECT COUNT_BIG(*) FROM {table} WITH (READPAST)), \
                         GETUTCDATE(), (SELECT MIN(Due) FROM {table} WITH (READPAST))"
                    )
                })
                .collect::<Vec<_>>()
                .join(" UNION ALL ");
            let mut conn = self.inner.conn().await?;
            let rows = conn.rows(&sql, &[]).await.map_err(|e| map_error(e, None))?;
            let mut chunk_readings = vec![DelayedReading::default(); chunk.len()];
            for row in rows {
                let i = int_at(&row, 0).unwrap_or(0).max(0) as usize;
                let now: Option<NaiveDateTime> = row.try_get(2).ok().flatten();
                let next: Option<NaiveDateTime> = row.try_get(3).ok().flatten();
                if let Some(reading) = chunk_readings.get_mut(i) {
                    *reading = DelayedReading {
                        waiting: int_at(&row, 1).unwrap_or(0).max(0) as u64,
                        next_due_in: now
                            .zip(next)
                            .map(|(now, next)| (next - now).to_std().unwrap_or_default()),
                    };
                }
            }
            readings.extend(chunk_readings);
        }
        Ok(readings)
    }

    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        self.inner
            .count(&mut conn, queue, &st.delayed.count, &[])
            .await
            .map_err(|e| delayed_table_named(e, queue, &st))
    }

    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        // Names are validated (no quotes), so the table sits inside the literal.
        let sql = format!(
            "SELECT CAST(CASE WHEN OBJECT_ID(N'{}', N'U') IS NULL THEN 0 ELSE 1 END AS bigint)",
            st.delayed.table
        );
        Ok(self.inner.count(&mut conn, queue, &sql, &[]).await? == 1)
    }

    fn delayed_table(&self, queue: &QueueName) -> String {
        self.inner.statements(queue).delayed.table.clone()
    }
}
