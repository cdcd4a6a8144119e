//! Queue administration: creating tables and indexes under a lock, checking their layout, purging,
//! listing.

use std::collections::HashSet;

use async_trait::async_trait;
use deadpool_postgres::Object;
use tokio_postgres::error::SqlState;

use crate::transport::{QueueAdmin, QueueName, TransportError};

use super::connection::map_error;
use super::statements::quote_ident;
use super::{Inner, PURGE_BATCH, PostgresTransport, QueueStatements, discard};

impl Inner {
    /// Builds the expression indexes an ordered queue's receives probe, those missing only.
    ///
    /// `CREATE INDEX IF NOT EXISTS` takes a SHARE lock on the table before it looks for the
    /// name, so a host starting while others receive would wait for every open receive and
    /// make every new one wait behind it. Existing indexes are therefore looked up first, and
    /// a missing one is built `CONCURRENTLY` (writes go on), one host at a time under the
    /// table's advisory lock (session level: CONCURRENTLY runs outside a transaction).
    pub(super) async fn ensure_indexes(
        &self,
        queue: &QueueName,
        st: &QueueStatements,
    ) -> Result<(), TransportError> {
        if st.ordering_indexes.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let built: Result<(), tokio_postgres::Error> = async {
            for index in &st.ordering_indexes {
                let exists = "SELECT to_regclass($1) IS NOT NULL";
                if client.query_one(exists, &[&index.name]).await?.get(0) {
                    continue;
                }
                client
                    .execute("SELECT pg_advisory_lock(hashtext($1))", &[&st.table])
                    .await?;
                let created = client.batch_execute(&index.create).await;
                client
                    .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&st.table])
                    .await?;
                created?;
            }
            Ok(())
        }
        .await;
        built.map_err(|e| {
            // A session lock may still be held on it: the connection goes.
            discard(client);
            map_error(e, Some(queue))
        })
    }
}

impl Inner {
    /// Runs a statement that answers one bigint count (negative read as 0).
    pub(super) async fn count(
        &self,
        queue: &QueueName,
        what: &'static str,
        sql: &str,
    ) -> Result<u64, TransportError> {
        let client = self.client_for(queue).await?;
        let (_, row) = self
            .answered(what, client, async |c| {
                let stmt = c.prepare_cached(sql).await?;
                c.query_one(&stmt, &[]).await
            })
            .await?;
        let row = row.map_err(|e| map_error(e, Some(queue)))?;
        let n: i64 = row
            .try_get(0)
            .map_err(|e| TransportError::database(e.to_string()))?;
        Ok(n.max(0) as u64)
    }

    /// The depths of up to [`crate::transport::DEPTHS_PER_STATEMENT`] queues in one statement, in their order:
    /// each queue's peek as one element of an array. When the statement fails (a table is
    /// missing), each queue is read on its own, so the others still get their depth.
    pub(super) async fn peek_chunk(
        &self,
        queues: &[QueueName],
    ) -> Vec<Result<u64, TransportError>> {
        let values: Result<Vec<String>, TransportError> = queues
            .iter()
            .map(|q| self.statements(q).map(|st| st.peek_value.clone()))
            .collect();
        let read = async {
            let sql = format!("SELECT ARRAY[{}]::bigint[]", values?.join(", "));
            let client = self.client().await?;
            let (_, row) = self
                .answered("a peek of many queues", client, async |c| {
                    // Prepared once per connection: planning two hundred reads each time was
                    // most of what an idle host cost the server.
                    let stmt = c.prepare_cached(&sql).await?;
                    c.query_one(&stmt, &[]).await
                })
                .await?;
            let depths: Vec<i64> = row
                .and_then(|r| r.try_get(0))
                .map_err(|e| map_error(e, None))?;
            Ok::<_, TransportError>(depths)
        };
        match read.await {
            Ok(depths) if depths.len() == queues.len() => {
                depths.into_iter().map(|d| Ok(d.max(0) as u64)).collect()
            }
            _ => {
                let mut depths = Vec::with_capacity(queues.len());
                for queue in queues {
                    let peek = self.statements(queue).map(|st| st.peek.clone());
                    depths.push(match peek {
                        Ok(sql) => self.count(queue, "a peek", &sql).await,
                        Err(e) => Err(e),
                    });
                }
                depths
            }
        }
    }
}

/// The column types a queue table must have (`information_schema` names), by column.
pub(super) const LAYOUT: [(&str, &[&str]); 5] = [
    ("id", &["uuid"]),
    (
        "expires",
        &["timestamp without time zone", "timestamp with time zone"],
    ),
    ("headers", &["text", "character varying"]),
    ("body", &["bytea"]),
    ("seq", &["integer", "bigint"]),
];

/// Checks a queue table's columns against [`LAYOUT`]; names the first one that differs.
pub(super) async fn check_layout(
    client: &tokio_postgres::Client,
    schema: &str,
    queue: &QueueName,
) -> Result<(), TransportError> {
    let key = (schema.to_string(), queue.table().to_string());
    let columns = columns_of(client, std::slice::from_ref(&key))
        .await
        .map_err(|e| map_error(e, Some(queue)))?;
    layout_of(queue, columns.get(&key))
}

/// A table's columns as `information_schema` names them: (lower-case name, type).
type Columns = Vec<(String, String)>;

/// The columns of every table of `tables` ((schema, table) pairs), in one statement: a start
/// with a thousand queues asked a thousand times before.
async fn columns_of(
    client: &tokio_postgres::Client,
    tables: &[(String, String)],
) -> Result<std::collections::HashMap<(String, String), Columns>, tokio_postgres::Error> {
    let (schemas, names) = schemas_and_names(tables);
    let rows = client
        .query(
            // The catalogs, not information_schema.columns: joined with a thousand names,
            // that view took seconds. format_type names the types as it does.
            "SELECT n.nspname::text, c.relname::text, lower(a.attname::text), \
             format_type(a.atttypid, NULL) \
             FROM unnest($1::text[], $2::text[]) AS t(s, n) \
             JOIN pg_namespace n ON n.nspname = t.s \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.n \
             AND c.relkind IN ('r', 'p') \
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped",
            &[&schemas, &names],
        )
        .await?;
    let mut columns: std::collections::HashMap<(String, String), Columns> = Default::default();
    for row in rows {
        columns
            .entry((row.get(0), row.get(1)))
            .or_default()
            .push((row.get(2), row.get(3)));
    }
    Ok(columns)
}

/// (schema, table) pairs as the two arrays the catalog reads unnest.
fn schemas_and_names(tables: &[(String, String)]) -> (Vec<&str>, Vec<&str>) {
    tables
        .iter()
        .map(|(schema, table)| (schema.as_str(), table.as_str()))
        .unzip()
}

/// Checks the columns `found` of `queue`'s table against [`LAYOUT`] (None: no such table).
fn layout_of(queue: &QueueName, found: Option<&Columns>) -> Result<(), TransportError> {
    let Some(rows) = found.filter(|rows| !rows.is_empty()) else {
        return Err(TransportError::QueueNotFound(queue.to_string()));
    };
    for (column, accepted) in LAYOUT {
        match rows.iter().find(|(name, _)| name == column) {
            Some((_, t)) if accepted.contains(&t.as_str()) => {}
            Some((_, t)) => {
                return Err(TransportError::queue(
                    queue,
                    format!(
                        "has column {column} of type {t}; the queue layout needs {} (see sql/postgres/queue.sql)",
                        accepted.join(" or ")
                    ),
                ));
            }
            None => {
                return Err(TransportError::queue(
                    queue,
                    format!(
                        "has no column {column}: it is not a queue table (see sql/postgres/queue.sql)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The tables of `tables` with a unique index on Seq, in one statement.
async fn indexed_on_seq(
    client: &tokio_postgres::Client,
    tables: &[(String, String)],
) -> Result<std::collections::HashSet<(String, String)>, tokio_postgres::Error> {
    let (schemas, names) = schemas_and_names(tables);
    let rows = client
        .query(
            "SELECT DISTINCT n.nspname::text, c.relname::text \
             FROM unnest($1::text[], $2::text[]) AS t(s, n) \
             JOIN pg_namespace n ON n.nspname = t.s \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.n \
             JOIN pg_index i ON i.indrelid = c.oid AND i.indisunique AND i.indnatts = 1 \
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = i.indkey[0] \
             AND lower(a.attname::text) = 'seq'",
            &[&schemas, &names],
        )
        .await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// Runs `ddl` (statements that create what is missing, each `IF NOT EXISTS`) in one
/// transaction under an advisory lock keyed by `name`: two hosts creating the same object at
/// once can still collide inside `CREATE ... IF NOT EXISTS`, so they take turns, and the
/// "already exists" errors that remain are harmless (Ok).
pub(super) async fn create_under_lock(
    client: &mut Object,
    name: &str,
    ddl: &[&str],
) -> Result<(), tokio_postgres::Error> {
    let result = async {
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&name])
            .await?;
        for statement in ddl {
            tx.batch_execute(statement).await?;
        }
        tx.commit().await
    }
    .await;
    match result {
        Err(e) if !is_concurrent_creation(&e) => Err(e),
        _ => Ok(()),
    }
}

/// "Already exists" errors of two hosts creating the same table at once: harmless.
pub(super) fn is_concurrent_creation(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        [
            SqlState::DUPLICATE_TABLE,
            SqlState::DUPLICATE_OBJECT,
            SqlState::UNIQUE_VIOLATION,
            SqlState::DUPLICATE_SCHEMA,
        ]
        .contains(c)
    })
}

/// The relations of `wanted` (schema, name) that exist, of any kind (tables, indexes), in one
/// read of the catalogs; with `trigger`, only those that carry a trigger of that name.
pub(super) async fn existing_relations(
    client: &tokio_postgres::Client,
    wanted: &[(String, String)],
    trigger: Option<&str>,
) -> Result<HashSet<(String, String)>, tokio_postgres::Error> {
    let (schemas, names) = schemas_and_names(wanted);
    let rows = client
        .query(
            "SELECT n.nspname::text, c.relname::text \
             FROM unnest($1::text[], $2::text[]) AS t(s, n) \
             JOIN pg_namespace n ON n.nspname = t.s \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.n \
             WHERE $3::text IS NULL OR EXISTS \
             (SELECT 1 FROM pg_trigger g WHERE g.tgrelid = c.oid AND g.tgname = $3)",
            &[&schemas, &names, &trigger],
        )
        .await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

#[async_trait]
impl QueueAdmin for PostgresTransport {
    /// Tables of the right layout that, where arrivals are announced, carry the trigger: two
    /// reads of the catalogs for all of them. (A notify function an older version of this host
    /// wrote stays as it was: its body has not changed.)
    async fn queues_in_place(
        &self,
        queues: &[QueueName],
    ) -> Result<HashSet<QueueName>, TransportError> {
        let client = self.inner.client().await?;
        let tables: Vec<(String, String)> = queues
            .iter()
            .map(|q| (self.inner.schema_of(q).to_string(), q.table().to_string()))
            .collect();
        let columns = columns_of(&client, &tables)
            .await
            .map_err(|e| map_error(e, None))?;
        let notifying = match self.inner.notify_on_insert {
            true => Some(
                existing_relations(&client, &tables, Some("throttlehost_notify"))
                    .await
                    .map_err(|e| map_error(e, None))?,
            ),
            false => None,
        };
        Ok(queues
            .iter()
            .zip(&tables)
            .filter(|(queue, table)| {
                layout_of(queue, columns.get(*table)).is_ok()
                    && notifying.as_ref().is_none_or(|n| n.contains(*table))
            })
            .map(|(queue, _)| queue.clone())
            .collect())
    }

    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let mut client = self.inner.client().await?;
        let own_schema = self.inner.schema_of(queue);
        let schema = quote_ident(own_schema);
        // Two hosts creating the same table at once can still collide inside
        // CREATE ... IF NOT EXISTS; an advisory lock keyed by the table serialises them and the
        // remaining "already exists" codes are harmless.
        let result: Result<(), tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&st.table])
                .await?;
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
            tx.batch_execute(&st.create).await?;
            if self.inner.notify_on_insert {
                // The notify function is the schema's, shared by its tables: one creator at a
                // time.
                tx.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('throttlehost_notify:' || $1))",
                    &[&own_schema],
                )
                .await?;
                tx.batch_execute(&st.notify_on_insert()).await?;
            }
            tx.commit().await
        }
        .await;
        let created = match result {
            Err(e) if !is_concurrent_creation(&e) => Err(map_error(e, Some(queue))),
            _ => Ok(()),
        };
        created?;
        // CREATE TABLE IF NOT EXISTS leaves a table of another layout in place.
        check_layout(&client, own_schema, queue).await
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        let mut total = 0;
        loop {
            let n = client
                .execute(&st.purge_expired_batch, &[&PURGE_BATCH])
                .await
                .map_err(|e| map_error(e, Some(queue)))?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        client
            .execute(&st.purge, &[])
            .await
            .map_err(|e| map_error(e, Some(queue)))
    }

    async fn reset_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue)?;
        let client = self.inner.client().await?;
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", st.table))
            .await
            .map_err(|e| map_error(e, Some(queue)))?;
        drop(client);
        self.create_queue(queue).await
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        let client = self.inner.client().await?;
        let rows = client
            .query(
                "SELECT table_name::text FROM information_schema.columns \
                 WHERE table_schema = $1 AND lower(column_name) IN ('id', 'expires', 'headers', 'body', 'seq') \
                 GROUP BY table_name HAVING count(*) = 5 ORDER BY 1",
                &[&self.inner.schema],
            )
            .await
            .map_err(|e| map_error(e, None))?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    async fn startup_checks(&self, queues: &[QueueName]) -> Result<Vec<String>, TransportError> {
        let mut warnings = Vec::new();
        let client = match self.inner.client().await {
            Ok(c) => c,
            Err(e) => return Ok(vec![format!("cannot run start-up checks: {e}")]),
        };
        let tables: Vec<(String, String)> = queues
            .iter()
            .map(|q| (self.inner.schema_of(q).to_string(), q.table().to_string()))
            .collect();
        let columns = match columns_of(&client, &tables).await {
            Ok(columns) => columns,
            Err(e) => {
                warnings.push(format!(
                    "cannot check the layout of the queues: {}",
                    map_error(e, None)
                ));
                return Ok(warnings);
            }
        };
        let indexed = indexed_on_seq(&client, &tables).await;
        for (queue, table) in queues.iter().zip(&tables) {
            match layout_of(queue, columns.get(table)) {
                Err(e) if e.is_configuration() => return Err(e),
                Err(e) => warnings.push(format!("cannot check the layout of `{queue}`: {e}")),
                Ok(()) => {}
            }
            match &indexed {
                Ok(indexed) if indexed.contains(table) => {}
                Ok(_) => warnings.push(format!(
                    "queue `{queue}` has no unique index on Seq: receives will scan the table (see sql/postgres/queue.sql)"
                )),
                Err(e) => warnings.push(format!("cannot check the indexes of `{queue}`: {e}")),
            }
        }
        Ok(warnings)
    }
}
