//! Receiving: the rows a receive returns, batch receives, and rows an autocommitted receive must
//! give back.

use std::sync::Arc;

use super::lanes::Lent;
use async_trait::async_trait;
use chrono::NaiveDateTime;
use uuid::Uuid;

use crate::config::TransactionMode;
use crate::transport::batch;
use crate::transport::row::RawRow;
use crate::transport::unit_of_work::{SqlReceived, split_batch};
use crate::transport::{QueueName, Received, TransportError};

use super::connection::map_error;
use super::{Inner, PostgresTransport, discard};

impl Inner {
    /// Turns the result of the receive statement `client` sent at `sent` into a [`Received`]
    /// (or ends an empty receive, and notes when the queue was found empty). Whatever went
    /// wrong closes the connection: the server rolls its transaction back.
    pub(super) async fn received(
        self: Arc<Self>,
        queue: &QueueName,
        (client, sent): (Lent, tokio::time::Instant),
        transactional: bool,
        row: Result<Option<RawRow>, TransportError>,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                discard(client);
                return Err(e);
            }
        };
        let Some(row) = row else {
            self.found_empty.found(queue, sent);
            if transactional && let Err(e) = client.batch_execute("ROLLBACK").await {
                discard(client);
                return Err(map_error(e, Some(queue)));
            }
            return Ok(None);
        };
        let client = if transactional { Some(client) } else { None };
        Ok(Some(SqlReceived::boxed(self, queue, client, row)))
    }

    /// Receives up to `max` messages in one transaction (see [`Transport::receive_batch`]).
    pub(super) async fn receive_batch(
        self: Arc<Self>,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue)?;
        if st.ordered {
            return Err(crate::transport::refuse_ordered_batch(queue));
        }
        let asked = tokio::time::Instant::now();
        let client = self.client_for(queue).await?;
        if self.found_empty.since(queue, asked) {
            return Ok(Vec::new());
        }
        let sent = tokio::time::Instant::now();
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let (client, asked) = self
            .answered("a receive", client, async |c| {
                let stmt = c.prepare_cached(&st.receive_batch).await?;
                // Pipelined as the single receive is: BEGIN and the DELETE in one write.
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&limit];
                let (begin, rows) = tokio::join!(c.batch_execute("BEGIN"), c.query(&stmt, &params));
                Ok::<_, tokio_postgres::Error>((begin, rows))
            })
            .await?;
        let rows = match asked {
            Ok((Ok(()), Ok(rows))) => rows,
            Ok((Err(e), Ok(rows))) => {
                // BEGIN failed yet the DELETE ran and committed on its own: put the rows
                // back rather than lose them (they go to the tail of the queue).
                discard(client);
                for row in &rows {
                    self.reinsert_autocommitted(queue, row).await;
                }
                return Err(map_error(e, Some(queue)));
            }
            Ok((_, Err(e))) | Err(e) => {
                discard(client);
                return Err(map_error(e, Some(queue)));
            }
        };
        if rows.is_empty() {
            self.found_empty.found(queue, sent);
        }
        let decoded = rows.iter().map(|row| decode_row(queue, row)).collect();
        split_batch(self, queue, client, decoded).await
    }

    pub(super) async fn reinsert_autocommitted(
        &self,
        queue: &QueueName,
        row: &tokio_postgres::Row,
    ) {
        let result = async {
            let st = self.statements(queue)?;
            let id: Uuid = row
                .try_get(0)
                .map_err(|e| TransportError::database(e.to_string()))?;
            let headers: String = row
                .try_get(2)
                .map_err(|e| TransportError::database(e.to_string()))?;
            let body: Option<Vec<u8>> = row
                .try_get(3)
                .map_err(|e| TransportError::database(e.to_string()))?;
            let client = self.client().await?;
            client
                .execute(&st.send_raw, &[&id, &headers, &body])
                .await
                .map_err(|e| map_error(e, Some(queue)))
        }
        .await;
        if let Err(e) = result {
            tracing::error!(queue = %queue, error = %e, "a message deleted outside a transaction could not be put back");
        }
    }
}

/// Reads `Expires` as the receive prints it (`statements::EXPIRES_TEXT`: ISO, with its offset
/// from UTC; without one it is taken as UTC). Values no date type here can hold (`infinity`,
/// years past 262143) read as no expiry: whether the row has expired was already decided by the
/// server, so only the informational expiry of the message is lost.
pub(super) fn parse_expires(text: &str) -> Option<NaiveDateTime> {
    NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f")
        .ok()
        .or_else(|| {
            chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
                .ok()
                .map(|t| t.naive_utc())
        })
}

/// Reads a received row: id, expired flag, headers, body, expiry as text.
pub(super) fn decode_row(
    queue: &QueueName,
    row: &tokio_postgres::Row,
) -> Result<RawRow, TransportError> {
    let decoded: Result<_, tokio_postgres::Error> = (|| {
        let id: Uuid = row.try_get(0)?;
        let expired: bool = row.try_get(1)?;
        let headers: String = row.try_get(2)?;
        let body: Option<Vec<u8>> = row.try_get(3)?;
        let expires: Option<String> = row.try_get(4)?;
        Ok(RawRow {
            id,
            expired,
            headers,
            body: body.unwrap_or_default(),
            expires: expires.as_deref().and_then(parse_expires),
            // Absent from receives that do not return it (batch receives).
            transaction: row.try_get::<_, Option<i64>>(5).ok().flatten(),
        })
    })();
    decoded.map_err(|e| {
        TransportError::database(format!(
            "queue `{queue}` has columns of unexpected types: {e}"
        ))
    })
}

#[async_trait]
impl crate::transport::BatchReceive for PostgresTransport {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        // Mode `none` deletes before handlers run: a batch there is single receives.
        if max <= 1 || self.inner.mode == TransactionMode::None {
            return batch::EachOnItsOwn::receive(self, queue, max).await;
        }
        self.inner.clone().receive_batch(queue, max).await
    }
}
