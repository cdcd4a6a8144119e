//! Storing messages: single, multi-row and bulk-loaded inserts, and the unit of work's statements.

use std::sync::Arc;

use async_trait::async_trait;
use uuid::Uuid;

use crate::config::Dialect;
use crate::message::OutgoingMessage;
use crate::transport::delayed::{delay_millis, delayed_headers};
use crate::transport::headers::serialize_headers;
use crate::transport::unit_of_work::{Receipt, SqlStore};
use crate::transport::{CommitAndReceive, QueueName, TransportError};

use super::connection::{int_at, is_server_error, map_error};
use super::delayed::delayed_table_named;
use super::pool::Connection;
use super::{DEADLOCK_RETRIES, Inner, Pooled, SqlServerTransport, claim, statements};

impl Inner {
    /// Inserts a message on `conn` (inside whatever transaction it has open).
    pub(super) async fn send_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let st = self.statements(queue);
        if let Some(delay_ms) = delay_millis(message)? {
            let headers =
                serialize_headers(&delayed_headers(&message.headers, self.address_of(queue)));
            let result = conn
                .execute(
                    st.delayed.store.as_str(),
                    &[&headers.as_str(), &message.body.as_slice(), &delay_ms],
                )
                .await;
            return self
                .after_insert(conn, queue, result)
                .map_err(|e| delayed_table_named(e, queue, &st));
        }
        let recoverable = self.has_recoverable(conn, queue, &st).await?;
        let sql = if recoverable {
            &st.send_with_recoverable
        } else {
            &st.send_without_recoverable
        };
        let ttbr = crate::transport::ttbr_millis(message)?;
        let headers = serialize_headers(&message.headers);
        let result = conn
            .execute(
                sql.as_str(),
                &[
                    &message.id,
                    &ttbr,
                    &headers.as_str(),
                    &message.body.as_slice(),
                ],
            )
            .await;
        self.after_insert(conn, queue, result)
    }

    /// Inserts `messages` on `conn` in the order given, [`statements::SEND_MANY_ROWS`] per
    /// statement (one statement, all or none, up to that many; several beyond it, so the
    /// caller wraps more in a transaction when they must be all or none).
    pub(super) async fn send_many_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        let st = self.statements(queue);
        if messages.iter().any(|m| m.deliver_after.is_some()) {
            // Delayed ones go to another table: one by one, in the order given.
            for message in messages {
                self.send_on(conn, queue, message).await?;
            }
            return Ok(());
        }
        for chunk in messages.chunks(statements::SEND_MANY_ROWS) {
            let recoverable = self.has_recoverable(conn, queue, &st).await?;
            let sql = statements::send_many(&st.table, chunk.len(), recoverable);
            let (ttbrs, headers) = crate::transport::insert_columns(chunk)?;
            let mut params: Vec<&dyn tiberius::ToSql> = Vec::with_capacity(4 * chunk.len());
            for (i, message) in chunk.iter().enumerate() {
                params.push(&message.id);
                params.push(&ttbrs[i]);
                params.push(&headers[i]);
                params.push(&message.body);
            }
            let result = conn.execute(sql.as_str(), &params).await;
            self.after_insert(conn, queue, result)?;
        }
        Ok(())
    }

    /// Stores `messages` (none with an expiry or a delay) in the order given through the TDS
    /// bulk load, inside the transaction open on `conn`.
    pub(super) async fn bulk_load_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        use tiberius::IntoRow;
        let st = self.statements(queue);
        let recoverable = self.has_recoverable(conn, queue, &st).await?;
        let (_, headers) = crate::transport::insert_columns(messages)?;
        let loaded = async {
            let columns: &[&str] = match recoverable {
                true => &["Id", "Recoverable", "Headers", "Body"],
                false => &["Id", "Headers", "Body"],
            };
            let mut request = conn.bulk_insert_columns(&st.table, columns).await?;
            for (message, headers) in messages.iter().zip(&headers) {
                let row = match recoverable {
                    true => {
                        (message.id, true, headers.as_str(), message.body.as_slice()).into_row()
                    }
                    false => (message.id, headers.as_str(), message.body.as_slice()).into_row(),
                };
                request.send(row).await?;
            }
            request.finalize().await
        }
        .await;
        loaded.map(|_| ()).map_err(|e| {
            conn.broken = true;
            map_error(e, Some(queue))
        })
    }

    /// Inserts a raw row (poison dead-lettering) on `conn`.
    pub(super) async fn send_raw_on(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        id: Uuid,
        headers: &str,
        body: &[u8],
    ) -> Result<(), TransportError> {
        let st = self.statements(queue);
        let recoverable = self.has_recoverable(conn, queue, &st).await?;
        let sql = if recoverable {
            &st.send_raw_with_recoverable
        } else {
            &st.send_raw_without_recoverable
        };
        let result = conn.execute(sql.as_str(), &[&id, &headers, &body]).await;
        self.after_insert(conn, queue, result)
    }

    pub(super) fn after_insert(
        &self,
        conn: &mut Connection,
        queue: &QueueName,
        result: Result<tiberius::ExecuteResult, tiberius::error::Error>,
    ) -> Result<(), TransportError> {
        match result {
            Ok(_) => Ok(()),
            Err(e) => {
                // Invalid column (207) or NULL into a NOT NULL column (515) naming Recoverable:
                // the table changed shape; detect the column again next time.
                if let tiberius::error::Error::Server(t) = &e
                    && matches!(t.code(), 207 | 515)
                    && t.message().contains("Recoverable")
                {
                    self.recoverable
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(queue);
                }
                conn.broken |= !is_server_error(&e);
                Err(map_error(e, Some(queue)))
            }
        }
    }
}

impl SqlServerTransport {
    /// Stores a batch ([`Transport::send_batch`]): multi-row inserts
    /// ([`statements::send_many`]) or the TDS bulk load; more than one statement's worth
    /// runs in a transaction, so a batch is stored all or none.
    pub(super) async fn store_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        if messages.is_empty() {
            return Ok(());
        }
        let mut conn = self.inner.conn().await?;
        if messages.len() <= statements::SEND_MANY_ROWS {
            return self.inner.send_many_on(&mut conn, queue, messages).await;
        }
        conn.run_batch("BEGIN TRAN;").await.map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })?;
        // Messages that neither expire nor wait go in through the TDS bulk load (no
        // parameters to bind: Babelfish took 2-4 s for 10 000 in multi-row inserts); an
        // expiry is the server's clock plus the time to be received, so those take the
        // multi-row insert, which computes it there.
        let bulk = messages
            .iter()
            .all(|m| m.deliver_after.is_none() && m.time_to_be_received.is_none());
        let sent = match bulk {
            true => self.inner.bulk_load_on(&mut conn, queue, messages).await,
            false => self.inner.send_many_on(&mut conn, queue, messages).await,
        };
        self.inner
            .end(conn, queue, sent.is_ok(), sent.is_err())
            .await?;
        sent
    }
}

#[async_trait]
impl SqlStore for Inner {
    fn arrived(&self, queue: &QueueName) {
        let sink = self
            .arrivals
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(sink) = sink {
            sink.arrived(queue);
        }
    }

    type Conn = Pooled;

    async fn insert(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.send_on(conn, queue, message).await
    }

    async fn insert_many(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        self.send_many_on(conn, queue, messages).await
    }

    async fn insert_alone(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let mut attempt = 0;
        loop {
            let mut conn = self.conn().await?;
            match self.send_on(&mut conn, queue, message).await {
                Err(e) if e.is_deadlock() && attempt < DEADLOCK_RETRIES => {
                    attempt += 1;
                    self.conflict(queue, true);
                    tracing::debug!(queue = %queue, attempt, "send was a deadlock victim; retrying");
                }
                other => return other,
            }
        }
    }

    async fn insert_raw(
        &self,
        conn: Option<&mut Pooled>,
        queue: &QueueName,
        (id, headers, body): (Uuid, &str, &[u8]),
    ) -> Result<(), TransportError> {
        match conn {
            Some(conn) => self.send_raw_on(conn, queue, id, headers, body).await,
            None => {
                let mut conn = self.conn().await?;
                self.send_raw_on(&mut conn, queue, id, headers, body).await
            }
        }
    }

    async fn end(
        &self,
        mut conn: Pooled,
        queue: &QueueName,
        commit: bool,
        after_failure: bool,
    ) -> Result<(), TransportError> {
        let sql = match commit {
            true => "COMMIT TRAN;",
            false => "IF @@TRANCOUNT > 0 ROLLBACK TRAN;",
        };
        let result = conn.run_batch(sql).await;
        claim::release(&mut conn.claim, !commit || result.is_err());
        // After an error inside the transaction the client's idea of it may be stale: start
        // the next unit of work on a fresh connection.
        conn.broken |= after_failure || result.is_err();
        result.map(|_| ()).map_err(|e| map_error(e, Some(queue)))
    }

    fn abandon(&self, mut conn: Pooled) {
        // Closing the connection makes the server roll the transaction back.
        conn.broken = true;
        claim::release(&mut conn.claim, true);
    }

    async fn took_effect(
        &self,
        queue: &QueueName,
        receipt: Receipt,
    ) -> Result<bool, TransportError> {
        // SQL Server keeps no status of ended transactions: the row is looked up. Gone means
        // the commit took effect, or it rolled back and another receiver has handled the
        // message since (it is then reported as done by both).
        let sql = self.statements(queue).still_queued.clone();
        let mut conn = self.conn().await?;
        let result = async {
            let row = conn
                .query(sql.as_str(), &[&receipt.id])
                .await?
                .into_row()
                .await?;
            Ok::<_, tiberius::error::Error>(row.as_ref().and_then(|r| int_at(r, 0)).unwrap_or(0))
        }
        .await;
        result.map(|count| count == 0).map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(queue))
        })
    }

    async fn commit_and_receive(
        self: Arc<Self>,
        conn: Pooled,
        queue: &QueueName,
    ) -> CommitAndReceive {
        let st = self.statements(queue);
        if self.dialect == Dialect::Babelfish {
            return self.commit_and_claim(conn, queue).await;
        }
        // One batch: COMMIT, BEGIN, receive. With XACT_ABORT ON a failed COMMIT aborts the
        // batch before anything is received.
        match self
            .run_receive(conn, queue, &st.commit_and_receive, true)
            .await
        {
            Ok(next) => CommitAndReceive {
                committed: Ok(()),
                next: Some(Ok(next)),
            },
            // Which statement of the batch failed is not known here: the commit is reported
            // as failed (its message returns to the queue if it did not take effect).
            Err(e) => CommitAndReceive {
                committed: Err(e),
                next: None,
            },
        }
    }
}
