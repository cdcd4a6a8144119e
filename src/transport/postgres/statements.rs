//! SQL text for one PostgreSQL queue table, built once per queue from validated, quoted
//! identifiers. The statements follow the NServiceBus PostgreSQL transport
//! (`PostgreSqlConstants`): same columns, same receive and peek semantics. DDL shipped in
//! `sql/postgres/queue.sql` is the same as [`QueueStatements::create`].

use crate::transport::QueueName;

/// Quotes a validated identifier for PostgreSQL. Names reaching here passed
/// [`crate::transport::names`], which rejects `"`; quoting keeps case and dots intact.
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
    /// Inserts a row; `$1` id, `$2` time-to-be-received in ms (NULL = never expires),
    /// `$3` headers, `$4` body. Expiry is computed from the server's clock.
    pub send: String,
    /// Inserts many messages in one statement, in the order given: arrays of ids, times to be
    /// received (ms, NULL for none), headers and bodies.
    pub send_batch: String,
    /// Inserts a row unchanged with no expiry (dead-lettering poison rows).
    pub send_raw: String,
    /// Deletes the oldest row not locked by another receiver; returns id, expired flag,
    /// headers, body, expires. Expiry is decided by the server and `Expires` comes back as
    /// text: a `timestamp` holds values no client date type can (`infinity`, year 294276),
    /// and a row the host cannot decode must not go back to the head of the queue.
    pub receive: String,
    /// Deletes up to `$1` of the oldest rows not locked by other receivers; returns them
    /// oldest first, in the columns of [`QueueStatements::receive`].
    pub receive_batch: String,
    /// max(Seq) - min(Seq) + 1 over rows not locked by in-flight receives; 0 when empty.
    pub peek: String,
    /// Deletes up to `$1` expired rows not locked by others.
    pub purge_expired_batch: String,
    /// Deletes every row.
    pub purge: String,
}

impl QueueStatements {
    /// Builds the statements for `schema`.`queue`.
    pub fn new(schema: &str, queue: &QueueName) -> Self {
        let table = format!("{}.{}", quote_ident(schema), quote_ident(queue.as_str()));
        QueueStatements {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {table} (
    Id uuid NOT NULL PRIMARY KEY,
    Expires timestamp,
    Headers text NOT NULL,
    Body bytea,
    Seq serial NOT NULL UNIQUE
)"
            ),
            send: format!(
                "INSERT INTO {table} (Id, Expires, Headers, Body) \
                 VALUES ($1, (now() AT TIME ZONE 'UTC') + ($2::bigint * interval '1 millisecond'), $3, $4)"
            ),
            send_batch: format!(
                "INSERT INTO {table} (Id, Expires, Headers, Body) \
                 SELECT m.id, (now() AT TIME ZONE 'UTC') + (m.ttbr * interval '1 millisecond'), m.headers, m.body \
                 FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::bytea[]) WITH ORDINALITY AS m(id, ttbr, headers, body, n) \
                 ORDER BY m.n"
            ),
            send_raw: format!(
                "INSERT INTO {table} (Id, Expires, Headers, Body) VALUES ($1, NULL, $2, $3)"
            ),
            receive: format!(
                "DELETE FROM {table} rs \
                 WHERE rs.Seq = (SELECT Seq FROM {table} ORDER BY Seq LIMIT 1 FOR UPDATE SKIP LOCKED) \
                 RETURNING rs.Id, \
                 CASE WHEN rs.Expires IS NULL OR rs.Expires > (now() AT TIME ZONE 'UTC') THEN false ELSE true END, \
                 rs.Headers, rs.Body, rs.Expires::text"
            ),
            receive_batch: format!(
                "WITH taken AS (DELETE FROM {table} rs \
                 WHERE rs.Seq IN (SELECT Seq FROM {table} ORDER BY Seq LIMIT $1 FOR UPDATE SKIP LOCKED) \
                 RETURNING rs.Seq, rs.Id, \
                 CASE WHEN rs.Expires IS NULL OR rs.Expires > (now() AT TIME ZONE 'UTC') THEN false ELSE true END AS expired, \
                 rs.Headers, rs.Body, rs.Expires::text AS expires) \
                 SELECT Id, expired, Headers, Body, expires FROM taken ORDER BY Seq"
            ),
            peek: format!(
                "SELECT COALESCE(\
                 (SELECT Seq FROM {table} ORDER BY Seq DESC LIMIT 1 FOR UPDATE SKIP LOCKED)::bigint - \
                 (SELECT Seq FROM {table} ORDER BY Seq ASC LIMIT 1 FOR UPDATE SKIP LOCKED)::bigint + 1, 0)"
            ),
            purge_expired_batch: format!(
                "DELETE FROM {table} WHERE Seq IN (SELECT Seq FROM {table} \
                 WHERE Expires < (now() AT TIME ZONE 'UTC') LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            purge: format!("DELETE FROM {table}"),
            table,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_and_kept_intact() {
        let s = QueueStatements::new("public", &QueueName::new("Sales.Node-1").unwrap());
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
        let s = QueueStatements::new("s", &QueueName::new("q").unwrap());
        let returning = s.receive.split("RETURNING").nth(1).unwrap();
        let id = returning.find("rs.Id").unwrap();
        let headers = returning.find("rs.Headers").unwrap();
        let body = returning.find("rs.Body").unwrap();
        assert!(id < headers && headers < body);
    }
}
