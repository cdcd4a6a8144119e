//! SQL text for one SQL Server queue table, built once per queue from validated,
//! bracket-quoted identifiers. The statements follow the NServiceBus SQL Server transport
//! (`SqlServerConstants`): same table, same receive, peek and purge semantics. Values are
//! always bound as parameters (`@P1`...), never spliced.
//!
//! Two dialects: `sqlserver` (the NServiceBus forms) and `babelfish` (Babelfish for
//! PostgreSQL rejects DELETE through a CTE and OUTPUT expressions over `deleted`, and ignores
//! READPAST; see `sql/sqlserver/README.md`).

use crate::config::{Dialect, FailedKey, OrderingConfig};
use crate::message::{EXECUTION_STAGE_HEADER, PREVIOUS_STAGE_HEADER};
use crate::transport::{HeldStatements, QueueName};

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

/// The receive of a queue that keeps an order (per key, stages or both): a transaction begins
/// (or, `after_commit`, the previous one commits first), the oldest message that may run now
/// is deleted into `@received`, and an empty receive ends its transaction. What other receives
/// hold back is guarded by application locks (`sp_getapplock`, owned by the transaction, tried
/// without waiting, so no receive ever waits for a lock or deadlocks on one):
///
/// 1. the `lookahead` oldest rows (on SQL Server those no other receive holds: READPAST), and
///    with a key, of each key the oldest of them (`@heads`); they are tried in order until one
///    is deleted;
/// 2. key: the key's lock (Exclusive) is taken and the key's oldest row at or before the head
///    becomes the candidate (one that an ended receive rolled back comes first). A key's rows
///    are deleted only under its lock, so while one is in flight no receive can take the next.
///    Babelfish reads every row under MVCC and ignores READPAST, so a row another receive is
///    deleting stays visible and its delete would wait for that receive to end: there an
///    unkeyed row is guarded by a lock of its own (its RowVersion), and every row is deleted
///    only by the receive holding its guard, so no delete ever meets another's row lock;
/// 3. stages: the candidate's own stage is locked Shared, before its row is deleted, and held
///    until the unit of work ends, so every message of a stage in flight holds its stage's lock.
///    A candidate with a previous stage then takes that stage's lock Exclusive, looks for a row
///    of the previous stage still in the table, and lets the lock go. Holding the Exclusive
///    lock while it looks closes the race of the original scheme: a message of the previous
///    stage is either in flight (its Shared lock makes the Exclusive one fail), or still a row
///    in the table (it cannot be deleted while the Exclusive lock is held, since its receive
///    must first take the Shared one), or gone;
/// 4. the row is deleted (SQL Server: with the NServiceBus hints); if any step fails, the
///    locks this candidate took are released and the next head is tried.
///
/// Keys and stages are read with `JSON_VALUE` (NULL for headers that are not JSON, or a value
/// over 4 000 characters: such messages are not ordered). A lock's name is a hash of the table
/// and the key or stage, within the 255 characters a resource may have. The look for a row of
/// the previous stage reads the whole queue (there is no index on a header); it runs only for
/// messages that name a previous stage.
pub fn ordered_receive(table: &str, ordering: &OrderingConfig, after_commit: bool) -> String {
    let begin = if after_commit {
        "COMMIT TRAN;\nBEGIN TRAN;"
    } else {
        "BEGIN TRAN;"
    };
    // `failed_key = "hold"`: the held-keys table of the queue's schema.
    let held = (ordering.failed_key == FailedKey::Hold)
        .then(|| held_statements(&table[..table.find("].[").map_or(0, |at| at + 1)]).table);
    let (heads, key_step) = match ordering.key_header() {
        Some(name) => ordered_key_step(table, name, ordering.lookahead, held.as_deref()),
        None => (
            format!(
                "SELECT TOP ({}) RowVersion, NULL FROM {table} WITH (READPAST) ORDER BY RowVersion",
                ordering.lookahead
            ),
            String::new(),
        ),
    };
    let stage_step = if ordering.stages {
        ordered_stage_step(table)
    } else {
        String::new()
    };
    let delete = format!(
        "    WITH message AS (SELECT TOP (1) * FROM {table} WITH (UPDLOCK, READPAST, ROWLOCK) WHERE RowVersion = @rv)
    DELETE FROM message
    OUTPUT deleted.Id, deleted.Expires, deleted.Headers, deleted.Body INTO @received;"
    );
    // Lets go of what a candidate that was not taken locked. (The CTE's WITH must follow a
    // statement that ends with a semicolon, so the delete stays outside any BEGIN block.)
    let release = "        IF @key_lock IS NOT NULL EXEC sp_releaseapplock @Resource = @key_lock, @LockOwner = 'Transaction';
        IF @stage_held = 1 EXEC sp_releaseapplock @Resource = @stage_lock, @LockOwner = 'Transaction';
";
    let sql = format!(
        "{begin}
DECLARE @received TABLE (Id uniqueidentifier, Expires datetime, Headers nvarchar(max), Body varbinary(max));
DECLARE @heads TABLE (RowVersion bigint PRIMARY KEY, k nvarchar(4000) NULL);
DECLARE @rv bigint, @k nvarchar(4000), @got int, @free bit, @stage_held bit;
DECLARE @stage nvarchar(4000), @previous nvarchar(4000);
DECLARE @key_lock nvarchar(255), @stage_lock nvarchar(255), @previous_lock nvarchar(255);
INSERT INTO @heads (RowVersion, k)
{heads};
WHILE NOT EXISTS (SELECT 1 FROM @received)
BEGIN
    SELECT @rv = NULL, @key_lock = NULL, @stage = NULL, @previous = NULL, @free = 1, @stage_held = 0;
    SELECT TOP (1) @rv = RowVersion, @k = k FROM @heads ORDER BY RowVersion;
    IF @rv IS NULL BREAK;
    DELETE FROM @heads WHERE RowVersion = @rv;
{key_step}{stage_step}    IF @free = 0
    BEGIN
{release}        CONTINUE;
    END;
{delete}
    IF @@ROWCOUNT = 0
    BEGIN
{release}    END;
END;
IF NOT EXISTS (SELECT 1 FROM @received) AND @@TRANCOUNT > 0 COMMIT TRAN;
{READ_RECEIVED}
FROM @received;"
    );
    sql
}

/// The messages among an ordered queue's `lookahead` oldest that may not run now: a later
/// message of its key, one whose key a receive holds (its lock cannot be had) or, with
/// `failed_key = "hold"`, is held by a failed message, and one whose previous stage is in
/// flight (the stage's Shared lock is held) or still stored.
///
/// Rows in flight are invisible to READPAST, so the locks tell what they hold back:
/// `APPLOCK_TEST` asks whether a lock could be granted without taking it. The owner is the
/// session, so the count needs no transaction; it runs on a connection that holds no locks,
/// as a lock this session held would test as grantable. The count takes no lock of its own.
///
/// Babelfish ignores READPAST, so rows in flight stay in the window: a key's oldest row whose
/// lock is held is the one in flight there (a receive only takes a key's oldest), not a row
/// waiting, and only the later rows of the key count.
fn ordered_waiting(table: &str, ordering: &OrderingConfig, dialect: Dialect) -> String {
    let mut columns = vec!["RowVersion".to_owned()];
    let mut conditions = Vec::new();
    let busy = |kind: &str, value: &str| {
        format!(
            "APPLOCK_TEST('public', {}, 'Exclusive', 'Session') = 0",
            lock_name(table, kind, value)
        )
    };
    if let Some(name) = ordering.key_header() {
        columns.push(format!("{} AS k", header_value(name)));
        let mut key_waits = vec!["w.nth > 1".to_owned()];
        if dialect == Dialect::Sqlserver {
            key_waits.push(busy("key", "w.k"));
        }
        if ordering.failed_key == FailedKey::Hold {
            let held = held_statements(&table[..table.find("].[").map_or(0, |at| at + 1)]).table;
            key_waits.push(format!(
                "EXISTS (SELECT 1 FROM {held} h WHERE h.queue_table = N'{table}' AND h.[key] = w.k)"
            ));
        }
        conditions.push(format!(
            "(w.k IS NOT NULL AND ({}))",
            key_waits.join(" OR ")
        ));
    } else {
        columns.push("CAST(NULL AS nvarchar(4000)) AS k".to_owned());
    }
    if ordering.stages {
        columns.push(format!(
            "{} AS previous",
            header_value(PREVIOUS_STAGE_HEADER)
        ));
        // Babelfish: rows of the previous stage in flight are still visible, and no lock may
        // be tested there (see `babelfish_ordered_candidates`).
        let in_flight = match dialect {
            Dialect::Sqlserver => format!("{} OR ", busy("stage", "w.previous")),
            Dialect::Babelfish => String::new(),
        };
        conditions.push(format!(
            "(w.previous IS NOT NULL AND ({in_flight}EXISTS (SELECT 1 FROM {table} s WITH (READPAST) WHERE {} = w.previous)))",
            header_value(EXECUTION_STAGE_HEADER),
        ));
    }
    format!(
        "SELECT CAST(COUNT(*) AS bigint) FROM (
    SELECT *, ROW_NUMBER() OVER (PARTITION BY k ORDER BY RowVersion) AS nth
    FROM (SELECT TOP ({}) {} FROM {table} WITH (READPAST) ORDER BY RowVersion) AS prefix
) AS w
WHERE {};",
        ordering.lookahead,
        columns.join(", "),
        conditions.join("\n   OR ")
    )
}

/// A header's value in a queue row, NULL when the headers are not JSON.
fn header_value(name: &str) -> String {
    format!("CASE WHEN ISJSON(Headers) = 1 THEN JSON_VALUE(Headers, N'$.\"{name}\"') END")
}

/// An application lock's name: `throttlehost:<kind>:<table tag>:` and `value` (an
/// expression), within the 255 characters a resource may have. A value of up to 200
/// characters is used as it is; a longer one is cut to 180 and followed by its `CHECKSUM` and
/// length (two long values that share all three share a lock, which only serialises them).
///
/// No binary value is converted to text: Babelfish ignores `CONVERT`'s style argument and
/// decodes the bytes as WIN1252 text (a SHA-256 hash failed that way for about half of all
/// keys), and it casts binary to integers through text as well.
fn lock_name(table: &str, kind: &str, value: &str) -> String {
    let tag = table_tag(table);
    format!(
        "N'throttlehost:{kind}:{tag}:' + CASE WHEN LEN({value}) <= 200 THEN {value} \
         ELSE LEFT({value}, 180) + N'~' + CONVERT(nvarchar(12), CHECKSUM({value})) + N'~' + CONVERT(nvarchar(12), LEN({value})) END"
    )
}

/// A table's tag in lock names: FNV-1a (64 bits) of its quoted name in hex, computed here so
/// that every host writes the same name and the statement converts nothing.
fn table_tag(table: &str) -> String {
    crate::names::stable_tag(table)
}

/// Per-key order ([`ordered_receive`] step 2): the candidates (each key's oldest in the
/// window, and every unkeyed row) and the step that locks the key and moves the candidate to
/// the key's oldest row.
/// With `held` (the held-keys table), a candidate that holds its key is passed over, and
/// with it the key: it is the key's oldest row.
fn ordered_key_step(
    table: &str,
    key_header: &str,
    lookahead: u32,
    held: Option<&str>,
) -> (String, String) {
    let key = header_value(key_header);
    let held_check = match held {
        Some(held) => format!(
            "        IF EXISTS (SELECT 1 FROM {held} h JOIN {table} m WITH (READPAST) ON m.Id = h.message_id
                   WHERE h.queue_table = N'{table}' AND m.RowVersion = @rv)
        BEGIN
            EXEC sp_releaseapplock @Resource = @key_lock, @LockOwner = 'Transaction';
            CONTINUE;
        END;
"
        ),
        None => String::new(),
    };
    let heads = format!(
        "SELECT RowVersion, k FROM (
    SELECT RowVersion, k, ROW_NUMBER() OVER (PARTITION BY k ORDER BY RowVersion) AS nth
    FROM (SELECT TOP ({lookahead}) RowVersion, {key} AS k FROM {table} WITH (READPAST) ORDER BY RowVersion) AS prefix
) AS h WHERE k IS NULL OR nth = 1"
    );
    let step = format!(
        "    IF @k IS NOT NULL
    BEGIN
        SET @key_lock = {};
        EXEC @got = sp_getapplock @Resource = @key_lock, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
        IF @got < 0 CONTINUE;
        SELECT TOP (1) @rv = RowVersion FROM {table} WITH (READPAST)
        WHERE RowVersion <= @rv AND {key} = @k ORDER BY RowVersion;
{held_check}    END;
",
        lock_name(table, "key", "@k")
    );
    (heads, step)
}

/// Ordered stages ([`ordered_receive`] step 3): the candidate's own stage locked Shared, and
/// the previous stage's lock held Exclusive around the look for its rows.
fn ordered_stage_step(table: &str) -> String {
    let stage = header_value(EXECUTION_STAGE_HEADER);
    let previous = header_value(PREVIOUS_STAGE_HEADER);
    format!(
        "    SELECT @stage = {stage}, @previous = {previous} FROM {table} WITH (READPAST) WHERE RowVersion = @rv;
    IF @stage IS NOT NULL
    BEGIN
        SET @stage_lock = {};
        EXEC @got = sp_getapplock @Resource = @stage_lock, @LockMode = 'Shared', @LockOwner = 'Transaction', @LockTimeout = 0;
        SET @stage_held = CASE WHEN @got < 0 THEN 0 ELSE 1 END;
        IF @stage_held = 0 SET @free = 0;
    END;
    IF @free = 1 AND @previous IS NOT NULL
    BEGIN
        SET @previous_lock = {};
        EXEC @got = sp_getapplock @Resource = @previous_lock, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
        IF @got < 0 SET @free = 0;
        IF @got >= 0
        BEGIN
            IF EXISTS (SELECT 1 FROM {table} WITH (READPAST) WHERE {stage} = @previous) SET @free = 0;
            EXEC sp_releaseapplock @Resource = @previous_lock, @LockOwner = 'Transaction';
        END;
    END;
",
        lock_name(table, "stage", "@stage"),
        lock_name(table, "stage", "@previous"),
    )
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

/// An ordered queue's claim candidates on Babelfish, oldest first: of the `lookahead`
/// oldest rows, each key's oldest and every unkeyed row; with `failed_key = "hold"` not of a
/// held key; with stages not of a stage whose previous stage still has rows.
///
/// Babelfish ignores READPAST and reads committed rows under MVCC, so a row in flight stays
/// visible until its receive commits: a key's oldest row is the one in flight when there is
/// one (the claim on it fails on its row lock and moves on), a later row of the key is never
/// a candidate, and a previous stage's rows in flight count as rows. No application lock is
/// needed, and none may be asked for: Babelfish 4.2 leaks an error-stack entry for every
/// refused `sp_getapplock` and every `APPLOCK_TEST` that answers 0, and its server process
/// aborts at the fifth in a session (`PANIC: ERRORDATA_STACK_SIZE exceeded`), restarting the
/// whole server.
pub fn babelfish_ordered_candidates(table: &str, ordering: &OrderingConfig) -> String {
    let key = match ordering.key_header() {
        Some(name) => header_value(name),
        None => "CAST(NULL AS nvarchar(4000))".to_owned(),
    };
    let mut filters = vec!["(h.k IS NULL OR h.nth = 1)".to_owned()];
    if ordering.key_header().is_some() && ordering.failed_key == FailedKey::Hold {
        let held = held_statements(&table[..table.find("].[").map_or(0, |at| at + 1)]).table;
        filters.push(format!(
            "(h.k IS NULL OR NOT EXISTS (SELECT 1 FROM {held} x WHERE x.queue_table = N'{table}' AND x.[key] = h.k))"
        ));
    }
    let previous = if ordering.stages {
        filters.push(format!(
            "(h.previous IS NULL OR NOT EXISTS (SELECT 1 FROM {table} s WHERE {} = h.previous))",
            header_value(EXECUTION_STAGE_HEADER)
        ));
        format!(", {} AS previous", header_value(PREVIOUS_STAGE_HEADER))
    } else {
        String::new()
    };
    format!(
        "SELECT h.RowVersion FROM (
    SELECT w.*, ROW_NUMBER() OVER (PARTITION BY w.k ORDER BY w.RowVersion) AS nth
    FROM (SELECT TOP ({}) RowVersion, {key} AS k{previous} FROM {table} ORDER BY RowVersion) AS w
) AS h
WHERE {}{AND_NOT_HELD}
ORDER BY h.RowVersion",
        ordering.lookahead,
        filters.join("\n  AND ")
    )
}

/// How long a Babelfish claim waits for a row another transaction holds before it gives up
/// on that row (milliseconds). Not 0: `SET LOCK_TIMEOUT 0` may reach PostgreSQL as
/// `lock_timeout = 0`, which there means "wait for ever".
pub const CLAIM_LOCK_TIMEOUT_MS: u32 = 1;

/// Babelfish's look-up of the rows a claim may take (see `claim.rs`): up to `n` RowVersions
/// of `from` (every row, or on an ordered queue the rows that may run), oldest first, passing
/// over the `excluded` rows this host holds and `skip` more. A read: it waits for no lock.
pub fn babelfish_candidates(from: &str, (excluded, skip): (&[i64], u32), n: usize) -> String {
    let not_held = |lead: &str| match excluded {
        [] => String::new(),
        rows => {
            let rows: Vec<String> = rows.iter().map(i64::to_string).collect();
            format!("{lead}RowVersion NOT IN ({})", rows.join(", "))
        }
    };
    let from = from
        .replace(WHERE_NOT_HELD, &not_held(" WHERE "))
        .replace(AND_NOT_HELD, &not_held("\n  AND h."));
    format!("{from} OFFSET {skip} ROWS FETCH NEXT {n} ROWS ONLY;")
}

/// Babelfish's claiming receive (see `claim.rs`): deletes exactly the `row_versions` a
/// look-up found ([`babelfish_candidates`]), giving up within [`CLAIM_LOCK_TIMEOUT_MS`] when
/// another transaction holds one, and sends them back as `CLAIM_OUTPUT` says. On an ordered
/// queue the look-up has already decided that the rows may run, and nothing can change that
/// before the claim: a key's next row is a candidate only once the one before it has gone,
/// a key is held by the commit that removes its failed row, and a stage opens only when the
/// previous one has no rows left. `transactional`: inside a transaction it begins, which an
/// empty claim leaves for the host to end ([`CLAIM_GIVE_UP`]: on Babelfish `@@ROWCOUNT` is 0
/// after a `DELETE ... OUTPUT` to the client, so the statement cannot tell); otherwise an
/// autocommit delete (transaction mode `none`). The lock timeout is set back to "wait" before
/// the statement ends, so the rest of the unit of work (sends, commit) waits as usual. The
/// RowVersions are numbers the host read, written into the text.
pub fn babelfish_claim(table: &str, row_versions: &[i64], transactional: bool) -> String {
    let rows: Vec<String> = row_versions.iter().map(i64::to_string).collect();
    let begin = if transactional { "BEGIN TRAN;\n" } else { "" };
    format!(
        "SET LOCK_TIMEOUT {CLAIM_LOCK_TIMEOUT_MS};
{begin}DELETE FROM {table}
{CLAIM_OUTPUT}
WHERE RowVersion IN ({});
SET LOCK_TIMEOUT -1;",
        rows.join(", ")
    )
}

/// Babelfish's warm-up of a queue for a connection ([`super::pool::WarmUp`]): an autocommit
/// claim of RowVersion -1, which no row has (the identity starts at 1), so it deletes nothing
/// and runs the statement a claim runs.
pub fn babelfish_warm_up(table: &str) -> String {
    babelfish_claim(table, &[-1], false)
}

/// Where a claim's candidates name the rows this host holds ([`babelfish_claim`]): in a
/// query without a WHERE clause, and in one with.
const WHERE_NOT_HELD: &str = "/*where not held*/";
const AND_NOT_HELD: &str = "/*and not held*/";

/// Ends a claim attempt that failed on a held row or found nothing: rolls back whatever it
/// left open (nothing was taken) and sets the lock timeout back to "wait".
pub const CLAIM_GIVE_UP: &str = "IF @@TRANCOUNT > 0 ROLLBACK TRAN;\nSET LOCK_TIMEOUT -1;";

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
