//! Handlers: the [`Handler`] trait the host calls for each message, the [`Context`] it gets,
//! and the built-in handlers the binary configures per queue in TOML.

mod command;
mod forward;
mod http;
mod publish;
mod simulate;

use std::sync::Arc;

use async_trait::async_trait;

pub use command::CommandHandler;
pub use forward::ForwardHandler;
pub use http::HttpHandler;
pub use publish::PublishHandler;
pub use simulate::{POISON_HEADER, SimulateHandler};

use crate::config::HandlerConfig;
use crate::message::{Headers, Message, Origin, OutgoingMessage};
use crate::publish::{EventTypes, Publisher, as_event};
use crate::transport::{QueueName, TransportError};

/// What a handler returns on failure. Any error type will do; its `Display` and source chain
/// end up in the `NServiceBus.ExceptionInfo.*` headers if the message reaches the error queue.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Processes messages of one queue.
///
/// A handler may be called concurrently (up to the queue's concurrency) and again for the same
/// message on retry, so it should be idempotent. Returning an error (or panicking, or running
/// past the queue's `handler_timeout`) counts as a failed attempt.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles one message.
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError>;

    /// A short name, written into `NServiceBus.ExceptionInfo.Source` on failure.
    fn name(&self) -> &str {
        "handler"
    }
}

/// The message being handled and the means to send more.
pub struct Context<'a> {
    message: &'a Message,
    queue: &'a QueueName,
    attempt: u32,
    sender: Sender<'a>,
    pub(crate) outbox: Vec<(QueueName, OutgoingMessage)>,
}

/// What a handler's sends go through: the publisher, who sends (for the headers
/// NServiceBus writes), and whether a send is written at once (transaction mode `none`).
pub(crate) struct Sender<'a> {
    pub(crate) origin: &'a Origin,
    pub(crate) publisher: &'a Publisher,
    pub(crate) send_immediately: bool,
}

impl<'a> Context<'a> {
    pub(crate) fn new(
        message: &'a Message,
        queue: &'a QueueName,
        attempt: u32,
        sender: Sender<'a>,
    ) -> Self {
        Context {
            message,
            queue,
            attempt,
            sender,
            outbox: Vec::new(),
        }
    }

    /// The message.
    pub fn message(&self) -> &Message {
        self.message
    }

    /// The message body.
    pub fn body(&self) -> &[u8] {
        &self.message.body
    }

    /// The message headers.
    pub fn headers(&self) -> &Headers {
        &self.message.headers
    }

    /// The queue the message came from.
    pub fn queue(&self) -> &QueueName {
        self.queue
    }

    /// 0 for the first attempt, 1 for the first retry, and so on.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Sends a message through the throttled publish path. It waits the publishing delay
    /// first. Unless the host runs in transaction mode `none`, the message is written only
    /// after this handler succeeds: with the receive (`sends_atomic_with_receive`) or just
    /// before it commits (`receive_only`). A failed attempt sends nothing.
    ///
    /// The message joins the conversation of the one being handled, with the headers
    /// NServiceBus writes (`ConversationId`, `RelatedTo`, `CorrelationId`, `ReplyToAddress`
    /// this queue, `OriginatingEndpoint`, intent `Send` unless set): see
    /// [`OutgoingMessage::caused_by`]. A copy that keeps the handled message's id is sent on
    /// unchanged.
    pub async fn send(
        &mut self,
        queue: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let queue = QueueName::new(queue)?;
        let publisher = self.sender.publisher;
        let reply_to = publisher.transport().address(self.queue);
        let message = message.caused_by(self.message, self.sender.origin, &reply_to);
        publisher.admit().await;
        if self.sender.send_immediately {
            publisher.insert(&queue, &message).await
        } else {
            self.outbox.push((queue, message));
            Ok(())
        }
    }
}

impl Context<'_> {
    /// Publishes an event of `types` to every subscriber of its topics (see
    /// [`EventTypes`]): a copy per subscriber's queue, each waiting the publishing throttle as
    /// a send does, with intent `Publish`, `EnclosedMessageTypes` the types and the
    /// conversation headers of [`Context::send`]. As handler sends, the copies are written
    /// only after the handler succeeds (with the receive in `sends_atomic_with_receive`), and
    /// at once, in one transaction, in transaction mode `none`. Returns how many subscribers
    /// it found (kept for `transport.subscription_cache`); none is not an error.
    pub async fn publish(
        &mut self,
        types: &EventTypes,
        message: OutgoingMessage,
    ) -> Result<usize, TransportError> {
        let publisher = self.sender.publisher;
        let queues = publisher.subscriber_queues(types).await?;
        let reply_to = publisher.transport().address(self.queue);
        let message =
            as_event(message, types).caused_by(self.message, self.sender.origin, &reply_to);
        let copies: Vec<(QueueName, OutgoingMessage)> =
            queues.into_iter().map(|q| (q, message.clone())).collect();
        for _ in &copies {
            publisher.admit().await;
        }
        let found = copies.len();
        match self.sender.send_immediately {
            true => publisher.store_copies(&copies).await?,
            false => self.outbox.extend(copies),
        }
        publisher.event_published(types, found);
        Ok(found)
    }
}

/// Accepts every message.
pub struct NoopHandler;

#[async_trait]
impl Handler for NoopHandler {
    async fn handle(&self, _ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        Ok(())
    }

    fn name(&self) -> &str {
        "noop"
    }
}

/// A built handler plus, for `simulate`, the handle that lets load tests change its knobs.
pub struct BuiltHandler {
    /// The handler.
    pub handler: Arc<dyn Handler>,
    /// Set for simulate handlers.
    pub simulate: Option<Arc<SimulateHandler>>,
}

/// Builds a configured built-in handler.
pub fn build(config: &HandlerConfig) -> Result<BuiltHandler, TransportError> {
    Ok(match config {
        HandlerConfig::Noop => BuiltHandler {
            handler: Arc::new(NoopHandler),
            simulate: None,
        },
        HandlerConfig::Simulate(s) => {
            let h = Arc::new(SimulateHandler::new(s.clone()));
            BuiltHandler {
                handler: h.clone(),
                simulate: Some(h),
            }
        }
        HandlerConfig::Forward(f) => BuiltHandler {
            handler: Arc::new(ForwardHandler::new(QueueName::new(&f.to)?)),
            simulate: None,
        },
        HandlerConfig::Command(c) => BuiltHandler {
            handler: Arc::new(CommandHandler::new(c.clone())),
            simulate: None,
        },
        HandlerConfig::Http(h) => BuiltHandler {
            handler: Arc::new(HttpHandler::new(h.clone())),
            simulate: None,
        },
        HandlerConfig::Publish(p) => BuiltHandler {
            handler: Arc::new(PublishHandler::new(
                EventTypes::parse(&p.types).map_err(TransportError::InvalidMessage)?,
            )),
            simulate: None,
        },
    })
}
