//! Storing messages: single and multi-row inserts, delayed rows, and the unit of work's statements.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Object;

use super::lanes::Lent;
use uuid::Uuid;

use crate::message::OutgoingMessage;
use crate::transport::delayed::{delay_millis, delayed_headers};
use crate::transport::headers::serialize_headers;
use crate::transport::unit_of_work::{Receipt, SqlStore};
use crate::transport::{CommitAndReceive, QueueName, TransportError};

use super::connection::map_error;
use super::delayed::map_delayed_error;
use super::pipeline;
use super::{Inner, QueueStatements, discard};

impl Inner {
    pub(super) async fn send_on(
        &self,
        client: &Object,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let st = self.statements(queue)?;
        if let Some(delay_ms) = delay_millis(message)? {
            return self
                .store_delayed_on(client, queue, &st, message, delay_ms)
                .await;
        }
        let stmt = client
            .prepare_cached(&st.send)
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        let ttbr_ms = crate::transport::ttbr_millis(message)?;
        let headers = serialize_headers(&message.headers);
        client
            .execute(&stmt, &[&message.id, &ttbr_ms, &headers, &message.body])
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        Ok(())
    }
}

impl Inner {
    /// Stores a delayed message in `queue`'s delayed table, due `delay_ms` after the server's
    /// clock now, with the forward destination set to `queue`.
    pub(super) async fn store_delayed_on(
        &self,
        client: &Object,
        queue: &QueueName,
        st: &QueueStatements,
        message: &OutgoingMessage,
        delay_ms: i64,
    ) -> Result<(), TransportError> {
        let headers = serialize_headers(&delayed_headers(&message.headers, st.table.clone()));
        let stmt = client
            .prepare_cached(&st.delayed.store)
            .await
            .map_err(|e| map_delayed_error(e, queue, st))?;
        client
            .execute(&stmt, &[&message.id, &headers, &message.body, &delay_ms])
            .await
            .map_err(|e| map_delayed_error(e, queue, st))?;
        Ok(())
    }
}

impl Inner {
    /// Inserts `messages` on `client` with one statement (all or none), in the order given:
    /// arrays through `unnest ... WITH ORDINALITY`, so Seq follows that order.
    pub(super) async fn send_many_on(
        &self,
        client: &Object,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        if messages.is_empty() {
            return Ok(());
        }
        if messages.iter().any(|m| m.deliver_after.is_some()) {
            // Delayed ones go to another table: one by one, in the order given.
            for message in messages {
                self.send_on(client, queue, message).await?;
            }
            return Ok(());
        }
        let st = self.statements(queue)?;
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
        let (ttbrs, headers) = crate::transport::insert_columns(messages)?;
        let bodies: Vec<&[u8]> = messages.iter().map(|m| m.body.as_slice()).collect();
        let stmt = client
            .prepare_cached(&st.send_batch)
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        client
            .execute(&stmt, &[&ids, &ttbrs, &headers, &bodies])
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        Ok(())
    }
}

#[async_trait]
impl SqlStore for Inner {
    type Conn = Lent;

    async fn insert(
        &self,
        conn: &mut Lent,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.send_on(conn, queue, message).await
    }

    async fn insert_many(
        &self,
        conn: &mut Lent,
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
        let client = self.client_for(queue).await?;
        self.send_on(&client, queue, message).await
    }

    async fn insert_raw(
        &self,
        conn: Option<&mut Lent>,
        queue: &QueueName,
        (id, headers, body): (Uuid, &str, &[u8]),
    ) -> Result<(), TransportError> {
        let st = self.statements(queue)?;
        let pooled;
        let client = match conn {
            Some(c) => &*c,
            None => {
                pooled = self.client_for(queue).await?;
                &pooled
            }
        };
        async {
            let stmt = client.prepare_cached(&st.send_raw).await?;
            client.execute(&stmt, &[&id, &headers, &body]).await
        }
        .await
        .map(|_| ())
        .map_err(|e| map_error(e, Some(queue)))
    }

    async fn end(
        &self,
        client: Lent,
        queue: &QueueName,
        commit: bool,
        _after_failure: bool,
    ) -> Result<(), TransportError> {
        // After a failed statement PostgreSQL only needs the ROLLBACK: the connection is
        // clean again once it answered.
        let (statement, what) = match commit {
            true => ("COMMIT", "a commit"),
            false => ("ROLLBACK", "a rollback"),
        };
        let (client, ended) = self
            .answered(what, client, async |c| c.batch_execute(statement).await)
            .await?;
        ended.map_err(|e| {
            discard(client);
            map_error(e, Some(queue))
        })
    }

    fn abandon(&self, client: Lent) {
        discard(client);
    }

    async fn took_effect(
        &self,
        queue: &QueueName,
        receipt: Receipt,
    ) -> Result<bool, TransportError> {
        // A statement's deadline passed and nothing has answered since: asking now would wait
        // another deadline on a connection others need (a frozen server then went unnoticed
        // for 15 s while every receiver asked). The commit stays in doubt.
        if self.silence.deadline_passed() {
            return Err(TransportError::connection(
                "the database has not answered since a statement's deadline passed",
            ));
        }
        let Some(transaction) = receipt.transaction else {
            return Err(TransportError::database(
                "the receive did not return its transaction's id",
            ));
        };
        // The server knows: `txid_status` says committed, aborted or still in progress (a
        // backend that has not yet read the COMMIT or seen its connection closed).
        let deadline = tokio::time::Instant::now() + self.answer_deadline;
        loop {
            let client = self.client().await?;
            let (client, status) = self
                .answered("the status of a commit", client, async |c| {
                    c.query_one("SELECT txid_status($1)", &[&transaction]).await
                })
                .await?;
            let status: Option<String> = status.and_then(|row| row.try_get(0)).map_err(|e| {
                discard(client);
                map_error(e, Some(queue))
            })?;
            match status.as_deref() {
                Some("committed") => return Ok(true),
                Some("aborted") => return Ok(false),
                Some("in progress") if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => {
                    return Err(TransportError::database(format!(
                        "transaction {transaction} is {}",
                        other.unwrap_or("too old to be known")
                    )));
                }
            }
        }
    }

    async fn commit_and_receive(
        self: Arc<Self>,
        client: Lent,
        queue: &QueueName,
    ) -> CommitAndReceive {
        let st = match self.statements(queue) {
            // Other queues of this lane wait for a connection: this one goes back to the
            // lane after its commit and takes its turn in line, instead of keeping the
            // connection for as long as its queue has messages (a queue started first kept
            // others of a 1 000-queue host from their first message for 6 s).
            Ok(_) if client.turn_over() && self.pool.waiting_in(client.lane()) => {
                let committed = self.end(client, queue, true, false).await;
                return CommitAndReceive::commit_only(committed);
            }
            Ok(st) if self.receive_prepared((client.lane(), &client), &st) => st,
            // A receive that changed since (the queue began keeping order): commit alone; the
            // next receive is a first receive again.
            _ => {
                let committed = self.end(client, queue, true, false).await;
                return CommitAndReceive::commit_only(committed);
            }
        };
        // One round trip and one answer: `COMMIT; BEGIN; EXECUTE` (see `pipeline`).
        let sent = tokio::time::Instant::now();
        let asked = self
            .answered("a commit", client, async |c| {
                pipeline::begin_and_receive(c, true, &st.receive_name).await
            })
            .await;
        let (client, pipelined) = match asked {
            Ok(answers) => answers,
            // Whether the COMMIT took effect is not known: reported as failed, the message
            // is handled again if it did not (at least once).
            Err(unanswered) => {
                return CommitAndReceive {
                    committed: Err(unanswered),
                    next: None,
                };
            }
        };
        let (committed, row) = pipelined.outcome(queue);
        let next = match row {
            Some(row) => Some(self.received(queue, (client, sent), true, row).await),
            // The COMMIT failed: the next receive counts as not attempted.
            None => {
                discard(client);
                None
            }
        };
        CommitAndReceive { committed, next }
    }
}
