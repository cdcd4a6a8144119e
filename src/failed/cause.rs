//! Why a message failed, as its fault headers say: what groups failed messages together.

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Serialize;

use crate::transport::QueueName;

/// The exception type given to rows whose headers no parser reads (moved to the error queue
/// as they were, without fault headers).
pub(super) const POISON: &str = "poison (headers that are not a JSON object)";

/// What a failed message's headers say of its failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cause {
    /// The exception type, or `POISON`, or empty when the headers name none.
    pub exception_type: String,
    /// The first line of the exception message.
    pub message: String,
    /// The queue it failed in, as this transport reaches it (`FailedQ` resolved: a bare
    /// table in the transport's schema, else the address); None when not said.
    pub source: Option<String>,
    /// When it failed (`NServiceBus.TimeOfFailure`).
    pub failed_at: Option<DateTime<Utc>>,
    /// Its logical id (`NServiceBus.MessageId`).
    pub message_id: Option<String>,
}

impl Cause {
    /// The cause `headers` (the column's text) tell, resolving `FailedQ` with `resolve`.
    /// Only the five headers it needs are read out of the text (a scan of 100 000 failed
    /// messages reads each once and allocates for those five only); headers that are not a
    /// JSON object, or whose fault headers are not strings, are `POISON`. (A retry parses
    /// the whole map, and leaves a row whose other values are not strings as unreadable.)
    pub fn of(headers: &str, resolve: impl Fn(&str) -> Option<QueueName>) -> Cause {
        match serde_json::from_str::<FaultHeaders<'_>>(headers).ok() {
            Some(h) => Cause {
                exception_type: h.exception_type.unwrap_or_default().into_owned(),
                message: h
                    .message
                    .as_deref()
                    .and_then(|m| m.lines().next())
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
                source: h
                    .failed_q
                    .map(|q| resolve(&q).map_or_else(|| q.to_string(), |queue| queue.to_string())),
                failed_at: h.time_of_failure.as_deref().and_then(parse_wire_time),
                message_id: h.message_id.map(|id| id.into_owned()),
            },
            None => Cause {
                exception_type: POISON.into(),
                message: String::new(),
                source: None,
                failed_at: None,
                message_id: None,
            },
        }
    }

    /// The id of the group of messages with this cause: the same on every host and run.
    pub fn group_id(&self) -> String {
        let key = format!(
            "{}\n{}\n{}",
            self.exception_type,
            self.message,
            self.source.as_deref().unwrap_or_default()
        );
        crate::names::stable_tag(&key)[..12].to_string()
    }
}

/// The headers a cause is read from; the others are skipped unread.
#[derive(serde::Deserialize)]
struct FaultHeaders<'a> {
    #[serde(rename = "NServiceBus.ExceptionInfo.ExceptionType", borrow, default)]
    exception_type: Option<std::borrow::Cow<'a, str>>,
    #[serde(rename = "NServiceBus.ExceptionInfo.Message", borrow, default)]
    message: Option<std::borrow::Cow<'a, str>>,
    #[serde(rename = "NServiceBus.FailedQ", borrow, default)]
    failed_q: Option<std::borrow::Cow<'a, str>>,
    #[serde(rename = "NServiceBus.TimeOfFailure", borrow, default)]
    time_of_failure: Option<std::borrow::Cow<'a, str>>,
    #[serde(rename = "NServiceBus.MessageId", borrow, default)]
    message_id: Option<std::borrow::Cow<'a, str>>,
}

/// Reads NServiceBus's wire time, `yyyy-MM-dd HH:mm:ss:ffffff Z` (UTC).
pub(super) fn parse_wire_time(text: &str) -> Option<DateTime<Utc>> {
    let text = text.trim().trim_end_matches('Z').trim_end();
    NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S:%6f")
        .or_else(|_| NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f"))
        .ok()
        .map(|t| t.and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::format_wire_time;

    #[test]
    fn a_cause_is_the_type_the_first_line_and_the_source_queue() {
        let headers = r#"{"NServiceBus.MessageId":"m1","NServiceBus.ExceptionInfo.ExceptionType":"Sales.Timeout","NServiceBus.ExceptionInfo.Message":"the order service timed out\nafter 30 s","NServiceBus.FailedQ":"Sales@[dbo]@[Shop]","NServiceBus.TimeOfFailure":"2026-11-27 10:00:00:123456 Z"}"#;
        let c = Cause::of(headers, |a| {
            QueueName::new(a)
                .ok()
                .map(|q| q.relative_to("dbo", Some("Shop")))
        });
        assert_eq!(c.exception_type, "Sales.Timeout");
        assert_eq!(c.message, "the order service timed out");
        assert_eq!(c.source.as_deref(), Some("Sales"));
        assert_eq!(c.message_id.as_deref(), Some("m1"));
        assert_eq!(
            c.failed_at.map(format_wire_time).as_deref(),
            Some("2026-11-27 10:00:00:123456 Z")
        );
        let same = Cause {
            failed_at: None,
            message_id: None,
            ..c.clone()
        };
        assert_eq!(
            same.group_id(),
            c.group_id(),
            "time and id are not the cause"
        );
        let other_queue = Cause {
            source: Some("Billing".into()),
            ..c.clone()
        };
        assert_ne!(other_queue.group_id(), c.group_id());
    }

    #[test]
    fn unreadable_headers_are_a_cause_of_their_own() {
        let c = Cause::of("{not json", |_| None);
        assert_eq!(c.exception_type, POISON);
        assert_eq!(c.source, None);
    }
}
