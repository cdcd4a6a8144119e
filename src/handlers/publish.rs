//! `kind = "publish"`: publishes each message as an event to the subscribers of its types,
//! with the same body (and content type), in the handled message's unit of work.

use async_trait::async_trait;

use super::{Context, Handler, HandlerError};
use crate::message::OutgoingMessage;
use crate::publish::EventTypes;

/// `NServiceBus.ContentType`: kept on the event, so subscribers read the body as it was.
const CONTENT_TYPE_HEADER: &str = "NServiceBus.ContentType";

/// The publish handler.
pub struct PublishHandler {
    types: EventTypes,
}

impl PublishHandler {
    /// Publishes as events of `types`.
    pub fn new(types: EventTypes) -> Self {
        PublishHandler { types }
    }
}

#[async_trait]
impl Handler for PublishHandler {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let mut event = OutgoingMessage::new(ctx.body().to_vec());
        if let Some(content_type) = ctx.message().header(CONTENT_TYPE_HEADER) {
            event = event.with_header(CONTENT_TYPE_HEADER, content_type);
        }
        ctx.publish(&self.types, event).await?;
        Ok(())
    }

    fn name(&self) -> &str {
        "publish"
    }
}
