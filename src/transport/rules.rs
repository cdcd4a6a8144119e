//! What every transport computes or refuses alike, written once: the columns of a
//! multi-row insert, a message's time to be received as stored, and the refusals of key
//! order where it cannot be kept.

use super::{QueueName, TransportError, headers};
use crate::config::TransactionMode;
use crate::message::OutgoingMessage;

/// The two columns of a multi-row insert that the SQL transports compute per message: the
/// time to be received in milliseconds (checked) and the headers in their wire form.
pub(crate) fn insert_columns(
    messages: &[OutgoingMessage],
) -> Result<(Vec<Option<i64>>, Vec<String>), TransportError> {
    let ttbrs = messages
        .iter()
        .map(ttbr_millis)
        .collect::<Result<Vec<_>, _>>()?;
    let headers = messages
        .iter()
        .map(|m| headers::serialize_headers(&m.headers))
        .collect();
    Ok((ttbrs, headers))
}

/// The refusal every transport gives a batch receive from an ordered queue: a batch would
/// take a key's messages together.
pub(crate) fn refuse_ordered_batch(queue: &QueueName) -> TransportError {
    TransportError::queue(
        queue,
        "keeps key order: receive it one message at a time (concurrency.receive_batch = 1)",
    )
}

/// The refusal every transport gives an ordered queue in transaction mode `none`.
pub(crate) fn check_orderable(
    mode: TransactionMode,
    queue: &QueueName,
) -> Result<(), TransportError> {
    if mode == TransactionMode::None {
        return Err(TransportError::queue(
            queue,
            "cannot keep key order in transaction_mode \"none\": each message is deleted before its handler runs",
        ));
    }
    Ok(())
}

/// A message's time to be received in milliseconds, as the transports store it; refused when
/// it is past [`crate::message::MAX_TIME_TO_BE_RECEIVED`] (an expiry no queue table can hold).
pub(crate) fn ttbr_millis(message: &OutgoingMessage) -> Result<Option<i64>, TransportError> {
    message
        .time_to_be_received
        .map(|t| {
            crate::message::check_time_to_be_received(t)
                .map(|t| i64::try_from(t.as_millis()).unwrap_or(i64::MAX))
                .map_err(TransportError::InvalidMessage)
        })
        .transpose()
}
