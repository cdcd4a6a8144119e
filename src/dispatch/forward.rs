//! Where a message goes besides its handler: forwarded to the queue its delayed row named,
//! undeliverable, or dead-lettered as poison.

use uuid::Uuid;

use crate::message::{FORWARD_DESTINATION_HEADER, Message, OutgoingMessage};
use crate::queue::{QueueEvent, QueueRuntime};
use crate::transport::{Payload, QueueName, Received};

use super::failure::Failure;
use super::{Destination, Dispatched, Dispatcher, Done, Outcome};

impl Dispatcher {
    /// Where a received message goes: here, unless it came from a delayed table for another
    /// queue.
    pub(super) fn destination(&self, q: &QueueRuntime, message: &Message) -> Destination {
        let Some(address) = message.header(FORWARD_DESTINATION_HEADER) else {
            return Destination::Here;
        };
        let parsed = self.publisher.transport().resolve_address(address);
        match parsed {
            Some(to) if to == *q.name() => Destination::Here,
            Some(to) => Destination::Queue(to),
            None => Destination::Unknown(address.to_string()),
        }
    }

    /// Sends a message from a delayed table on to the queue it is for, in the receive's unit
    /// of work. A send that fails rolls back; the next delivery of the same row goes to the
    /// error queue (as NServiceBus does), naming the destination.
    pub(super) async fn forward<'a>(
        &'a self,
        q: &'a QueueRuntime,
        mut received: Box<dyn Received>,
        to: QueueName,
    ) -> Dispatched<'a> {
        let Payload::Message(message) = received.payload() else {
            return Dispatched::Ended;
        };
        let (id, logical_id) = (message.id, message.logical_id());
        if q.failed_attempts(id) > 0 {
            self.undeliverable(q, received, to.as_str()).await;
            return Dispatched::Ended;
        }
        let mut copy = OutgoingMessage::forward_of(message);
        copy.headers.remove(FORWARD_DESTINATION_HEADER);
        if let Err(e) = self
            .publisher
            .insert_within(received.as_mut(), &to, &copy)
            .await
        {
            q.remember_failed_attempts(id, 1);
            tracing::warn!(queue = %q.name(), %id, destination = %to, error = %e,
                "a due delayed message could not be sent on to its destination; it returns and goes to the error queue next");
            let _ = received.rollback().await;
            return Dispatched::Ended;
        }
        let done = Done::Forwarded { id, logical_id };
        self.to_commit(q, received, done, None, None)
    }

    /// A message whose forward destination cannot be reached goes to the error queue with
    /// `NServiceBus.FailedQ` naming that destination.
    pub(super) async fn undeliverable(
        &self,
        q: &QueueRuntime,
        received: Box<dyn Received>,
        to: &str,
    ) {
        let Payload::Message(message) = received.payload() else {
            return;
        };
        let failure = Failure {
            kind: "throttlehost.ForwardFailed",
            message: format!("the forward destination `{to}` names no queue this host can send to"),
            detail: format!("{FORWARD_DESTINATION_HEADER} = {to}"),
        };
        let (id, logical_id) = (message.id, message.logical_id());
        let mut error_message = self.error_message(q, message, &failure, 1);
        error_message.headers.remove(FORWARD_DESTINATION_HEADER);
        error_message
            .headers
            .insert("NServiceBus.FailedQ".into(), Some(to.to_string()));
        if let Some(outcome) = self
            .move_to_error(q, received, id, &error_message, &failure)
            .await
        {
            self.observe(q, id, Some(&logical_id), outcome);
        }
    }

    pub(super) async fn dead_letter(
        &self,
        q: &QueueRuntime,
        mut received: Box<dyn Received>,
        id: Uuid,
        reason: &str,
    ) {
        tracing::warn!(queue = %q.name(), %id, error_queue = %q.error_queue(), %reason,
            "probable message metadata corruption: moving the row to the error queue unchanged");
        let result = match received.dead_letter(q.error_queue()).await {
            Ok(()) => received.commit().await,
            Err(e) => {
                let _ = received.rollback().await;
                Err(e)
            }
        };
        match result {
            Ok(()) => {
                q.count(QueueEvent::Poison);
                self.throttle.delivery_rates.outgoing();
                self.observe(q, id, None, Outcome::Poison);
            }
            Err(e) => tracing::error!(queue = %q.name(), %id, error = %e,
                "could not move a poison row to the error queue; it stays in the queue"),
        }
    }
}
