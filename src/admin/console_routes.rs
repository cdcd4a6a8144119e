//! The console's routes: the page and its assets (with the console's CSP) and
//! `/console/data`, the page's once-a-second poll.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{Shared, error};
use crate::console::{self, ConsoleData, History};

/// A console asset with its type, the console's CSP and no caching (a new binary may serve
/// a new page on the same address).
fn console_asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (
                header::CONTENT_SECURITY_POLICY,
                console::CONTENT_SECURITY_POLICY,
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

pub(super) async fn console_page() -> Response {
    console_asset("text/html; charset=utf-8", console::PAGE_HTML)
}

pub(super) async fn console_script() -> Response {
    console_asset("text/javascript; charset=utf-8", console::SCRIPT_JS)
}

pub(super) async fn console_icon() -> Response {
    console_asset("image/svg+xml", console::ICON_SVG)
}

pub(super) async fn console_style() -> Response {
    console_asset("text/css; charset=utf-8", console::STYLE_CSS)
}

#[derive(Deserialize)]
pub(super) struct DataQuery {
    #[serde(default)]
    after: u64,
}

pub(super) async fn console_data(
    State(host): State<Shared>,
    axum::Extension(history): axum::Extension<Arc<History>>,
    query: Result<Query<DataQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return error(
            StatusCode::BAD_REQUEST,
            "`after` must be a sample number (a whole number from 0)",
        );
    };
    let data = ConsoleData {
        status: host.status(),
        samples: history.after(query.after),
        history_seconds: console::HISTORY.as_secs(),
    };
    ([(header::CACHE_CONTROL, "no-store")], axum::Json(data)).into_response()
}
