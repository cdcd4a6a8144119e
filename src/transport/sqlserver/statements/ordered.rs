//! The statements of a queue that keeps an order: the ordered receive under application locks, and
//! the count of what waits.

use crate::config::{Dialect, FailedKey, OrderingConfig};
use crate::message::{EXECUTION_STAGE_HEADER, PREVIOUS_STAGE_HEADER};

use super::{READ_RECEIVED, held_statements};

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
pub(super) fn ordered_waiting(table: &str, ordering: &OrderingConfig, dialect: Dialect) -> String {
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
pub(super) fn header_value(name: &str) -> String {
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
pub(super) fn lock_name(table: &str, kind: &str, value: &str) -> String {
    let tag = table_tag(table);
    format!(
        "N'throttlehost:{kind}:{tag}:' + CASE WHEN LEN({value}) <= 200 THEN {value} \
         ELSE LEFT({value}, 180) + N'~' + CONVERT(nvarchar(12), CHECKSUM({value})) + N'~' + CONVERT(nvarchar(12), LEN({value})) END"
    )
}

/// A table's tag in lock names: FNV-1a (64 bits) of its quoted name in hex, computed here so
/// that every host writes the same name and the statement converts nothing.
pub(super) fn table_tag(table: &str) -> String {
    crate::names::stable_tag(table)
}

/// Per-key order ([`ordered_receive`] step 2): the candidates (each key's oldest in the
/// window, and every unkeyed row) and the step that locks the key and moves the candidate to
/// the key's oldest row.
/// With `held` (the held-keys table), a candidate that holds its key is passed over, and
/// with it the key: it is the key's oldest row.
pub(super) fn ordered_key_step(
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
pub(super) fn ordered_stage_step(table: &str) -> String {
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
