//! One failed message as an operator reads it: headers, the exception and its stack trace,
//! the retries it had, and its body shown as text, JSON or hex, cut when large.

use serde::Serialize;
use uuid::Uuid;

use super::Cause;
use crate::message::Headers;
use crate::transport::failed::StoredRow;
use crate::transport::headers::parse_headers;

/// A body made readable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BodyView {
    /// `json`, `text` or `binary` (shown as hex).
    pub kind: &'static str,
    /// The body's size in bytes.
    pub size: usize,
    /// What is shown: pretty-printed JSON, the text, or hex pairs.
    pub shown: String,
    /// Whether `shown` stops before the end of the body.
    pub cut: bool,
}

impl BodyView {
    /// `body` shown with at most `limit` bytes of it.
    pub fn of(body: &[u8], limit: usize) -> BodyView {
        let size = body.len();
        if let Ok(text) = std::str::from_utf8(body) {
            if let Ok(json) = serde_json::from_str::<serde_json::Value>(text)
                && (json.is_object() || json.is_array())
            {
                let pretty = serde_json::to_string_pretty(&json).unwrap_or_default();
                let (shown, cut) = cut_text(&pretty, limit);
                return BodyView {
                    kind: "json",
                    size,
                    shown,
                    cut,
                };
            }
            if !text.chars().any(|c| c.is_control() && !c.is_whitespace()) {
                let (shown, cut) = cut_text(text, limit);
                return BodyView {
                    kind: "text",
                    size,
                    shown,
                    cut,
                };
            }
        }
        let shown_bytes = &body[..size.min(limit / 2)];
        BodyView {
            kind: "binary",
            size,
            shown: shown_bytes
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" "),
            cut: shown_bytes.len() < size,
        }
    }
}

/// `text` cut to at most `limit` bytes, at a character boundary.
fn cut_text(text: &str, limit: usize) -> (String, bool) {
    if text.len() <= limit {
        return (text.to_string(), false);
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (text[..end].to_string(), true)
}

/// One failed message in full.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct MessageView {
    /// The native id.
    pub id: Uuid,
    /// Why it failed.
    pub cause: Cause,
    /// Its group's id.
    pub group: String,
    /// Its headers; None when they are not a JSON object (a poison row: see `raw_headers`).
    pub headers: Option<Headers>,
    /// The headers column as stored, when it could not be read as headers.
    pub raw_headers: Option<String>,
    /// The stack trace (`NServiceBus.ExceptionInfo.StackTrace`).
    pub stack_trace: Option<String>,
    /// Delayed retries it had (`NServiceBus.Retries`), if it said.
    pub delayed_retries: Option<String>,
    /// Attempts of its last delivery (`NServiceBus.ExceptionInfo.Data.Attempts`), if it said.
    pub attempts: Option<String>,
    /// The body.
    pub body: BodyView,
}

impl MessageView {
    /// The view of `row` (with its body), which failed for `cause`.
    pub fn of(row: &StoredRow, cause: Cause, body_limit: usize) -> MessageView {
        let headers = parse_headers(&row.headers).ok();
        let get = |name: &str| {
            headers
                .as_ref()
                .and_then(|h| h.get(name).cloned().flatten())
        };
        MessageView {
            id: row.id,
            group: cause.group_id(),
            stack_trace: get("NServiceBus.ExceptionInfo.StackTrace"),
            delayed_retries: get("NServiceBus.Retries"),
            attempts: get("NServiceBus.ExceptionInfo.Data.Attempts"),
            raw_headers: headers.is_none().then(|| row.headers.clone()),
            headers,
            cause,
            body: BodyView::of(&row.body, body_limit),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_shown_as_json_text_or_hex_and_cut_with_their_size() {
        let json = BodyView::of(br#"{"order":1}"#, 1000);
        assert_eq!((json.kind, json.cut), ("json", false));
        assert!(json.shown.contains("\"order\": 1"), "{}", json.shown);
        let text = BodyView::of("plain \u{e9}t\u{e9}".as_bytes(), 1000);
        assert_eq!(text.kind, "text");
        let binary = BodyView::of(&[0, 1, 0xff], 1000);
        assert_eq!((binary.kind, binary.shown.as_str()), ("binary", "00 01 ff"));
        let long = BodyView::of("é".repeat(100).as_bytes(), 51);
        assert!(long.cut && long.shown.len() <= 51 && long.size == 200);
        let script = BodyView::of(b"<script>alert(1)</script>", 1000);
        assert_eq!(script.kind, "text", "shown as text; the console escapes it");
    }
}
