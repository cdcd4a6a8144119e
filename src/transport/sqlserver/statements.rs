//! SQL text for one SQL Server queue table, built once per queue from validated,
//! bracket-quoted identifiers. The statements follow the NServiceBus SQL Server transport
//! (`SqlServerConstants`): same table, same receive, peek and purge semantics. Values are
//! always bound as parameters (`@P1`...), never spliced.
//!
//! Two dialects: `sqlserver` (the NServiceBus forms) and `babelfish` (Babelfish for
//! PostgreSQL rejects DELETE through a CTE and OUTPUT expressions over `deleted`, and ignores
//! READPAST; see `sql/sqlserver/README.md`).

mod babelfish;
mod ordered;

use self::babelfish::WHERE_NOT_HELD;
pub use self::babelfish::{
    CLAIM_GIVE_UP, CLAIM_LOCK_TIMEOUT_MS, babelfish_candidates, babelfish_claim,
    babelfish_ordered_candidates, babelfish_warm_up,
};
pub use self::ordered::ordered_receive;
use self::ordered::ordered_waiting;

use crate::config::{Dialect, OrderingConfig};
use crate::transport::{HeldStatements, QueueName};

/// Quotes a validated identifier for SQL Server. Names reaching here passed
/// `crate::names`, which rejects `[` and `]`.
pub fn bracket(name: &str) -> String {
    debug_assert!(!name.contains(['[', ']']));
    format!("[{name}]")
}

/// Every statement the transport runs against one queue table.
#[derive(Debug, Clone)]
pub struct QueueStatements {
    /// `[schema].[table]`
    pub table: String,
    /// Creates schema (if missing) and table with its indexes, under an application lock so
    /// that hosts creating at once do not collide. Idempotent.
    pub create: String,
    /// Drops the table if it exists (load tests start from a fresh table).
    pub drop: String,
    /// Insert with the legacy `Recoverable` column set to 1. `@P1` id, `@P2` time-to-be-received
    /// in ms (NULL = never), `@P3` headers, `@P4` body. Expiry uses the server's clock.
    pub send_with_recoverable: String,
    /// Insert for tables without `Recoverable`.
    pub send_without_recoverable: String,
    /// Insert of a raw row with no expiry (dead-lettering poison rows), with `Recoverable`.
    pub send_raw_with_recoverable: String,
    /// The same without `Recoverable`.
    pub send_raw_without_recoverable: String,
    /// Does the table have a `Recoverable` column? 1 yes, 0 no, -1 no such table.
    pub has_recoverable: String,
    /// Deletes the oldest row not locked by another receiver, outside a transaction of its
    /// own (transaction mode `none`); returns id, expired flag (int), headers, body, expires.
    pub receive: String,
    /// Starts a transaction and receives as `receive`; when nothing was deleted the same batch
    /// ends the transaction, so an empty receive costs one round trip.
    pub begin_and_receive: String,
    /// Commits the current receive, then does what `begin_and_receive` does.
    pub commit_and_receive: String,
    /// max(RowVersion) - min(RowVersion) + 1 over committed rows not locked by receivers.
    pub peek: String,
    /// The same depth as a scalar subquery, for reading many queues in one statement.
    pub peek_value: String,
    /// How many rows have id `@P1`, read with locks (`READCOMMITTEDLOCK`, so a transaction
    /// deleting the row is waited for even under read-committed snapshot): asked after a
    /// commit reported an error. Scans the table (Id has no index), which only such errors
    /// pay for.
    pub still_queued: String,
    /// Deletes up to `@P1` expired rows; returns the count.
    pub purge_expired_batch: String,
    /// Deletes every row; returns the count.
    pub purge: String,
    /// Whether the receives keep an order ([`ordered_receive`]); batch receives are refused.
    pub ordered: bool,
    /// An ordered queue's count of messages that may not run yet (`ordered_waiting`).
    pub waiting: Option<String>,
    /// The dialect the statements are written in.
    pub dialect: Dialect,
    /// Babelfish's claim candidates, oldest first ([`babelfish_claim`]): every row, or on an
    /// ordered queue the rows that may run ([`babelfish_ordered_candidates`]).
    pub claim_from: String,
    /// The queue's delayed table, `[schema].[<queue>.Delayed]` (the suffix configurable), and
    /// its statements.
    pub delayed: DelayedStatements,
}

/// The statements of a queue's delayed table, laid out as NServiceBus creates it
/// (`CreateDelayedMessageStoreText`: Headers, Body, Due, RowVersion, a nonclustered index on
/// Due). Due times are the server's `GETUTCDATE()` plus the delay, as NServiceBus writes them.
#[derive(Debug, Clone)]
pub struct DelayedStatements {
    /// `[schema].[<queue>.Delayed]`
    pub table: String,
    /// Creates the table and its index under the schema's creation lock. Idempotent.
    pub create: String,
    /// Stores a message: `@P1` headers (with the forward destination), `@P2` body, `@P3`
    /// delay in milliseconds from the server's clock.
    pub store: String,
    /// Moves up to `@P1` due rows into the queue (with the `Recoverable` column) in one
    /// transaction under the queue's mover lock (an application lock another mover finds
    /// taken); returns moved, 1 when the lock was had, rows left, the server's time and the
    /// earliest due time left. The count and the earliest skip locked rows (`READPAST`, as
    /// NServiceBus reads its next due time): a delayed retry stored by a receive that has not
    /// committed yet would otherwise make the mover wait for it.
    pub move_due_with_recoverable: String,
    /// The same for a queue table without `Recoverable`.
    pub move_due_without_recoverable: String,
    /// Rows in the table.
    pub count: String,
}

impl DelayedStatements {
    /// `(catalog, schema)`: the catalog as the queue table's prefix (`[catalog].` or empty).
    fn new(
        (catalog, schema): (&str, &str),
        queue: &QueueName,
        queue_table: &str,
        dialect: Dialect,
        suffix: &str,
    ) -> Self {
        let table = format!(
            "{catalog}{}.{}",
            bracket(schema),
            bracket(&format!("{}.{suffix}", queue.table()))
        );
        let mover = format!("throttlehost_mover_{schema}.{queue}");
        let move_due = |recoverable: bool| {
            let (column, value) = if recoverable {
                ("Recoverable, ", "1, ")
            } else {
                ("", "")
            };
            // Read out into a table variable, then inserted in due order: identity values
            // follow an INSERT ... SELECT's ORDER BY, not an OUTPUT's.
            let output = "OUTPUT deleted.Headers, deleted.Body, deleted.Due INTO @moving (Headers, Body, Due)";
            let delete = match dialect {
                Dialect::Sqlserver => format!(
                    "WITH message AS (SELECT TOP(@P1) * FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) WHERE Due < GETUTCDATE() ORDER BY Due)
    DELETE FROM message
    {output};"
                ),
                // Babelfish takes no DML through a CTE: the same rows by RowVersion.
                Dialect::Babelfish => format!(
                    "DELETE FROM {table}
    {output}
    WHERE RowVersion IN (SELECT TOP(@P1) RowVersion FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) WHERE Due < GETUTCDATE() ORDER BY Due);"
                ),
            };
            let delete = format!(
                "{delete}
    SET @moved = @@ROWCOUNT;
    INSERT INTO {queue_table} (Id, CorrelationId, ReplyToAddress, {column}Expires, Headers, Body)
    SELECT NEWID(), NULL, NULL, {value}NULL, Headers, Body FROM @moving ORDER BY Due, N;"
            );
            let report = format!(
                "SELECT @moved, CAST(CASE WHEN @got >= 0 THEN 1 ELSE 0 END AS int), (SELECT COUNT_BIG(*) FROM {table} WITH (READPAST)), GETUTCDATE(), (SELECT MIN(Due) FROM {table} WITH (READPAST));"
            );
            match dialect {
                Dialect::Sqlserver => format!(
                    "SET XACT_ABORT ON;
BEGIN TRAN;
DECLARE @got int, @moved bigint = 0;
DECLARE @moving TABLE (N int IDENTITY(1,1), Headers nvarchar(max), Body varbinary(max), Due datetime);
EXEC @got = sp_getapplock @Resource = N'{mover}', @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
IF @got >= 0
BEGIN
    {delete}
END
{report}
COMMIT TRAN;"
                ),
                // No application lock (Babelfish 4.2's server process aborts at the fifth
                // refused one of a session, see `babelfish_ordered_candidates`): the rows'
                // own locks, given up within 1 ms, keep two movers apart. The batch then
                // fails with a lock timeout, which the transport reports as busy.
                Dialect::Babelfish => format!(
                    "SET XACT_ABORT ON;
SET LOCK_TIMEOUT {CLAIM_LOCK_TIMEOUT_MS};
BEGIN TRAN;
DECLARE @got int = 0, @moved bigint = 0;
DECLARE @moving TABLE (N int IDENTITY(1,1), Headers nvarchar(max), Body varbinary(max), Due datetime);
{delete}
COMMIT TRAN;
SET LOCK_TIMEOUT -1;
{report}"
                ),
            }
        };
        DelayedStatements {
            create: created_under_lock(
                schema,
                &format!("OBJECT_ID(N'{table}', N'U') IS NULL"),
                &format!(
                    "    CREATE TABLE {table} (
        Headers nvarchar(max) NOT NULL,
        Body varbinary(max) NULL,
        Due datetime NOT NULL,
        RowVersion bigint IDENTITY(1,1) NOT NULL
    );
    CREATE NONCLUSTERED INDEX [Index_Due] ON {table} (Due);
END"
                ),
            ),
            store: format!(
                "INSERT INTO {table} (Headers, Body, Due) VALUES (@P1, @P2, DATEADD(ms, @P3 % 1000, DATEADD(s, @P3 / 1000, GETUTCDATE())));"
            ),
            move_due_with_recoverable: move_due(true),
            move_due_without_recoverable: move_due(false),
            count: format!("SELECT COUNT_BIG(*) FROM {table};"),
            table,
        }
    }
}

/// The receive: the NServiceBus CTE form, or the Babelfish table-variable form.
/// Reads back what a receive deleted into `@received`: id, expired flag, headers, body and
/// expiry, the columns every receive returns.
const READ_RECEIVED: &str = "SELECT Id,
    CASE WHEN Expires IS NULL THEN 0 WHEN Expires > GETUTCDATE() THEN 0 ELSE 1 END,
    Headers,
    Body,
    Expires";

fn receive(table: &str, dialect: Dialect) -> String {
    match dialect {
        Dialect::Sqlserver => format!(
            "WITH message AS (SELECT TOP(1) * FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) ORDER BY RowVersion)
DELETE FROM message
OUTPUT deleted.Id,
    CASE WHEN deleted.Expires IS NULL THEN 0 ELSE CASE WHEN deleted.Expires > GETUTCDATE() THEN 0 ELSE 1 END END,
    CAST(deleted.Headers AS nvarchar(max)),
    deleted.Body,
    deleted.Expires;"
        ),
        Dialect::Babelfish => format!(
            "DECLARE @received TABLE (Id uniqueidentifier, Expires datetime, Headers nvarchar(max), Body varbinary(max));
DELETE FROM {table}
OUTPUT deleted.Id, deleted.Expires, deleted.Headers, deleted.Body INTO @received
WHERE RowVersion IN (SELECT TOP(1) RowVersion FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) ORDER BY RowVersion);
{READ_RECEIVED}
FROM @received;"
        ),
    }
}

/// Puts `end` right after the receive's DELETE (before the Babelfish SELECT), where
/// `@@ROWCOUNT` still counts the deleted rows.
/// Begins a transaction and deletes up to `max` of the oldest rows not locked by other
/// receivers, returning them oldest first; an empty receive commits its empty transaction.
/// The rows go through a table variable, and the final SELECT orders them (OUTPUT promises no
/// order). SQL Server deletes through the CTE NServiceBus uses, whose READPAST scan skips rows
/// other receivers hold; Babelfish cannot DELETE through a CTE and selects the RowVersions
/// first, as its single receive does (only `OUTPUT ... INTO` keeps `@@ROWCOUNT` there). `max`
/// is a number the host bounds (1 to 1000), written into the text because the batch has no
/// parameters.
pub fn begin_and_receive_batch(table: &str, max: u32, dialect: Dialect) -> String {
    let delete = match dialect {
        Dialect::Sqlserver => format!(
            "WITH message AS (SELECT TOP({max}) * FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) ORDER BY RowVersion)
DELETE FROM message
OUTPUT deleted.RowVersion, deleted.Id, deleted.Expires, CAST(deleted.Headers AS nvarchar(max)), deleted.Body INTO @received;"
        ),
        Dialect::Babelfish => format!(
            "DELETE FROM {table}
OUTPUT deleted.RowVersion, deleted.Id, deleted.Expires, deleted.Headers, deleted.Body INTO @received
WHERE RowVersion IN (SELECT TOP({max}) RowVersion FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) ORDER BY RowVersion);"
        ),
    };
    format!(
        "BEGIN TRAN;
DECLARE @received TABLE (RowVersion bigint, Id uniqueidentifier, Expires datetime, Headers nvarchar(max), Body varbinary(max));
{delete}
IF @@ROWCOUNT = 0 AND @@TRANCOUNT > 0 COMMIT TRAN;
{READ_RECEIVED}
FROM @received
ORDER BY RowVersion;"
    )
}

/// What a Babelfish claim sends back, straight to the client: Id, the server's UTC time,
/// Headers, Body, Expires, RowVersion. Not through a table variable, which Babelfish makes as
/// a temporary table on every statement: the claim with one took 2.0 ms a message and 1.0 ms
/// without (1 000 claims and commits in one session). Babelfish rejects expressions over
/// `deleted` in an OUTPUT, so whether the row has expired is decided by the host from Expires
/// and the server's time (the same comparison the SQL Server receive makes, on the same clock).
const CLAIM_OUTPUT: &str = "OUTPUT deleted.Id, GETUTCDATE(), deleted.Headers, deleted.Body, deleted.Expires, deleted.RowVersion";

fn with_end_if_empty(receive: &str, end: &str) -> String {
    match receive.find("\nSELECT Id,") {
        Some(at) => format!("{}\n{end}{}", &receive[..at], &receive[at..]),
        None => format!("{receive}\n{end}"),
    }
}

/// The held-keys table of `schema` (bracket-quoted), `[schema].[throttlehost_held]`: queue
/// tables as `[schema].[table]`; `@P1` .. `@P4` bound as [`HeldStatements`] says.
pub fn held_statements(schema: &str) -> HeldStatements {
    let table = format!("{schema}.[throttlehost_held]");
    HeldStatements {
        create: format!(
            "IF OBJECT_ID(N'{table}', N'U') IS NULL
CREATE TABLE {table} (
    queue_table nvarchar(400) NOT NULL,
    message_id uniqueidentifier NOT NULL,
    [key] nvarchar(4000) NOT NULL,
    reason nvarchar(max) NOT NULL,
    held_at datetime2 NOT NULL DEFAULT SYSUTCDATETIME(),
    PRIMARY KEY (queue_table, message_id)
);"
        ),
        insert: format!(
            "INSERT INTO {table} (queue_table, message_id, [key], reason)
SELECT @P1, @P2, @P3, @P4
WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE queue_table = @P1 AND message_id = @P2);"
        ),
        list: format!(
            "SELECT [key], message_id, reason, CONVERT(nvarchar(30), held_at, 121) FROM {table}
WHERE queue_table = @P1 ORDER BY held_at, [key];"
        ),
        is_held: format!("SELECT TOP (1) 1 FROM {table} WHERE queue_table = @P1 AND [key] = @P2;"),
        release: format!(
            "DELETE FROM {table} WHERE queue_table = @P1 AND [key] = @P2;
SELECT CAST(@@ROWCOUNT AS bigint);"
        ),
        // A statement of its own rather than a NULL key: Babelfish refuses a NULL parameter
        // sent without a type (TDS type 0x1F).
        release_all: format!(
            "DELETE FROM {table} WHERE queue_table = @P1;
SELECT CAST(@@ROWCOUNT AS bigint);"
        ),
        table,
    }
}

/// The most messages one multi-row insert carries: four parameters each, well under SQL
/// Server's 2 100 parameters per request (and its 1 000 rows per table value constructor).
pub const SEND_MANY_ROWS: usize = 500;

/// A creation script: under the schema's creation lock (one per schema, so hosts creating the
/// schema and its tables at once do not collide), the schema when missing, then `body` (which
/// ends in `END`) when `condition` holds. Names inside N'...' literals cannot hold quotes
/// (validated).
pub(super) fn created_under_lock(schema: &str, condition: &str, body: &str) -> String {
    let lock = format!("throttlehost_create_{schema}");
    let sq = bracket(schema);
    format!(
        "SET XACT_ABORT ON;
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'{lock}', @LockMode = 'Exclusive', @LockOwner = 'Transaction';
IF SCHEMA_ID(N'{schema}') IS NULL EXEC(N'CREATE SCHEMA {sq}');
IF {condition}
BEGIN
{body}
COMMIT TRAN;"
    )
}

/// Inserts `rows` messages (1 to [`SEND_MANY_ROWS`]) into `table` (`[schema].[table]`) in one
/// statement. Message `i` (from 0) binds `@P{4i+1}` id, `@P{4i+2}` time-to-be-received in
/// milliseconds (NULL: never expires), `@P{4i+3}` headers, `@P{4i+4}` body. The rows go through
/// `INSERT ... SELECT ... ORDER BY`, for which SQL Server computes identity values in the
/// ORDER BY's order, so RowVersion follows the order given (a VALUES list alone does not
/// promise that).
pub fn send_many(table: &str, rows: usize, recoverable: bool) -> String {
    debug_assert!((1..=SEND_MANY_ROWS).contains(&rows));
    let values: Vec<String> = (0..rows)
        .map(|i| {
            let p = 4 * i;
            format!("({i}, @P{}, @P{}, @P{}, @P{})", p + 1, p + 2, p + 3, p + 4)
        })
        .collect();
    let (column, value) = if recoverable {
        ("Recoverable, ", "1, ")
    } else {
        ("", "")
    };
    format!(
        "INSERT INTO {table} (Id, CorrelationId, ReplyToAddress, {column}Expires, Headers, Body)
SELECT m.Id, NULL, NULL, {value}CASE WHEN m.Ttbr IS NULL THEN NULL ELSE DATEADD(ms, m.Ttbr % 1000, DATEADD(s, m.Ttbr / 1000, GETUTCDATE())) END, m.Headers, m.Body
FROM (VALUES {}) AS m (N, Id, Ttbr, Headers, Body)
ORDER BY m.N;",
        values.join(", ")
    )
}

impl QueueStatements {
    /// Builds the statements for `queue` in a dialect: `[schema].[table]`, with the schema
    /// (and `[catalog].` before it) its address names, if it names them.
    pub fn new(schema: &str, queue: &QueueName, dialect: Dialect, delayed_suffix: &str) -> Self {
        let parts = queue.parts();
        let schema = parts.schema.unwrap_or(schema);
        let catalog = parts
            .catalog
            .map(|c| format!("{}.", bracket(c)))
            .unwrap_or_default();
        let table = format!("{catalog}{}.{}", bracket(schema), bracket(parts.table));
        // Inside N'...' literals: names cannot contain quotes (validated).
        let exists = format!("OBJECT_ID(N'{table}', N'U') IS NOT NULL");
        let insert = |recoverable: bool, expires: &str, params: &str| {
            let (column, value) = if recoverable {
                ("Recoverable, ", "1, ")
            } else {
                ("", "")
            };
            format!(
                "INSERT INTO {table} (Id, CorrelationId, ReplyToAddress, {column}Expires, Headers, Body) VALUES (@P1, NULL, NULL, {value}{expires}, {params});"
            )
        };
        // Milliseconds split into seconds and a remainder so TTBRs beyond 24 days fit
        // DATEADD's int argument.
        let expires = "CASE WHEN @P2 IS NULL THEN NULL ELSE DATEADD(ms, @P2 % 1000, DATEADD(s, @P2 / 1000, GETUTCDATE())) END";
        let receive = receive(&table, dialect);
        let peek_query = match dialect {
            Dialect::Sqlserver => format!(
                "SELECT ISNULL(CAST(MAX(RowVersion) - MIN(RowVersion) + 1 AS bigint), 0) FROM {table} WITH (READPAST, READCOMMITTEDLOCK)"
            ),
            // Babelfish reads committed data under MVCC and ignores READPAST: rows locked by
            // in-flight receives are counted (an overestimate).
            Dialect::Babelfish => format!(
                "SELECT ISNULL(CAST(MAX(RowVersion) - MIN(RowVersion) + 1 AS bigint), 0) FROM {table}"
            ),
        };
        let end_if_empty = "IF @@ROWCOUNT = 0 AND @@TRANCOUNT > 0 COMMIT TRAN;";
        QueueStatements {
            create: created_under_lock(
                schema,
                &format!("NOT ({exists})"),
                &format!(
                    "    CREATE TABLE {table} (
        Id uniqueidentifier NOT NULL,
        CorrelationId varchar(255) NULL,
        ReplyToAddress varchar(255) NULL,
        Recoverable bit NOT NULL,
        Expires datetime NULL,
        Headers nvarchar(max) NOT NULL,
        Body varbinary(max) NULL,
        RowVersion bigint IDENTITY(1,1) NOT NULL
    );
    CREATE NONCLUSTERED INDEX Index_RowVersion ON {table} (RowVersion);
    CREATE NONCLUSTERED INDEX Index_Expires ON {table} (Expires) INCLUDE (Id, RowVersion) WHERE Expires IS NOT NULL;
END"
                ),
            ),
            drop: format!("IF {exists} DROP TABLE {table};"),
            send_with_recoverable: insert(true, expires, "@P3, @P4"),
            send_without_recoverable: insert(false, expires, "@P3, @P4"),
            send_raw_with_recoverable: insert(true, "NULL", "@P2, @P3"),
            send_raw_without_recoverable: insert(false, "NULL", "@P2, @P3"),
            has_recoverable: format!(
                "SELECT CASE WHEN OBJECT_ID(N'{table}', N'U') IS NULL THEN -1 WHEN COL_LENGTH(N'{table}', N'Recoverable') IS NULL THEN 0 ELSE 1 END;"
            ),
            begin_and_receive: format!("BEGIN TRAN;\n{}", with_end_if_empty(&receive, end_if_empty)),
            commit_and_receive: format!("COMMIT TRAN;\nBEGIN TRAN;\n{}", with_end_if_empty(&receive, end_if_empty)),
            receive,
            claim_from: format!("SELECT RowVersion FROM {table}{WHERE_NOT_HELD} ORDER BY RowVersion"),
            still_queued: format!(
                "SELECT COUNT(*) FROM {table} WITH (READCOMMITTEDLOCK) WHERE Id = @P1;"
            ),
            peek: format!("{peek_query};"),
            peek_value: format!("({peek_query})"),
            purge_expired_batch: format!(
                "DELETE FROM {table} WHERE RowVersion IN (SELECT TOP(@P1) RowVersion FROM {table} WITH (READPAST) WHERE Expires < GETUTCDATE());
SELECT CAST(@@ROWCOUNT AS bigint);"
            ),
            purge: format!("DELETE FROM {table};\nSELECT CAST(@@ROWCOUNT AS bigint);"),
            ordered: false,
            waiting: None,
            dialect,
            delayed: DelayedStatements::new(
                (&catalog, schema),
                queue,
                &table,
                dialect,
                delayed_suffix,
            ),
            table,
        }
    }

    /// The same statements with receives that keep the order `ordering` asks for.
    pub fn with_ordering(mut self, ordering: &OrderingConfig) -> Self {
        match self.dialect {
            Dialect::Sqlserver => {
                self.begin_and_receive = ordered_receive(&self.table, ordering, false);
                self.commit_and_receive = ordered_receive(&self.table, ordering, true);
            }
            // Babelfish receives by claim, from the candidates that may run.
            Dialect::Babelfish => {
                self.claim_from = babelfish_ordered_candidates(&self.table, ordering);
            }
        }
        self.waiting = Some(ordered_waiting(&self.table, ordering, self.dialect));
        self.ordered = true;
        self
    }
}

/// Startup check: indexes whose first key column is RowVersion (type 1 clustered, 2 not).
pub const ROWVERSION_INDEXES: &str = "SELECT CAST(i.type AS int), i.name FROM sys.indexes i
JOIN sys.index_columns ic ON ic.object_id = i.object_id AND ic.index_id = i.index_id AND ic.key_ordinal = 1
JOIN sys.columns c ON c.object_id = ic.object_id AND c.column_id = ic.column_id
WHERE i.object_id = OBJECT_ID(@P1, N'U') AND c.name = N'RowVersion';";

/// Startup check: the type of the Headers column.
pub const HEADERS_TYPE: &str = "SELECT t.name FROM sys.columns c
JOIN sys.types t ON t.user_type_id = c.user_type_id
WHERE c.object_id = OBJECT_ID(@P1, N'U') AND c.name = N'Headers';";

/// The queue tables in a schema: tables with the columns a queue has. Read from
/// INFORMATION_SCHEMA, which keeps names as written on both servers (Babelfish's `sys.tables`
/// gives them lowercased: `sales.node-1` for `Sales.Node-1`).
pub const LIST_QUEUES: &str = "SELECT t.TABLE_NAME FROM INFORMATION_SCHEMA.TABLES t
WHERE t.TABLE_SCHEMA = @P1 AND t.TABLE_TYPE = N'BASE TABLE'
  AND (SELECT COUNT(*) FROM INFORMATION_SCHEMA.COLUMNS c
       WHERE c.TABLE_SCHEMA = t.TABLE_SCHEMA AND c.TABLE_NAME = t.TABLE_NAME
       AND c.COLUMN_NAME IN (N'Id', N'Expires', N'Headers', N'Body', N'RowVersion')) = 5
ORDER BY t.TABLE_NAME;";

/// Start-up check: 1 on Babelfish for PostgreSQL, NULL on SQL Server (an unknown property).
pub const IS_BABELFISH: &str = "SELECT CAST(SERVERPROPERTY('babelfish') AS int);";
