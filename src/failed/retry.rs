//! Sending failed messages back: what a retried message carries, and the paced run that
//! moves them in batches, each batch in the transaction that removes it from the error queue.

use futures_util::future::BoxFuture;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Cause, FailedMessages};
use crate::message::{FORWARD_DESTINATION_HEADER, Headers, OutgoingMessage, format_wire_time};
use crate::transport::failed::{MoveOut, StoredRow};
use crate::transport::headers::parse_headers;
use crate::transport::{QueueName, TransportError};

/// How many times a message was sent back from an error queue (kept across failures).
pub const RETRY_COUNT_HEADER: &str = "throttlehost.Retry.Count";
/// When it was last sent back, in NServiceBus's wire time.
pub const RETRIED_AT_HEADER: &str = "throttlehost.Retry.At";

/// Headers that describe the failure or the attempts before it: a retried message starts
/// afresh without them, as a message ServiceControl retries does.
fn dropped(name: &str) -> bool {
    name.starts_with("NServiceBus.ExceptionInfo.")
        || [
            "NServiceBus.FailedQ",
            "NServiceBus.TimeOfFailure",
            "NServiceBus.ProcessingMachine",
            "NServiceBus.ProcessingEndpoint",
            "NServiceBus.Retries",
            "NServiceBus.Retries.Timestamp",
            "NServiceBus.FLRetries",
            "$.diagnostics.hostid",
            "$.diagnostics.hostdisplayname",
            FORWARD_DESTINATION_HEADER,
        ]
        .contains(&name)
}

/// The message a failed row goes back as: the same body and logical id (its
/// `NServiceBus.MessageId` and conversation are kept), a fresh row id, the failure's headers
/// and retry counters dropped, [`RETRY_COUNT_HEADER`] counted up and [`RETRIED_AT_HEADER`]
/// set. Err when its headers cannot be read (a poison row: it would only fail again).
pub fn retried_message(row: &StoredRow) -> Result<OutgoingMessage, String> {
    let headers = parse_headers(&row.headers)?;
    let count = headers
        .get(RETRY_COUNT_HEADER)
        .and_then(|v| v.as_deref())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let mut kept: Headers = headers
        .into_iter()
        .filter(|(name, _)| !dropped(name))
        .collect();
    kept.insert(RETRY_COUNT_HEADER.into(), Some((count + 1).to_string()));
    kept.insert(
        RETRIED_AT_HEADER.into(),
        Some(format_wire_time(chrono::Utc::now())),
    );
    if !kept.contains_key(crate::message::MESSAGE_ID_HEADER) {
        // The logical id stays the one it failed under (its native id, when it had none).
        kept.insert(
            crate::message::MESSAGE_ID_HEADER.into(),
            Some(row.id.to_string()),
        );
    }
    let mut message = OutgoingMessage::new(row.body.clone());
    message.headers = kept;
    Ok(message)
}

/// How a retry run is paced, reported and stopped.
pub struct RetryRun<'a> {
    /// Waited before each message is moved (the host's publishing admission); None: unpaced.
    pub admit: Option<&'a (dyn Fn() -> BoxFuture<'static, ()> + Send + Sync)>,
    /// Hears the running total moved after each batch.
    pub progress: &'a (dyn Fn(u64) + Send + Sync),
    /// Hears each message stored by a committed batch (the host counts it as published).
    pub stored: &'a (dyn Fn(&QueueName, &OutgoingMessage) + Send + Sync),
    /// Ends the run between batches.
    pub stop: CancellationToken,
}

/// What a retry run did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Retried {
    /// Messages sent back, each removed from the error queue in the same transaction.
    pub moved: u64,
    /// Messages left because nothing says where they failed and no queue was named.
    pub no_source: u64,
    /// Messages left because their headers cannot be read (poison rows).
    pub unreadable: u64,
    /// Messages that were gone, or held by a receive, when their batch ran.
    pub gone: u64,
    /// Whether the run was stopped before the end.
    pub stopped: bool,
}

pub(super) async fn run(
    failed: &FailedMessages,
    queue: &QueueName,
    ids: &[Uuid],
    to: Option<&QueueName>,
    batch: usize,
    run: &RetryRun<'_>,
) -> Result<Retried, TransportError> {
    let mut done = Retried::default();
    for chunk in ids.chunks(batch.max(1)) {
        if run.stop.is_cancelled() {
            done.stopped = true;
            break;
        }
        let rows = failed.store().read(queue, chunk).await?;
        done.gone += (chunk.len() - rows.len()) as u64;
        let mut moves = Vec::with_capacity(rows.len());
        for row in rows {
            let cause = Cause::of(&row.headers, |a| failed.resolve(a));
            let target = to
                .cloned()
                .or_else(|| cause.source.as_deref().and_then(|s| QueueName::new(s).ok()));
            let Ok(message) = retried_message(&row) else {
                done.unreadable += 1;
                continue;
            };
            let Some(target) = target else {
                done.no_source += 1;
                continue;
            };
            if let Some(admit) = run.admit {
                admit().await;
            }
            moves.push(MoveOut {
                id: row.id,
                to: target,
                message,
            });
        }
        let moved = failed.store().move_out(queue, &moves).await?;
        for m in moves.iter().filter(|m| moved.contains(&m.id)) {
            (run.stored)(&m.to, &m.message);
        }
        done.gone += (moves.len() - moved.len()) as u64;
        done.moved += moved.len() as u64;
        (run.progress)(done.moved);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retried_message_drops_its_failure_and_keeps_its_identity() {
        let row = StoredRow {
            position: 1,
            id: Uuid::new_v4(),
            headers: r#"{"NServiceBus.MessageId":"m1","NServiceBus.ConversationId":"c1","NServiceBus.FailedQ":"Sales","NServiceBus.ExceptionInfo.Message":"boom","NServiceBus.Retries":"3","NServiceBus.TimeOfFailure":"x","throttlehost.Retry.Count":"1","Custom":"kept"}"#.into(),
            body: b"order".to_vec(),
        };
        let m = retried_message(&row).unwrap();
        let get = |n: &str| m.headers.get(n).cloned().flatten();
        assert_eq!(get("NServiceBus.MessageId").as_deref(), Some("m1"));
        assert_eq!(get("NServiceBus.ConversationId").as_deref(), Some("c1"));
        assert_eq!(get("Custom").as_deref(), Some("kept"));
        for gone in [
            "NServiceBus.FailedQ",
            "NServiceBus.ExceptionInfo.Message",
            "NServiceBus.Retries",
            "NServiceBus.TimeOfFailure",
        ] {
            assert_eq!(get(gone), None, "{gone}");
        }
        assert_eq!(get(RETRY_COUNT_HEADER).as_deref(), Some("2"));
        assert!(get(RETRIED_AT_HEADER).is_some());
        assert_ne!(m.id, row.id, "a new row");
        assert_eq!(m.body, b"order");
        let poison = StoredRow {
            headers: "{oops".into(),
            ..row
        };
        assert!(retried_message(&poison).is_err());
    }
}
