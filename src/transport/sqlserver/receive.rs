//! Receiving: the READPAST receive, Babelfish's claims, batch receives and reading the rows they
//! return.

use std::sync::Arc;

use async_trait::async_trait;
use chrono::NaiveDateTime;
use uuid::Uuid;

use crate::config::{Dialect, TransactionMode};
use crate::transport::batch;
use crate::transport::row::RawRow;
use crate::transport::unit_of_work::{SqlReceived, split_batch};
use crate::transport::{CommitAndReceive, QueueName, Received, TransportError};

use super::connection::{int_at, is_server_error, map_error};
use super::{Inner, MAX_BATCH, Pooled, SqlServerTransport, claim, statements};

impl Inner {
    /// Runs a receive batch and turns its result into a [`Received`].
    pub(super) async fn run_receive(
        self: &Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
        sql: &str,
        transactional: bool,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let rows = receive_rows(&mut conn, queue, sql).await?;
        let Some(row) = rows.first() else {
            // The batch already ended the empty transaction.
            return Ok(None);
        };
        let row = match decode_row(queue, row) {
            Ok(row) => row,
            Err(e) => {
                conn.broken = true;
                return Err(e);
            }
        };
        let conn = if transactional { Some(conn) } else { None };
        Ok(Some(SqlReceived::boxed(self.clone(), queue, conn, row)))
    }

    /// Babelfish's receive: claims a row no other transaction holds (see `claim.rs`).
    pub(super) async fn claim_receive(
        self: &Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
        transactional: bool,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue);
        for _ in 0..claim::CLAIM_ATTEMPTS {
            let Some(target) = self.candidates(&mut conn, queue, 1).await?.pop() else {
                return Ok(None);
            };
            let sql =
                statements::babelfish_claim(&st.table, &[target.row_version()], transactional);
            match conn.first_result(&sql).await {
                Ok(rows) => match rows.first() {
                    Some(row) => {
                        let (row, _) =
                            decode_claimed(queue, row).inspect_err(|_| conn.broken = true)?;
                        if !transactional {
                            return Ok(Some(SqlReceived::boxed(self.clone(), queue, None, row)));
                        }
                        conn.claim.push(target);
                        return Ok(Some(SqlReceived::boxed(
                            self.clone(),
                            queue,
                            Some(conn),
                            row,
                        )));
                    }
                    // Gone since the look-up (another host took it): the next candidate.
                    None if transactional => self.end_empty_claim(&mut conn, queue).await?,
                    None => {}
                },
                Err(e) => {
                    self.gave_up_on_held_row(&mut conn, queue, e).await?;
                    target.held_elsewhere();
                }
            }
        }
        Ok(None)
    }

    /// Up to `n` rows for this host's receive to claim, each held by it alone until the
    /// guard drops: the last look-up's candidates, or a new look-up's when those run short.
    pub(super) async fn candidates(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        n: usize,
    ) -> Result<Vec<claim::Held>, TransportError> {
        // Every look-up comes before a claim, and the first ones run while the queue is
        // still empty (each receiver's first receive): the queue's claim of no row joins the
        // warm-up there, and this connection runs it now, not inside a message's receive.
        let table = &self.statements(queue).table;
        self.warm_up
            .add(table, || statements::babelfish_warm_up(table));
        conn.warm().await;
        let mut taken = self.held.take(queue, n);
        if taken.len() == n {
            return Ok(taken);
        }
        let looking = self.held.look_up(queue).await;
        if !looking.found_meanwhile() {
            let sql = statements::babelfish_candidates(
                &self.statements(queue).claim_from,
                (&looking.excluded, looking.skip),
                n.saturating_mul(2).max(claim::CANDIDATES),
            );
            let rows = conn.first_result(&sql).await.map_err(|e| {
                conn.broken |= !is_server_error(&e);
                map_error(e, Some(queue))
            })?;
            let found: Vec<i64> = rows.iter().filter_map(|row| int_at(row, 0)).collect();
            looking.found(&found);
        }
        taken.extend(self.held.take(queue, n - taken.len()));
        Ok(taken)
    }

    /// After a statement that failed under the claims' 1 ms lock timeout: Ok when it gave
    /// up on a row another transaction holds (counted, its transaction rolled back, the
    /// connection fit for the next attempt); any other error closes the connection and is
    /// returned.
    pub(super) async fn gave_up_on_held_row(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
        error: tiberius::error::Error,
    ) -> Result<(), TransportError> {
        let held = matches!(&error, tiberius::error::Error::Server(t)
            if claim::classify(t.code(), t.message()) == claim::ClaimFailure::Held);
        if !held {
            conn.broken = true;
            return Err(map_error(error, Some(queue)));
        }
        self.conflict(queue, false);
        self.end_empty_claim(conn, queue).await
    }

    /// Ends the transaction of a claim that took nothing ([`statements::CLAIM_GIVE_UP`]),
    /// leaving the connection fit for the next statement.
    pub(super) async fn end_empty_claim(
        &self,
        conn: &mut Pooled,
        queue: &QueueName,
    ) -> Result<(), TransportError> {
        conn.run_batch(statements::CLAIM_GIVE_UP)
            .await
            .map_err(|e| {
                conn.broken = true;
                map_error(e, Some(queue))
            })
    }

    /// Babelfish's commit-and-receive: the commit, then a claim on the same connection.
    pub(super) async fn commit_and_claim(
        self: Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
    ) -> CommitAndReceive {
        let committed = conn.run_batch("COMMIT TRAN;").await;
        claim::release(&mut conn.claim, committed.is_err());
        if let Err(e) = committed {
            conn.broken = true;
            return CommitAndReceive {
                committed: Err(map_error(e, Some(queue))),
                next: None,
            };
        }
        CommitAndReceive {
            committed: Ok(()),
            next: Some(self.claim_receive(conn, queue, true).await),
        }
    }

    /// Receives up to `max` messages in one transaction (see [`Transport::receive_batch`]).
    pub(super) async fn receive_batch(
        self: &Arc<Self>,
        queue: &QueueName,
        max: u32,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue);
        if st.ordered {
            return Err(crate::transport::refuse_ordered_batch(queue));
        }
        let mut conn = self.conn().await?;
        if self.dialect == Dialect::Babelfish {
            return self.claim_batch(conn, queue, max).await;
        }
        let sql = statements::begin_and_receive_batch(&st.table, max, self.dialect);
        let rows = receive_rows(&mut conn, queue, &sql).await?;
        if rows.is_empty() {
            // The batch already ended the empty transaction.
            return Ok(Vec::new());
        }
        let decoded = rows.iter().map(|row| decode_row(queue, row)).collect();
        split_batch(self.clone(), queue, conn, decoded).await
    }

    /// Babelfish's batch receive: a claim of up to `max` candidates at once (see
    /// `claim.rs`). A row another host holds makes it give up within 1 ms and answer empty.
    pub(super) async fn claim_batch(
        self: &Arc<Self>,
        mut conn: Pooled,
        queue: &QueueName,
        max: u32,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let st = self.statements(queue);
        let targets = self.candidates(&mut conn, queue, max as usize).await?;
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let row_versions: Vec<i64> = targets.iter().map(claim::Held::row_version).collect();
        let sql = statements::babelfish_claim(&st.table, &row_versions, true);
        let rows = match conn.first_result(&sql).await {
            Ok(rows) => rows,
            Err(e) => {
                self.gave_up_on_held_row(&mut conn, queue, e).await?;
                return Ok(Vec::new());
            }
        };
        if rows.is_empty() {
            self.end_empty_claim(&mut conn, queue).await?;
            return Ok(Vec::new());
        }
        let claimed: Result<Vec<(RawRow, i64)>, TransportError> =
            rows.iter().map(|row| decode_claimed(queue, row)).collect();
        let decoded = claimed.map(|mut claimed| {
            // OUTPUT promises no order; a batch runs oldest first.
            claimed.sort_by_key(|(_, row_version)| *row_version);
            // Rows gone since the look-up are released; the claimed ones stay held.
            conn.claim.extend(
                targets
                    .into_iter()
                    .filter(|held| claimed.iter().any(|(_, v)| *v == held.row_version())),
            );
            claimed.into_iter().map(|(row, _)| row).collect()
        });
        split_batch(self.clone(), queue, conn, decoded).await
    }
}

/// Runs a receive batch and reads the rows it returned.
pub(super) async fn receive_rows(
    conn: &mut Pooled,
    queue: &QueueName,
    sql: &str,
) -> Result<Vec<tiberius::Row>, TransportError> {
    let rows = conn.first_result(sql).await;
    rows.map_err(|e| {
        // Whatever the error, do not reuse a connection whose transaction state is in doubt.
        conn.broken = true;
        map_error(e, Some(queue))
    })
}

/// Reads a received row: id, expired flag, headers, body, expiry.
pub(super) fn decode_row(queue: &QueueName, row: &tiberius::Row) -> Result<RawRow, TransportError> {
    let decoded: Result<_, tiberius::error::Error> = (|| {
        let id: Option<Uuid> = row.try_get(0)?;
        let expired: Option<i32> = row.try_get(1)?;
        let headers: Option<&str> = row.try_get(2)?;
        let body: Option<&[u8]> = row.try_get(3)?;
        let expires: Option<NaiveDateTime> = row.try_get(4)?;
        Ok((id, expired, headers, body, expires))
    })();
    match decoded {
        Ok((Some(id), expired, headers, body, expires)) => Ok(RawRow {
            id,
            expired: expired.unwrap_or(0) != 0,
            headers: headers.unwrap_or("").to_string(),
            body: body.unwrap_or(&[]).to_vec(),
            expires,
            transaction: None,
        }),
        Ok((None, ..)) | Err(_) => Err(TransportError::database(format!(
            "queue `{queue}` returned a row of unexpected shape; is it an NServiceBus queue table?"
        ))),
    }
}

/// A row as a Babelfish claim sends it back (`statements::CLAIM_OUTPUT`: Id, the server's
/// UTC time, Headers, Body, Expires, RowVersion), with its RowVersion. Expired as the SQL
/// Server receive decides it: Expires set and not after the server's time.
pub(super) fn decode_claimed(
    queue: &QueueName,
    row: &tiberius::Row,
) -> Result<(RawRow, i64), TransportError> {
    let decoded: Result<_, tiberius::error::Error> = (|| {
        let id: Option<Uuid> = row.try_get(0)?;
        let now: Option<NaiveDateTime> = row.try_get(1)?;
        let headers: Option<&str> = row.try_get(2)?;
        let body: Option<&[u8]> = row.try_get(3)?;
        let expires: Option<NaiveDateTime> = row.try_get(4)?;
        Ok((id, now, headers, body, expires))
    })();
    match (decoded, int_at(row, 5)) {
        (Ok((Some(id), Some(now), headers, body, expires)), Some(row_version)) => Ok((
            RawRow {
                id,
                expired: expires.is_some_and(|expires| expires <= now),
                headers: headers.unwrap_or("").to_string(),
                body: body.unwrap_or(&[]).to_vec(),
                expires,
                transaction: None,
            },
            row_version,
        )),
        _ => Err(TransportError::database(format!(
            "queue `{queue}` returned a row of unexpected shape; is it an NServiceBus queue table?"
        ))),
    }
}

#[async_trait]
impl crate::transport::BatchReceive for SqlServerTransport {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        // Mode `none` deletes before handlers run: a batch there is single receives.
        if max <= 1 || self.inner.mode == TransactionMode::None {
            return batch::EachOnItsOwn::receive(self, queue, max).await;
        }
        let max = u32::try_from(max).unwrap_or(u32::MAX).min(MAX_BATCH);
        self.inner.receive_batch(queue, max).await
    }
}
