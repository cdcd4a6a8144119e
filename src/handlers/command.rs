//! `kind = "command"`: runs a program per message. The body goes to its stdin, the headers to
//! the environment (`THROTTLEHOST_HEADERS` as the wire JSON, `THROTTLEHOST_MESSAGE_ID`,
//! `THROTTLEHOST_QUEUE`). Exit status 0 is success; anything else fails the attempt with the
//! end of its stderr as the error message.

use std::process::Stdio;

use async_trait::async_trait;
use tokio::io::AsyncWriteExt;

use super::{Context, Handler, HandlerError};
use crate::config::CommandConfig;
use crate::transport::headers::serialize_headers;

/// Longest stderr tail kept in an error message.
const STDERR_TAIL: usize = 2000;

/// The command handler.
pub struct CommandHandler {
    config: CommandConfig,
}

impl CommandHandler {
    /// Runs `config.program` per message.
    pub fn new(config: CommandConfig) -> Self {
        CommandHandler { config }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("`{program}` exited with {status}: {stderr}")]
struct CommandFailed {
    program: String,
    status: std::process::ExitStatus,
    stderr: String,
}

#[async_trait]
impl Handler for CommandHandler {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let mut child = tokio::process::Command::new(&self.config.program)
            .args(&self.config.args)
            .env("THROTTLEHOST_HEADERS", serialize_headers(ctx.headers()))
            .env("THROTTLEHOST_MESSAGE_ID", ctx.message().logical_id())
            .env("THROTTLEHOST_QUEUE", ctx.queue().as_str())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start `{}`: {e}", self.config.program))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A program that does not read its input closes the pipe; that is not a failure.
            let _ = stdin.write_all(ctx.body()).await;
        }
        let output = child.wait_with_output().await?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let start = stderr.len().saturating_sub(STDERR_TAIL);
        let start = (start..stderr.len())
            .find(|i| stderr.is_char_boundary(*i))
            .unwrap_or(stderr.len());
        Err(Box::new(CommandFailed {
            program: self.config.program.clone(),
            status: output.status,
            stderr: stderr[start..].trim().to_string(),
        }))
    }

    fn name(&self) -> &str {
        "command"
    }
}
