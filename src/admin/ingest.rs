//! Ingest: `POST /queues/{name}/messages` stores one message (the request body), and
//! `POST /queues/{name}/batch` stores a JSON array of messages with multi-row inserts. Both
//! go through the throttled publish path (one admission per message, paced exactly as sends
//! are), both answer 503 with Retry-After while publishing waits longer than
//! `admin.ingest_reject_after`, and a bad request is refused whole, naming what is wrong,
//! before anything is stored. `POST /events?types=...` publishes the request body as an
//! event to every subscriber of its topics, through the same path.

use super::header_case::{DECLARED_NAMES, HeaderCase};
use std::collections::BTreeMap;

use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::{AdminState, Shared, authorize, error};
use crate::isolate::on_host;
use crate::message::OutgoingMessage;
use crate::publish::{EventTypes, Published};
use crate::transport::QueueName;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct IngestQuery {
    /// Time to be received, e.g. `30s`.
    ttbr: Option<String>,
    /// Delivery delay, e.g. `30s`: stored in the queue's delayed table until due.
    delay: Option<String>,
}

/// `POST /events`'s query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PublishQuery {
    /// The event's type and the types it derives from, `;`-separated (see [`EventTypes`]).
    types: Option<String>,
    /// Time to be received, e.g. `30s`.
    ttbr: Option<String>,
}

const HEADER_PREFIX: &str = "x-header-";

/// The steps both routes take before reading the body: authorised, a queue this host
/// accepts, publishing not waiting too long.
fn admit_request(
    host: &dyn AdminState,
    headers: &HeaderMap,
    name: &str,
) -> Result<QueueName, Box<Response>> {
    authorize(host, headers)?;
    let queue = QueueName::new(name)
        .map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, e.to_string())))?;
    if !host.accepts(&queue) {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            format!(
                "unknown queue `{queue}`: this host accepts messages for the queues it receives from, forwards to or sends errors to"
            ),
        )));
    }
    publishing_not_waiting(host)?;
    Ok(queue)
}

/// Refuses a request while publishing waits longer than `admin.ingest_reject_after`: 503
/// with Retry-After.
fn publishing_not_waiting(host: &dyn AdminState) -> Result<(), Box<Response>> {
    let settings = host.settings();
    let wait = host.publisher().current_wait();
    if wait > settings.ingest_reject_after {
        let retry_after = wait.as_secs_f64().ceil().max(1.0) as u64;
        let mut response = error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "publishing is throttled (wait {:.3}s > admin.ingest_reject_after {}s); retry later",
                wait.as_secs_f64(),
                settings.ingest_reject_after.as_secs_f64()
            ),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
        return Err(Box::new(response));
    }
    Ok(())
}

/// The request body, at most `admin.max_body_size`.
pub(super) async fn read_body(host: &dyn AdminState, body: Body) -> Result<Bytes, Box<Response>> {
    let settings = host.settings();
    to_bytes(body, settings.max_body_size.bytes() as usize)
        .await
        .map_err(|_| {
            Box::new(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body is larger than admin.max_body_size ({})",
                    settings.max_body_size
                ),
            ))
        })
}

/// Stores `messages` through the publisher on the host's runtime: one send, or one batch.
async fn store(
    host: &dyn AdminState,
    queue: &QueueName,
    messages: Vec<OutgoingMessage>,
) -> Result<(), Box<Response>> {
    let (publisher, runtime) = (host.publisher(), host.runtime());
    let queue = queue.clone();
    let origin = host.origin();
    let messages: Vec<OutgoingMessage> = messages.into_iter().map(|m| m.sent_by(&origin)).collect();
    let sent = on_host(&runtime, async move {
        match messages.as_slice() {
            [one] => publisher.send(&queue, one).await,
            many => publisher.send_batch(&queue, many).await,
        }
    });
    answered_on_host(sent.await, "store the message")
}

/// What work sent to the host's runtime came back with: 503 when the host is stopping or the
/// work failed (saying what could not be done), else its value.
fn answered_on_host<T>(
    done: Option<Result<T, crate::transport::TransportError>>,
    what: &str,
) -> Result<T, Box<Response>> {
    match done {
        None => Err(Box::new(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the host is stopping; retry later",
        ))),
        Some(Ok(value)) => Ok(value),
        Some(Err(e)) => Err(Box::new(error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("could not {what}: {e}"),
        ))),
    }
}

/// `POST /queues/{name}/messages`: the body is the message.
pub(super) async fn ingest(
    State(host): State<Shared>,
    Path(name): Path<String>,
    query: Result<Query<IngestQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let accepted = async {
        let queue = admit_request(host.as_ref(), &headers, &name)?;
        let Ok(Query(query)) = query else {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                "the query parameters are `ttbr` and `delay` (durations such as 30s)",
            )));
        };
        let body = read_body(host.as_ref(), body).await?;
        let case = HeaderCase::new(
            headers
                .get_all(DECLARED_NAMES)
                .iter()
                .filter_map(|v| v.to_str().ok()),
            &host.header_names(),
        );
        let mut message = ingested_message(body.to_vec(), query.ttbr.as_deref(), &headers, &case)?;
        if let Some(delay) = query.delay.as_deref() {
            message = with_delay(message, delay, "delay")
                .map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, e)))?;
        }
        let id = message.logical_id();
        store(host.as_ref(), &queue, vec![message]).await?;
        Ok(json!({ "id": id, "queue": queue.as_str() }))
    };
    answer(accepted.await)
}

/// `POST /events?types=...`: the body is the event, published to every subscriber of its
/// topics. Answers 202 with its id, topic and the queues a copy went to (none is no error).
pub(super) async fn publish(
    State(host): State<Shared>,
    query: Result<Query<PublishQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let accepted = async {
        authorize(host.as_ref(), &headers)?;
        let bad = |message: String| Box::new(error(StatusCode::BAD_REQUEST, message));
        let Ok(Query(query)) = query else {
            return Err(bad("the query parameters are `types` (the event's type, then the types it derives from, `;`-separated) and `ttbr`".into()));
        };
        let types = query
            .types
            .as_deref()
            .ok_or_else(|| bad("name the event: ?types=Namespace.EventName".into()))?;
        let types = EventTypes::parse(types).map_err(|e| bad(format!("types: {e}")))?;
        publishing_not_waiting(host.as_ref())?;
        let body = read_body(host.as_ref(), body).await?;
        let case = HeaderCase::new(
            headers
                .get_all(DECLARED_NAMES)
                .iter()
                .filter_map(|v| v.to_str().ok()),
            &host.header_names(),
        );
        let message = ingested_message(body.to_vec(), query.ttbr.as_deref(), &headers, &case)?;
        let id = message.logical_id();
        let published = publish_on_host(host.as_ref(), &types, message).await?;
        let subscribers: Vec<&str> = published.subscribers.iter().map(|q| q.as_str()).collect();
        Ok(json!({ "id": id, "topic": types.topic(), "subscribers": subscribers }))
    };
    answer(accepted.await)
}

/// Publishes an event through the publisher on the host's runtime.
async fn publish_on_host(
    host: &dyn AdminState,
    types: &EventTypes,
    message: OutgoingMessage,
) -> Result<Published, Box<Response>> {
    let (publisher, runtime) = (host.publisher(), host.runtime());
    let types = types.clone();
    // The publisher marks it an event (intent Publish over the Send `sent_by` sets).
    let message = message.sent_by(&host.origin());
    let published = on_host(
        &runtime,
        async move { publisher.publish(&types, message).await },
    );
    answered_on_host(published.await, "publish the event")
}

/// 202 with `accepted`, or the refusal.
fn answer(accepted: Result<serde_json::Value, Box<Response>>) -> Response {
    match accepted {
        Ok(body) => (StatusCode::ACCEPTED, axum::Json(body)).into_response(),
        Err(refused) => *refused,
    }
}

/// One element of a batch: `body` is a string (stored as its UTF-8 bytes) or any other JSON
/// value (stored as its JSON text, with `NServiceBus.ContentType: application/json` unless
/// `headers` names a content type).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchItem {
    body: serde_json::Value,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    ttbr: Option<String>,
    delay: Option<String>,
}

/// `message` delivered no sooner than `delay` (a duration) from now; the error names `field`.
fn with_delay(
    message: OutgoingMessage,
    delay: &str,
    field: &str,
) -> Result<OutgoingMessage, String> {
    let d = humantime::parse_duration(delay.trim()).map_err(|e| {
        format!("{field}: `{delay}` is not a duration ({e}); write for example 30s or 5m")
    })?;
    let message = message.with_delay(d);
    message
        .checked_delay()
        .map_err(|e| format!("{field}: {e}"))?;
    Ok(message)
}

/// Where the data after the first JSON value of `body` starts (its first non-blank byte).
fn trailing_offset(body: &[u8]) -> usize {
    let mut values = serde_json::Deserializer::from_slice(body).into_iter::<serde_json::Value>();
    let _ = values.next();
    let end = values.byte_offset();
    end + body[end..]
        .iter()
        .take_while(|b| b.is_ascii_whitespace())
        .count()
}

/// The most messages one batch request may carry.
pub(super) const MAX_BATCH_MESSAGES: usize = 100_000;

fn batch_messages(body: &[u8]) -> Result<Vec<OutgoingMessage>, String> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    let items: Vec<BatchItem> = serde_path_to_error::deserialize(&mut reader).map_err(|e| {
        let at = e.path().to_string();
        format!(
            "the body must be a JSON array of {{\"body\": ..., \"headers\": {{...}}, \"ttbr\": \"30s\", \"delay\": \"10s\"}}; at `{at}`: {}",
            e.inner()
        )
    })?;
    // One array and nothing after it: a second value would otherwise be dropped unseen.
    reader.end().map_err(|e| {
        let offset = trailing_offset(body);
        format!("the body holds more than one JSON value: data after the array at byte {offset} ({e}); send one array")
    })?;
    if items.is_empty() || items.len() > MAX_BATCH_MESSAGES {
        return Err(format!(
            "a batch holds 1 to {MAX_BATCH_MESSAGES} messages, not {}",
            items.len()
        ));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let json_body = !item.body.is_string();
            let bytes = match item.body {
                serde_json::Value::String(text) => text.into_bytes(),
                other => other.to_string().into_bytes(),
            };
            let mut message = OutgoingMessage::new(bytes);
            if let Some(ttbr) = &item.ttbr {
                let ttbr = humantime::parse_duration(ttbr.trim())
                    .map_err(|e| format!("[{i}].ttbr: `{ttbr}` is not a duration ({e}); write for example 30s or 5m"))
                    .and_then(|d| {
                        crate::message::check_time_to_be_received(d).map_err(|e| format!("[{i}].ttbr: {e}"))
                    })?;
                message = message.with_time_to_be_received(ttbr);
            }
            if let Some(delay) = &item.delay {
                message = with_delay(message, delay, &format!("[{i}].delay"))?;
            }
            let names_content_type = item
                .headers
                .keys()
                .any(|k| k.eq_ignore_ascii_case("NServiceBus.ContentType"));
            if json_body && !names_content_type {
                message = message.with_header("NServiceBus.ContentType", "application/json");
            }
            for (name, value) in item.headers {
                message = message.with_header(name, value);
            }
            Ok(message)
        })
        .collect()
}

/// `POST /queues/{name}/batch`: a JSON array of messages, stored with multi-row inserts.
pub(super) async fn ingest_batch(
    State(host): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let accepted = async {
        let queue = admit_request(host.as_ref(), &headers, &name)?;
        let body = read_body(host.as_ref(), body).await?;
        let messages = batch_messages(&body)
            .map_err(|reason| Box::new(error(StatusCode::BAD_REQUEST, reason)))?;
        let ids: Vec<String> = messages
            .iter()
            .map(|m| m.logical_id().to_string())
            .collect();
        store(host.as_ref(), &queue, messages).await?;
        Ok(json!({ "queue": queue.as_str(), "count": ids.len(), "ids": ids }))
    };
    answer(accepted.await)
}

/// The message an ingest request describes: the body, `?ttbr=`, `Content-Type` as
/// `NServiceBus.ContentType`, and every `X-Header-<Name>` header, its name's case restored
/// by `case` (see [`HeaderCase`]).
fn ingested_message(
    body: Vec<u8>,
    ttbr: Option<&str>,
    headers: &HeaderMap,
    case: &HeaderCase,
) -> Result<OutgoingMessage, Box<Response>> {
    let mut message = OutgoingMessage::new(body);
    if let Some(ttbr) = ttbr {
        let parsed = humantime::parse_duration(ttbr.trim())
            .map_err(|e| format!("`{ttbr}` is not a duration ({e}); write for example 30s or 5m"))
            .and_then(crate::message::check_time_to_be_received);
        match parsed {
            Ok(d) => message = message.with_time_to_be_received(d),
            Err(e) => {
                return Err(Box::new(error(
                    StatusCode::BAD_REQUEST,
                    format!("ttbr: {e}"),
                )));
            }
        }
    }
    if let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    {
        message = message.with_header("NServiceBus.ContentType", ct);
    }
    for (name, value) in headers {
        let Some(header_name) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        if name.as_str() == DECLARED_NAMES {
            continue;
        }
        match value.to_str() {
            Ok(v) => message = message.with_header(case.restore(header_name), v),
            Err(_) => {
                return Err(Box::new(error(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "header `{name}` is not visible ASCII; send UTF-8 values in the body instead"
                    ),
                )));
            }
        }
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_after_the_array_is_refused_naming_its_offset() {
        let body = br#"[{"body":"a"}] [{"body":"b"},{"body":"c"}]"#;
        let e = batch_messages(body).unwrap_err();
        assert!(e.contains("at byte 15"), "{e}");
        assert_eq!(batch_messages(b"[{\"body\":\"a\"}] \n").unwrap().len(), 1);
    }

    #[test]
    fn a_batch_item_may_be_delayed_and_a_bad_delay_is_named() {
        let ok = batch_messages(br#"[{"body":"a","delay":"30s"}]"#).unwrap();
        assert_eq!(
            ok[0].deliver_after,
            Some(std::time::Duration::from_secs(30))
        );
        let e = batch_messages(br#"[{"body":"a"},{"body":"b","delay":"soon"}]"#).unwrap_err();
        assert!(e.contains("[1].delay"), "{e}");
        let e = batch_messages(br#"[{"body":"a","delay":"1s","ttbr":"5s"}]"#).unwrap_err();
        assert!(
            e.contains("[0].delay") && e.contains("time to be received"),
            "{e}"
        );
    }
}
