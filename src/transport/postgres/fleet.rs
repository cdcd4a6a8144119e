//! PostgreSQL's instance registry (see `transport::fleet`): a table in the queue schema, one
//! upsert per heartbeat, stamped by `now()` of the server.

use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::admin::create_under_lock;
use super::{PostgresTransport, map_error, quote_ident};
use crate::transport::fleet::{
    BeatRow, FLEET_ORDER_ROWS, FleetShares, Heartbeat, INSTANCES_TABLE, InstanceRecord,
    InstanceRegistry, SHARES_TABLE, ShareClaim, ShareRow,
};
use crate::transport::{QueueName, TransportError};

/// Every statement of the registry in one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryStatements {
    /// The table, quoted: `"schema"."throttlehost_instances"`.
    pub table: String,
    /// Creates the schema and the table when missing.
    pub create: String,
    /// `$1` process id, `$2` host name, `$3` instance id, `$4` version, `$5` admin address
    /// (NULL: none), `$6` summary; answers every row (process id, summary, seconds since
    /// seen, whether the session that wrote it is still open) as it was before this
    /// statement.
    pub heartbeat: String,
    /// Every instance's row, with seconds up and seconds since seen by the server's clock.
    pub list: String,
    /// `$1`: seconds; removes the rows not seen for longer.
    pub forget: String,
    /// `$1`: process id.
    pub leave: String,
}

/// The fleet's order rows as an SQL list: `'0000...0001', '0000...0002'`.
pub(crate) fn order_rows() -> String {
    FLEET_ORDER_ROWS
        .iter()
        .map(|id| format!("'{id}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Creates the registry's schema and table when missing, and adds the `backend` column to a
/// table an earlier version made.
fn registry_create(schema: &str, table: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {table} (
    process_id uuid PRIMARY KEY,
    host_name text NOT NULL,
    instance_id text NOT NULL,
    version text NOT NULL,
    admin_address text NULL,
    summary text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now(),
    backend integer NULL
);
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
    WHERE attrelid = to_regclass('{table_text}') AND attname = 'backend'
        AND NOT attisdropped) THEN
    ALTER TABLE {table} ADD COLUMN backend integer NULL;
    END IF;
END $$;",
        schema = quote_ident(schema),
        // An earlier version's table has no `backend`; adding it only when missing keeps a
        // table owned by another role usable (ALTER needs ownership even with IF NOT EXISTS).
        table_text = table.replace('\'', "''"),
    )
}

/// The registry's statements in `schema` (unquoted).
pub fn registry_statements(schema: &str) -> RegistryStatements {
    let table = format!("{}.{}", quote_ident(schema), quote_ident(INSTANCES_TABLE));
    let orders = order_rows();
    // Rows anyone can write: a time PostgreSQL cannot subtract ('infinity') failed the whole
    // read-back, every host's heartbeat with it; a time far ahead kept a row alive for ever.
    // Such rows are not read, and the next forget deletes them.
    // `backend` is the server process of the session that wrote the last heartbeat: a host
    // killed outright closes its sessions, so its row is seen disconnected at the next
    // heartbeat of any other (`fleet::lead` hands its leads over then, not after gone_after).
    // A row of an earlier version has none (NULL: cannot tell).
    let readable = "isfinite(last_seen) AND isfinite(started_at) \
AND last_seen <= now() + interval '1 day'";
    RegistryStatements {
        create: registry_create(schema, &table),
        heartbeat: format!(
            "WITH beat AS (
    INSERT INTO {table}
        (process_id, host_name, instance_id, version, admin_address, summary, backend)
    VALUES ($1, $2, $3, $4, $5, $6, pg_backend_pid())
    ON CONFLICT (process_id) DO UPDATE SET
        host_name = EXCLUDED.host_name, instance_id = EXCLUDED.instance_id,
        version = EXCLUDED.version, admin_address = EXCLUDED.admin_address,
        summary = EXCLUDED.summary, backend = EXCLUDED.backend, last_seen = now()
)
SELECT process_id, summary, EXTRACT(EPOCH FROM now() - last_seen)::float8,
    CASE WHEN backend IS NULL THEN NULL
        ELSE EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = backend) END
FROM {table} WHERE {readable}"
        ),
        list: format!(
            "SELECT process_id, host_name, instance_id, version, admin_address, summary,
    EXTRACT(EPOCH FROM now() - started_at)::float8,
    EXTRACT(EPOCH FROM now() - last_seen)::float8
FROM {table} WHERE process_id NOT IN ({orders}) AND {readable}
ORDER BY last_seen DESC, host_name, instance_id"
        ),
        forget: format!(
            "DELETE FROM {table}
WHERE (last_seen < now() - make_interval(secs => $1) OR NOT ({readable}))
    AND process_id NOT IN ({orders})"
        ),
        leave: format!("DELETE FROM {table} WHERE process_id = $1"),
        table,
    }
}

/// Every statement of the fleet-wide limits' shares in one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareStatements {
    /// The table, quoted: `"schema"."throttlehost_shares"`.
    pub table: String,
    /// Creates the schema and the table when missing.
    pub create: String,
    /// `$1`: the lock's key (the table and the queue); held to the end of the transaction.
    pub lock: String,
    /// `$1` queue, `$2` gone after (seconds): every instance's row of the queue with whether
    /// it is alive (seen within gone after, or within [`HELD_WHILE_CONNECTED`] times that
    /// while its heartbeat's session is open) and whether the registry still lists it.
    ///
    /// [`HELD_WHILE_CONNECTED`]: crate::transport::fleet::HELD_WHILE_CONNECTED
    pub read: String,
    /// `$1` queue, `$2` process id, `$3` wanted, `$4` granted; also stamps the process's
    /// registry row as seen (a host that takes its share is alive).
    pub write: String,
    /// `$1` queue, `$2` this process: removes the rows of instances the registry no longer
    /// lists (left, or forgotten).
    pub forget_unlisted: String,
    /// `$1`: process id; removes its rows.
    pub drop: String,
}

/// The shares' statements in `schema` (unquoted).
pub fn share_statements(schema: &str) -> ShareStatements {
    let table = format!("{}.{}", quote_ident(schema), quote_ident(SHARES_TABLE));
    let instances = registry_statements(schema).table;
    ShareStatements {
        create: format!(
            "CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {table} (
    queue text NOT NULL,
    process_id uuid NOT NULL,
    wanted integer NOT NULL,
    granted integer NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, process_id)
);",
            schema = quote_ident(schema)
        ),
        lock: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))".to_string(),
        read: format!(
            "SELECT s.process_id, s.wanted, s.granted,
    COALESCE(i.last_seen >= now() - make_interval(secs => $2)
        OR (i.last_seen >= now() - make_interval(secs => $2 * {held})
            AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = i.backend)), false),
    i.process_id IS NOT NULL
FROM {table} s LEFT JOIN {instances} i ON i.process_id = s.process_id
WHERE s.queue = $1",
            held = crate::transport::fleet::HELD_WHILE_CONNECTED
        ),
        write: format!(
            "WITH seen AS (UPDATE {instances} SET last_seen = now() WHERE process_id = $2)
INSERT INTO {table} (queue, process_id, wanted, granted) VALUES ($1, $2, $3, $4)
ON CONFLICT (queue, process_id) DO UPDATE SET
    wanted = EXCLUDED.wanted, granted = EXCLUDED.granted, updated_at = now()"
        ),
        forget_unlisted: format!(
            "DELETE FROM {table} s WHERE s.queue = $1 AND s.process_id <> $2
    AND NOT EXISTS (SELECT 1 FROM {instances} i WHERE i.process_id = s.process_id)"
        ),
        drop: format!("DELETE FROM {table} WHERE process_id = $1"),
        table,
    }
}

impl PostgresTransport {
    fn registry(&self) -> RegistryStatements {
        registry_statements(&self.inner.schema)
    }
}

/// A shares error in words: a missing table is named as the shares table.
fn shares_error(e: tokio_postgres::Error, table: &str) -> TransportError {
    match map_error(e, None) {
        TransportError::QueueNotFound(_) => {
            TransportError::QueueNotFound(format!("{table} (the fleet-wide limits' shares)"))
        }
        other => other,
    }
}

#[async_trait]
impl FleetShares for PostgresTransport {
    async fn create_shares(&self) -> Result<(), TransportError> {
        let st = share_statements(&self.inner.schema);
        let mut client = self.inner.client().await?;
        create_under_lock(&mut client, &st.table, &[&st.create])
            .await
            .map_err(|e| shares_error(e, &st.table))
    }

    async fn share_round(
        &self,
        queue: &QueueName,
        me: Uuid,
        gone_after: Duration,
        decide: &mut (dyn for<'r> FnMut(&'r [ShareRow]) -> ShareClaim + Send),
    ) -> Result<ShareClaim, TransportError> {
        let st = share_statements(&self.inner.schema);
        let client = self.inner.client().await?;
        let key = format!("{}/{}", st.table, queue.as_str());
        let gone = gone_after.as_secs_f64();
        let (_, done) = self
            .inner
            .answered_mut("a round of a fleet-wide limit", client, async |c| {
                let tx = c.transaction().await?;
                tx.execute(&st.lock, &[&key]).await?;
                let read = tx.prepare_cached(&st.read).await?;
                let found = tx.query(&read, &[&queue.as_str(), &gone]).await?;
                let rows: Vec<ShareRow> = found
                    .iter()
                    .map(|r| ShareRow {
                        process_id: r.get(0),
                        wanted: r.get::<_, i32>(1).max(0) as u32,
                        granted: r.get::<_, i32>(2).max(0) as u32,
                        alive: r.get(3),
                    })
                    .collect();
                let claim = decide(&rows);
                let (wanted, granted) = claim.columns();
                let write = tx.prepare_cached(&st.write).await?;
                tx.execute(&write, &[&queue.as_str(), &me, &wanted, &granted])
                    .await?;
                if found.iter().any(|r| !r.get::<_, bool>(4)) {
                    tx.execute(&st.forget_unlisted, &[&queue.as_str(), &me])
                        .await?;
                }
                tx.commit().await.map(|()| claim)
            })
            .await?;
        done.map_err(|e| shares_error(e, &st.table))
    }

    async fn drop_shares(&self, me: Uuid) -> Result<(), TransportError> {
        let st = share_statements(&self.inner.schema);
        let client = self.inner.client().await?;
        let (_, done) = self
            .inner
            .answered("a give-back of fleet-wide limits", client, async |c| {
                c.execute(&st.drop, &[&me]).await
            })
            .await?;
        done.map(|_| ()).map_err(|e| shares_error(e, &st.table))
    }
}

/// A registry error in words: a missing table is named as the registry's.
fn registry_error(e: tokio_postgres::Error, table: &str) -> TransportError {
    match map_error(e, None) {
        TransportError::QueueNotFound(_) => {
            TransportError::QueueNotFound(format!("{table} (the instance registry)"))
        }
        other => other,
    }
}

#[async_trait]
impl InstanceRegistry for PostgresTransport {
    async fn create_registry(&self) -> Result<(), TransportError> {
        let st = self.registry();
        let mut client = self.inner.client().await?;
        create_under_lock(&mut client, &st.table, &[&st.create])
            .await
            .map_err(|e| registry_error(e, &st.table))
    }

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<BeatRow>, TransportError> {
        let st = self.registry();
        let client = self.inner.client().await?;
        let (_, done) = self
            .inner
            .answered("a heartbeat", client, async |c| {
                let stmt = c.prepare_cached(&st.heartbeat).await?;
                c.query(
                    &stmt,
                    &[
                        &beat.process_id,
                        &beat.host_name,
                        &beat.instance_id,
                        &beat.version,
                        &beat.admin_address,
                        &beat.summary,
                    ],
                )
                .await
            })
            .await?;
        let rows = done.map_err(|e| registry_error(e, &st.table))?;
        Ok(rows
            .iter()
            .map(|row| BeatRow {
                process_id: row.get(0),
                summary: row.get(1),
                seen_seconds_ago: row.get::<_, f64>(2).max(0.0),
                connected: row.get(3),
            })
            .collect())
    }

    async fn instances(&self) -> Result<Vec<InstanceRecord>, TransportError> {
        let st = self.registry();
        let client = self.inner.client().await?;
        let (_, rows) = self
            .inner
            .answered("a read of the instance registry", client, async |c| {
                c.query(&st.list, &[]).await
            })
            .await?;
        let rows = rows.map_err(|e| registry_error(e, &st.table))?;
        Ok(rows
            .iter()
            .map(|row| InstanceRecord {
                heartbeat: Heartbeat {
                    process_id: row.get(0),
                    host_name: row.get(1),
                    instance_id: row.get(2),
                    version: row.get(3),
                    admin_address: row.get(4),
                    summary: row.get(5),
                },
                up_seconds: row.get::<_, f64>(6).max(0.0),
                seen_seconds_ago: row.get::<_, f64>(7).max(0.0),
            })
            .collect())
    }

    async fn forget(&self, older_than: Duration) -> Result<u64, TransportError> {
        let st = self.registry();
        let client = self.inner.client().await?;
        let seconds = older_than.as_secs_f64();
        let (_, done) = self
            .inner
            .answered("a clean-up of the instance registry", client, async |c| {
                c.execute(&st.forget, &[&seconds]).await
            })
            .await?;
        done.map_err(|e| registry_error(e, &st.table))
    }

    async fn leave(&self, process_id: Uuid) -> Result<(), TransportError> {
        let st = self.registry();
        let client = self.inner.client().await?;
        let (_, done) = self
            .inner
            .answered("a leave of the instance registry", client, async |c| {
                c.execute(&st.leave, &[&process_id]).await
            })
            .await?;
        done.map(|_| ()).map_err(|e| registry_error(e, &st.table))
    }
}
