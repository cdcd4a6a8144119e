//! `kind = "forward"`: sends each message on to another queue through the publish path, with
//! the same headers and body and a fresh row id.

use async_trait::async_trait;

use super::{Context, Handler, HandlerError};
use crate::message::OutgoingMessage;
use crate::transport::QueueName;

/// The forward handler.
pub struct ForwardHandler {
    to: QueueName,
}

impl ForwardHandler {
    /// Forwards to `to`.
    pub fn new(to: QueueName) -> Self {
        ForwardHandler { to }
    }
}

#[async_trait]
impl Handler for ForwardHandler {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let copy = OutgoingMessage::forward_of(ctx.message());
        ctx.send(self.to.as_str(), copy).await?;
        Ok(())
    }

    fn name(&self) -> &str {
        "forward"
    }
}
