//! SQL Server's instance registry (see `transport::fleet`): a table in the queue schema,
//! one update-or-insert per heartbeat, stamped by `SYSUTCDATETIME()` of the server.

use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::statements::{bracket, created_under_lock};
use super::{SqlServerTransport, map_error};
use crate::transport::fleet::{
    BeatRow, FLEET_ORDER_ROWS, FleetShares, Heartbeat, INSTANCES_TABLE, InstanceRecord,
    InstanceRegistry, SHARES_TABLE, ShareClaim, ShareRow,
};
use crate::transport::{QueueName, TransportError};

/// Every statement of the registry in one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryStatements {
    /// The table, bracket-quoted: `[schema].[throttlehost_instances]`.
    pub table: String,
    /// Creates the schema and the table when missing, under the schema's creation lock.
    pub create: String,
    /// `@P1` process id, `@P2` host name, `@P3` instance id, `@P4` version, `@P5` admin
    /// address (empty: none, stored as NULL), `@P6` summary; then selects every row (process
    /// id, summary, seconds since seen) (one batch, one round trip).
    pub heartbeat: String,
    /// Every instance's row, with seconds up and seconds since seen by the server's clock.
    pub list: String,
    /// `@P1`: whole seconds; removes the rows not seen for longer and answers how many (the
    /// session runs with NOCOUNT on, so the count is selected).
    pub forget: String,
    /// `@P1`: process id.
    pub leave: String,
}

/// Seconds from a `datetime2` column to now: to the millisecond within a day, in whole
/// seconds beyond (`DATEDIFF` counts in an `int`, which milliseconds overflow after 24 days).
fn seconds_since(column: &str) -> String {
    format!(
        "CASE WHEN {column} < DATEADD(day, -1, SYSUTCDATETIME()) \
         THEN CAST(DATEDIFF(second, {column}, SYSUTCDATETIME()) AS float) \
         ELSE CAST(DATEDIFF(millisecond, {column}, SYSUTCDATETIME()) AS float) / 1000.0 END"
    )
}

/// The fleet's order rows as an SQL list: `N'0000...0001', N'0000...0002'`.
fn order_rows() -> String {
    FLEET_ORDER_ROWS
        .iter()
        .map(|id| format!("N'{id}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The registry's statements in `schema` (unquoted).
pub fn registry_statements(schema: &str) -> RegistryStatements {
    let table = format!("{}.{}", bracket(schema), bracket(INSTANCES_TABLE));
    let orders = order_rows();
    RegistryStatements {
        create: created_under_lock(
            schema,
            &format!("OBJECT_ID(N'{table}', N'U') IS NULL"),
            &format!(
                "    CREATE TABLE {table} (
        process_id uniqueidentifier NOT NULL PRIMARY KEY,
        host_name nvarchar(400) NOT NULL,
        instance_id nvarchar(400) NOT NULL,
        version nvarchar(100) NOT NULL,
        admin_address nvarchar(400) NULL,
        summary nvarchar(max) NOT NULL,
        started_at datetime2 NOT NULL DEFAULT SYSUTCDATETIME(),
        last_seen datetime2 NOT NULL DEFAULT SYSUTCDATETIME()
    );
END"
            ),
        ),
        heartbeat: format!(
            "UPDATE {table} SET host_name = @P2, instance_id = @P3, version = @P4,
    admin_address = NULLIF(@P5, N''), summary = @P6, last_seen = SYSUTCDATETIME()
WHERE process_id = @P1;
IF @@ROWCOUNT = 0
    INSERT INTO {table} (process_id, host_name, instance_id, version, admin_address, summary)
    VALUES (@P1, @P2, @P3, @P4, NULLIF(@P5, N''), @P6);
SELECT process_id, summary, {} FROM {table};",
            seconds_since("last_seen"),
        ),
        list: format!(
            "SELECT process_id, host_name, instance_id, version, admin_address, summary,
    {}, {}
FROM {table} WHERE process_id NOT IN ({orders})
ORDER BY last_seen DESC, host_name, instance_id;",
            seconds_since("started_at"),
            seconds_since("last_seen"),
        ),
        forget: format!(
            "DELETE FROM {table} WHERE last_seen < DATEADD(second, -@P1, SYSUTCDATETIME())
    AND process_id NOT IN ({orders});
SELECT CAST(@@ROWCOUNT AS bigint);"
        ),
        leave: format!("DELETE FROM {table} WHERE process_id = @P1;"),
        table,
    }
}

/// Every statement of the fleet-wide limits' shares in one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareStatements {
    /// The table, bracket-quoted: `[schema].[throttlehost_shares]`.
    pub table: String,
    /// Creates the schema and the table when missing, under the schema's creation lock.
    pub create: String,
    /// Opens the round's transaction and takes the queue's lock (`@P1`, waiting up to 10 s),
    /// then selects whether it was granted and, when it was, every instance's row of queue
    /// `@P2` with whether it is alive (its registry row seen within `@P3` milliseconds).
    pub read: String,
    /// `@P1` queue, `@P2` process id, `@P3` wanted, `@P4` granted; also stamps the process's
    /// registry row as seen (a host that takes its share is alive), removes the rows of
    /// instances the registry no longer lists, and commits.
    pub write: String,
    /// `@P1`: process id; removes its rows.
    pub drop: String,
}

/// The shares' statements in `schema` (unquoted).
pub fn share_statements(schema: &str) -> ShareStatements {
    let table = format!("{}.{}", bracket(schema), bracket(SHARES_TABLE));
    let instances = format!("{}.{}", bracket(schema), bracket(INSTANCES_TABLE));
    ShareStatements {
        create: created_under_lock(
            schema,
            &format!("OBJECT_ID(N'{table}', N'U') IS NULL"),
            &format!(
                "    CREATE TABLE {table} (
        queue nvarchar(400) NOT NULL,
        process_id uniqueidentifier NOT NULL,
        wanted int NOT NULL,
        granted int NOT NULL,
        updated_at datetime2 NOT NULL DEFAULT SYSUTCDATETIME(),
        PRIMARY KEY (queue, process_id)
    );
END"
            ),
        ),
        read: format!(
            "SET XACT_ABORT ON;
BEGIN TRAN;
DECLARE @got int;
EXEC @got = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 10000;
SELECT @got;
SELECT s.process_id, s.wanted, s.granted,
    CASE WHEN i.last_seen >= DATEADD(millisecond, -@P3, SYSUTCDATETIME()) THEN 1 ELSE 0 END
FROM {table} s LEFT JOIN {instances} i ON i.process_id = s.process_id
WHERE s.queue = @P2 AND @got >= 0;"
        ),
        write: format!(
            "UPDATE {instances} SET last_seen = SYSUTCDATETIME() WHERE process_id = @P2;
UPDATE {table} SET wanted = @P3, granted = @P4, updated_at = SYSUTCDATETIME()
WHERE queue = @P1 AND process_id = @P2;
IF @@ROWCOUNT = 0
    INSERT INTO {table} (queue, process_id, wanted, granted) VALUES (@P1, @P2, @P3, @P4);
DELETE FROM {table} WHERE queue = @P1 AND process_id <> @P2
    AND process_id NOT IN (SELECT process_id FROM {instances});
COMMIT TRAN;"
        ),
        drop: format!("DELETE FROM {table} WHERE process_id = @P1;"),
        table,
    }
}

#[async_trait]
impl FleetShares for SqlServerTransport {
    async fn create_shares(&self) -> Result<(), TransportError> {
        let st = share_statements(&self.inner.schema);
        self.create_fleet_table(&st.create, &st.table).await
    }

    async fn share_round(
        &self,
        queue: &QueueName,
        me: Uuid,
        gone_after: Duration,
        decide: &mut (dyn for<'r> FnMut(&'r [ShareRow]) -> ShareClaim + Send),
    ) -> Result<ShareClaim, TransportError> {
        let st = share_statements(&self.inner.schema);
        let mut conn = self.inner.conn().await?;
        let key = format!("throttlehost_share_{}", queue.as_str());
        let gone_ms = i32::try_from(gone_after.as_millis()).unwrap_or(i32::MAX);
        let read = async {
            conn.query(
                st.read.as_str(),
                &[&key.as_str(), &queue.as_str(), &gone_ms],
            )
            .await?
            .into_results()
            .await
        }
        .await;
        // Any failure from here on leaves a transaction open: the connection is dropped, and
        // the server rolls it back.
        let results = settle(&mut conn.broken, read, &st.table)?;
        if !lock_granted(&results) {
            conn.broken = true;
            return Err(TransportError::Unanswered {
                what: "the lock of a fleet-wide limit",
                after: Duration::from_secs(10),
            });
        }
        let claim = decide(&share_rows(&results));
        let (wanted, granted) = claim.columns();
        let written = conn
            .execute(
                st.write.as_str(),
                &[&queue.as_str(), &me, &wanted, &granted],
            )
            .await;
        settle(&mut conn.broken, written, &st.table).map(|_| claim)
    }

    async fn drop_shares(&self, me: Uuid) -> Result<(), TransportError> {
        let st = share_statements(&self.inner.schema);
        let mut conn = self.inner.conn().await?;
        let result = conn.execute(st.drop.as_str(), &[&me]).await;
        settle(&mut conn.broken, result, &st.table).map(|_| ())
    }
}

impl SqlServerTransport {
    fn registry(&self) -> RegistryStatements {
        registry_statements(&self.inner.schema)
    }

    /// Runs a fleet table's creation batch (`create`, under the schema's creation lock); a
    /// table another host created at the same moment is no error.
    async fn create_fleet_table(&self, create: &str, table: &str) -> Result<(), TransportError> {
        let mut conn = self.inner.conn().await?;
        match conn.run_batch(create).await {
            Ok(()) => Ok(()),
            Err(e) => {
                conn.broken = true;
                match e {
                    tiberius::error::Error::Server(t) if matches!(t.code(), 2714 | 1913) => Ok(()),
                    e => Err(registry_error(e, table)),
                }
            }
        }
    }
}

/// A registry error in words: a missing table is named as the registry's (or, for the shares
/// table, as the fleet-wide limits').
fn registry_error(e: tiberius::error::Error, table: &str) -> TransportError {
    let what = match table.contains(SHARES_TABLE) {
        true => "the fleet-wide limits' shares",
        false => "the instance registry",
    };
    match &e {
        tiberius::error::Error::Server(t) if t.code() == 208 => {
            TransportError::QueueNotFound(format!("{table} ({what})"))
        }
        _ => map_error(e, None),
    }
}

/// `result` as the registry answers it: a statement that failed leaves its connection marked
/// broken (the pool drops it) and is named as the registry's.
fn settle<T>(
    broken: &mut bool,
    result: Result<T, tiberius::error::Error>,
    table: &str,
) -> Result<T, TransportError> {
    result.map_err(|e| {
        *broken = true;
        registry_error(e, table)
    })
}

#[async_trait]
impl InstanceRegistry for SqlServerTransport {
    async fn create_registry(&self) -> Result<(), TransportError> {
        let st = self.registry();
        self.create_fleet_table(&st.create, &st.table).await
    }

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<BeatRow>, TransportError> {
        let st = self.registry();
        let mut conn = self.inner.conn().await?;
        // Not a NULL parameter: Babelfish refuses one sent without a type (TDS type 0x1F).
        let admin = beat.admin_address.as_deref().unwrap_or("");
        let result = async {
            conn.query(
                st.heartbeat.as_str(),
                &[
                    &beat.process_id,
                    &beat.host_name.as_str(),
                    &beat.instance_id.as_str(),
                    &beat.version.as_str(),
                    &admin,
                    &beat.summary.as_str(),
                ],
            )
            .await?
            .into_first_result()
            .await
        }
        .await;
        let rows = settle(&mut conn.broken, result, &st.table)?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                Some(BeatRow {
                    process_id: row.get::<Uuid, _>(0)?,
                    summary: row.get::<&str, _>(1).unwrap_or_default().to_owned(),
                    seen_seconds_ago: row.get::<f64, _>(2).unwrap_or(0.0).max(0.0),
                    // Other sessions are visible only with VIEW SERVER STATE: not told.
                    connected: None,
                })
            })
            .collect())
    }

    async fn instances(&self) -> Result<Vec<InstanceRecord>, TransportError> {
        let st = self.registry();
        let mut conn = self.inner.conn().await?;
        let result = conn.first_result(&st.list).await;
        let rows = settle(&mut conn.broken, result, &st.table)?;
        let text = |row: &tiberius::Row, i: usize| -> String {
            row.get::<&str, _>(i).unwrap_or_default().to_owned()
        };
        Ok(rows
            .iter()
            .filter_map(|row| {
                Some(InstanceRecord {
                    heartbeat: Heartbeat {
                        process_id: row.get::<Uuid, _>(0)?,
                        host_name: text(row, 1),
                        instance_id: text(row, 2),
                        version: text(row, 3),
                        admin_address: row.get::<&str, _>(4).map(str::to_owned),
                        summary: text(row, 5),
                    },
                    up_seconds: row.get::<f64, _>(6).unwrap_or(0.0).max(0.0),
                    seen_seconds_ago: row.get::<f64, _>(7).unwrap_or(0.0).max(0.0),
                })
            })
            .collect())
    }

    async fn forget(&self, older_than: Duration) -> Result<u64, TransportError> {
        let st = self.registry();
        let mut conn = self.inner.conn().await?;
        let seconds = i64::try_from(older_than.as_secs()).unwrap_or(i64::MAX);
        let answer = async {
            conn.query(st.forget.as_str(), &[&seconds])
                .await?
                .into_row()
                .await
        }
        .await;
        let row = settle(&mut conn.broken, answer, &st.table)?;
        Ok(row
            .and_then(|r| r.get::<i64, _>(0))
            .map_or(0, |n| n.max(0) as u64))
    }

    async fn leave(&self, process_id: Uuid) -> Result<(), TransportError> {
        let st = self.registry();
        let mut conn = self.inner.conn().await?;
        let result = conn.execute(st.leave.as_str(), &[&process_id]).await;
        settle(&mut conn.broken, result, &st.table).map(|_| ())
    }
}

/// Whether the share read's first result says the application lock was granted.
fn lock_granted(results: &[Vec<tiberius::Row>]) -> bool {
    results
        .first()
        .and_then(|rows| rows.first())
        .and_then(|row| row.get::<i32, _>(0))
        .is_some_and(|got| got >= 0)
}

/// The shares the read's second result holds; rows of unexpected shape are passed over.
fn share_rows(results: &[Vec<tiberius::Row>]) -> Vec<ShareRow> {
    results
        .get(1)
        .map(|rows| {
            rows.iter()
                .filter_map(|r| {
                    Some(ShareRow {
                        process_id: r.get::<Uuid, _>(0)?,
                        wanted: r.get::<i32, _>(1)?.max(0) as u32,
                        granted: r.get::<i32, _>(2)?.max(0) as u32,
                        alive: r.get::<i32, _>(3)? == 1,
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}
