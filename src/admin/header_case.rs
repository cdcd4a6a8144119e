//! Header names as the sender wrote them. HTTP header names are case-insensitive and arrive
//! lowercased (`x-header-nservicebus.messageid`), while a message's headers are compared
//! case-sensitively by NServiceBus and by this host (`NServiceBus.MessageId`, an ordering
//! key). Ingest restores each name's case from, in order: the names the request declares in
//! `X-Header-Names` (comma-separated, as they should be stored), the headers the host's
//! configuration names (ordering keys), and the headers NServiceBus and this host define. A
//! name found in none stays lowercase; the JSON batch form keeps every name as written.

use std::collections::HashMap;

use crate::message::{
    CONVERSATION_ID_HEADER, CORRELATION_ID_HEADER, DELIVER_AT_HEADER,
    ENCLOSED_MESSAGE_TYPES_HEADER, EXECUTION_STAGE_HEADER, FL_RETRIES_HEADER,
    FORWARD_DESTINATION_HEADER, MESSAGE_ID_HEADER, MESSAGE_INTENT_HEADER,
    ORIGINATING_ENDPOINT_HEADER, ORIGINATING_HOST_ID_HEADER, ORIGINATING_MACHINE_HEADER,
    PREVIOUS_STAGE_HEADER, RELATED_TO_HEADER, REPLY_TO_ADDRESS_HEADER, RETRIES_HEADER,
    RETRIES_TIMESTAMP_HEADER, TIME_SENT_HEADER, TIME_TO_BE_RECEIVED_HEADER,
};

/// The request header that declares header names in their case.
pub(super) const DECLARED_NAMES: &str = "x-header-names";

/// Headers NServiceBus and this host define, in their case.
const WELL_KNOWN: &[&str] = &[
    MESSAGE_ID_HEADER,
    CONVERSATION_ID_HEADER,
    CORRELATION_ID_HEADER,
    RELATED_TO_HEADER,
    REPLY_TO_ADDRESS_HEADER,
    MESSAGE_INTENT_HEADER,
    ENCLOSED_MESSAGE_TYPES_HEADER,
    ORIGINATING_ENDPOINT_HEADER,
    ORIGINATING_MACHINE_HEADER,
    ORIGINATING_HOST_ID_HEADER,
    TIME_SENT_HEADER,
    TIME_TO_BE_RECEIVED_HEADER,
    DELIVER_AT_HEADER,
    FORWARD_DESTINATION_HEADER,
    RETRIES_HEADER,
    RETRIES_TIMESTAMP_HEADER,
    FL_RETRIES_HEADER,
    EXECUTION_STAGE_HEADER,
    PREVIOUS_STAGE_HEADER,
    "NServiceBus.ContentType",
    "NServiceBus.Version",
    "NServiceBus.IsSagaTimeoutMessage",
    "NServiceBus.OriginatingSagaId",
    "NServiceBus.OriginatingSagaType",
    "NServiceBus.SagaId",
    "NServiceBus.SagaType",
    "NServiceBus.NonDurableMessage",
    "traceparent",
];

/// [`WELL_KNOWN`] by lowercased name, built once.
static WELL_KNOWN_BY_LOWERCASE: std::sync::LazyLock<HashMap<String, &'static str>> =
    std::sync::LazyLock::new(|| {
        WELL_KNOWN
            .iter()
            .map(|name| (name.to_ascii_lowercase(), *name))
            .collect()
    });

/// Lowercased name -> the name to store, for the names a request declares and the
/// configuration uses; the well-known names are looked up after them.
pub(super) struct HeaderCase(HashMap<String, String>);

impl HeaderCase {
    /// The case map of one request: `declared` (its `X-Header-Names` values) first, then
    /// `configured` (header names the host's configuration uses), then the well-known names.
    pub(super) fn new<'a>(
        declared: impl IntoIterator<Item = &'a str>,
        configured: &[String],
    ) -> Self {
        let mut map = HashMap::new();
        let declared = declared
            .into_iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|n| !n.is_empty());
        let configured = configured.iter().map(String::as_str);
        for name in declared.chain(configured) {
            map.entry(name.to_ascii_lowercase())
                .or_insert_with(|| name.to_string());
        }
        HeaderCase(map)
    }

    /// The name to store for `lowercase`, as it arrived.
    pub(super) fn restore(&self, lowercase: &str) -> String {
        let key = lowercase.to_ascii_lowercase();
        self.0
            .get(&key)
            .cloned()
            .or_else(|| WELL_KNOWN_BY_LOWERCASE.get(&key).map(|n| n.to_string()))
            .unwrap_or_else(|| lowercase.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_get_their_case_back_from_the_request_the_configuration_or_nservicebus() {
        let case = HeaderCase::new(
            ["Tenant, Sales.OrderId", "Custom"],
            &["Billing.AccountId".to_string()],
        );
        assert_eq!(
            case.restore("nservicebus.messageid"),
            "NServiceBus.MessageId"
        );
        assert_eq!(
            case.restore("nservicebus.conversationid"),
            "NServiceBus.ConversationId"
        );
        assert_eq!(case.restore("sales.orderid"), "Sales.OrderId");
        assert_eq!(case.restore("billing.accountid"), "Billing.AccountId");
        assert_eq!(case.restore("custom"), "Custom");
        assert_eq!(
            case.restore("unknown.name"),
            "unknown.name",
            "left as it came"
        );
        let declared_wins = HeaderCase::new(["NSERVICEBUS.MESSAGEID"], &[]);
        assert_eq!(
            declared_wins.restore("nservicebus.messageid"),
            "NSERVICEBUS.MESSAGEID"
        );
    }
}
