//! Connection strings carry passwords; this type makes sure they never reach a log line, a
//! status page or `config check` output. Only the transports read the raw value.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A database connection string (ADO.NET `key=value;` form, libpq `key=value` form or a
/// `postgres://` URL). `Debug`, `Display` and `Serialize` show it with the password replaced.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ConnectionString(String);

impl ConnectionString {
    /// Wraps a raw connection string.
    pub fn new(raw: impl Into<String>) -> Self {
        ConnectionString(raw.into())
    }

    /// The raw value, password included. Hand it to a driver, never to a formatter.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True when no connection string was given.
    pub fn is_empty(&self) -> bool {
        self.0.trim().is_empty()
    }

    /// The connection string with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact(&self.0)
    }
}

impl fmt::Debug for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConnectionString({:?})", self.redacted())
    }
}

impl fmt::Display for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for ConnectionString {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for ConnectionString {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(ConnectionString)
    }
}

/// A secret value such as a bearer token: shown as `***` everywhere, readable only through
/// [`Secret::expose`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(raw: impl Into<String>) -> Self {
        Secret(raw.into())
    }

    /// The raw value, for comparison only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True when no secret is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn shown(&self) -> &'static str {
        if self.0.is_empty() { "" } else { "***" }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({:?})", self.shown())
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.shown())
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

const PASSWORD_KEYS: [&str; 3] = ["password", "pwd", "passwd"];

/// Replaces passwords in URL userinfo (`scheme://user:pw@host`) and in `key=value` pairs
/// separated by `;` (ADO.NET) or whitespace (libpq).
pub fn redact(raw: &str) -> String {
    if let Some(scheme_end) = raw.find("://") {
        let rest = &raw[scheme_end + 3..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let mut out = String::with_capacity(raw.len());
        out.push_str(&raw[..scheme_end + 3]);
        if let Some(at) = authority.rfind('@') {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..colon]);
                    out.push_str(":***");
                }
                None => out.push_str(userinfo),
            }
            out.push_str(&authority[at..]);
        } else {
            out.push_str(authority);
        }
        // Query parameters may carry a password too (`?password=...`).
        out.push_str(&redact_pairs(&rest[authority_end..], &['&', '?']));
        return out;
    }
    let separators: &[char] = if raw.contains(';') {
        &[';']
    } else {
        &[' ', '\t']
    };
    redact_pairs(raw, separators)
}

fn redact_pairs(raw: &str, separators: &[char]) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while !rest.is_empty() {
        let end = rest.find(separators).unwrap_or(rest.len());
        let (pair, tail) = rest.split_at(end);
        match pair.split_once('=') {
            Some((key, _))
                if PASSWORD_KEYS
                    .iter()
                    .any(|k| key.trim().eq_ignore_ascii_case(k)) =>
            {
                out.push_str(key);
                out.push_str("=***");
            }
            _ => out.push_str(pair),
        }
        if let Some(sep) = tail.chars().next() {
            out.push(sep);
            rest = &tail[sep.len_utf8()..];
        } else {
            rest = tail;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ado_passwords_are_hidden() {
        let s = "Server=tcp:db,1433;Database=q;User Id=sa;Password=S3cret!;Encrypt=true";
        let r = redact(s);
        assert!(!r.contains("S3cret"), "{r}");
        assert!(r.contains("Password=***"));
        assert!(r.contains("User Id=sa"));
        assert!(redact("Pwd=abc;Server=x").starts_with("Pwd=***;"));
    }

    #[test]
    fn url_and_libpq_passwords_are_hidden() {
        assert_eq!(
            redact("postgres://app:hunter2@db:5432/test"),
            "postgres://app:***@db:5432/test"
        );
        assert_eq!(
            redact("postgres://app@db/test?password=hunter2&sslmode=off"),
            "postgres://app@db/test?password=***&sslmode=off"
        );
        assert_eq!(
            redact("host=db user=app password=hunter2 dbname=test"),
            "host=db user=app password=*** dbname=test"
        );
    }

    #[test]
    fn debug_and_display_never_show_the_password() {
        let c = ConnectionString::new("Server=x;Password=topsecret");
        assert!(!format!("{c:?}").contains("topsecret"));
        assert!(!c.to_string().contains("topsecret"));
        assert_eq!(c.expose(), "Server=x;Password=topsecret");
    }
}
