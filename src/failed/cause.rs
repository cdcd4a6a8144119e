//! Why a message failed, as its fault headers say: what groups failed messages together.

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Serialize;

use crate::message::{Headers, MESSAGE_ID_HEADER};
use crate::transport::QueueName;
use crate::transport::headers::parse_headers;

/// `NServiceBus.ExceptionInfo.ExceptionType`.
pub const EXCEPTION_TYPE_HEADER: &str = "NServiceBus.ExceptionInfo.ExceptionType";
/// `NServiceBus.ExceptionInfo.Message`.
pub const EXCEPTION_MESSAGE_HEADER: &str = "NServiceBus.ExceptionInfo.Message";
/// `NServiceBus.FailedQ`: the queue the message failed in, as a transport address.
pub const FAILED_Q_HEADER: &str = "NServiceBus.FailedQ";
/// `NServiceBus.TimeOfFailure`.
pub const TIME_OF_FAILURE_HEADER: &str = "NServiceBus.TimeOfFailure";

/// The exception type given to rows whose headers no parser reads (moved to the error queue
/// as they were, without fault headers).
pub const POISON: &str = "poison (headers that are not a JSON object)";

/// What a failed message's headers say of its failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cause {
    /// The exception type, or [`POISON`], or empty when the headers name none.
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
    pub fn of(headers: &str, resolve: impl Fn(&str) -> Option<QueueName>) -> Cause {
        match parse_headers(headers) {
            Ok(h) => Cause::of_headers(&h, resolve),
            Err(_) => Cause {
                exception_type: POISON.into(),
                message: String::new(),
                source: None,
                failed_at: None,
                message_id: None,
            },
        }
    }

    /// The cause parsed headers tell.
    pub fn of_headers(h: &Headers, resolve: impl Fn(&str) -> Option<QueueName>) -> Cause {
        let get = |name: &str| h.get(name).and_then(|v| v.as_deref());
        Cause {
            exception_type: get(EXCEPTION_TYPE_HEADER).unwrap_or_default().to_string(),
            message: get(EXCEPTION_MESSAGE_HEADER)
                .and_then(|m| m.lines().next())
                .unwrap_or_default()
                .trim()
                .to_string(),
            source: get(FAILED_Q_HEADER)
                .map(|q| resolve(q).map_or_else(|| q.to_string(), |queue| queue.to_string())),
            failed_at: get(TIME_OF_FAILURE_HEADER).and_then(parse_wire_time),
            message_id: get(MESSAGE_ID_HEADER).map(str::to_string),
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

/// Reads NServiceBus's wire time, `yyyy-MM-dd HH:mm:ss:ffffff Z` (UTC).
pub fn parse_wire_time(text: &str) -> Option<DateTime<Utc>> {
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
