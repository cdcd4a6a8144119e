//! Transport addresses: how a queue is named inside headers that other endpoints read
//! (`NServiceBus.FailedQ`, `NServiceBus.ReplyToAddress`, the delayed forward destination).
//! Each transport writes its own form ([`super::Transport::address`]); this reads them all.

use super::QueueName;

/// Reads an address in the forms the SQL transports write: `table`,
/// `table@schema`, `table@[schema]@[catalog]` (SQL Server) and `"schema"."table"`
/// (PostgreSQL). A schema, when named, must be `schema` (compared without case); the catalog
/// is not checked (a host reaches one database).
pub(crate) fn parse(address: &str, schema: &str) -> Option<QueueName> {
    let address = address.trim();
    let unbracket = |s: &str| {
        let s = s.trim();
        s.strip_prefix('[')
            .and_then(|s| s.strip_suffix(']'))
            .unwrap_or(s)
            .replace("]]", "]")
    };
    let (table, named_schema) = if let Some(rest) = address.strip_prefix('"') {
        // "schema"."table" or "table"
        match rest.split_once("\".\"") {
            Some((s, t)) => (t.strip_suffix('"')?.to_string(), Some(s.to_string())),
            None => (rest.strip_suffix('"')?.to_string(), None),
        }
    } else {
        let mut parts = address.split('@');
        let table = unbracket(parts.next()?);
        (table, parts.next().map(unbracket))
    };
    if named_schema.is_some_and(|s| !s.is_empty() && !s.eq_ignore_ascii_case(schema)) {
        return None;
    }
    QueueName::new(&table).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_addresses_in_every_written_form_name_the_queue() {
        let q = |s: &str| parse(s, "dbo").map(|q| q.to_string());
        assert_eq!(q("Sales").as_deref(), Some("Sales"));
        assert_eq!(q("Sales@dbo").as_deref(), Some("Sales"));
        assert_eq!(q("Sales@[dbo]@[Messaging]").as_deref(), Some("Sales"));
        assert_eq!(q("Sales.host-1@[DBO]").as_deref(), Some("Sales.host-1"));
        assert_eq!(q("[Sales]@[dbo]").as_deref(), Some("Sales"));
        assert_eq!(q("bad name@[dbo]"), None, "not a queue name");
        assert_eq!(q("Sales@[other]"), None, "another schema is not ours");
        assert_eq!(
            parse("\"public\".\"Sales\"", "public")
                .map(|q| q.to_string())
                .as_deref(),
            Some("Sales")
        );
        assert_eq!(parse("\"other\".\"Sales\"", "public"), None);
        assert_eq!(q(""), None);
    }
}
