//! The per-message receive as one simple query: `[COMMIT;] BEGIN; EXECUTE <receive>`.
//!
//! PostgreSQL answers every protocol-level query with a `ReadyForQuery` and flushes its
//! output there. `COMMIT; BEGIN` as one query and the receive as another (extended protocol)
//! cost two answers and often two wake-ups of the host per message; one simple query that
//! runs the receive prepared under a SQL name (`PREPARE`, once per connection: see
//! `Inner::prepare_receive`) costs one, as pgbench's one-statement transaction does. The
//! price is the text format: the row comes back as text, `Body` as `bytea` text (hex, twice
//! its size on the wire, or escape when the server is set so), decoded here. Batch receives
//! and mode `none` keep the binary format.
//!
//! The replies are read one by one, so what each statement did is known: a connection that
//! dies right after the COMMIT took effect has still sent the COMMIT's completion, and a
//! BEGIN that failed ran no receive (the server skips the rest of a failed query).

use futures_util::StreamExt;
use tokio_postgres::{Client, SimpleQueryMessage, SimpleQueryRow};
use uuid::Uuid;

use super::map_error;
use super::receive::parse_expires;
use crate::transport::row::RawRow;
use crate::transport::{QueueName, TransportError};

/// A receive's outcome: the row it took, if any, or why there is none.
pub(super) type ReceivedRow = Result<Option<RawRow>, TransportError>;

/// What `[COMMIT;] BEGIN; EXECUTE <receive>` did, statement by statement.
pub(super) struct Pipelined {
    /// The COMMIT's outcome (`Ok` when none was asked for).
    pub committed: Result<(), tokio_postgres::Error>,
    /// The BEGIN's; `None` when it never ran (the COMMIT failed).
    pub begun: Option<Result<(), tokio_postgres::Error>>,
    /// The receive's row, if it took one; `None` when it never ran.
    pub received: Option<Result<Option<SimpleQueryRow>, tokio_postgres::Error>>,
}

impl Pipelined {
    /// The COMMIT's outcome and the receive's as the transport reports them: the row taken,
    /// if any, or why there is none; `None` when the COMMIT failed and nothing after it ran.
    pub(super) fn outcome(
        self,
        queue: &QueueName,
    ) -> (Result<(), TransportError>, Option<ReceivedRow>) {
        let committed = self.committed.map_err(|e| map_error(e, Some(queue)));
        let received = match (self.begun, self.received) {
            (None, _) => None,
            (Some(Err(e)), _) | (Some(Ok(())), Some(Err(e))) => {
                Some(Err(map_error(e, Some(queue))))
            }
            (Some(Ok(())), Some(Ok(None))) => Some(Ok(None)),
            (Some(Ok(())), Some(Ok(Some(row)))) => {
                Some(decode_text_row(&row).map(Some).map_err(|e| {
                    TransportError::database(format!(
                        "queue `{queue}` has columns of unexpected types: {e}"
                    ))
                }))
            }
            (Some(Ok(())), None) => Some(Err(TransportError::database(format!(
                "the server ended the receive from queue `{queue}` without its answer"
            )))),
        };
        (committed, received)
    }
}

/// Runs `[COMMIT;] BEGIN; EXECUTE <receive>` as one query on `client` (`commit`: end the
/// transaction open on it first) and reads what each statement did.
pub(super) async fn begin_and_receive(client: &Client, commit: bool, receive: &str) -> Pipelined {
    let sql = if commit {
        format!("COMMIT; BEGIN; EXECUTE {}", receive)
    } else {
        format!("BEGIN; EXECUTE {}", receive)
    };
    let mut outcome = Pipelined {
        committed: Ok(()),
        begun: None,
        received: None,
    };
    // The statement the next reply belongs to.
    let mut stage = if commit { Stage::Commit } else { Stage::Begin };
    let mut row = None;
    let replies = match client.simple_query_raw(&sql).await {
        Ok(replies) => replies,
        Err(e) => {
            stage.fail(&mut outcome, e);
            return outcome;
        }
    };
    futures_util::pin_mut!(replies);
    while let Some(reply) = replies.next().await {
        match reply {
            Ok(SimpleQueryMessage::CommandComplete(_)) => {
                stage = stage.complete(&mut outcome, row.take());
            }
            Ok(SimpleQueryMessage::Row(r)) => row = Some(r),
            Ok(_) => {}
            Err(e) => {
                stage.fail(&mut outcome, e);
                return outcome;
            }
        }
    }
    outcome
}

/// The statement of the query whose reply comes next.
#[derive(Clone, Copy)]
enum Stage {
    Commit,
    Begin,
    Receive,
    Done,
}

impl Stage {
    /// Records that this statement completed; the next one.
    fn complete(self, outcome: &mut Pipelined, row: Option<SimpleQueryRow>) -> Stage {
        match self {
            Stage::Commit => Stage::Begin,
            Stage::Begin => {
                outcome.begun = Some(Ok(()));
                Stage::Receive
            }
            Stage::Receive => {
                outcome.received = Some(Ok(row));
                Stage::Done
            }
            Stage::Done => Stage::Done,
        }
    }

    /// Records that this statement failed (the server skips the rest of the query).
    fn fail(self, outcome: &mut Pipelined, e: tokio_postgres::Error) {
        match self {
            Stage::Commit => outcome.committed = Err(e),
            Stage::Begin => outcome.begun = Some(Err(e)),
            Stage::Receive => outcome.received = Some(Err(e)),
            Stage::Done => {}
        }
    }
}

/// Reads a received row in text format: id, expired flag (`t`/`f`), headers, body (`bytea`
/// text), expiry.
pub(super) fn decode_text_row(row: &SimpleQueryRow) -> Result<RawRow, String> {
    let column = |i: usize| row.try_get(i).map_err(|e| e.to_string());
    let id = column(0)?.ok_or("Id is NULL")?;
    let id = Uuid::parse_str(id).map_err(|e| format!("Id `{id}` is not a uuid: {e}"))?;
    let expired = column(1)? == Some("t");
    let headers = column(2)?.ok_or("Headers is NULL")?.to_owned();
    let body = match column(3)? {
        Some(text) => decode_bytea(text)?,
        None => Vec::new(),
    };
    let expires = column(4)?.and_then(parse_expires);
    // Absent from receives that do not return it (batch receives).
    let transaction = row.try_get(5).ok().flatten().and_then(|t| t.parse().ok());
    Ok(RawRow {
        id,
        expired,
        headers,
        body,
        expires,
        transaction,
    })
}

/// Hex digit values by byte; 255 for bytes that are not hex digits.
const HEX: [u8; 256] = {
    let mut table = [255u8; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        table[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

/// Decodes `bytea` in PostgreSQL's text output: hex (`\x0a1b`, the default) or escape (bytes
/// as they are, `\\` for a backslash, `\ooo` octal for the rest).
fn decode_bytea(text: &str) -> Result<Vec<u8>, String> {
    let bad = || {
        format!(
            "Body is not bytea text: `{}`",
            text.get(..40).unwrap_or(text)
        )
    };
    if let Some(hex) = text.strip_prefix("\\x") {
        let hex = hex.as_bytes();
        if hex.len() % 2 != 0 {
            return Err(bad());
        }
        let mut out = Vec::with_capacity(hex.len() / 2);
        for pair in hex.chunks_exact(2) {
            match (HEX[pair[0] as usize], HEX[pair[1] as usize]) {
                (hi, lo) if hi < 16 && lo < 16 => out.push(hi << 4 | lo),
                _ => return Err(bad()),
            }
        }
        return Ok(out);
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1)) {
            (b'\\', Some(b'\\')) => {
                out.push(b'\\');
                i += 2;
            }
            (b'\\', _) => {
                let octal = bytes.get(i + 1..i + 4).ok_or_else(bad)?;
                let value = std::str::from_utf8(octal)
                    .ok()
                    .and_then(|s| u8::from_str_radix(s, 8).ok())
                    .ok_or_else(bad)?;
                out.push(value);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::decode_bytea;

    #[test]
    fn bytea_hex_decodes() {
        assert_eq!(decode_bytea("\\x").unwrap(), b"");
        assert_eq!(decode_bytea("\\x00ff7B0a").unwrap(), vec![0, 255, 0x7b, 10]);
    }

    #[test]
    fn bytea_escape_decodes() {
        assert_eq!(decode_bytea("ab\\\\c\\000\\377").unwrap(), b"ab\\c\0\xff");
    }

    #[test]
    fn bad_bytea_is_an_error_naming_the_column() {
        for bad in ["\\x0", "\\xzz", "a\\9"] {
            let e = decode_bytea(bad).unwrap_err();
            assert!(e.contains("Body"), "{e}");
        }
    }
}
