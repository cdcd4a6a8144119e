//! The headers NServiceBus's outgoing pipeline writes on a message it sends, so that an
//! NServiceBus endpoint, ServiceControl and ServicePulse read what this host sends as they read
//! each other's: the intent, the message types, the conversation (`ConversationId`,
//! `CorrelationId`, `RelatedTo`), who sent it (`OriginatingEndpoint`, `OriginatingMachine`,
//! `$.diagnostics.originating.hostid`), where replies go (`ReplyToAddress`) and, for a delayed
//! send, when it is due (`DeliverAt`). Each is written only where the message does not carry
//! it already: what a caller set explicitly wins.

use uuid::Uuid;

use super::{Headers, MESSAGE_ID_HEADER, Message, OutgoingMessage};

/// `NServiceBus.MessageIntent`.
pub const MESSAGE_INTENT_HEADER: &str = "NServiceBus.MessageIntent";
/// `NServiceBus.EnclosedMessageTypes`: the message's type and its base types, `;`-separated.
pub const ENCLOSED_MESSAGE_TYPES_HEADER: &str = "NServiceBus.EnclosedMessageTypes";
/// `NServiceBus.ConversationId`: shared by every message a first message caused.
pub const CONVERSATION_ID_HEADER: &str = "NServiceBus.ConversationId";
/// `NServiceBus.CorrelationId`.
pub const CORRELATION_ID_HEADER: &str = "NServiceBus.CorrelationId";
/// `NServiceBus.RelatedTo`: the id of the message being handled when this one was sent.
pub const RELATED_TO_HEADER: &str = "NServiceBus.RelatedTo";
/// `NServiceBus.ReplyToAddress`: the transport address replies go to.
pub const REPLY_TO_ADDRESS_HEADER: &str = "NServiceBus.ReplyToAddress";
/// `NServiceBus.OriginatingEndpoint`.
pub const ORIGINATING_ENDPOINT_HEADER: &str = "NServiceBus.OriginatingEndpoint";
/// `NServiceBus.OriginatingMachine`.
pub const ORIGINATING_MACHINE_HEADER: &str = "NServiceBus.OriginatingMachine";
/// `$.diagnostics.originating.hostid`.
pub const ORIGINATING_HOST_ID_HEADER: &str = "$.diagnostics.originating.hostid";
/// `NServiceBus.DeliverAt`: when a delayed message is due, in the wire time format.
pub const DELIVER_AT_HEADER: &str = "NServiceBus.DeliverAt";

/// What a message is for (`NServiceBus.MessageIntent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageIntent {
    /// A command sent to one queue.
    Send,
    /// An event published to its subscribers.
    Publish,
    /// A reply to the sender of the message being handled.
    Reply,
}

impl MessageIntent {
    /// The header's value.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageIntent::Send => "Send",
            MessageIntent::Publish => "Publish",
            MessageIntent::Reply => "Reply",
        }
    }
}

/// Who sends: the endpoint (the host name), the machine and a stable host id, as
/// NServiceBus writes them into `Originating*` headers and `ProcessingMachine` on failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The endpoint name (`[host] name`).
    pub endpoint: String,
    /// The machine's host name.
    pub machine: String,
    /// A UUID derived from machine, endpoint and instance: the same every run.
    pub host_id: Uuid,
}

impl Origin {
    /// The origin of `endpoint`'s instance `instance` on this machine.
    pub fn new(endpoint: &str, instance: &str) -> Self {
        let machine = sysinfo::System::host_name().unwrap_or_else(|_| "unknown".into());
        let host_id = Uuid::new_v5(
            &Uuid::NAMESPACE_OID,
            format!("{machine}/{endpoint}/{instance}").as_bytes(),
        );
        Origin {
            endpoint: endpoint.to_string(),
            machine,
            host_id,
        }
    }
}

fn set_missing(headers: &mut Headers, name: &str, value: impl FnOnce() -> String) {
    let slot = headers.entry(name.to_string()).or_insert(None);
    if slot.as_deref().is_none_or(str::is_empty) {
        *slot = Some(value());
    }
}

impl OutgoingMessage {
    /// Sets `NServiceBus.MessageIntent`.
    pub fn with_intent(self, intent: MessageIntent) -> Self {
        self.with_header(MESSAGE_INTENT_HEADER, intent.as_str())
    }

    /// Sets `NServiceBus.EnclosedMessageTypes` (NServiceBus's serializers find the type to
    /// read the body as here): the message's type first, then its base types and interfaces,
    /// as full names (assembly-qualified where the receiver expects it), `;`-separated.
    pub fn with_enclosed_message_types(self, types: impl Into<String>) -> Self {
        self.with_header(ENCLOSED_MESSAGE_TYPES_HEADER, types)
    }

    /// Writes the headers of a message that starts a conversation, sent by `origin`: intent
    /// `Send` unless set, a new `ConversationId`, `CorrelationId` = its own message id, and
    /// the originating endpoint, machine and host id.
    pub fn sent_by(mut self, origin: &Origin) -> Self {
        let own_id = self.logical_id();
        let h = &mut self.headers;
        set_missing(h, MESSAGE_INTENT_HEADER, || {
            MessageIntent::Send.as_str().into()
        });
        set_missing(h, CONVERSATION_ID_HEADER, || Uuid::new_v4().to_string());
        set_missing(h, CORRELATION_ID_HEADER, || own_id);
        stamp_origin(h, origin);
        self
    }

    /// Writes the headers of a message sent while `incoming` is handled by `origin`, from
    /// the queue whose transport address is `reply_to`: the incoming message's conversation
    /// (its `ConversationId`, else its id), `RelatedTo` its id, `CorrelationId` its
    /// correlation id (else its id), replies to `reply_to`, and the originating headers. A
    /// message that carries the incoming message's own id is that message sent on (a
    /// forward), not one it caused: it is left as it is.
    pub fn caused_by(mut self, incoming: &Message, origin: &Origin, reply_to: &str) -> Self {
        let incoming_id = incoming.logical_id();
        if self.header_value(MESSAGE_ID_HEADER) == Some(incoming_id.as_str()) {
            return self;
        }
        let h = &mut self.headers;
        set_missing(h, MESSAGE_INTENT_HEADER, || {
            MessageIntent::Send.as_str().into()
        });
        set_missing(h, CONVERSATION_ID_HEADER, || {
            incoming
                .header(CONVERSATION_ID_HEADER)
                .map_or_else(|| incoming_id.clone(), str::to_string)
        });
        set_missing(h, RELATED_TO_HEADER, || incoming_id.clone());
        set_missing(h, CORRELATION_ID_HEADER, || {
            incoming
                .header(CORRELATION_ID_HEADER)
                .map_or_else(|| incoming_id.clone(), str::to_string)
        });
        set_missing(h, REPLY_TO_ADDRESS_HEADER, || reply_to.to_string());
        stamp_origin(h, origin);
        self
    }

    fn header_value(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.as_deref())
    }
}

fn stamp_origin(h: &mut Headers, origin: &Origin) {
    set_missing(h, ORIGINATING_ENDPOINT_HEADER, || origin.endpoint.clone());
    set_missing(h, ORIGINATING_MACHINE_HEADER, || origin.machine.clone());
    set_missing(h, ORIGINATING_HOST_ID_HEADER, || origin.host_id.to_string());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        Origin {
            endpoint: "Billing".into(),
            machine: "m1".into(),
            host_id: Uuid::nil(),
        }
    }

    fn incoming(headers: &[(&str, &str)]) -> Message {
        Message {
            id: Uuid::new_v4(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string())))
                .collect(),
            body: Vec::new(),
            expires: None,
        }
    }

    #[test]
    fn a_first_message_starts_its_own_conversation() {
        let m = OutgoingMessage::new("x").sent_by(&origin());
        let id = m.logical_id();
        let h = |n: &str| m.header_value(n).map(str::to_string);
        assert_eq!(h(MESSAGE_INTENT_HEADER).as_deref(), Some("Send"));
        assert_eq!(h(CORRELATION_ID_HEADER), Some(id));
        assert!(h(CONVERSATION_ID_HEADER).is_some());
        assert_eq!(h(ORIGINATING_ENDPOINT_HEADER).as_deref(), Some("Billing"));
        assert_eq!(h(ORIGINATING_MACHINE_HEADER).as_deref(), Some("m1"));
        assert_eq!(h(RELATED_TO_HEADER), None, "caused by nothing");
        assert_eq!(h(REPLY_TO_ADDRESS_HEADER), None, "no queue to reply to");
    }

    #[test]
    fn a_message_sent_by_a_handler_joins_the_conversation_it_was_caused_in() {
        let cause = incoming(&[
            (MESSAGE_ID_HEADER, "m-1"),
            (CONVERSATION_ID_HEADER, "conv-7"),
            (CORRELATION_ID_HEADER, "corr-3"),
        ]);
        let m = OutgoingMessage::new("y").caused_by(&cause, &origin(), "Billing@[dbo]@[Shop]");
        let h = |n: &str| m.header_value(n);
        assert_eq!(h(CONVERSATION_ID_HEADER), Some("conv-7"));
        assert_eq!(h(RELATED_TO_HEADER), Some("m-1"));
        assert_eq!(h(CORRELATION_ID_HEADER), Some("corr-3"));
        assert_eq!(h(REPLY_TO_ADDRESS_HEADER), Some("Billing@[dbo]@[Shop]"));
        assert_eq!(h(MESSAGE_INTENT_HEADER), Some("Send"));
        assert_ne!(m.logical_id(), "m-1", "a new message");

        let bare = incoming(&[(MESSAGE_ID_HEADER, "m-2")]);
        let m = OutgoingMessage::new("z").caused_by(&bare, &origin(), "q");
        assert_eq!(m.header_value(CONVERSATION_ID_HEADER), Some("m-2"));
        assert_eq!(m.header_value(CORRELATION_ID_HEADER), Some("m-2"));
    }

    #[test]
    fn what_the_caller_set_wins_and_a_forward_is_left_alone() {
        let cause = incoming(&[(MESSAGE_ID_HEADER, "m-1"), (CONVERSATION_ID_HEADER, "c")]);
        let m = OutgoingMessage::new("r")
            .with_intent(MessageIntent::Reply)
            .with_header(CONVERSATION_ID_HEADER, "mine")
            .caused_by(&cause, &origin(), "q");
        assert_eq!(m.header_value(MESSAGE_INTENT_HEADER), Some("Reply"));
        assert_eq!(m.header_value(CONVERSATION_ID_HEADER), Some("mine"));

        let forward = OutgoingMessage::forward_of(&cause).caused_by(&cause, &origin(), "q");
        assert_eq!(forward.header_value(RELATED_TO_HEADER), None);
        assert_eq!(forward.header_value(ORIGINATING_ENDPOINT_HEADER), None);
    }
}
