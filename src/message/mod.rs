//! Messages as handlers see them and as senders write them.
//!
//! The row `Id` is the transport's (native) id, a fresh UUID per physical send, as in the
//! NServiceBus SQL transports; the logical id travels in the `NServiceBus.MessageId` header,
//! which [`OutgoingMessage::new`] sets to the same value unless the sender chose another.

mod outgoing;

pub use outgoing::{
    CONVERSATION_ID_HEADER, CORRELATION_ID_HEADER, DELIVER_AT_HEADER,
    ENCLOSED_MESSAGE_TYPES_HEADER, MESSAGE_INTENT_HEADER, MessageIntent,
    ORIGINATING_ENDPOINT_HEADER, ORIGINATING_HOST_ID_HEADER, ORIGINATING_MACHINE_HEADER, Origin,
    RELATED_TO_HEADER, REPLY_TO_ADDRESS_HEADER,
};
use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// Message headers: a JSON object of string -> string or null on the wire.
pub type Headers = BTreeMap<String, Option<String>>;

/// Header holding the logical message id.
pub const MESSAGE_ID_HEADER: &str = "NServiceBus.MessageId";
/// The stage a message belongs to, on a queue with ordered stages.
pub const EXECUTION_STAGE_HEADER: &str = "throttlehost.ExecutionStage";
/// The stage whose messages must all have ended before this message starts.
pub const PREVIOUS_STAGE_HEADER: &str = "throttlehost.PreviousStage";
/// Header holding the time the message was sent (`yyyy-MM-dd HH:mm:ss:ffffff Z`).
pub const TIME_SENT_HEADER: &str = "NServiceBus.TimeSent";
/// Informational time-to-be-received header (the `Expires` column is what counts).
pub const TIME_TO_BE_RECEIVED_HEADER: &str = "NServiceBus.TimeToBeReceived";
/// The queue a message stored in a delayed table is for: set on store, read (and removed)
/// when the moved message is received. The SQL transports' only header of their own.
pub const FORWARD_DESTINATION_HEADER: &str = "NServiceBus.SqlServer.ForwardDestination";
/// How many delayed retries a message has had (NServiceBus recoverability).
pub const RETRIES_HEADER: &str = "NServiceBus.Retries";
/// When the last delayed retry was scheduled (`yyyy-MM-dd HH:mm:ss:ffffff Z`).
pub const RETRIES_TIMESTAMP_HEADER: &str = "NServiceBus.Retries.Timestamp";
/// Immediate retries a message had in its last delivery (NServiceBus writes it too).
pub const FL_RETRIES_HEADER: &str = "NServiceBus.FLRetries";

/// The longest delay a message may be sent with: 50 years, as for the time to be received
/// (SQL Server adds it to the server's clock in whole seconds held in an int).
pub const MAX_DELIVERY_DELAY: Duration = MAX_TIME_TO_BE_RECEIVED;

/// A received message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The row id (native id).
    pub id: Uuid,
    /// Headers as stored.
    pub headers: Headers,
    /// Body bytes, exactly as stored.
    pub body: Vec<u8>,
    /// When the message expires (UTC), if it has a time-to-be-received.
    pub expires: Option<DateTime<Utc>>,
}

impl Message {
    /// The logical id: the `NServiceBus.MessageId` header, else the native id.
    pub fn logical_id(&self) -> String {
        match self.headers.get(MESSAGE_ID_HEADER) {
            Some(Some(id)) if !id.is_empty() => id.clone(),
            _ => self.id.to_string(),
        }
    }

    /// A header's value, if present and not null.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.as_deref())
    }
}

/// The longest time to be received a message may carry: 50 years. SQL Server adds it to the
/// send time with `DATEADD(s, ...)`, whose argument is an int (68 years); PostgreSQL would take
/// more, and then write an expiry the host could not read back.
/// (Years of 365.25 days, as `50y` is read.)
pub const MAX_TIME_TO_BE_RECEIVED: Duration = Duration::from_secs(50 * 31_557_600);

/// Checks a time to be received against [`MAX_TIME_TO_BE_RECEIVED`], naming the value.
pub fn check_time_to_be_received(ttbr: Duration) -> Result<Duration, String> {
    if ttbr > MAX_TIME_TO_BE_RECEIVED {
        return Err(format!(
            "time to be received {} is longer than the longest supported (50 years); leave it out for a message that never expires",
            humantime::format_duration(ttbr)
        ));
    }
    Ok(ttbr)
}

/// A message to send.
#[derive(Debug, Clone, PartialEq)]
pub struct OutgoingMessage {
    /// Row id for the new row; fresh per physical send.
    pub id: Uuid,
    /// Headers to store.
    pub headers: Headers,
    /// Body bytes.
    pub body: Vec<u8>,
    /// Expiry, computed by the database server from its own clock at insert time.
    pub time_to_be_received: Option<Duration>,
    /// Deliver no sooner than this long after the send: the message is stored in the
    /// destination's delayed table (due time computed by the server) and moved into the
    /// queue when due. None: delivered at once.
    pub deliver_after: Option<Duration>,
}

impl OutgoingMessage {
    /// A message with a fresh id, `NServiceBus.MessageId` set to it, and `TimeSent` now.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        let id = Uuid::new_v4();
        let mut headers = Headers::new();
        headers.insert(MESSAGE_ID_HEADER.into(), Some(id.to_string()));
        headers.insert(TIME_SENT_HEADER.into(), Some(format_wire_time(Utc::now())));
        OutgoingMessage {
            id,
            headers,
            body: body.into(),
            time_to_be_received: None,
            deliver_after: None,
        }
    }

    /// Adds or replaces a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), Some(value.into()));
        self
    }

    /// Sets the time-to-be-received (and its informational header).
    pub fn with_time_to_be_received(mut self, ttbr: Duration) -> Self {
        self.time_to_be_received = Some(ttbr);
        self.headers.insert(
            TIME_TO_BE_RECEIVED_HEADER.into(),
            Some(format_timespan(ttbr)),
        );
        self
    }

    /// Delivers the message no sooner than `delay` from now (NServiceBus `DelayDeliveryWith`),
    /// with `NServiceBus.DeliverAt` saying when by this machine's clock, as NServiceBus writes
    /// it (the due time the table holds is the database server's).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.deliver_after = Some(delay);
        if let Ok(delay) = chrono::Duration::from_std(delay)
            && let Some(at) = Utc::now().checked_add_signed(delay)
        {
            self.headers
                .insert(DELIVER_AT_HEADER.into(), Some(format_wire_time(at)));
        }
        self
    }

    /// Delivers the message no sooner than `at` (NServiceBus `DoNotDeliverBefore`): the delay
    /// is `at` less this machine's clock now, as NServiceBus computes it; a time past is now.
    pub fn with_deliver_at(self, at: DateTime<Utc>) -> Self {
        let delay = (at - Utc::now()).to_std().unwrap_or_default();
        self.with_delay(delay)
    }

    /// The delay as the transports store it, checked: refused past [`MAX_DELIVERY_DELAY`],
    /// and together with a time to be received (a delayed message cannot also expire, as in
    /// NServiceBus, whose dispatcher refuses the pair).
    pub fn checked_delay(&self) -> Result<Option<Duration>, String> {
        let Some(delay) = self.deliver_after else {
            return Ok(None);
        };
        if self.time_to_be_received.is_some() {
            return Err(
                "a message cannot have both a delivery delay and a time to be received".into(),
            );
        }
        if delay > MAX_DELIVERY_DELAY {
            return Err(format!(
                "delivery delay {} is longer than the longest supported (50 years)",
                humantime::format_duration(delay)
            ));
        }
        Ok(Some(delay))
    }

    /// The logical id this message will be known by.
    pub fn logical_id(&self) -> String {
        match self.headers.get(MESSAGE_ID_HEADER) {
            Some(Some(id)) if !id.is_empty() => id.clone(),
            _ => self.id.to_string(),
        }
    }

    /// A copy of a received message to send on: same headers and body, a fresh row id.
    pub fn forward_of(message: &Message) -> Self {
        OutgoingMessage {
            id: Uuid::new_v4(),
            headers: message.headers.clone(),
            body: message.body.clone(),
            time_to_be_received: None,
            deliver_after: None,
        }
    }
}

/// Formats a time the way NServiceBus writes date headers: `yyyy-MM-dd HH:mm:ss:ffffff Z`.
pub fn format_wire_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S:%6f Z").to_string()
}

/// Formats a duration as a .NET TimeSpan (`[d.]hh:mm:ss[.fffffff]`), NServiceBus's form for
/// `TimeToBeReceived`.
pub fn format_timespan(d: Duration) -> String {
    let total = d.as_secs();
    let (days, h, m, s) = (
        total / 86_400,
        total / 3600 % 24,
        total / 60 % 60,
        total % 60,
    );
    let ticks = d.subsec_nanos() / 100;
    let mut out = String::new();
    if days > 0 {
        out.push_str(&format!("{days}."));
    }
    out.push_str(&format!("{h:02}:{m:02}:{s:02}"));
    if ticks > 0 {
        out.push_str(&format!(".{ticks:07}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outgoing_message_carries_its_logical_id() {
        let m = OutgoingMessage::new("x");
        assert_eq!(m.logical_id(), m.id.to_string());
        assert!(m.headers.contains_key(TIME_SENT_HEADER));
    }

    #[test]
    fn fifty_years_written_as_50y_is_accepted() {
        let fifty = humantime::parse_duration("50y").unwrap();
        assert_eq!(check_time_to_be_received(fifty), Ok(fifty));
        assert!(check_time_to_be_received(fifty + Duration::from_secs(1)).is_err());
    }

    #[test]
    fn a_delay_is_checked_against_its_limits() {
        let m = OutgoingMessage::new("x").with_delay(Duration::from_secs(30));
        assert_eq!(m.checked_delay(), Ok(Some(Duration::from_secs(30))));
        let both = m.clone().with_time_to_be_received(Duration::from_secs(5));
        assert!(
            both.checked_delay()
                .unwrap_err()
                .contains("time to be received")
        );
        let long = OutgoingMessage::new("x").with_delay(MAX_DELIVERY_DELAY * 2);
        assert!(long.checked_delay().unwrap_err().contains("50 years"));
        let past =
            OutgoingMessage::new("x").with_deliver_at(Utc::now() - chrono::Duration::hours(1));
        assert_eq!(past.deliver_after, Some(Duration::ZERO));
        assert_eq!(OutgoingMessage::new("x").checked_delay(), Ok(None));
    }

    #[test]
    fn timespans_look_like_dotnet() {
        assert_eq!(format_timespan(Duration::from_secs(90)), "00:01:30");
        assert_eq!(
            format_timespan(Duration::from_millis(1500)),
            "00:00:01.5000000"
        );
        assert_eq!(
            format_timespan(Duration::from_secs(86_400 + 3661)),
            "1.01:01:01"
        );
    }

    #[test]
    fn wire_time_format() {
        let t = DateTime::parse_from_rfc3339("2026-11-22T06:13:21.123456Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(format_wire_time(t), "2026-11-22 06:13:21:123456 Z");
    }
}
