//! The subscription table on SQL Server, with the semantics of NServiceBus's SQL Server
//! transport (`SqlConstants`): created under a lock when missing (`PRIMARY KEY CLUSTERED
//! (Endpoint, Topic)`), subscribe as a `MERGE ... WITH (HOLDLOCK, TABLOCK)` upsert (Babelfish
//! takes no MERGE: an update, then an insert when it found no row, in one transaction), the
//! distinct addresses of a set of topics, and unsubscribe by key.

use async_trait::async_trait;
use tiberius::ToSql;

use super::SqlServerTransport;
use super::connection::{is_server_error, map_error};
use super::statements::{bracket, created_under_lock};
use crate::config::Dialect;
use crate::message::OutgoingMessage;
use crate::transport::unit_of_work::SqlStore;
use crate::transport::{QueueName, Subscription, Subscriptions, TransportError};

/// SQL Server's error for a duplicate key: two subscribers of one key inserted at once.
const DUPLICATE_KEY: u32 = 2627;

impl SqlServerTransport {
    /// The subscription table, bracket-quoted: `[dbo].[SubscriptionRouting]` by default.
    fn subscription_table_name(&self) -> String {
        let (schema, table) = &self.inner.subscription_table;
        format!("{}.{}", bracket(schema), bracket(table))
    }

    /// Runs a statement on the subscription table and returns its first result's rows. A
    /// statement that hit a duplicate key (a racing subscribe) runs once more when
    /// `again_on_duplicate`: the row is there then, and the upsert's update finds it.
    async fn on_table(
        &self,
        sql: &str,
        params: &[&dyn ToSql],
        again_on_duplicate: bool,
    ) -> Result<Vec<tiberius::Row>, TransportError> {
        let table = self.subscription_table_name();
        let mut conn = self.inner.conn().await?;
        let mut rows = async { conn.query(sql, params).await?.into_first_result().await }.await;
        if again_on_duplicate
            && matches!(&rows, Err(tiberius::error::Error::Server(t)) if t.code() == DUPLICATE_KEY)
        {
            rows = async { conn.query(sql, params).await?.into_first_result().await }.await;
        }
        rows.map_err(|e| {
            conn.broken |= !is_server_error(&e);
            match map_error(e, None) {
                TransportError::QueueNotFound(_) => {
                    crate::transport::subscriptions::missing_table(&table)
                }
                other => other,
            }
        })
    }

    /// The upsert of one subscription: `@P1` queue address, `@P2` topic, `@P3` endpoint.
    fn subscribe_statement(&self) -> String {
        let table = self.subscription_table_name();
        match self.inner.dialect {
            Dialect::Sqlserver => format!(
                "MERGE {table} WITH (HOLDLOCK, TABLOCK) AS target
USING (SELECT @P3 AS Endpoint, @P1 AS QueueAddress, @P2 AS Topic) AS source
ON target.Endpoint = source.Endpoint AND target.Topic = source.Topic
WHEN MATCHED AND target.QueueAddress <> source.QueueAddress THEN
    UPDATE SET QueueAddress = @P1
WHEN NOT MATCHED THEN
    INSERT (QueueAddress, Topic, Endpoint) VALUES (@P1, @P2, @P3);"
            ),
            Dialect::Babelfish => format!(
                "SET XACT_ABORT ON;
BEGIN TRAN;
UPDATE {table} SET QueueAddress = @P1 WHERE Endpoint = @P3 AND Topic = @P2;
IF @@ROWCOUNT = 0 INSERT INTO {table} (QueueAddress, Topic, Endpoint) VALUES (@P1, @P2, @P3);
COMMIT TRAN;"
            ),
        }
    }
}

#[async_trait]
impl Subscriptions for SqlServerTransport {
    fn subscription_table(&self) -> String {
        self.subscription_table_name()
    }

    async fn create_subscription_table(&self) -> Result<(), TransportError> {
        let (schema, _) = &self.inner.subscription_table;
        let table = self.subscription_table_name();
        let create = created_under_lock(
            schema,
            &format!("OBJECT_ID(N'{table}', N'U') IS NULL"),
            &format!(
                "    CREATE TABLE {table} (
        QueueAddress NVARCHAR(200) NOT NULL,
        Endpoint NVARCHAR(200) NOT NULL,
        Topic NVARCHAR(200) NOT NULL,
        PRIMARY KEY CLUSTERED (Endpoint, Topic)
    );
END"
            ),
        );
        let mut conn = self.inner.conn().await?;
        match conn.run_batch(&create).await {
            Ok(()) => Ok(()),
            Err(e) => {
                conn.broken = true;
                match e {
                    // Created by another host at the same moment.
                    tiberius::error::Error::Server(t) if matches!(t.code(), 2714 | 1913) => Ok(()),
                    e => Err(map_error(e, None)),
                }
            }
        }
    }

    async fn subscribe(
        &self,
        endpoint: &str,
        topic: &str,
        queue_address: &str,
    ) -> Result<(), TransportError> {
        let sql = self.subscribe_statement();
        let params: [&dyn ToSql; 3] = [&queue_address, &topic, &endpoint];
        self.on_table(&sql, &params, true).await.map(|_| ())
    }

    async fn unsubscribe(&self, endpoint: &str, topic: &str) -> Result<bool, TransportError> {
        let table = self.subscription_table_name();
        let sql = format!(
            "DELETE FROM {table} WHERE Endpoint = @P1 AND Topic = @P2;
SELECT CAST(@@ROWCOUNT AS bigint);"
        );
        let rows = self.on_table(&sql, &[&endpoint, &topic], false).await;
        // The count is the batch's second result; a DELETE sends none of its own.
        Ok(rows?
            .first()
            .and_then(|r| r.get::<i64, _>(0))
            .is_some_and(|n| n > 0))
    }

    async fn subscribers(&self, topics: &[String]) -> Result<Vec<String>, TransportError> {
        if topics.is_empty() {
            return Ok(Vec::new());
        }
        let table = self.subscription_table_name();
        let list: Vec<String> = (1..=topics.len()).map(|i| format!("@P{i}")).collect();
        let sql = format!(
            "SELECT DISTINCT QueueAddress FROM {table} WHERE Topic IN ({})",
            list.join(", ")
        );
        let params: Vec<&dyn ToSql> = topics.iter().map(|t| t as &dyn ToSql).collect();
        let rows = self.on_table(&sql, &params, false).await?;
        Ok(rows
            .iter()
            .filter_map(|r| r.get::<&str, _>(0).map(str::to_string))
            .collect())
    }

    async fn all_subscriptions(&self) -> Result<Vec<Subscription>, TransportError> {
        let table = self.subscription_table_name();
        let sql =
            format!("SELECT Endpoint, Topic, QueueAddress FROM {table} ORDER BY Topic, Endpoint");
        let rows = self.on_table(&sql, &[], false).await?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(Subscription {
                    endpoint: r.get::<&str, _>(0)?.to_string(),
                    topic: r.get::<&str, _>(1)?.to_string(),
                    queue_address: r.get::<&str, _>(2)?.to_string(),
                })
            })
            .collect())
    }

    async fn deliver(&self, copies: &[(QueueName, OutgoingMessage)]) -> Result<(), TransportError> {
        let Some((first, _)) = copies.first() else {
            return Ok(());
        };
        let mut conn = self.inner.conn().await?;
        conn.run_batch("BEGIN TRAN;").await.map_err(|e| {
            conn.broken |= !is_server_error(&e);
            map_error(e, Some(first))
        })?;
        let sent = async {
            for (queue, message) in copies {
                self.inner.send_on(&mut conn, queue, message).await?;
            }
            Ok::<_, TransportError>(())
        }
        .await;
        self.inner
            .end(conn, first, sent.is_ok(), sent.is_err())
            .await?;
        sent?;
        for (queue, _) in copies {
            self.inner.arrived(queue);
        }
        Ok(())
    }
}
