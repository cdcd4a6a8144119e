//! Queue and schema names. They end up inside SQL as quoted identifiers, so they are checked
//! here once, before anything else sees them: a name that could close a quote, open a bracket
//! or end a statement is rejected, never escaped and spliced.

use std::fmt;
use std::sync::Arc;

/// Longest queue name accepted anywhere (SQL Server's `sysname` is 128 characters).
pub const MAX_QUEUE_NAME_CHARS: usize = 128;

/// Longest PostgreSQL queue (table) name in bytes: NServiceBus's limit, 63 bytes minus room
/// for the `_Seq_seq` sequence suffix.
pub const MAX_POSTGRES_TABLE_NAME_BYTES: usize = 55;

/// Checks a queue name against the PostgreSQL transport's length limit.
pub fn validate_postgres_table_name(name: &str) -> Result<(), String> {
    if name.len() > MAX_POSTGRES_TABLE_NAME_BYTES {
        return Err(format!(
            "queue name `{name}` is {} bytes, longer than {MAX_POSTGRES_TABLE_NAME_BYTES}, the PostgreSQL transport's limit",
            name.len()
        ));
    }
    Ok(())
}

/// Checks a queue (table) name: letters, digits, `_`, `-` and `.`, not starting with `.` or
/// `-`, at most 128 characters.
pub fn validate_queue_name(name: &str) -> Result<(), String> {
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
pub fn validate_delayed_table_suffix(suffix: &str) -> Result<(), String> {
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
pub fn validate_schema_name(name: &str) -> Result<(), String> {
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
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueName(Arc<str>);

impl QueueName {
    /// Validates and wraps a queue name.
    pub fn new(name: &str) -> Result<Self, InvalidName> {
        validate_queue_name(name).map_err(InvalidName)?;
        Ok(QueueName(Arc::from(name)))
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
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

/// A short tag for `text` that every host computes the same way: FNV-1a (64 bits) in hex.
/// Not a secure hash; it names things (lock names, notification channels) that must be
/// short and free of the characters of the text.
pub fn stable_tag(text: &str) -> String {
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
    fn schemas_are_plain_identifiers() {
        assert!(validate_schema_name("dbo").is_ok());
        assert!(validate_schema_name("_t1").is_ok());
        for bad in ["1a", "a-b", "a.b", "a\"", ""] {
            assert!(validate_schema_name(bad).is_err(), "{bad}");
        }
    }
}
