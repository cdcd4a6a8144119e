//! Babelfish's claims: it ignores READPAST, so receives pick candidates and claim them under a 1 ms
//! lock timeout.

use crate::config::{FailedKey, OrderingConfig};
use crate::message::{EXECUTION_STAGE_HEADER, PREVIOUS_STAGE_HEADER};

use super::ordered::header_value;
use super::{CLAIM_OUTPUT, held_statements};

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

/// Babelfish's warm-up of a queue for a connection ([`super::super::pool::WarmUp`]): an autocommit
/// claim of RowVersion -1, which no row has (the identity starts at 1), so it deletes nothing
/// and runs the statement a claim runs.
pub fn babelfish_warm_up(table: &str) -> String {
    babelfish_claim(table, &[-1], false)
}

/// Where a claim's candidates name the rows this host holds ([`babelfish_claim`]): in a
/// query without a WHERE clause, and in one with.
pub(super) const WHERE_NOT_HELD: &str = "/*where not held*/";
pub(super) const AND_NOT_HELD: &str = "/*and not held*/";

/// Ends a claim attempt that failed on a held row or found nothing: rolls back whatever it
/// left open (nothing was taken) and sets the lock timeout back to "wait".
pub const CLAIM_GIVE_UP: &str = "IF @@TRANCOUNT > 0 ROLLBACK TRAN;\nSET LOCK_TIMEOUT -1;";
