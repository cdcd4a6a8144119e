//! Queue and schema names. They end up inside SQL as quoted identifiers, so they are checked
//! here once, before anything else sees them: a name that could close a quote, open a bracket
//! or end a statement is rejected, never escaped and spliced.

use std::fmt;
use std::sync::Arc;

/// Longest queue name accepted anywhere (SQL Server's `sysname` is 128 characters).
pub(crate) const MAX_QUEUE_NAME_CHARS: usize = 128;

/// Longest PostgreSQL queue (table) name in bytes: NServiceBus's limit, 63 bytes minus room
/// for the `_Seq_seq` sequence suffix.
pub(crate) const MAX_POSTGRES_TABLE_NAME_BYTES: usize = 55;

/// Checks a queue name against the PostgreSQL transport's length limit.
pub(crate) fn validate_postgres_table_name(name: &str) -> Result<(), String> {
    if name.len() > MAX_POSTGRES_TABLE_NAME_BYTES {
        return Err(format!(
            "queue name `{name}` is {} bytes, longer than {MAX_POSTGRES_TABLE_NAME_BYTES}, the PostgreSQL transport's limit",
            name.len()
        ));
    }
    Ok(())
}

/// The longest topic the subscription table holds (`Topic NVARCHAR(200)` / `VARCHAR(200)`).
pub(crate) const MAX_TOPIC_CHARS: usize = 200;

/// Checks an event topic: a type's full name as NServiceBus writes it into the subscription
/// table (`Sales.Messages.OrderAccepted`), without the assembly part an
/// `EnclosedMessageTypes` entry carries after a comma.
pub(crate) fn validate_topic(topic: &str) -> Result<(), String> {
    if topic.trim().is_empty() {
        return Err("a topic must not be empty".into());
    }
    if topic.chars().count() > MAX_TOPIC_CHARS {
        return Err(format!(
            "`{topic}` is longer than the {MAX_TOPIC_CHARS} characters the subscription table holds"
        ));
    }
    if topic.trim() != topic
        || topic
            .chars()
            .any(|c| c.is_control() || c == ';' || c == ',')
    {
        return Err(format!(
            "`{topic}` is not a type's full name: no spaces around it, no `;` or `,` (the assembly part of an EnclosedMessageTypes entry is not part of the topic)"
        ));
    }
    Ok(())
}

/// The entries of an event's types as `NServiceBus.EnclosedMessageTypes` holds them
/// (`;`-separated, the event's own type first), each checked: its full name (before an
/// assembly part after `,`) must be a topic. Errors name the entry at fault.
pub(crate) fn event_type_entries(text: &str) -> Result<Vec<String>, String> {
    let entries: Vec<String> = text
        .split(';')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_string)
        .collect();
    if entries.is_empty() {
        return Err("an event needs its type: `Namespace.EventName` (and, after `;`, the types it derives from)".into());
    }
    for entry in &entries {
        validate_topic(topic_of(entry)).map_err(|e| format!("event type `{entry}`: {e}"))?;
    }
    Ok(entries)
}

/// An event type entry's full name, its topic: what comes before the assembly part.
pub(crate) fn topic_of(entry: &str) -> &str {
    entry.split(',').next().unwrap_or(entry).trim()
}

/// Checks a queue (table) name: letters, digits, `_`, `-` and `.`, not starting with `.` or
/// `-`, at most 128 characters.
pub(crate) fn validate_queue_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a queue name must not be empty".into());
    }
    if name.chars().count() > MAX_QUEUE_NAME_CHARS {
        return Err(format!(
            "queue name `{name}` is longer than {MAX_QUEUE_NAME_CHARS} characters"
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(format!(
            "queue name `{}` contains {:?}; use letters, digits, '_', '-' and '.' only",
            shown(name),
            bad
        ));
    }
    if name.starts_with(['.', '-']) {
        return Err(format!(
            "queue name `{name}` must not start with '.' or '-'"
        ));
    }
    Ok(())
}

/// Checks a delayed table suffix (`<queue>.<suffix>`): 1 to 32 ASCII letters, digits and `_`.
pub(crate) fn validate_delayed_table_suffix(suffix: &str) -> Result<(), String> {
    if suffix.is_empty()
        || suffix.len() > 32
        || !suffix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(format!(
            "`{}` is not a delayed table suffix: use 1 to 32 ASCII letters, digits and '_' (NServiceBus's default is `Delayed`)",
            shown(suffix)
        ));
    }
    Ok(())
}

/// A name as the user wrote it, unless it holds control characters (shown escaped then).
fn shown(name: &str) -> String {
    if name.chars().any(char::is_control) {
        name.escape_debug().to_string()
    } else {
        name.to_string()
    }
}

/// Checks a schema name: an unquoted-style identifier (letter or `_`, then letters, digits,
/// `_`), at most 63 characters (PostgreSQL's limit).
pub(crate) fn validate_schema_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let valid_start = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !valid_start || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!(
            "schema name `{}` must start with a letter or '_' and contain only ASCII letters, digits and '_'",
            shown(name)
        ));
    }
    if name.len() > 63 {
        return Err(format!("schema name `{name}` is longer than 63 characters"));
    }
    Ok(())
}

/// Why a queue name was refused, in words that name the name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidName(pub String);

/// A validated queue name; cheap to clone.
///
/// Either a table of the transport's schema (`Sales`), or an address naming another schema
/// and, on SQL Server, another catalog, in the forms NServiceBus writes: `Sales@[billing]`,
/// `Sales@[billing]@[Shop]` (SQL Server), `"billing"."Sales"` (PostgreSQL). Every part is
/// checked as a name is; the transport resolves the parts into its quoted table name. A bare
/// name with dots stays one table name (`Sales.MACHINE-01`, an instance queue), which is why
/// PostgreSQL's other-schema form is the quoted one.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueName(Arc<str>);

/// The parts of a [`QueueName`]: the table, and the schema and catalog it names, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueParts<'a> {
    /// The table.
    pub table: &'a str,
    /// The schema, when the name is an address that names one.
    pub schema: Option<&'a str>,
    /// The catalog (SQL Server's database), when the address names one.
    pub catalog: Option<&'a str>,
}

impl QueueName {
    /// Validates and wraps a queue name or address.
    pub fn new(name: &str) -> Result<Self, InvalidName> {
        split_address(name).map_err(InvalidName)?;
        Ok(QueueName(Arc::from(name)))
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The table, schema and catalog this name stands for.
    pub fn parts(&self) -> QueueParts<'_> {
        // Validated at construction.
        split_address(&self.0).unwrap_or(QueueParts {
            table: &self.0,
            schema: None,
            catalog: None,
        })
    }

    /// The table's name, without schema or catalog.
    pub fn table(&self) -> &str {
        self.parts().table
    }

    /// `self` as the transport whose own schema is `schema` and database `catalog` reaches
    /// it: the bare table name when the address names that schema (compared without case,
    /// as both servers compare them by default) and no other catalog; else the address,
    /// without a catalog that is the transport's own.
    pub fn relative_to(&self, schema: &str, catalog: Option<&str>) -> QueueName {
        let parts = self.parts();
        let same = |a: Option<&str>, b: Option<&str>| match (a, b) {
            (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
            _ => false,
        };
        let foreign_catalog = parts.catalog.filter(|c| !same(Some(c), catalog));
        let foreign_schema = parts.schema.filter(|s| !s.eq_ignore_ascii_case(schema));
        let text = match (foreign_schema, foreign_catalog) {
            (None, None) => parts.table.to_string(),
            (schema_named, None) if self.0.starts_with('"') => {
                format!("\"{}\".\"{}\"", schema_named.unwrap_or(schema), parts.table)
            }
            (schema_named, None) => {
                format!("{}@[{}]", parts.table, schema_named.unwrap_or(schema))
            }
            (schema_named, Some(catalog)) => format!(
                "{}@[{}]@[{catalog}]",
                parts.table,
                schema_named.or(parts.schema).unwrap_or(schema)
            ),
        };
        QueueName(Arc::from(text.as_str()))
    }
}

/// Splits and checks a queue name or address (see [`QueueName`]).
fn split_address(name: &str) -> Result<QueueParts<'_>, String> {
    if let Some(rest) = name.strip_prefix('"') {
        // "schema"."table" or "table"
        let (schema, table) = match rest.split_once("\".\"") {
            Some((schema, table)) => (Some(schema), table),
            None => (None, rest),
        };
        let table = table.strip_suffix('"').ok_or_else(|| {
            format!(
                "queue address `{}` is not \"schema\".\"table\" (PostgreSQL's form)",
                shown(name)
            )
        })?;
        validate_queue_name(table)?;
        if let Some(schema) = schema {
            validate_schema_name(schema)?;
        }
        return Ok(QueueParts {
            table,
            schema,
            catalog: None,
        });
    }
    if !name.contains('@') {
        validate_queue_name(name)?;
        return Ok(QueueParts {
            table: name,
            schema: None,
            catalog: None,
        });
    }
    // table@schema[@catalog], each part optionally in brackets (SQL Server's form).
    let mut parts = name.split('@').map(|p| {
        p.strip_prefix('[')
            .and_then(|p| p.strip_suffix(']'))
            .unwrap_or(p)
    });
    let table = parts.next().unwrap_or_default();
    let schema = parts.next().filter(|s| !s.is_empty());
    let catalog = parts.next();
    if parts.next().is_some() || catalog.is_some_and(str::is_empty) {
        return Err(format!(
            "queue address `{}` is not table@[schema] or table@[schema]@[catalog] (SQL Server's form)",
            shown(name)
        ));
    }
    validate_queue_name(table)?;
    if let Some(schema) = schema {
        validate_schema_name(schema)?;
    }
    if let Some(catalog) = catalog {
        validate_catalog_name(catalog)?;
    }
    Ok(QueueParts {
        table,
        schema,
        catalog,
    })
}

/// Checks a catalog (database) name in an address: letters, digits, `_` and `-`, at most
/// 128 characters (SQL Server's `sysname`).
fn validate_catalog_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.chars().count() > MAX_QUEUE_NAME_CHARS
        || !name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-'))
    {
        return Err(format!(
            "catalog `{}` in a queue address: use letters, digits, '_' and '-' only",
            shown(name)
        ));
    }
    Ok(())
}

impl fmt::Display for QueueName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for QueueName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

impl AsRef<str> for QueueName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Maps keyed by queue name are read with a `&str` (its order and hash are the text's).
impl std::borrow::Borrow<str> for QueueName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl serde::Serialize for QueueName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

/// A short tag for `text` that every host computes the same way: FNV-1a (64 bits) in hex.
/// Not a secure hash; it names things (lock names, notification channels) that must be
/// short and free of the characters of the text.
pub(crate) fn stable_tag(text: &str) -> String {
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_nservicebus_names_pass() {
        for ok in [
            "Sales",
            "Sales.MACHINE-01",
            "error",
            "audit",
            "q_1",
            "Zählung",
        ] {
            assert!(validate_queue_name(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn quotes_brackets_and_semicolons_are_rejected() {
        for bad in [
            "a'b", "a\"b", "a]b", "a[b", "a;b", "a b", "a/*", "-a", ".a", "",
        ] {
            assert!(validate_queue_name(bad).is_err(), "{bad}");
        }
        assert!(validate_queue_name(&"x".repeat(129)).is_err());
    }

    #[test]
    fn addresses_name_their_schema_and_catalog() {
        let parts = |s: &str| {
            let q = QueueName::new(s).unwrap();
            let p = q.parts();
            (
                p.table.to_string(),
                p.schema.map(str::to_string),
                p.catalog.map(str::to_string),
            )
        };
        let own = |t: &str| (t.to_string(), None, None);
        assert_eq!(parts("Sales.MACHINE-01"), own("Sales.MACHINE-01"));
        assert_eq!(
            parts("Sales@[billing]@[Shop]"),
            ("Sales".into(), Some("billing".into()), Some("Shop".into()))
        );
        assert_eq!(
            parts("Sales@billing"),
            ("Sales".into(), Some("billing".into()), None)
        );
        assert_eq!(
            parts("\"billing\".\"Sales.v2\""),
            ("Sales.v2".into(), Some("billing".into()), None)
        );
        assert_eq!(parts("\"Sales\""), own("Sales"));
        for bad in [
            "Sales@[bil ling]",
            "Sales@[dbo]@[Shop]@[x]",
            "Sales@[dbo]@",
            "\"billing\".Sales",
            "\"bil\"ling\".\"Sales\"",
            "@[dbo]",
            "Sa'les@[dbo]",
        ] {
            assert!(QueueName::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_address_in_the_transports_own_schema_is_its_bare_table() {
        let rel = |s: &str| {
            QueueName::new(s)
                .unwrap()
                .relative_to("dbo", Some("Shop"))
                .to_string()
        };
        assert_eq!(rel("Sales@[DBO]@[shop]"), "Sales");
        assert_eq!(rel("Sales@[dbo]"), "Sales");
        assert_eq!(rel("Sales"), "Sales");
        assert_eq!(rel("Sales@[billing]@[Shop]"), "Sales@[billing]");
        assert_eq!(rel("Sales@[dbo]@[Other]"), "Sales@[dbo]@[Other]");
        assert_eq!(rel("\"billing\".\"Sales\""), "\"billing\".\"Sales\"");
        assert_eq!(rel("\"dbo\".\"Sales\""), "Sales");
    }

    #[test]
    fn schemas_are_plain_identifiers() {
        assert!(validate_schema_name("dbo").is_ok());
        assert!(validate_schema_name("_t1").is_ok());
        for bad in ["1a", "a-b", "a.b", "a\"", ""] {
            assert!(validate_schema_name(bad).is_err(), "{bad}");
        }
    }
}
