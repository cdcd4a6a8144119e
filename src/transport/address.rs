//! Transport addresses: how a queue is named inside headers that other endpoints read
//! (`NServiceBus.FailedQ`, `NServiceBus.ReplyToAddress`, the delayed forward destination).
//! Each transport writes its own form ([`super::Transport::address`]); this reads them all.

use super::QueueName;

/// Reads an address in the forms the SQL transports write (`table`, `table@schema`,
/// `table@[schema]@[catalog]`, `"schema"."table"`) as the queue a transport whose own schema
/// is `schema` and database `catalog` sends to: the bare table in its own schema, else the
/// address of the other schema or catalog. None when it is not an address of a queue.
pub(crate) fn parse(address: &str, schema: &str, catalog: Option<&str>) -> Option<QueueName> {
    QueueName::new(address.trim())
        .ok()
        .map(|q| q.relative_to(schema, catalog))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_in_every_written_form_name_the_queue() {
        let q = |s: &str| parse(s, "dbo", Some("Messaging")).map(|q| q.to_string());
        assert_eq!(q("Sales").as_deref(), Some("Sales"));
        assert_eq!(q("Sales@dbo").as_deref(), Some("Sales"));
        assert_eq!(q("Sales@[dbo]@[Messaging]").as_deref(), Some("Sales"));
        assert_eq!(q("Sales.host-1@[DBO]").as_deref(), Some("Sales.host-1"));
        assert_eq!(q("[Sales]@[dbo]").as_deref(), Some("Sales"));
        assert_eq!(q("bad name@[dbo]"), None, "not a queue name");
        assert_eq!(
            q("Sales@[other]@[Messaging]").as_deref(),
            Some("Sales@[other]"),
            "another schema of the same database"
        );
        assert_eq!(
            q("Sales@[dbo]@[Archive]").as_deref(),
            Some("Sales@[dbo]@[Archive]"),
            "another database"
        );
        let pg = |s: &str| parse(s, "public", None).map(|q| q.to_string());
        assert_eq!(pg("\"public\".\"Sales\"").as_deref(), Some("Sales"));
        assert_eq!(
            pg("\"other\".\"Sales\"").as_deref(),
            Some("\"other\".\"Sales\"")
        );
        assert_eq!(q(""), None);
    }
}
