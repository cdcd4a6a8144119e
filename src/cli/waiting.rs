//! While `run` waits for the database at start: the admin address answers already, so
//! `/healthz`, `/readyz` and the console say why the host is not up instead of refusing the
//! connection. It is stopped (and the address freed) just before the host starts.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The waiting endpoint; stop it with [`Waiting::stop`].
pub struct Waiting {
    reason: Arc<Mutex<String>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

type Reason = Arc<Mutex<String>>;

fn reason_of(reason: &Reason) -> String {
    reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

async fn healthz(State(reason): State<Reason>) -> Response {
    axum::Json(json!({ "status": "starting", "reason": reason_of(&reason) })).into_response()
}

async fn not_yet(State(reason): State<Reason>) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({ "error": reason_of(&reason) })),
    )
        .into_response()
}

impl Waiting {
    /// Serves on `address` (none when it is "off" or cannot be bound: the host's own endpoint
    /// reports that later).
    pub async fn serve(address: &str, reason: String) -> Option<Waiting> {
        if address.trim().eq_ignore_ascii_case("off") {
            return None;
        }
        let listener = match tokio::net::TcpListener::bind(address.trim()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(%address, error = %e, "cannot serve the admin endpoint while waiting for the database");
                return None;
            }
        };
        let reason: Reason = Arc::new(Mutex::new(reason));
        let app = Router::new()
            .route("/healthz", get(healthz))
            .fallback(not_yet)
            .with_state(reason.clone());
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.cancelled().await })
                .await;
        });
        Some(Waiting { reason, stop, task })
    }

    /// Says why the host is still not up.
    pub fn set_reason(&self, reason: String) {
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = reason;
    }

    /// Stops serving and frees the address.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}
