//! The open receive of the two SQL transports, written once: a received row and the
//! pooled connection whose transaction removed it. What differs between PostgreSQL and SQL
//! Server (how to insert on the connection, how to end the transaction, what to do with a
//! connection left in doubt, how to commit and receive in one round trip) is the
//! [`SqlStore`] each implements; the bookkeeping (a failed statement makes the commit fail,
//! mode `none` sends on a connection of their own, a dropped receive rolls back) is here.

use std::sync::Arc;

use async_trait::async_trait;
use uuid::Uuid;

use super::batch::BatchWork;
use super::row::{RawRow, kept_row, payload_of};
use super::{CommitAndReceive, Payload, QueueName, Received, TransportError};
use crate::message::OutgoingMessage;

/// What a SQL transport does on one of its pooled connections for an open receive.
#[async_trait]
pub(crate) trait SqlStore: Send + Sync + Sized + 'static {
    /// A pooled connection.
    type Conn: Send + 'static;

    /// Inserts a message on `conn`, inside its open transaction.
    async fn insert(
        &self,
        conn: &mut Self::Conn,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError>;

    /// Inserts `messages`, in the order given, on `conn` inside its open transaction, with
    /// as few statements as the server allows (the default: one by one).
    async fn insert_many(
        &self,
        conn: &mut Self::Conn,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        for message in messages {
            self.insert(conn, queue, message).await?;
        }
        Ok(())
    }

    /// Inserts a message on a connection of its own (transaction mode `none`).
    async fn insert_alone(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError>;

    /// Inserts a row as it was received (same id, raw headers and body, no expiry); `conn`
    /// `None`: on a connection of its own.
    async fn insert_raw(
        &self,
        conn: Option<&mut Self::Conn>,
        queue: &QueueName,
        row: (Uuid, &str, &[u8]),
    ) -> Result<(), TransportError>;

    /// Commits (`commit`) or rolls back the transaction on `conn` and gives the connection
    /// back to the pool, or closes it when its state is in doubt. `after_failure`: a
    /// statement in the transaction failed before.
    async fn end(
        &self,
        conn: Self::Conn,
        queue: &QueueName,
        commit: bool,
        after_failure: bool,
    ) -> Result<(), TransportError>;

    /// Closes a connection whose transaction is still open: the server rolls it back.
    fn abandon(&self, conn: Self::Conn);

    /// Commits the transaction on `conn`, then receives the next message from `queue` on the
    /// same connection, in as few round trips as the server allows.
    async fn commit_and_receive(
        self: Arc<Self>,
        conn: Self::Conn,
        queue: &QueueName,
    ) -> CommitAndReceive;

    /// Whether the commit of the receive `receipt` took effect, asked on a connection of its
    /// own after the commit reported an error. Waits (up to the answer deadline) for a
    /// transaction the server is still running to end.
    async fn took_effect(
        &self,
        queue: &QueueName,
        receipt: Receipt,
    ) -> Result<bool, TransportError>;

    /// Messages sent by this process became visible in `queue` (their transaction committed):
    /// a store whose server does not notify wakes the queue's receivers here (default:
    /// nothing, the server notifies).
    fn arrived(&self, _queue: &QueueName) {}
}

/// What identifies a receive's commit for [`SqlStore::took_effect`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Receipt {
    /// The message's id.
    pub id: Uuid,
    /// The id of the transaction that removed its row, when the server told it.
    pub transaction: Option<i64>,
}

/// A batch receive's rows handed out one [`Received`] each over one transaction on `conn`
/// ([`batch::split`]; no rows end the transaction). Rows that could not be decoded fail the
/// batch: closing the connection rolls all of it back.
pub(crate) async fn split_batch<S: SqlStore>(
    store: Arc<S>,
    queue: &QueueName,
    conn: S::Conn,
    rows: Result<Vec<RawRow>, TransportError>,
) -> Result<Vec<Box<dyn Received>>, TransportError> {
    match rows {
        Ok(rows) => {
            let work = SqlBatchWork::new(store, queue, conn);
            let decoded = rows.into_iter().map(payload_of).collect();
            super::batch::split(Box::new(work), decoded).await
        }
        Err(e) => {
            store.abandon(conn);
            Err(e)
        }
    }
}

/// The row to dead-letter: a poison row's raw headers and body as received, or a message
/// written back in wire form.
pub(crate) fn dead_letter_row(
    payload: &Payload,
    raw: &Option<(String, Vec<u8>)>,
) -> Result<(Uuid, String, Vec<u8>), TransportError> {
    match kept_row(payload, raw) {
        Some((headers, body)) => Ok((payload.id(), headers, body)),
        None => Err(TransportError::database(format!(
            "cannot dead-letter {payload:?}: its row was not kept"
        ))),
    }
}

/// What a receive's commit that reported an error really did. A lost answer (a restarted or
/// frozen server, a broken connection) leaves the commit in doubt, and on SQL Server an error
/// of the receive batched after the COMMIT looks the same: the store is asked on a connection
/// of its own ([`SqlStore::took_effect`]). Took effect: reported as done, so a handled
/// message is neither logged as returning nor missing from the success count. Did not: the
/// error stands (the message returns). Not known: asked again until the database answers,
/// for [`COMMIT_CHECK_PATIENCE`] at most, then [`TransportError::InDoubt`].
pub(crate) async fn settle_commit<S: SqlStore>(
    store: &S,
    queue: &QueueName,
    receipt: Receipt,
    committed: Result<(), TransportError>,
) -> Result<(), TransportError> {
    let Err(error) = committed else {
        return Ok(());
    };
    let took_effect = until_answered(
        || store.took_effect(queue, receipt),
        // Said at once: a frozen or restarting server is news an operator wants now, not
        // after the patience.
        |check| {
            tracing::warn!(queue = %queue, id = %receipt.id, error = %error, check = %check,
                "the answer to a commit was lost and the database does not say whether it took effect; asking again until it does");
        },
    )
    .await;
    match took_effect {
        Ok(true) => {
            tracing::info!(queue = %queue, id = %receipt.id, error = %error,
                "the commit reported an error but took effect");
            Ok(())
        }
        Ok(false) => Err(error),
        Err(check) => Err(TransportError::InDoubt {
            error: error.to_string(),
            check: check.to_string(),
        }),
    }
}

/// How long a commit in doubt is asked after: a database frozen or restarting answers within
/// this in the outages the host rides out, and the receive's slot is held meanwhile (nothing
/// else would run on a database that does not answer).
pub(crate) const COMMIT_CHECK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// The answer of `ask`, asked again while it fails, 250 ms doubling to 1 s apart, for
/// [`COMMIT_CHECK_PATIENCE`]; its last error after that. A look-up while the database is
/// silent fails at once without a statement, and the short wait lets receiving resume within
/// a second of the database's answer. Before, the first failed look-up left the commit in
/// doubt: after a 45 s freeze, 8 of 40 000 handled messages whose commits had taken effect
/// were missing from the success count.
/// `first_failure` is told of the first failed look-up.
async fn until_answered<F, Fut>(
    mut ask: F,
    first_failure: impl FnOnce(&TransportError),
) -> Result<bool, TransportError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool, TransportError>>,
{
    let give_up = tokio::time::Instant::now() + COMMIT_CHECK_PATIENCE;
    let mut wait = std::time::Duration::from_millis(250);
    let mut first_failure = Some(first_failure);
    loop {
        match ask().await {
            Ok(answer) => return Ok(answer),
            Err(e) if tokio::time::Instant::now() + wait > give_up => return Err(e),
            Err(e) => {
                if let Some(tell) = first_failure.take() {
                    tell(&e);
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(std::time::Duration::from_secs(1));
            }
        }
    }
}

/// An open receive on a SQL transport.
pub(crate) struct SqlReceived<S: SqlStore> {
    store: Arc<S>,
    queue: QueueName,
    /// The connection holding the transaction; None in mode `none` and once finished.
    conn: Option<S::Conn>,
    /// A statement in the transaction failed: the server has aborted (PostgreSQL) or rolled
    /// back (SQL Server, XACT_ABORT) the transaction, so commit must report an error.
    failed: bool,
    payload: Payload,
    /// Raw headers and body of a poison row, for dead-lettering it unchanged.
    raw: Option<(String, Vec<u8>)>,
    /// The id of the receiving transaction, when the server told it.
    transaction: Option<i64>,
    /// Queues sent to inside the transaction, told of when it commits ([`SqlStore::arrived`]).
    sent_to: Vec<QueueName>,
}

impl<S: SqlStore> SqlReceived<S> {
    /// The receive of `row` from `queue`; `conn` holds its transaction (None in mode `none`,
    /// where the row is already gone).
    pub(crate) fn boxed(
        store: Arc<S>,
        queue: &QueueName,
        conn: Option<S::Conn>,
        row: RawRow,
    ) -> Box<dyn Received> {
        let transaction = row.transaction;
        let (payload, raw) = payload_of(row);
        Box::new(SqlReceived {
            transaction,
            store,
            queue: queue.clone(),
            conn,
            failed: false,
            payload,
            raw,
            sent_to: Vec::new(),
        })
    }

    /// Ends the transaction, if one is open.
    async fn end(&mut self, commit: bool) -> Result<(), TransportError> {
        match self.conn.take() {
            Some(conn) => self.store.end(conn, &self.queue, commit, self.failed).await,
            None => Ok(()),
        }
    }

    fn receipt(&self) -> Receipt {
        Receipt {
            id: self.payload.id(),
            transaction: self.transaction,
        }
    }

    /// The transaction committed: its sends are visible.
    fn sent_arrived(&self) {
        for queue in &self.sent_to {
            self.store.arrived(queue);
        }
    }

    /// Notes the outcome of a statement run inside the transaction.
    fn inside<T>(&mut self, result: Result<T, TransportError>) -> Result<T, TransportError> {
        self.failed |= result.is_err();
        result
    }
}

impl<S: SqlStore> Drop for SqlReceived<S> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.store.abandon(conn);
        }
    }
}

#[async_trait]
impl<S: SqlStore> Received for SqlReceived<S> {
    fn payload(&self) -> &Payload {
        &self.payload
    }

    async fn send(
        &mut self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        match self.conn.as_mut() {
            Some(conn) => {
                let result = self.store.insert(conn, queue, message).await;
                if result.is_ok() && !self.sent_to.contains(queue) {
                    self.sent_to.push(queue.clone());
                }
                self.inside(result)
            }
            None => {
                self.store.insert_alone(queue, message).await?;
                self.store.arrived(queue);
                Ok(())
            }
        }
    }

    async fn dead_letter(&mut self, queue: &QueueName) -> Result<(), TransportError> {
        let (id, headers, body) = dead_letter_row(&self.payload, &self.raw)?;
        let row = (id, headers.as_str(), body.as_slice());
        match self.conn.as_mut() {
            Some(conn) => {
                let result = self.store.insert_raw(Some(conn), queue, row).await;
                self.inside(result)
            }
            None => self.store.insert_raw(None, queue, row).await,
        }
    }

    async fn commit(mut self: Box<Self>) -> Result<(), TransportError> {
        if self.failed {
            self.end(false).await?;
            return Err(TransportError::aborted(&self.queue));
        }
        let committed = self.end(true).await;
        let settled = settle_commit(&*self.store, &self.queue, self.receipt(), committed).await;
        if settled.is_ok() {
            self.sent_arrived();
        }
        settled
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), TransportError> {
        self.end(false).await
    }

    async fn commit_and_receive(mut self: Box<Self>, queue: &QueueName) -> CommitAndReceive {
        // The one-round-trip form needs a clean transaction on a connection that receives
        // from the same queue (SQL Server's batch is per queue).
        match (self.failed || self.queue != *queue, self.conn.take()) {
            (false, Some(conn)) => {
                let mut done = self.store.clone().commit_and_receive(conn, queue).await;
                let receipt = self.receipt();
                done.committed =
                    settle_commit(&*self.store, &self.queue, receipt, done.committed).await;
                if done.committed.is_ok() {
                    self.sent_arrived();
                }
                done
            }
            (_, conn) => {
                self.conn = conn;
                CommitAndReceive::commit_only(self.commit().await)
            }
        }
    }
}

/// The transaction of a batch receive on a SQL transport.
pub(crate) struct SqlBatchWork<S: SqlStore> {
    store: Arc<S>,
    queue: QueueName,
    /// The connection holding the transaction; None once ended.
    conn: Option<S::Conn>,
    /// A write in the transaction failed.
    failed: bool,
    /// Queues sent to inside the transaction, told of when it commits.
    sent_to: Vec<QueueName>,
}

impl<S: SqlStore> SqlBatchWork<S> {
    /// The batch transaction open on `conn`, which removed rows from `queue`.
    pub(crate) fn new(store: Arc<S>, queue: &QueueName, conn: S::Conn) -> Self {
        SqlBatchWork {
            store,
            queue: queue.clone(),
            conn: Some(conn),
            failed: false,
            sent_to: Vec::new(),
        }
    }

    fn conn(&mut self) -> Result<&mut S::Conn, TransportError> {
        self.conn
            .as_mut()
            .ok_or_else(|| TransportError::database("the batch's transaction has ended"))
    }

    async fn end(mut self: Box<Self>, commit: bool) -> Result<(), TransportError> {
        let Some(conn) = self.conn.take() else {
            return Err(TransportError::database(
                "the batch's transaction has ended",
            ));
        };
        self.store.end(conn, &self.queue, commit, self.failed).await
    }
}

impl<S: SqlStore> Drop for SqlBatchWork<S> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.store.abandon(conn);
        }
    }
}

#[async_trait]
impl<S: SqlStore> BatchWork for SqlBatchWork<S> {
    async fn insert_many(
        &mut self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        let store = self.store.clone();
        let result = store.insert_many(self.conn()?, queue, messages).await;
        self.failed |= result.is_err();
        if result.is_ok() && !self.sent_to.contains(queue) {
            self.sent_to.push(queue.clone());
        }
        result
    }

    async fn insert_raw(
        &mut self,
        queue: &QueueName,
        id: Uuid,
        row: Option<(&str, &[u8])>,
    ) -> Result<(), TransportError> {
        let Some((headers, body)) = row else {
            return Err(TransportError::database(format!(
                "cannot dead-letter {id}: its row was not kept"
            )));
        };
        let store = self.store.clone();
        let result = store
            .insert_raw(Some(self.conn()?), queue, (id, headers, body))
            .await;
        self.failed |= result.is_err();
        result
    }

    async fn commit(self: Box<Self>) -> Result<(), TransportError> {
        let (store, sent_to) = (self.store.clone(), self.sent_to.clone());
        self.end(true).await?;
        for queue in &sent_to {
            store.arrived(queue);
        }
        Ok(())
    }

    async fn rollback(self: Box<Self>) -> Result<(), TransportError> {
        self.end(false).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A look-up that fails while the database does not answer is asked again until it
    /// does: the commit is settled by the answer, not left in doubt; one that never answers
    /// is in doubt after the patience.
    #[tokio::test(start_paused = true)]
    async fn a_commit_in_doubt_is_asked_after_until_the_database_answers() {
        let asked = std::cell::Cell::new(0);
        let frozen_for = |answers_after: u32| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                let answered = asked.get() > answers_after;
                async move {
                    if answered {
                        Ok(true)
                    } else {
                        Err(TransportError::connection("the database does not answer"))
                    }
                }
            }
        };
        let started = tokio::time::Instant::now();
        let told = std::cell::Cell::new(0);
        let tell = |_: &TransportError| told.set(told.get() + 1);
        assert!(until_answered(frozen_for(12), tell).await.unwrap());
        assert_eq!(told.get(), 1, "the first failure is told, once");
        assert_eq!(asked.get(), 13);
        assert!(started.elapsed() < COMMIT_CHECK_PATIENCE);
        asked.set(0);
        let started = tokio::time::Instant::now();
        assert!(until_answered(frozen_for(u32::MAX), |_| {}).await.is_err());
        assert!(started.elapsed() <= COMMIT_CHECK_PATIENCE);
        assert!(started.elapsed() >= COMMIT_CHECK_PATIENCE - std::time::Duration::from_secs(5));
    }
}
