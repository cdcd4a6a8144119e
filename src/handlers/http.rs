//! `kind = "http"`: POSTs each message body to a URL. Headers travel as `X-Header-<name>`
//! (names outside HTTP's token characters are skipped) plus `X-Message-Id`. A 2xx answer is
//! success; anything else, or no answer within the queue's handler timeout, fails the attempt.

use async_trait::async_trait;

use super::{Context, Handler, HandlerError};
use crate::config::HttpConfig;

/// The HTTP handler.
pub struct HttpHandler {
    config: HttpConfig,
    agent: ureq::Agent,
}

impl HttpHandler {
    /// POSTs to `config.url`.
    pub fn new(config: HttpConfig) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        HttpHandler { config, agent }
    }
}

fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[async_trait]
impl Handler for HttpHandler {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let mut request = self
            .agent
            .post(&self.config.url)
            .header("X-Message-Id", ctx.message().logical_id())
            .header("Content-Type", "application/octet-stream");
        for (name, value) in ctx.headers() {
            if let Some(value) = value
                && is_token(name)
                && value
                    .bytes()
                    .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
            {
                request = request.header(format!("X-Header-{name}"), value);
            }
        }
        let body = ctx.body().to_vec();
        let url = self.config.url.clone();
        let status =
            tokio::task::spawn_blocking(move || request.send(&body[..]).map(|r| r.status()))
                .await?
                .map_err(|e| format!("POST {url} failed: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("POST {} answered {}", self.config.url, status).into())
        }
    }

    fn name(&self) -> &str {
        "http"
    }
}
