//! The failed-messages routes: see what failed (groups, a page of messages, one message),
//! retry through the host's publishing admission as a job that reports progress and can be
//! stopped, and delete. Reads are open like `/status`; retry and delete need the admin token
//! when one is set, and each is logged with what it touched and how many.

use std::sync::{Arc, Mutex};

use axum::Extension;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Shared, authorize, error, read_json};
use crate::failed::{FailedMessages, Filter, Retried, RetryRun};
use crate::isolate::on_host;
use crate::transport::QueueName;

/// The most messages one page lists.
const MAX_PAGE: usize = 1_000;
/// The most bytes of a body one message view shows.
const BODY_SHOWN: usize = 64 * 1024;
/// Messages moved per transaction by a retry.
const RETRY_BATCH: usize = 100;

/// The retry job of this host: at most one runs at a time.
#[derive(Default)]
pub(super) struct RetryJob {
    state: Mutex<Option<JobState>>,
}

#[derive(Clone, Serialize)]
struct JobState {
    queue: String,
    selected: u64,
    moved: u64,
    started: DateTime<Utc>,
    finished: Option<DateTime<Utc>>,
    result: Option<Retried>,
    error: Option<String>,
    #[serde(skip)]
    stop: CancellationToken,
}

/// `?queue=&group=&source=&since=&until=&offset=&limit=` of the read routes.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FailedQuery {
    queue: Option<String>,
    group: Option<String>,
    source: Option<String>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    offset: Option<usize>,
    limit: Option<usize>,
}

impl FailedQuery {
    fn filter(&self) -> Filter {
        Filter {
            group: self.group.clone(),
            source: self.source.clone(),
            since: self.since,
            until: self.until,
            ..Filter::default()
        }
    }
}

/// The body of `POST /errors/retry` and `POST /errors/delete`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Selection {
    queue: Option<String>,
    #[serde(default)]
    filter: Filter,
    /// Every message of the queue: needed when the filter is empty, so an empty body never
    /// means "all".
    #[serde(default)]
    all: bool,
    /// Retry only: send here instead of where each failed.
    to: Option<String>,
}

/// The tool over the host's transport, and the error queue a request names (the first
/// queue's error queue when it names none).
fn tool(host: &Shared, queue: Option<&str>) -> Result<(FailedMessages, QueueName), Box<Response>> {
    let failed = FailedMessages::new(host.transport())
        .map_err(|e| Box::new(error(StatusCode::NOT_IMPLEMENTED, e.to_string())))?;
    let name = queue.map(str::to_string).unwrap_or_else(|| {
        host.error_queues()
            .into_iter()
            .next()
            .unwrap_or("error".into())
    });
    let queue = QueueName::new(&name)
        .map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, e.to_string())))?;
    Ok((failed, queue))
}

/// Runs `work` on the host's runtime, turning a transport error into a 503.
async fn on_runtime<T: Send + 'static>(
    host: &Shared,
    work: impl std::future::Future<Output = Result<T, crate::transport::TransportError>>
    + Send
    + 'static,
) -> Result<T, Box<Response>> {
    match on_host(&host.runtime(), work).await {
        None => Err(Box::new(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the host is stopping",
        ))),
        Some(Err(e)) => Err(Box::new(error(
            StatusCode::SERVICE_UNAVAILABLE,
            e.to_string(),
        ))),
        Some(Ok(v)) => Ok(v),
    }
}

type QueryResult = Result<Query<FailedQuery>, axum::extract::rejection::QueryRejection>;

/// A read request: its query, the tool and the error queue it names.
fn read_request(
    host: &Shared,
    query: QueryResult,
) -> Result<(FailedQuery, FailedMessages, QueueName), Box<Response>> {
    let Ok(Query(query)) = query else {
        return Err(Box::new(bad_query()));
    };
    let (failed, queue) = tool(host, query.queue.as_deref())?;
    Ok((query, failed, queue))
}

/// `GET /errors/groups`: the groups of the error queue, largest first.
pub(super) async fn groups(State(host): State<Shared>, query: QueryResult) -> Response {
    let (query, failed, queue) = match read_request(&host, query) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let filter = query.filter();
    let name = queue.to_string();
    match on_runtime(&host, async move { failed.groups(&queue, &filter).await }).await {
        Ok(groups) => axum::Json(json!({ "queue": name, "groups": groups })).into_response(),
        Err(refused) => *refused,
    }
}

/// `GET /errors/messages`: a page of the messages the filter selects.
pub(super) async fn messages(State(host): State<Shared>, query: QueryResult) -> Response {
    let (query, failed, queue) = match read_request(&host, query) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let (filter, offset) = (query.filter(), query.offset.unwrap_or(0));
    let limit = query.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    let name = queue.to_string();
    let page = on_runtime(&host, async move {
        failed.list(&queue, &filter, offset, limit).await
    });
    match page.await {
        Ok(page) => axum::Json(json!({
            "queue": name,
            "offset": offset,
            "limit": limit,
            "total": page.total,
            "messages": page.messages,
        }))
        .into_response(),
        Err(refused) => *refused,
    }
}

/// `GET /errors/messages/{id}`: one message in full.
pub(super) async fn message(
    State(host): State<Shared>,
    Path(id): Path<String>,
    query: QueryResult,
) -> Response {
    let Ok(id) = Uuid::parse_str(&id) else {
        return error(
            StatusCode::BAD_REQUEST,
            format!("`{id}` is not a message id (the row's Id, a UUID)"),
        );
    };
    let (_, failed, queue) = match read_request(&host, query) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let name = queue.to_string();
    match on_runtime(
        &host,
        async move { failed.show(&queue, id, BODY_SHOWN).await },
    )
    .await
    {
        Ok(Some(view)) => axum::Json(view).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            format!("no message {id} in error queue `{name}`"),
        ),
        Err(refused) => *refused,
    }
}

/// `POST /errors/delete`: deletes the messages a selection names.
pub(super) async fn delete(State(host): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let (selection, failed, queue) = match mutating_request(&host, &headers, body).await {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let (name, filter) = (queue.to_string(), selection.filter.clone());
    match on_runtime(&host, async move { failed.delete(&queue, &filter).await }).await {
        Ok(deleted) => {
            host.failed_handled(&name, "deleted", deleted);
            tracing::info!(queue = %name, filter = ?selection.filter, deleted, "failed messages deleted");
            axum::Json(json!({ "queue": name, "deleted": deleted })).into_response()
        }
        Err(refused) => *refused,
    }
}

/// A retry or delete request: authorized, its selection read and checked (an empty filter
/// selects everything, so only with `all`: a forgotten filter touches nothing), and the tool
/// and error queue it names.
async fn mutating_request(
    host: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Selection, FailedMessages, QueueName), Box<Response>> {
    authorize(host.as_ref(), headers)?;
    let selection: Selection = read_json(host.as_ref(), body).await?;
    if selection.filter.is_all() && !selection.all {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "name what to select: `filter` (ids, group, source, since, until), or `\"all\": true` for every message",
        )));
    }
    let (failed, queue) = tool(host, selection.queue.as_deref())?;
    Ok((selection, failed, queue))
}

/// `POST /errors/retry`: starts a retry job (202), paced by the publishing admission; 409
/// while another runs.
pub(super) async fn retry(
    State(host): State<Shared>,
    Extension(job): Extension<Arc<RetryJob>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (selection, failed, queue) = match mutating_request(&host, &headers, body).await {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let to = match selection.to.as_deref().map(QueueName::new).transpose() {
        Ok(to) => to,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("to: {e}")),
    };
    let Some(stop) = job.begin(&queue) else {
        return error(
            StatusCode::CONFLICT,
            "a retry is running: GET /errors/retry shows it, DELETE /errors/retry stops it",
        );
    };
    let publisher = host.publisher();
    let counter = publisher.clone();
    let meter = host.clone();
    let filter = selection.filter.clone();
    let runner = job.clone();
    tracing::info!(queue = %queue, filter = ?filter, to = ?to, "retry of failed messages started");
    host.runtime().spawn(async move {
        let outcome = async {
            let ids = failed.select(&queue, &filter).await?;
            runner.update(|s| s.selected = ids.len() as u64);
            let admit = paced_by(publisher);
            let progress = |moved: u64| runner.update(|s| s.moved = moved);
            let stored =
                |q: &QueueName, m: &crate::message::OutgoingMessage| counter.published(q, m);
            let run = RetryRun {
                admit: Some(&admit),
                progress: &progress,
                stored: &stored,
                stop,
            };
            failed
                .retry(&queue, &ids, to.as_ref(), RETRY_BATCH, &run)
                .await
        }
        .await;
        if let Ok(done) = &outcome {
            meter.failed_handled(queue.as_str(), "retried", done.moved);
        }
        runner.end(&queue, outcome);
    });
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({ "retry": "started", "progress": "GET /errors/retry" })),
    )
        .into_response()
}

/// Waits, before each message a retry moves, for the host's publishing admission: the
/// retry is paced by publishing throttling as the host's own sends are.
fn paced_by(
    publisher: Arc<crate::publish::Publisher>,
) -> impl Fn() -> futures_util::future::BoxFuture<'static, ()> + Send + Sync {
    move || {
        let publisher = publisher.clone();
        Box::pin(async move {
            publisher.admit().await;
        })
    }
}

impl RetryJob {
    /// Starts a job on `queue` unless one is running; its stop token.
    fn begin(&self, queue: &QueueName) -> Option<CancellationToken> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.as_ref().is_some_and(|s| s.finished.is_none()) {
            return None;
        }
        let stop = CancellationToken::new();
        *state = Some(JobState {
            queue: queue.to_string(),
            selected: 0,
            moved: 0,
            started: Utc::now(),
            finished: None,
            result: None,
            error: None,
            stop: stop.clone(),
        });
        Some(stop)
    }

    /// Ends the job on `queue` with its outcome, said in the log.
    fn end<E: std::fmt::Display>(&self, queue: &QueueName, outcome: Result<Retried, E>) {
        match &outcome {
            Ok(done) => {
                tracing::info!(queue = %queue, moved = done.moved, no_source = done.no_source,
                unreadable = done.unreadable, gone = done.gone, stopped = done.stopped,
                "retry of failed messages ended")
            }
            Err(e) => tracing::warn!(queue = %queue, error = %e, "retry of failed messages failed"),
        }
        self.update(|s| {
            s.finished = Some(Utc::now());
            match outcome {
                Ok(done) => s.result = Some(done),
                Err(e) => s.error = Some(e.to_string()),
            }
        });
    }

    fn update(&self, change: impl FnOnce(&mut JobState)) {
        if let Some(state) = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            change(state);
        }
    }
}

/// `GET /errors/retry`: the last retry job, running or ended.
pub(super) async fn retry_progress(Extension(job): Extension<Arc<RetryJob>>) -> Response {
    let state = job.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match state {
        Some(state) => axum::Json(json!({
            "running": state.finished.is_none(),
            "job": state,
        }))
        .into_response(),
        None => axum::Json(json!({ "running": false, "job": null })).into_response(),
    }
}

/// `DELETE /errors/retry`: stops the running retry after its current batch.
pub(super) async fn stop_retry(
    State(host): State<Shared>,
    Extension(job): Extension<Arc<RetryJob>>,
    headers: HeaderMap,
) -> Response {
    if let Err(denied) = authorize(host.as_ref(), &headers) {
        return *denied;
    }
    let state = job.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match state {
        Some(state) if state.finished.is_none() => {
            state.stop.cancel();
            tracing::info!(queue = %state.queue, moved = state.moved, "retry of failed messages stopped");
            axum::Json(json!({ "stopping": true, "moved": state.moved })).into_response()
        }
        _ => error(StatusCode::NOT_FOUND, "no retry is running"),
    }
}

fn bad_query() -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "the query parameters are queue, group, source, since and until (RFC 3339 times), offset and limit",
    )
}
