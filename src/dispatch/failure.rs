//! What a failure becomes: the fault description, a held key, a delayed retry, or a move to the
//! error queue with the headers ServiceControl reads.

use std::time::Duration;

use chrono::Utc;
use uuid::Uuid;

use crate::message::{
    FORWARD_DESTINATION_HEADER, Headers, Message, OutgoingMessage, RETRIES_HEADER,
    RETRIES_TIMESTAMP_HEADER, format_wire_time,
};
use crate::queue::{QueueEvent, QueueRuntime};
use crate::transport::{QueueName, Received, TransportError};

use super::{Dispatcher, Outcome, send_and_commit};

/// The exception type of an attempt that ran past the handler timeout.
pub(super) const TIMEOUT_KIND: &str = "throttlehost.HandlerTimeout";

/// Longest exception message kept in `NServiceBus.ExceptionInfo.Message` (as Core does).
pub(super) const MAX_EXCEPTION_MESSAGE: usize = 16_384;

/// Why one handler attempt failed.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// `NServiceBus.ExceptionInfo.ExceptionType`.
    pub kind: &'static str,
    /// `NServiceBus.ExceptionInfo.Message`.
    pub message: String,
    /// `NServiceBus.ExceptionInfo.StackTrace`: the error's source chain.
    pub detail: String,
}

impl Failure {
    pub(super) fn from_error(e: &(dyn std::error::Error + 'static)) -> Self {
        let mut detail = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            detail.push_str("\n  caused by: ");
            detail.push_str(&s.to_string());
            source = s.source();
        }
        Failure {
            kind: "throttlehost.HandlerError",
            message: e.to_string(),
            detail,
        }
    }

    pub(super) fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "handler panicked".into());
        Failure {
            kind: "throttlehost.HandlerPanic",
            detail: format!("panic: {message}"),
            message,
        }
    }

    pub(super) fn timeout(limit: Duration) -> Self {
        let message = format!(
            "handler did not finish within {}",
            humantime::format_duration(limit)
        );
        Failure {
            kind: TIMEOUT_KIND,
            detail: message.clone(),
            message,
        }
    }

    pub(super) fn send(e: &crate::transport::TransportError) -> Self {
        Failure {
            kind: "throttlehost.SendFailed",
            message: format!("sending the handler's messages failed: {e}"),
            detail: e.to_string(),
        }
    }
}

/// Delayed retries a message has had, from its `NServiceBus.Retries` header.
pub(super) fn delayed_retries_of(message: &Message) -> u32 {
    message
        .header(RETRIES_HEADER)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

impl Dispatcher {
    /// A keyed message failed after its retries on a queue that holds its key: it stays in
    /// place, its key held in the store, and this receive rolls back. When the hold cannot be
    /// recorded, the message goes to the error queue as on any other queue: never lost, and
    /// never left to fail again at once.
    pub(super) async fn hold(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        id: Uuid,
        key: &str,
        error_message: &OutgoingMessage,
        failure: &Failure,
    ) -> Option<Outcome> {
        let held = match self.store.key_ordering() {
            Some(ordering) => ordering.hold(q.name(), id, key, &failure.message).await,
            None => Err(TransportError::Unsupported {
                what: "this transport cannot hold a key",
                setting: "queues.ordering.failed_key",
            }),
        };
        if let Err(e) = held {
            tracing::error!(queue = %q.name(), %id, %key, error = %e,
                "could not hold the key of a failed message; moving it to the error queue instead");
            return self
                .move_to_error(q, received, id, error_message, failure)
                .await;
        }
        // Released, it is tried afresh: its earlier attempts do not count.
        q.forget_failed_attempts(id);
        tracing::warn!(queue = %q.name(), %id, %key, error = %failure.message,
            "message failed after its retries: it stays in the queue and holds its key until `throttlehost queues release {} --key {key}`", q.name());
        if let Err(e) = received.rollback().await {
            tracing::warn!(queue = %q.name(), %id, error = %e, "rollback failed (the connection was discarded; the message returns)");
        }
        None
    }
}

impl Dispatcher {
    pub(super) async fn move_to_error(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        id: Uuid,
        error_message: &OutgoingMessage,
        failure: &Failure,
    ) -> Option<Outcome> {
        let result = send_and_commit(received, q.error_queue(), error_message).await;
        match result {
            Ok(()) => {
                q.forget_failed_attempts(id);
                q.count(QueueEvent::Failed);
                self.throttle.delivery_rates.outgoing();
                tracing::warn!(queue = %q.name(), %id, error_queue = %q.error_queue(), error = %failure.message,
                    "message moved to the error queue after its retries");
                Some(Outcome::Error)
            }
            Err(e) => {
                tracing::error!(queue = %q.name(), %id, error_queue = %q.error_queue(), error = %e,
                    "could not move a failed message to the error queue; it stays in the queue");
                None
            }
        }
    }

    /// Stores a message whose immediate retries are used up in `home`'s delayed table for its
    /// next delayed retry, in the unit of work that removes it; true when that committed.
    pub(super) async fn defer(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        id: Uuid,
        home: &QueueName,
        retry: &OutgoingMessage,
        failure: &Failure,
    ) -> bool {
        let result = send_and_commit(received, home, retry).await;
        match result {
            Ok(()) => {
                q.forget_failed_attempts(id);
                q.depth().departed();
                q.count(QueueEvent::DelayedRetry);
                self.throttle.delivery_rates.outgoing();
                self.publisher.scheduled(home, retry.deliver_after);
                tracing::info!(queue = %q.name(), %id, retry = retry.headers.get(RETRIES_HEADER).cloned().flatten().as_deref().unwrap_or("?"),
                    after = %humantime::format_duration(retry.deliver_after.unwrap_or_default()), error = %failure.message,
                    "message failed its immediate retries; a delayed retry is scheduled");
                true
            }
            Err(e) => {
                tracing::error!(queue = %q.name(), %id, error = %e,
                    "could not store a failed message for its delayed retry; it stays in the queue");
                false
            }
        }
    }

    /// The copy stored for delayed retry `n`: the message's headers with `NServiceBus.Retries`
    /// and its timestamp, a fresh row id, due `n` x the increment from now. A retry of
    /// another queue's message (an instance queue's, waiting in its main queue's table) names
    /// that queue as its forward destination.
    pub(super) fn delayed_retry(
        &self,
        q: &QueueRuntime,
        home: &QueueName,
        message: &Message,
        n: u32,
    ) -> OutgoingMessage {
        let mut retry = OutgoingMessage::forward_of(message);
        retry.headers.remove(FORWARD_DESTINATION_HEADER);
        retry
            .headers
            .insert(RETRIES_HEADER.into(), Some(n.to_string()));
        retry.headers.insert(
            RETRIES_TIMESTAMP_HEADER.into(),
            Some(format_wire_time(Utc::now())),
        );
        if home != q.name() {
            retry.headers.insert(
                FORWARD_DESTINATION_HEADER.into(),
                Some(self.publisher.transport().address(q.name())),
            );
        }
        if !retry
            .headers
            .contains_key(crate::message::MESSAGE_ID_HEADER)
        {
            retry.headers.insert(
                crate::message::MESSAGE_ID_HEADER.into(),
                Some(message.id.to_string()),
            );
        }
        let increment = q.settings().delayed_retry_increment;
        retry.with_delay(increment.saturating_mul(n))
    }

    /// The copy that goes to the error queue: headers plus the NServiceBus fault headers.
    pub(super) fn error_message(
        &self,
        q: &QueueRuntime,
        message: &Message,
        failure: &Failure,
        attempts: u32,
    ) -> OutgoingMessage {
        let mut headers: Headers = message.headers.clone();
        headers.remove("NServiceBus.Retries");
        headers.remove("NServiceBus.FLRetries");
        let text = cut_to(&failure.message, MAX_EXCEPTION_MESSAGE);
        let id = &self.identity;
        for (name, value) in [
            (
                "NServiceBus.FailedQ",
                self.publisher.transport().address(q.name()),
            ),
            (
                "NServiceBus.ExceptionInfo.ExceptionType",
                failure.kind.to_string(),
            ),
            ("NServiceBus.ExceptionInfo.Message", text),
            (
                "NServiceBus.ExceptionInfo.Source",
                self.handler_of(q).name().to_string(),
            ),
            (
                "NServiceBus.ExceptionInfo.StackTrace",
                failure.detail.clone(),
            ),
            (
                "NServiceBus.ExceptionInfo.Data.Attempts",
                attempts.to_string(),
            ),
            ("NServiceBus.TimeOfFailure", format_wire_time(Utc::now())),
            ("NServiceBus.ProcessingMachine", id.origin.machine.clone()),
            ("NServiceBus.ProcessingEndpoint", id.origin.endpoint.clone()),
            ("$.diagnostics.hostid", id.origin.host_id.to_string()),
            ("$.diagnostics.hostdisplayname", id.instance.clone()),
        ] {
            headers.insert(name.into(), Some(value));
        }
        if !headers.contains_key(crate::message::MESSAGE_ID_HEADER) {
            headers.insert(
                crate::message::MESSAGE_ID_HEADER.into(),
                Some(message.id.to_string()),
            );
        }
        OutgoingMessage {
            id: Uuid::new_v4(),
            headers,
            body: message.body.clone(),
            time_to_be_received: None,
            deliver_after: None,
        }
    }
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn cut_to(text: &str, max: usize) -> String {
    let mut cut = max.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text[..cut].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chains_become_the_stack_trace() {
        let inner = std::io::Error::other("disk full");
        #[derive(Debug, thiserror::Error)]
        #[error("saving failed")]
        struct Outer(#[source] std::io::Error);
        let f = Failure::from_error(&Outer(inner));
        assert_eq!(f.message, "saving failed");
        assert_eq!(f.detail, "saving failed\n  caused by: disk full");
    }

    #[test]
    fn a_long_exception_message_is_cut_on_a_character_boundary() {
        assert_eq!(cut_to("héllo", 2), "h");
        assert_eq!(cut_to("héllo", 3), "hé");
        assert_eq!(cut_to("hi", 16_384), "hi");
    }

    #[test]
    fn panics_keep_their_message() {
        let f = Failure::from_panic(Box::new("boom"));
        assert_eq!(
            (f.kind, f.message.as_str()),
            ("throttlehost.HandlerPanic", "boom")
        );
        let f = Failure::from_panic(Box::new(String::from("bang")));
        assert_eq!(f.message, "bang");
    }
}
