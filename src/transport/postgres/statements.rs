//! SQL text for one PostgreSQL queue table, built once per queue from validated, quoted
//! identifiers. The statements follow the NServiceBus PostgreSQL transport
//! (`PostgreSqlConstants`): same columns, same receive and peek semantics. DDL shipped in
//! `sql/postgres/queue.sql` is the same as [`QueueStatements::create`].

use crate::config::{FailedKey, OrderingConfig};
use crate::message::{EXECUTION_STAGE_HEADER, PREVIOUS_STAGE_HEADER};
use crate::transport::{HeldStatements, QueueName};

/// A received row's `Expires` as text the same whatever the session's `DateStyle` and
/// `TimeZone`: ISO digits with the offset from UTC (`+00` for the NServiceBus `timestamp`
/// column, which holds UTC; the session's offset for a `timestamptz` one). `infinity` comes
/// back NULL, a message that never expires.
const EXPIRES_TEXT: &str = "to_char(rs.Expires, 'YYYY-MM-DD HH24:MI:SS.USOF')";

/// Quotes a validated identifier for PostgreSQL. Names reaching here passed
/// `crate::names`, which rejects `"`; quoting keeps case and dots intact.
pub fn quote_ident(name: &str) -> String {
    debug_assert!(!name.contains('"'));
    format!("\"{name}\"")
}

/// Every statement the transport runs against one queue table.
#[derive(Debug)]
pub struct QueueStatements {
    /// `"schema"."table"`
    pub table: String,
    /// Creates the table (idempotent; run under an advisory lock).
    pub create: String,
    /// The channel the table's inserts notify (see [`QueueStatements::notify_on_insert`]):
    /// `throttlehost_` and a tag of the table's name, within PostgreSQL's 63 bytes.
    pub notify_channel: String,
    /// Inserts a row; `$1` id, `$2` time-to-be-received in ms (NULL = never expires),
    /// `$3` headers, `$4` body. Expiry is computed from the server's clock.
    pub send: String,
    /// Inserts many messages in one statement, in the order given: arrays of ids, times to be
    /// received (ms, NULL for none), headers and bodies.
    pub send_batch: String,
    /// Inserts a row unchanged with no expiry (dead-lettering poison rows).
    pub send_raw: String,
    /// Deletes the oldest row not locked by another receiver; returns id, expired flag,
    /// headers, body, expires and the transaction's id (which tells, after a commit whose
    /// answer was lost, whether it took effect). Expiry is decided by the server and `Expires` comes back as
    /// text (`EXPIRES_TEXT`): a `timestamp` holds values no client date type can
    /// (`infinity`, year 294276), and a row the host cannot decode must not go back to the
    /// head of the queue.
    pub receive: String,
    /// The name [`QueueStatements::receive`] is prepared under with SQL `PREPARE` (see
    /// `pipeline`): unique in the process, new whenever the receive changes.
    pub receive_name: String,
    /// Deletes up to `$1` of the oldest rows not locked by other receivers; returns them
    /// oldest first, in the columns of [`QueueStatements::receive`].
    pub receive_batch: String,
    /// max(Seq) - min(Seq) + 1 over rows not locked by in-flight receives; 0 when empty.
    pub peek: String,
    /// The peek's value as an expression, for reading many queues in one statement.
    pub peek_value: String,
    /// Deletes up to `$1` expired rows not locked by others.
    pub purge_expired_batch: String,
    /// Deletes every row.
    pub purge: String,
    /// Whether [`QueueStatements::receive`] keeps key order (batch receives are refused then).
    pub ordered: bool,
    /// On an ordered queue: of the rows a receive looks at, how many may not run now.
    pub waiting: Option<String>,
    /// On an ordered queue: the expression indexes its receive probes, each as its
    /// schema-qualified name and the DDL that builds it without blocking writes.
    pub ordering_indexes: Vec<OrderingIndex>,
    /// The queue's delayed table, `"schema"."<queue>.Delayed"`, and its statements.
    pub delayed: DelayedStatements,
}

/// The statements of a queue's delayed table, laid out as the NServiceBus PostgreSQL transport
/// creates it (`Id`, `Headers`, `Body`, `Due`, an index on `Due`). Due times are written and
/// compared as NServiceBus does, `(now() AT TIME ZONE 'UTC')` taken as a `timestamptz`, so
/// both movers agree on what is due when they share a server.
#[derive(Debug)]
pub struct DelayedStatements {
    /// `"schema"."<queue>.<suffix>"` (suffix `Delayed` unless configured)
    pub table: String,
    /// Stores a message: `$1` id, `$2` headers (with the forward destination), `$3` body,
    /// `$4` delay in milliseconds from the server's clock.
    pub store: String,
    /// Moves up to `$1` due rows into the queue in one statement, under the queue's mover
    /// lock (`$2`, a transaction-scoped advisory lock that another mover finds taken);
    /// returns moved, whether the lock was had, rows left, and milliseconds until the
    /// earliest finite due time left (NULL when none). A due row whose Id a queued row
    /// already has (rows anyone can write) goes in under a new Id: its headers keep the
    /// message's id, and the queue's primary key failed every move of the table.
    pub move_due: String,
    /// Rows in the table.
    pub count: String,
    /// The schema, unquoted (the DDL below is built when it runs, not kept per queue, and
    /// the catalog names are read by it).
    schema: String,
    /// The table's name, unquoted: `<queue>.<suffix>`.
    name: String,
    /// The table of the old name to adopt, unquoted; None when the suffix is `delayed` itself.
    old_name: Option<String>,
}

impl DelayedStatements {
    fn new(schema: &str, queue: &QueueName, queue_table: &str, suffix: &str) -> Self {
        let name = format!("{}.{suffix}", queue.table());
        let table = format!("{}.{}", quote_ident(schema), quote_ident(&name));
        DelayedStatements {
            store: exact(format!(
                "INSERT INTO {table} (Id, Headers, Body, Due) \
                 VALUES ($1, $2, $3, (now() AT TIME ZONE 'UTC')::timestamptz + ($4::bigint * interval '1 millisecond'))"
            )),
            move_due: exact(format!(
                "WITH mover AS (SELECT pg_try_advisory_xact_lock(hashtext($2)) AS got), \
                 due AS (DELETE FROM {table} WHERE Id IN (SELECT Id FROM {table} \
                 WHERE Due < (now() AT TIME ZONE 'UTC')::timestamptz AND (SELECT got FROM mover) \
                 ORDER BY Due LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING Id, Headers, Body, Due), \
                 moved AS (INSERT INTO {queue_table} (Id, Expires, Headers, Body) \
                 SELECT CASE WHEN EXISTS (SELECT 1 FROM {queue_table} q WHERE q.Id = due.Id) \
                 THEN gen_random_uuid() ELSE due.Id END, NULL, Headers, Body \
                 FROM due ORDER BY Due RETURNING 1) \
                 SELECT (SELECT count(*) FROM moved)::bigint, (SELECT got FROM mover), \
                 ((SELECT count(*) FROM {table}) - (SELECT count(*) FROM due))::bigint, \
                 (SELECT (EXTRACT(EPOCH FROM (min(Due) - (now() AT TIME ZONE 'UTC')::timestamptz)) * 1000)::float8 \
                 FROM {table} WHERE isfinite(Due) AND Id NOT IN (SELECT Id FROM due))"
            )),
            count: exact(format!("SELECT count(*)::bigint FROM {table}")),
            table: exact(table),
            schema: schema.to_string(),
            old_name: (suffix != OLD_DELAYED_SUFFIX)
                .then(|| format!("{}.{OLD_DELAYED_SUFFIX}", queue.table())),
            name,
        }
    }

    /// Creates the table and its index (idempotent; run under an advisory lock).
    pub fn create(&self) -> String {
        let table = &self.table;
        let index = quote_ident(&format!("{}_Due", self.name));
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (
    Id uuid NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
    Headers text NOT NULL,
    Body bytea,
    Due timestamptz NOT NULL
) WITH (fillfactor = 100);
CREATE INDEX IF NOT EXISTS {index} ON {table} (Due)"
        )
    }

    /// Adopts the table the host named `"<queue>.delayed"` before it followed NServiceBus's
    /// name: renames it when the new table is missing, else moves its rows over (a row whose
    /// id is taken gets a new one) and drops it. Returns the rows it moved or renamed, NULL
    /// when there was no old table. Run in the transaction that creates the new table, before
    /// it, under the same lock. None when the suffix is `delayed` itself.
    pub fn adopt_old(&self) -> Option<String> {
        let old_name = self.old_name.as_deref()?;
        Some(adopt_old_delayed_table(
            &self.schema,
            old_name,
            &self.table,
            &self.name,
        ))
    }

    /// The catalog names that say whether the table stands as [`DelayedStatements::create`]
    /// and [`DelayedStatements::adopt_old`] leave it.
    pub(super) fn relations(&self) -> DelayedRelations {
        let at = |name: String| (self.schema.clone(), name);
        DelayedRelations {
            present: [at(format!("{}_Due", self.name)), at(self.name.clone())],
            absent: self.old_name.clone().map(at),
        }
    }
}

/// `s` without the spare capacity `format!` leaves (it reserves about twice its literal
/// text): a host keeps these for every queue, and at 1 000 queues the spare was megabytes.
fn exact(s: String) -> String {
    s.into_boxed_str().into_string()
}

/// The catalog names (schema, name) of a queue's delayed table
/// ([`DelayedStatements::relations`]).
pub(super) struct DelayedRelations {
    /// The table and its index on Due.
    pub present: [(String, String); 2],
    /// The table of the old name, while there is one to adopt.
    pub absent: Option<(String, String)>,
}

/// The suffix this host gave delayed tables before it followed NServiceBus (`"<queue>.delayed"`).
const OLD_DELAYED_SUFFIX: &str = "delayed";

/// See [`DelayedStatements::adopt_old`]. Names are validated (no quotes), so they can sit
/// inside the literals.
fn adopt_old_delayed_table(schema: &str, old_name: &str, table: &str, name: &str) -> String {
    let old = format!("{}.{}", quote_ident(schema), quote_ident(old_name));
    let literal = |s: &str| s.replace('\'', "''");
    let old_index = format!(
        "{}.{}",
        quote_ident(schema),
        quote_ident(&format!("{old_name}_Due"))
    );
    let new_index = quote_ident(&format!("{name}_Due"));
    format!(
        "DO $adopt$
DECLARE adopted bigint;
BEGIN
  IF to_regclass('{old}') IS NULL THEN
    PERFORM set_config('throttlehost.adopted', '', true);
    RETURN;
  END IF;
  IF to_regclass('{table}') IS NULL THEN
    SELECT count(*) INTO adopted FROM {old};
    ALTER TABLE {old} RENAME TO {new};
    ALTER INDEX IF EXISTS {old_index} RENAME TO {new_index};
  ELSE
    INSERT INTO {table} (Id, Headers, Body, Due)
      SELECT CASE WHEN EXISTS (SELECT 1 FROM {table} n WHERE n.Id = o.Id) THEN gen_random_uuid() ELSE o.Id END,
             o.Headers, o.Body, o.Due
      FROM {old} o;
    GET DIAGNOSTICS adopted = ROW_COUNT;
    DROP TABLE {old};
  END IF;
  PERFORM set_config('throttlehost.adopted', adopted::text, true);
END
$adopt$;
SELECT NULLIF(current_setting('throttlehost.adopted', true), '')::bigint",
        old = literal(&old),
        table = literal(table),
        new = quote_ident(name),
    )
}

/// The function and trigger of [`QueueStatements::notify_on_insert`]. Names are validated
/// (no quotes), so they can sit inside the literals.
fn notify_on_insert_sql(schema: &str, table: &str, channel: &str) -> String {
    format!(
        "CREATE OR REPLACE FUNCTION {schema}.throttlehost_notify() RETURNS trigger LANGUAGE plpgsql AS $body$
BEGIN
  PERFORM pg_notify(TG_ARGV[0], '');
  RETURN NULL;
END
$body$;
DO $do$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '{table}'::regclass AND tgname = 'throttlehost_notify') THEN
    CREATE TRIGGER throttlehost_notify AFTER INSERT ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {schema}.throttlehost_notify('{channel}');
  END IF;
END
$do$"
    )
}

/// A name for a receive statement no other in this process has.
fn next_receive_name() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("throttlehost_receive_{n}")
}

impl QueueStatements {
    /// Builds the statements for `queue` (a table of `schema`, or of the schema its address
    /// names), its delayed table `<table>.<delayed_suffix>` beside it.
    pub fn new(schema: &str, queue: &QueueName, delayed_suffix: &str) -> Self {
        let parts = queue.parts();
        let schema = parts.schema.unwrap_or(schema);
        let table = format!("{}.{}", quote_ident(schema), quote_ident(parts.table));
        let notify_channel = format!("throttlehost_{}", crate::names::stable_tag(&table));
        let peek_value = format!(
            "COALESCE(\
             (SELECT Seq FROM {table} ORDER BY Seq DESC LIMIT 1 FOR UPDATE SKIP LOCKED)::bigint - \
             (SELECT Seq FROM {table} ORDER BY Seq ASC LIMIT 1 FOR UPDATE SKIP LOCKED)::bigint + 1, 0)"
        );
        QueueStatements {
            receive_name: next_receive_name(),
            notify_channel,
            create: exact(format!(
                "CREATE TABLE IF NOT EXISTS {table} (
    Id uuid NOT NULL PRIMARY KEY,
    Expires timestamp,
    Headers text NOT NULL,
    Body bytea,
    Seq serial NOT NULL UNIQUE
)"
            )),
            send: exact(format!(
                "INSERT INTO {table} (Id, Expires, Headers, Body) \
                 VALUES ($1, (now() AT TIME ZONE 'UTC') + ($2::bigint * interval '1 millisecond'), $3, $4)"
            )),
            send_batch: exact(format!(
                "INSERT INTO {table} (Id, Expires, Headers, Body) \
                 SELECT m.id, (now() AT TIME ZONE 'UTC') + (m.ttbr * interval '1 millisecond'), m.headers, m.body \
                 FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::bytea[]) WITH ORDINALITY AS m(id, ttbr, headers, body, n) \
                 ORDER BY m.n"
            )),
            send_raw: exact(format!(
                "INSERT INTO {table} (Id, Expires, Headers, Body) VALUES ($1, NULL, $2, $3)"
            )),
            receive: exact(format!(
                "DELETE FROM {table} rs \
                 WHERE rs.Seq = (SELECT Seq FROM {table} ORDER BY Seq LIMIT 1 FOR UPDATE SKIP LOCKED) \
                 RETURNING rs.Id, \
                 CASE WHEN rs.Expires IS NULL OR rs.Expires > (now() AT TIME ZONE 'UTC') THEN false ELSE true END, \
                 rs.Headers, rs.Body, {EXPIRES_TEXT}, txid_current()"
            )),
            receive_batch: exact(format!(
                "WITH taken AS (DELETE FROM {table} rs \
                 WHERE rs.Seq IN (SELECT Seq FROM {table} ORDER BY Seq LIMIT $1 FOR UPDATE SKIP LOCKED) \
                 RETURNING rs.Seq, rs.Id, \
                 CASE WHEN rs.Expires IS NULL OR rs.Expires > (now() AT TIME ZONE 'UTC') THEN false ELSE true END AS expired, \
                 rs.Headers, rs.Body, {EXPIRES_TEXT} AS expires) \
                 SELECT Id, expired, Headers, Body, expires FROM taken ORDER BY Seq"
            )),
            peek: exact(format!("SELECT {peek_value}")),
            peek_value: exact(peek_value),
            purge_expired_batch: exact(format!(
                "DELETE FROM {table} WHERE Seq IN (SELECT Seq FROM {table} \
                 WHERE Expires < (now() AT TIME ZONE 'UTC') LIMIT $1 FOR UPDATE SKIP LOCKED)"
            )),
            purge: exact(format!("DELETE FROM {table}")),
            ordered: false,
            waiting: None,
            ordering_indexes: Vec::new(),
            delayed: DelayedStatements::new(schema, queue, &table, delayed_suffix),
            table: exact(table),
        }
    }

    /// Makes every insert statement into the table (this host's sends, other hosts',
    /// NServiceBus's, the delayed mover's) notify [`QueueStatements::notify_channel`] once,
    /// in its own transaction, so listeners hear of it when the rows are visible: the
    /// schema's `throttlehost_notify()` function and the table's statement trigger, made when
    /// missing (idempotent; run under the schema's advisory lock, see `create_queue`).
    pub fn notify_on_insert(&self) -> String {
        notify_on_insert_sql(schema_of(&self.table), &self.table, &self.notify_channel)
    }

    /// The expression index on `header`'s value, `then` (a column or nothing) after it.
    fn ordering_index(&self, header: &str, then: &str) -> OrderingIndex {
        let table = &self.table;
        let index = index_name(table, header);
        let schema = schema_of(table);
        let columns = match then {
            "" => format!("({})", header_value(header, "Headers")),
            column => format!("({}), {column}", header_value(header, "Headers")),
        };
        OrderingIndex {
            name: format!("{schema}.{index}"),
            create: format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {table} ({columns})"
            ),
        }
    }

    /// The same statements with a receive that keeps the order `ordering` asks for.
    ///
    /// A receive looks at the `lookahead` oldest rows, in order, and takes the first that
    /// may run and is not row-locked (`FOR UPDATE SKIP LOCKED`). A row may run when no older
    /// row has its key and, with stages, no row has its previous stage as its stage. Both
    /// checks read rows whatever their locks: in PostgreSQL a row another receive has
    /// deleted but not committed is still visible (and one rolled back is simply still
    /// there), so a message in flight on any host holds back the rest of its key and the
    /// next stage until its unit of work ends. The key's oldest row is a head whose lock is
    /// skipped while it runs; no lock is taken or held while waiting.
    ///
    /// The header values are read by expressions that expression indexes keep
    /// ([`QueueStatements::ordering_indexes`]), so each check is one index probe and a key is
    /// read from the headers once per row stored, not once per receive.
    pub fn with_ordering(mut self, ordering: &OrderingConfig) -> Self {
        let table = &self.table;
        let key = ordering.key_header();
        let stages = ordering.stages;
        let mut checks = String::new();
        let mut indexes = Vec::new();
        if let Some(header) = key {
            checks.push_str(&format!(
                " AND NOT EXISTS (SELECT 1 FROM {table} o WHERE {} = {} AND o.Seq < t.Seq)",
                header_value(header, "o.Headers"),
                header_value(header, "t.Headers"),
            ));
            indexes.push(self.ordering_index(header, "Seq"));
        }
        if key.is_some() && ordering.failed_key == FailedKey::Hold {
            // A held message stays its key's oldest row, so this one check holds the key.
            let held = held_statements(schema_of(table));
            checks.push_str(&format!(
                " AND NOT EXISTS (SELECT 1 FROM {} h WHERE h.queue_table = {} AND h.message_id = t.Id)",
                held.table,
                sql_literal(table)
            ));
        }
        if stages {
            checks.push_str(&format!(
                " AND NOT EXISTS (SELECT 1 FROM {table} s WHERE {} = {})",
                header_value(EXECUTION_STAGE_HEADER, "s.Headers"),
                header_value(PREVIOUS_STAGE_HEADER, "t.Headers"),
            ));
            indexes.push(self.ordering_index(EXECUTION_STAGE_HEADER, ""));
        }
        // The window's last row: a bound the Seq index scan stops at (int max while fewer).
        let window = format!(
            "t.Seq <= COALESCE((SELECT Seq FROM {table} ORDER BY Seq OFFSET {} LIMIT 1), 2147483647)",
            ordering.lookahead.saturating_sub(1)
        );
        self.receive_name = next_receive_name();
        self.receive = format!(
            "DELETE FROM {table} rs \
             WHERE rs.Seq = (SELECT t.Seq FROM {table} t WHERE {window}{checks} \
             ORDER BY t.Seq LIMIT 1 FOR UPDATE OF t SKIP LOCKED) \
             RETURNING rs.Id, \
             CASE WHEN rs.Expires IS NULL OR rs.Expires > (now() AT TIME ZONE 'UTC') THEN false ELSE true END, \
             rs.Headers, rs.Body, {EXPIRES_TEXT}, txid_current()"
        );
        // Rows of the window that may not run: the complement of the receive's checks.
        let may_run = checks.trim_start_matches(" AND ");
        self.waiting = Some(format!(
            "SELECT count(*) FROM {table} t WHERE {window} AND NOT ({may_run})"
        ));
        self.ordering_indexes = indexes;
        self.ordered = true;
        self
    }
}

/// The quoted schema of a `"schema"."table"`: everything before the `.` that joins them.
fn schema_of(table: &str) -> &str {
    &table[..table.find("\".\"").map_or(0, |at| at + 1)]
}

/// The held-keys table of `schema` (quoted), `"schema".throttlehost_held`: queue tables
/// as `"schema"."table"`; `$1` .. `$4` bound as [`HeldStatements`] says.
pub fn held_statements(schema: &str) -> HeldStatements {
    let table = format!("{schema}.throttlehost_held");
    HeldStatements {
        create: format!(
            "CREATE TABLE IF NOT EXISTS {table} (
    queue_table text NOT NULL,
    message_id uuid NOT NULL,
    key text NOT NULL,
    reason text NOT NULL,
    held_at timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'UTC'),
    PRIMARY KEY (queue_table, message_id)
)"
        ),
        insert: format!(
            "INSERT INTO {table} (queue_table, message_id, key, reason) VALUES ($1, $2, $3, $4) \
             ON CONFLICT DO NOTHING"
        ),
        list: format!(
            "SELECT key, message_id, reason, held_at::text FROM {table} \
             WHERE queue_table = $1 ORDER BY held_at, key"
        ),
        is_held: format!("SELECT 1 FROM {table} WHERE queue_table = $1 AND key = $2 LIMIT 1"),
        release: format!("DELETE FROM {table} WHERE queue_table = $1 AND key = $2"),
        release_all: format!("DELETE FROM {table} WHERE queue_table = $1"),
        table,
    }
}

/// An expression index of an ordered queue.
#[derive(Debug)]
pub struct OrderingIndex {
    /// `"schema".name`, for `to_regclass`.
    pub name: String,
    /// `CREATE INDEX CONCURRENTLY IF NOT EXISTS ...` (outside any transaction).
    pub create: String,
}

/// A stable name for the expression index of `header` on `table` (within PostgreSQL's 63
/// characters, whatever the table's name).
fn index_name(table: &str, header: &str) -> String {
    let id = uuid::Uuid::new_v5(
        &uuid::Uuid::NAMESPACE_OID,
        format!("{table}|{header}").as_bytes(),
    );
    format!("throttlehost_order_{}", &id.simple().to_string()[..16])
}

/// A string as a PostgreSQL literal (standard-conforming strings: only `'` is special).
fn sql_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// A header's value as stored in `column`, the headers' JSON text; NULL when the header is
/// missing or null. Immutable (expression indexes keep it) and never fails, even on headers
/// that are not JSON (poison rows must still reach the dispatcher). The fast path finds
/// `"name":"` (the compact form every JSON writer here produces; inside a string value its
/// quotes would be escaped) and takes the text up to the next quote: a value with an escaped
/// quote is cut there, which can only put two keys together, never one key apart. Other
/// layouts (spaces around the colon) go through a regular expression.
fn header_value(header: &str, column: &str) -> String {
    let escaped: String = header
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' || !c.is_ascii() {
                c.to_string()
            } else {
                format!("\\{c}")
            }
        })
        .collect();
    let compact = sql_literal(&format!("\"{header}\":\""));
    let name = sql_literal(&format!("\"{header}\""));
    let anywhere = sql_literal(&format!(r#"[{{,]\s*"{escaped}"\s*:\s*"((?:[^"\\]|\\.)*)""#));
    format!(
        "(CASE WHEN strpos({column}, {compact}) > 0 THEN split_part(split_part({column}, {compact}, 2), '\"', 1) \
         WHEN strpos({column}, {name}) = 0 THEN NULL \
         ELSE substring({column} from {anywhere}) END)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_and_kept_intact() {
        let s = QueueStatements::new(
            "public",
            &QueueName::new("Sales.Node-1").unwrap(),
            "Delayed",
        );
        assert_eq!(s.table, r#""public"."Sales.Node-1""#);
        assert!(s.receive.contains(r#"FROM "public"."Sales.Node-1" rs"#));
        assert!(s.receive.contains("FOR UPDATE SKIP LOCKED"));
        assert!(
            s.peek
                .contains("ORDER BY Seq DESC LIMIT 1 FOR UPDATE SKIP LOCKED")
        );
    }

    #[test]
    fn receive_returns_the_nservicebus_columns_in_order() {
        let s = QueueStatements::new("s", &QueueName::new("q").unwrap(), "Delayed");
        let returning = s.receive.split("RETURNING").nth(1).unwrap();
        let id = returning.find("rs.Id").unwrap();
        let headers = returning.find("rs.Headers").unwrap();
        let body = returning.find("rs.Body").unwrap();
        assert!(id < headers && headers < body);
    }
}
