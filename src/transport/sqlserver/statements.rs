//! SQL text for one SQL Server queue table, built once per queue from validated,
//! bracket-quoted identifiers. The statements follow the NServiceBus SQL Server transport
//! (`SqlServerConstants`): same table, same receive, peek and purge semantics. Values are
//! always bound as parameters (`@P1`...), never spliced.
//!
//! Two dialects: `sqlserver` (the NServiceBus forms) and `babelfish` (Babelfish for
//! PostgreSQL rejects DELETE through a CTE and OUTPUT expressions over `deleted`, and ignores
//! READPAST; see `sql/sqlserver/README.md`).

use crate::config::Dialect;
use crate::transport::QueueName;

/// Quotes a validated identifier for SQL Server. Names reaching here passed
/// [`crate::transport::names`], which rejects `[` and `]`.
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
    /// Deletes up to `@P1` expired rows; returns the count.
    pub purge_expired_batch: String,
    /// Deletes every row; returns the count.
    pub purge: String,
    /// Whether the receives keep key order ([`ordered_receive`]); batch receives are refused.
    pub ordered: bool,
}

/// The receive: the NServiceBus CTE form, or the Babelfish table-variable form.
/// Reads back what a receive deleted into `@received`: id, expired flag, headers, body and
/// expiry, the columns every receive returns.
const READ_RECEIVED: &str = "SELECT Id,
    CASE WHEN Expires IS NULL THEN 0 WHEN Expires > GETUTCDATE() THEN 0 ELSE 1 END,
    Headers,
    Body,
    Expires
FROM @received";

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
{READ_RECEIVED};"
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
ORDER BY RowVersion;"
    )
}

fn with_end_if_empty(receive: &str, end: &str) -> String {
    match receive.find("\nSELECT Id,") {
        Some(at) => format!("{}\n{end}{}", &receive[..at], &receive[at..]),
        None => format!("{receive}\n{end}"),
    }
}

/// The receive of a queue that keeps key order, for the exact SQL Server dialect: a
/// transaction begins (or, `after_commit`, the previous one commits first), the oldest
/// message that may run now is deleted into `@received`, and an empty receive ends its
/// transaction. Rows other receives hold are invisible to READPAST, so the key is guarded by
/// an application lock (`sp_getapplock`, Exclusive, owned by the transaction, no wait) that
/// every receive takes before it deletes a keyed row and keeps until it commits or rolls back:
///
/// 1. the `lookahead` oldest unlocked rows, and of each key the oldest of them (`@heads`);
/// 2. in order: an unkeyed head is deleted if still free; for a keyed head the key's lock is
///    tried, and with it held the key's oldest row at or before the head is taken (one that
///    an ended receive rolled back comes first), else the lock is released and the next head
///    is tried.
///
/// A key's rows are deleted only under its lock, so while one of its messages is in flight
/// no other receive can take the next, and the lock is free only once that message is gone or
/// back in place. Keys are read with `JSON_VALUE` (NULL for headers that are not JSON, or a
/// value over 4 000 characters: such messages are not ordered). The lock's name is a hash of
/// the table and the key, within the 255 characters a resource may have.
pub fn ordered_receive(
    table: &str,
    key_header: &str,
    lookahead: u32,
    after_commit: bool,
) -> String {
    let begin = if after_commit {
        "COMMIT TRAN;\nBEGIN TRAN;"
    } else {
        "BEGIN TRAN;"
    };
    let key = format!(
        "CASE WHEN ISJSON(Headers) = 1 THEN JSON_VALUE(Headers, N'$.\"{key_header}\"') END"
    );
    format!(
        "{begin}
DECLARE @received TABLE (Id uniqueidentifier, Expires datetime, Headers nvarchar(max), Body varbinary(max));
DECLARE @heads TABLE (RowVersion bigint PRIMARY KEY, k nvarchar(4000) NULL);
DECLARE @rv bigint, @k nvarchar(4000), @got int, @resource nvarchar(255);
INSERT INTO @heads (RowVersion, k)
SELECT RowVersion, k FROM (
    SELECT RowVersion, k, ROW_NUMBER() OVER (PARTITION BY k ORDER BY RowVersion) AS nth
    FROM (SELECT TOP ({lookahead}) RowVersion, {key} AS k FROM {table} WITH (READPAST) ORDER BY RowVersion) AS prefix
) AS h WHERE k IS NULL OR nth = 1;
WHILE NOT EXISTS (SELECT 1 FROM @received)
BEGIN
    SET @rv = NULL;
    SELECT TOP (1) @rv = RowVersion, @k = k FROM @heads ORDER BY RowVersion;
    IF @rv IS NULL BREAK;
    DELETE FROM @heads WHERE RowVersion = @rv;
    IF @k IS NOT NULL
    BEGIN
        SET @resource = N'throttlehost:' + CONVERT(nvarchar(64), HASHBYTES('SHA2_256', N'{table}|' + @k), 2);
        EXEC @got = sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
        IF @got < 0 CONTINUE;
        SELECT TOP (1) @rv = RowVersion FROM {table} WITH (READPAST)
        WHERE RowVersion <= @rv AND {key} = @k ORDER BY RowVersion;
    END;
    WITH message AS (SELECT TOP (1) * FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) WHERE RowVersion = @rv)
    DELETE FROM message
    OUTPUT deleted.Id, deleted.Expires, deleted.Headers, deleted.Body INTO @received;
    IF @@ROWCOUNT = 0 AND @k IS NOT NULL
        EXEC sp_releaseapplock @Resource = @resource, @LockOwner = 'Transaction';
END;
IF NOT EXISTS (SELECT 1 FROM @received) AND @@TRANCOUNT > 0 COMMIT TRAN;
{READ_RECEIVED};"
    )
}

/// How long a Babelfish claim waits for a row another transaction holds before it gives up
/// on that row (milliseconds). Not 0: `SET LOCK_TIMEOUT 0` may reach PostgreSQL as
/// `lock_timeout = 0`, which there means "wait for ever".
pub const CLAIM_LOCK_TIMEOUT_MS: u32 = 1;

/// Babelfish's claiming receive (see `claim.rs`): deletes the row `skip` places from the
/// head, giving up within [`CLAIM_LOCK_TIMEOUT_MS`] when another transaction holds it.
/// `transactional`: inside a transaction it begins (committed at once when nothing was
/// found); otherwise an autocommit delete (transaction mode `none`). The lock timeout is
/// set back to "wait" before the rows are returned, so the rest of the unit of work (sends,
/// commit) waits as usual. `skip` is a number the host computes, written into the text.
pub fn babelfish_claim(table: &str, skip: u32, transactional: bool) -> String {
    let (begin, end_if_empty) = if transactional {
        (
            "BEGIN TRAN;\n",
            "IF @@ROWCOUNT = 0 AND @@TRANCOUNT > 0 COMMIT TRAN;\n",
        )
    } else {
        ("", "")
    };
    format!(
        "SET LOCK_TIMEOUT {CLAIM_LOCK_TIMEOUT_MS};
{begin}DECLARE @received TABLE (Id uniqueidentifier, Expires datetime, Headers nvarchar(max), Body varbinary(max));
DELETE FROM {table}
OUTPUT deleted.Id, deleted.Expires, deleted.Headers, deleted.Body INTO @received
WHERE RowVersion IN (SELECT RowVersion FROM {table} ORDER BY RowVersion OFFSET {skip} ROWS FETCH NEXT 1 ROWS ONLY);
{end_if_empty}SET LOCK_TIMEOUT -1;
{READ_RECEIVED};"
    )
}

/// Ends a claim attempt that failed on a held row: rolls back whatever the failed batch left
/// open and sets the lock timeout back to "wait".
pub const CLAIM_GIVE_UP: &str = "IF @@TRANCOUNT > 0 ROLLBACK TRAN;\nSET LOCK_TIMEOUT -1;";

/// The most messages one multi-row insert carries: four parameters each, well under SQL
/// Server's 2 100 parameters per request (and its 1 000 rows per table value constructor).
pub const SEND_MANY_ROWS: usize = 500;

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
    /// Builds the statements for `[schema].[queue]` in a dialect.
    pub fn new(schema: &str, queue: &QueueName, dialect: Dialect) -> Self {
        let table = format!("{}.{}", bracket(schema), bracket(queue.as_str()));
        // Inside N'...' literals: names cannot contain quotes (validated). One lock per schema
        // serialises creating the schema and its tables across hosts.
        let lock = format!("throttlehost_create_{schema}");
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
        let end_if_empty = "IF @@ROWCOUNT = 0 AND @@TRANCOUNT > 0 COMMIT TRAN;";
        QueueStatements {
            create: format!(
                "SET XACT_ABORT ON;
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'{lock}', @LockMode = 'Exclusive', @LockOwner = 'Transaction';
IF SCHEMA_ID(N'{schema}') IS NULL EXEC(N'CREATE SCHEMA {sq}');
IF NOT ({exists})
BEGIN
    CREATE TABLE {table} (
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
END
COMMIT TRAN;",
                sq = bracket(schema)
            ),
            drop: format!("IF {exists} DROP TABLE {table};"),
            send_with_recoverable: insert(true, expires, "@P3, @P4"),
            send_without_recoverable: insert(false, expires, "@P3, @P4"),
            send_raw_with_recoverable: insert(true, "NULL", "@P2, @P3"),
            send_raw_without_recoverable: insert(false, "NULL", "@P2, @P3"),
            has_recoverable: format!(
                "SELECT CASE WHEN OBJECT_ID(N'{table}', N'U') IS NULL THEN -1 ELSE (SELECT COUNT(*) FROM sys.columns WHERE object_id = OBJECT_ID(N'{table}', N'U') AND name = N'Recoverable') END;"
            ),
            begin_and_receive: format!("BEGIN TRAN;\n{}", with_end_if_empty(&receive, end_if_empty)),
            commit_and_receive: format!("COMMIT TRAN;\nBEGIN TRAN;\n{}", with_end_if_empty(&receive, end_if_empty)),
            receive,
            peek: match dialect {
                Dialect::Sqlserver => format!(
                    "SELECT ISNULL(CAST(MAX(RowVersion) - MIN(RowVersion) + 1 AS bigint), 0) FROM {table} WITH (READPAST, READCOMMITTEDLOCK);"
                ),
                // Babelfish reads committed data under MVCC and ignores READPAST: rows
                // locked by in-flight receives are counted (an overestimate).
                Dialect::Babelfish => format!(
                    "SELECT ISNULL(CAST(MAX(RowVersion) - MIN(RowVersion) + 1 AS bigint), 0) FROM {table};"
                ),
            },
            purge_expired_batch: format!(
                "DELETE FROM {table} WHERE RowVersion IN (SELECT TOP(@P1) RowVersion FROM {table} WITH (READPAST) WHERE Expires < GETUTCDATE());
SELECT CAST(@@ROWCOUNT AS bigint);"
            ),
            purge: format!("DELETE FROM {table};\nSELECT CAST(@@ROWCOUNT AS bigint);"),
            ordered: false,
            table,
        }
    }

    /// The same statements with receives that keep key order by `key_header`.
    pub fn with_ordering(mut self, key_header: &str, lookahead: u32) -> Self {
        self.begin_and_receive = ordered_receive(&self.table, key_header, lookahead, false);
        self.commit_and_receive = ordered_receive(&self.table, key_header, lookahead, true);
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
