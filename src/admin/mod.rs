//! The admin HTTP endpoint (axum):
//!
//! | route | what |
//! |---|---|
//! | `GET /` | the live console (a page; see [`crate::console`]) |
//! | `GET /console/data?after=N` | the console's poll: the `/status` document and new history samples |
//! | `GET /metrics` | Prometheus text exposition |
//! | `GET /status` | JSON: throttling per direction, sensors, queues |
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 when the transport answers and every queue's receiver runs, else 503 naming what is not |
//! | `POST /queues/{name}/messages` | ingest one message (the body) through the throttled publish path |
//! | `POST /queues/{name}/batch` | ingest a JSON array of messages, stored with multi-row inserts |
//! | `PUT /throttling/{direction}/override` | `none`, `throttle` or `never`; `?scope=fleet`: every instance on the database, through the instance registry |
//! | `GET /fleet` | every instance on the database, and the fleet-wide overrides in force |
//! | `GET /errors/groups`, `GET /errors/messages[/{id}]` | failed messages: groups by cause, a page, one in full (`?queue=&group=&source=&since=&until=&offset=&limit=`) |
//! | `POST /errors/retry`, `GET`/`DELETE /errors/retry` | retry a selection as a paced job, its progress, stop it |
//! | `POST /errors/delete` | delete a selection of failed messages |
//!
//! Every request names this endpoint in its `Host` (an IP address, localhost, this machine's
//! name or one of `admin.allowed_hosts`), and a request that changes something comes from no
//! other site (`Origin`, `Sec-Fetch-Site`): see `guard.rs`. Mutating routes need
//! `Authorization: Bearer <admin.token>` when a token is set (compared in constant time). Every error is a JSON body `{"error": "..."}` with a 4xx/5xx status.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::Deserialize;
use serde_json::json;
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;

use crate::config::{AdminConfig, OverrideMode};
use crate::console::{self, History};

mod console_routes;
mod failed_routes;
mod guard;
mod header_case;
mod ingest;

use crate::fleet::{FleetOrderError, FleetView};
use crate::isolate::on_host;
use crate::publish::Publisher;
use crate::status::HostStatus;
use crate::throttling::Direction;
use crate::transport::{QueueName, Transport};
use console_routes::{console_data, console_icon, console_page, console_script, console_style};
use ingest::{ingest, ingest_batch, publish};

/// How long `/readyz` waits for the transport.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

type Shared = Arc<dyn AdminState>;

/// What the admin endpoint reads from a running host and the two things it may change (the
/// override, by storing messages). The host implements it; the endpoint knows nothing else of
/// the host.
pub(crate) trait AdminState: Send + Sync + 'static {
    /// The `/status` document.
    fn status(&self) -> HostStatus;
    /// The Prometheus text exposition.
    fn metrics_text(&self) -> String;
    /// Why the host is not ready to receive (shutdown begun, a receiver not running); None
    /// when it is, apart from the transport, which [`AdminState::transport`] answers.
    fn not_ready(&self) -> Option<String>;
    /// The transport, to ping it (on [`AdminState::runtime`]).
    fn transport(&self) -> Arc<dyn Transport>;
    /// The runtime transport work must run on.
    fn runtime(&self) -> tokio::runtime::Handle;
    /// The admin settings in force (token, body size, ingest rejection).
    fn settings(&self) -> AdminConfig;
    /// Whether ingest may store into `queue`.
    fn accepts(&self, queue: &QueueName) -> bool;
    /// The throttled publisher ingest stores through.
    fn publisher(&self) -> Arc<Publisher>;
    /// Who the host is in the headers of what it sends (ingest stamps its messages so).
    fn origin(&self) -> crate::message::Origin;
    /// Header names the configuration uses (ordering keys), in their case: ingest restores
    /// the case HTTP takes from header names by them.
    fn header_names(&self) -> Vec<String>;
    /// The error queues the configuration names, each once, in the queues' order.
    fn error_queues(&self) -> Vec<String>;
    /// Counts failed messages of `queue` an operator retried or deleted (`action`).
    fn failed_handled(&self, queue: &str, action: &'static str, n: u64);
    /// Sets a direction's override on this instance until the next reload or fleet order.
    fn set_override(&self, direction: Direction, mode: OverrideMode);
    /// Orders every instance on the database to override `direction` (see `crate::fleet`);
    /// Err says why it could not be written. Writes the database: run it on
    /// [`AdminState::runtime`].
    fn set_fleet_override(
        &self,
        direction: Direction,
        mode: OverrideMode,
    ) -> futures_util::future::BoxFuture<'_, Result<(), crate::fleet::FleetOrderError>>;
    /// Every instance on the database (`/fleet`); Err says why there is no view. Reads the
    /// database: run it on [`AdminState::runtime`].
    fn fleet(&self) -> futures_util::future::BoxFuture<'_, Result<FleetView, String>>;
}

/// The most admin connections open at once. A new connection beyond it closes the oldest, so
/// a flood of idle or slow connections can neither exhaust the process's file descriptors
/// (which the database pool needs too) nor lock out a health check.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves the admin routes on `listener` until `stop` is cancelled.
///
/// Takes a std listener so it can be served on another runtime than the one that bound it
/// (the admin endpoint runs on its own thread; see [`crate::isolate`]).
pub(crate) async fn serve(listener: std::net::TcpListener, host: Shared, stop: CancellationToken) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "admin endpoint cannot listen");
            return;
        }
    };
    let history = Arc::new(History::default());
    tokio::spawn(record_history(host.clone(), history.clone(), stop.clone()));
    let app = router(host, history);
    let open = Arc::new(OpenConnections::default());
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, typically: wait instead of spinning on accept.
                    tracing::warn!(error = %e, "admin endpoint cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (id, evicted) = open.admit();
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let open = open.clone();
        let stop = stop.clone();
        connections.spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                // The oldest of too many: closed at once, its descriptor freed.
                _ = evicted.cancelled() => {}
                _ = stop.cancelled() => {
                    // Shutdown: finish a request under way, then close.
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(HEADER_READ_TIMEOUT, connection).await;
                }
            }
            open.remove(id);
        });
    }
    connections.close();
    connections.wait().await;
}

/// The admin connections open now, oldest first, each with the token that closes it.
#[derive(Default)]
struct OpenConnections {
    inner: std::sync::Mutex<(u64, std::collections::VecDeque<(u64, CancellationToken)>)>,
}

impl OpenConnections {
    /// Registers a new connection, evicting the oldest when [`MAX_CONNECTIONS`] are open;
    /// returns its id and the token that evicts it.
    fn admit(&self) -> (u64, CancellationToken) {
        let close = CancellationToken::new();
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (next, open) = &mut *guard;
        while open.len() >= MAX_CONNECTIONS {
            if let Some((_, oldest)) = open.pop_front() {
                oldest.cancel();
            }
        }
        *next += 1;
        open.push_back((*next, close.clone()));
        (*next, close)
    }

    fn remove(&self, id: u64) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.1.retain(|(i, _)| *i != id);
    }
}

/// Takes a console history sample every [`console::SAMPLE_INTERVAL`] until `stop`, so a page
/// opened late still draws the last ten minutes.
async fn record_history(host: Shared, history: Arc<History>, stop: CancellationToken) {
    let mut every = tokio::time::interval(console::SAMPLE_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = every.tick() => history.record(&host.status()),
        }
    }
}

/// The routes, for serving or for tests; `history` is what the console draws from.
pub(crate) fn router(host: Shared, history: Arc<History>) -> Router {
    Router::new()
        .route("/", get(console_page))
        .route("/console/console.js", get(console_script))
        .route("/console/console.css", get(console_style))
        .route("/console/icon.svg", get(console_icon))
        .route(
            "/console/data",
            get(console_data).layer(axum::Extension(history)),
        )
        .route("/metrics", get(metrics))
        .route("/status", get(status))
        .route("/fleet", get(fleet))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/queues/{name}/messages", post(ingest))
        .route("/queues/{name}/batch", post(ingest_batch))
        .route("/events", post(publish))
        .route("/throttling/{direction}/override", put(set_override))
        .route("/errors/groups", get(failed_routes::groups))
        .route("/errors/messages", get(failed_routes::messages))
        .route("/errors/messages/{id}", get(failed_routes::message))
        .route("/errors/delete", post(failed_routes::delete))
        .route(
            "/errors/retry",
            post(failed_routes::retry)
                .get(failed_routes::retry_progress)
                .delete(failed_routes::stop_retry),
        )
        .layer(axum::Extension(
            Arc::new(failed_routes::RetryJob::default()),
        ))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            host.clone(),
            guard::guard,
        ))
        .with_state(host)
}

/// A JSON error response.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "no such route; try / (the console), /metrics, /status, /healthz, /readyz, POST /queues/{name}/messages, POST /queues/{name}/batch, PUT /throttling/{direction}/override, GET /errors/groups, GET /errors/messages",
    )
}

async fn method_not_allowed() -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed on this route",
    )
}

async fn metrics(State(host): State<Shared>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        host.metrics_text(),
    )
        .into_response()
}

async fn status(State(host): State<Shared>) -> Response {
    axum::Json(host.status()).into_response()
}

async fn healthz() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

/// Runs `call` (a use of the instance registry) on the host's runtime and waits
/// [`READY_TIMEOUT`] for it; a runtime that is stopping or a registry that does not answer
/// is a 503 (`unanswered` says what that leaves undecided).
async fn on_registry<T: Send + 'static>(
    host: &Shared,
    call: impl std::future::Future<Output = T> + Send + 'static,
    unanswered: &str,
) -> Result<T, Response> {
    match tokio::time::timeout(READY_TIMEOUT, on_host(&host.runtime(), call)).await {
        Ok(Some(answer)) => Ok(answer),
        Ok(None) => Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the host runtime is stopping",
        )),
        Err(_) => Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the instance registry did not answer within {}s{unanswered}",
                READY_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// `GET /fleet`: every instance on this host's database (see `crate::fleet`).
async fn fleet(State(host): State<Shared>) -> Response {
    let reader = host.clone();
    match on_registry(&host, async move { reader.fleet().await }, "").await {
        Ok(Ok(view)) => axum::Json(view).into_response(),
        Ok(Err(why)) => error(StatusCode::SERVICE_UNAVAILABLE, why),
        Err(unanswered) => unanswered,
    }
}

async fn readyz(State(host): State<Shared>) -> Response {
    if let Some(reason) = host.not_ready() {
        return error(StatusCode::SERVICE_UNAVAILABLE, reason);
    }
    let (transport, runtime) = (host.transport(), host.runtime());
    let ping = on_host(&runtime, async move { transport.ping().await });
    match tokio::time::timeout(READY_TIMEOUT, ping).await {
        Ok(None) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the host runtime is stopping",
        ),
        Ok(Some(Ok(()))) => axum::Json(json!({ "status": "ready" })).into_response(),
        Ok(Some(Err(e))) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("transport unavailable: {e}"),
        ),
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "transport did not answer within {}s",
                READY_TIMEOUT.as_secs()
            ),
        ),
    }
}

/// Reads a JSON body (at most `admin.max_body_size`), refusing what does not parse with the
/// reason.
async fn read_json<T: serde::de::DeserializeOwned>(
    host: &dyn AdminState,
    body: Body,
) -> Result<T, Box<Response>> {
    let bytes = ingest::read_body(host, body).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, format!("the body: {e}"))))
}

fn authorize(host: &dyn AdminState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let settings = host.settings();
    let token = settings.token.expose();
    if token.is_empty() {
        return Ok(());
    }
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(presented.as_bytes().ct_eq(token.as_bytes())) {
        Ok(())
    } else {
        Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "this route needs `Authorization: Bearer <admin.token>`",
        )))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OverrideBody {
    mode: OverrideMode,
}

/// `?scope=` of the override route.
#[derive(Debug, Deserialize)]
struct OverrideQuery {
    scope: Option<String>,
}

async fn set_override(
    State(host): State<Shared>,
    Path(direction): Path<String>,
    Query(query): Query<OverrideQuery>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(denied) = authorize(host.as_ref(), &headers) {
        return *denied;
    }
    let fleet = match query.scope.as_deref() {
        None | Some("local") => false,
        Some("fleet") => true,
        Some(other) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "unknown scope `{other}`; use local (this instance, the default) or fleet (every instance on the database)"
                ),
            );
        }
    };
    let Some(direction) = Direction::parse(&direction) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("unknown direction `{direction}`; use delivery or publishing"),
        );
    };
    let Ok(body) = to_bytes(body, 1024).await else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the body must be a few bytes",
        );
    };
    let text = String::from_utf8_lossy(&body);
    let text = text.trim();
    let mode = if text.starts_with('{') {
        serde_json::from_str::<OverrideBody>(text)
            .map(|b| b.mode)
            .ok()
    } else {
        serde_json::from_value::<OverrideMode>(json!(text.trim_matches('"'))).ok()
    };
    let Some(mode) = mode else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "`{text}` is not an override; send none, throttle or never (plain text or {{\"mode\": \"throttle\"}})"
            ),
        );
    };
    if !fleet {
        host.set_override(direction, mode);
        return axum::Json(
            json!({ "direction": direction.name(), "override": mode, "scope": "local" }),
        )
        .into_response();
    }
    let writer = host.clone();
    let write = async move { writer.set_fleet_override(direction, mode).await };
    let unanswered = "; the fleet-wide override may or may not have been written";
    match on_registry(&host, write, unanswered).await {
        Ok(Ok(())) => {
            axum::Json(json!({ "direction": direction.name(), "override": mode, "scope": "fleet" }))
                .into_response()
        }
        // No registry: the request cannot be done as asked on this host.
        Ok(Err(why @ (FleetOrderError::NoRegistry(_) | FleetOrderError::NoToken))) => {
            error(StatusCode::CONFLICT, why.to_string())
        }
        Ok(Err(why)) => error(StatusCode::SERVICE_UNAVAILABLE, why.to_string()),
        Err(unanswered) => unanswered,
    }
}
