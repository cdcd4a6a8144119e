//! Queue administration: creating, checking and purging tables, and addresses as NServiceBus writes
//! them.

use async_trait::async_trait;

use crate::config::Dialect;
use crate::transport::{QueueAdmin, QueueName, TransportError};

use super::connection::{int_at, is_server_error, map_error};
use super::{Inner, PURGE_BATCH, SqlServerTransport, statements};

impl Inner {
    /// `queue`'s address as NServiceBus writes it: `table@[schema]@[catalog]`, or
    /// `table@[schema]` while the catalog is not known (a transport built without connecting).
    pub(super) fn address_of(&self, queue: &QueueName) -> String {
        let parts = queue.parts();
        let schema = statements::bracket(parts.schema.unwrap_or(&self.schema));
        match parts.catalog.or(self.catalog.get().map(String::as_str)) {
            // Database names may hold `]`: doubled, as SQL Server's QUOTENAME does.
            Some(catalog) => format!("{}@{schema}@[{}]", parts.table, catalog.replace(']', "]]")),
            None => format!("{}@{schema}", parts.table),
        }
    }

    /// Tables are created in this connection's database only: a queue whose address names
    /// another is refused, naming it.
    pub(super) fn check_creatable(&self, queue: &QueueName) -> Result<(), TransportError> {
        let Some(catalog) = queue.parts().catalog else {
            return Ok(());
        };
        if self
            .catalog
            .get()
            .is_some_and(|own| own.eq_ignore_ascii_case(catalog))
        {
            return Ok(());
        }
        Err(TransportError::queue(
            queue,
            format!(
                "is in database `{catalog}`: the host creates tables in its own database only; create it there (sql/sqlserver/queue.sql, or the endpoint's installers)"
            ),
        ))
    }
}

#[async_trait]
impl QueueAdmin for SqlServerTransport {
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        self.inner.check_creatable(queue)?;
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        let result = conn.run_batch(&st.create).await;
        match result {
            Ok(_) => Ok(()),
            Err(e) => {
                // The script's transaction was aborted: do not reuse the connection.
                conn.broken = true;
                match e {
                    // "Already exists" from a host that won a race the lock did not cover.
                    tiberius::error::Error::Server(t) if matches!(t.code(), 2714 | 1913) => Ok(()),
                    e => Err(map_error(e, Some(queue))),
                }
            }
        }
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        let mut total = 0;
        loop {
            let n = self
                .inner
                .count(&mut conn, queue, &st.purge_expired_batch, &[&PURGE_BATCH])
                .await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue);
        let mut conn = self.inner.conn().await?;
        self.inner.count(&mut conn, queue, &st.purge, &[]).await
    }

    async fn reset_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        let st = self.inner.statements(queue);
        {
            let mut conn = self.inner.conn().await?;
            let dropped = conn.run_batch(&st.drop).await;
            if let Err(e) = dropped {
                conn.broken = true;
                return Err(map_error(e, Some(queue)));
            }
        }
        self.inner
            .recoverable
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
        self.create_queue(queue).await
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        let mut conn = self.inner.conn().await?;
        let schema = self.inner.schema.as_str();
        let rows = conn
            .rows(statements::LIST_QUEUES, &[&schema])
            .await
            .map_err(|e| map_error(e, None))?;
        Ok(rows
            .iter()
            .filter_map(|r| r.get::<&str, _>(0).map(str::to_string))
            .collect())
    }

    async fn server_checks(&self) -> Result<Vec<String>, TransportError> {
        let mut conn = match self.inner.conn().await {
            Ok(c) => c,
            Err(e) => return Ok(vec![format!("cannot run start-up checks: {e}")]),
        };
        let server = async {
            conn.simple_query(statements::IS_BABELFISH)
                .await?
                .into_row()
                .await
        }
        .await;
        match server {
            Ok(row) => {
                let babelfish = row.and_then(|r| int_at(&r, 0)) == Some(1);
                dialect_check(self.inner.dialect, babelfish)
            }
            Err(e) => {
                conn.broken |= !is_server_error(&e);
                Ok(vec![format!(
                    "cannot tell SQL Server from Babelfish: {}",
                    map_error(e, None)
                )])
            }
        }
    }

    async fn startup_checks(&self, queues: &[QueueName]) -> Result<Vec<String>, TransportError> {
        let mut warnings = Vec::new();
        if !self.inner.max_pool_size_in_connection_string {
            warnings.push(format!(
                "the connection string sets no Max Pool Size; the pool holds at most transport.pool_size = {} connections, one per in-flight message: keep it above the queues' total concurrency",
                self.inner.pool_size
            ));
        }
        let mut conn = match self.inner.conn().await {
            Ok(c) => c,
            Err(e) => return Ok(vec![format!("cannot run start-up checks: {e}")]),
        };
        for queue in queues {
            let st = self.inner.statements(queue);
            let table = st.table.as_str();
            let indexes = async {
                conn.query(statements::ROWVERSION_INDEXES, &[&table])
                    .await?
                    .into_first_result()
                    .await
            }
            .await;
            match indexes {
                Ok(rows) => {
                    let types: Vec<i64> = rows.iter().filter_map(|r| int_at(r, 0)).collect();
                    if types.is_empty() {
                        warnings.push(format!(
                            "queue `{queue}` has no index on RowVersion: every receive scans the table (create Index_RowVersion, see sql/sqlserver/queue.sql)"
                        ));
                    } else if !types.contains(&2) {
                        warnings.push(format!(
                            "queue `{queue}` has a clustered index on RowVersion: under concurrency it suffers page-latch contention; recreate Index_RowVersion as NONCLUSTERED (sql/sqlserver/migrate-nonclustered.sql)"
                        ));
                    }
                }
                Err(e) => warnings.push(format!(
                    "cannot check the indexes of `{queue}`: {}",
                    map_error(e, Some(queue))
                )),
            }
            let headers = async {
                conn.query(statements::HEADERS_TYPE, &[&table])
                    .await?
                    .into_row()
                    .await
            }
            .await;
            match headers {
                Ok(Some(row)) if row.get::<&str, _>(0) == Some("varchar") => warnings.push(format!(
                    "queue `{queue}` stores Headers as varchar: characters outside its code page are lost; change the column to nvarchar(max)"
                )),
                Ok(_) => {}
                Err(e) => warnings.push(format!("cannot check the Headers column of `{queue}`: {}", map_error(e, Some(queue)))),
            }
        }
        Ok(warnings)
    }
}

/// Whether `transport.dialect` fits the server: an error that stops the start when the exact
/// SQL Server dialect meets Babelfish (every receive would fail with `relation "message" does
/// not exist`: Babelfish rejects DML through a CTE), warnings otherwise.
pub(super) fn dialect_check(
    dialect: Dialect,
    server_is_babelfish: bool,
) -> Result<Vec<String>, TransportError> {
    match (dialect, server_is_babelfish) {
        (Dialect::Sqlserver, true) => Err(TransportError::Setting {
            setting: "transport.dialect",
            message: "the server is Babelfish for PostgreSQL, which rejects the SQL Server receive statement (DELETE through a CTE); set transport.dialect = \"babelfish\"".into(),
        }),
        (Dialect::Babelfish, true) => Ok(vec![
            "dialect babelfish: Babelfish ignores READPAST, so receivers claim rows: a row another receive holds is passed over within 1 ms and counted in throttlehost_lock_conflicts_total{kind=\"lock_timeout\"} (see sql/sqlserver/README.md)".into(),
        ]),
        (Dialect::Babelfish, false) => Ok(vec![
            "transport.dialect = \"babelfish\" on SQL Server: it works, but receives claim rows under a lock timeout where READPAST passes over them; \"sqlserver\" is the dialect for this server".into(),
        ]),
        (Dialect::Sqlserver, false) => Ok(Vec::new()),
    }
}
