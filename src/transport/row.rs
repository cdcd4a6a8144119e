//! A row a SQL transport received: as read (`RawRow`), what it became (`payload_of`: a
//! message, an expired row or a poison row, which keeps its raw headers and body), and its
//! headers and body in wire form again for the error queue (`kept_row`). Shared by the open
//! receive (`unit_of_work`) and the batch receive (`batch`).

use uuid::Uuid;

use super::{Payload, headers};
use crate::message::Message;

/// What a received row became, with its raw headers and body when they could not be parsed.
pub(crate) type ReceivedRow = (Payload, Option<(String, Vec<u8>)>);

/// A received row as the SQL transports read it, before its headers are parsed.
pub(crate) struct RawRow {
    pub id: Uuid,
    pub expired: bool,
    pub headers: String,
    pub body: Vec<u8>,
    pub expires: Option<chrono::NaiveDateTime>,
    /// The id of the transaction that removed the row, where the server tells it
    /// (PostgreSQL).
    pub transaction: Option<i64>,
}

/// What a received row becomes: a message, an expired row, or a poison row (whose raw headers
/// and body are returned for dead-lettering it unchanged).
pub(crate) fn payload_of(row: RawRow) -> ReceivedRow {
    use chrono::TimeZone;
    if row.expired {
        return (Payload::Expired { id: row.id }, None);
    }
    match headers::parse_headers(&row.headers) {
        Ok(parsed) => (
            Payload::Message(Message {
                id: row.id,
                headers: parsed,
                body: row.body,
                expires: row.expires.map(|e| chrono::Utc.from_utc_datetime(&e)),
            }),
            None,
        ),
        Err(reason) => (
            Payload::Poison { id: row.id, reason },
            Some((row.headers, row.body)),
        ),
    }
}

/// A received row's headers and body in wire form, when they are known.
pub(crate) fn kept_row(
    payload: &Payload,
    raw: &Option<(String, Vec<u8>)>,
) -> Option<(String, Vec<u8>)> {
    match (payload, raw) {
        (_, Some((headers, body))) => Some((headers.clone(), body.clone())),
        (Payload::Message(m), None) => {
            Some((headers::serialize_headers(&m.headers), m.body.clone()))
        }
        (_, None) => None,
    }
}
