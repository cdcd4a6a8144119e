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

/// Keys whose value is a secret, in any of the three forms (compared without case, spaces and
/// underscores): passwords, the client key's passphrase (libpq `sslpassword`), and the tokens
/// and secrets ADO.NET and SqlClient take.
const SECRET_KEYS: [&str; 8] = [
    "password",
    "pwd",
    "passwd",
    "sslpassword",
    "accesstoken",
    "clientsecret",
    "keystoresecret",
    "columnencryptionkey",
];

fn is_password_key(key: &str) -> bool {
    let folded: String = key
        .trim()
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '_')
        .flat_map(char::to_lowercase)
        .collect();
    SECRET_KEYS.contains(&folded.as_str())
}

/// Replaces every password with `***`: in URL userinfo (`scheme://user:pw@host`) and its query
/// (`?password=`), in libpq `key = value` pairs (quoted `'...'` values with `\'` escapes,
/// spaces around `=`), and in ADO.NET `key=value;` pairs (`{...}`, `"..."` and `'...'` values).
/// A string is read both as libpq and as ADO.NET and the password spans of both are hidden, so
/// a form mistaken for the other still hides its password (`Pwd=abc;Server=x`, read as libpq,
/// is one password: all of it is hidden); a value that does not end (an open quote) is hidden
/// to the end of the string.
///
/// A string with no `key=value` pair and no URL is not echoed at all: it may be a password
/// pasted on its own.
pub fn redact(raw: &str) -> String {
    if !raw.contains("://") && !raw.contains('=') {
        return if raw.trim().is_empty() {
            String::new()
        } else {
            "*** (not a connection string: hidden)".into()
        };
    }
    let mut spans = Vec::new();
    if let Some(scheme_end) = raw.find("://") {
        url_password_spans(raw, scheme_end + 3, &mut spans);
    } else {
        libpq_password_spans(raw, &mut spans);
        ado_password_spans(raw, &mut spans);
    }
    hide(raw, spans)
}

/// Replaces the byte ranges `spans` (possibly overlapping: their union) with `***`.
fn hide(raw: &str, mut spans: Vec<(usize, usize)>) -> String {
    spans.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (start, end) in spans {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let mut out = String::with_capacity(raw.len());
    let mut at = 0;
    for (start, end) in merged {
        out.push_str(&raw[at..start]);
        out.push_str("***");
        at = end;
    }
    out.push_str(&raw[at..]);
    out
}

fn url_password_spans(raw: &str, authority_start: usize, spans: &mut Vec<(usize, usize)>) {
    let rest = &raw[authority_start..];
    // The last '@' ends the userinfo: a password may hold '/', '?' or '@' unescaped. (When the
    // last '@' is in the query instead, this hides more than the password, never less.)
    if let Some(at) = rest.rfind('@')
        && let Some(colon) = rest[..at].find(':')
    {
        spans.push((authority_start + colon + 1, authority_start + at));
    }
    if let Some(q) = rest.find('?') {
        let query_start = authority_start + q + 1;
        let mut pos = query_start;
        for pair in raw[query_start..].split('&') {
            if let Some((key, _)) = pair.split_once('=')
                && is_password_key(key)
            {
                spans.push((pos + key.len() + 1, pos + pair.len()));
            }
            pos += pair.len() + 1;
        }
    }
}

/// libpq: `key = value` pairs separated by whitespace; values may be single-quoted, and `\`
/// escapes the next character, quoted or not.
fn libpq_password_spans(raw: &str, spans: &mut Vec<(usize, usize)>) {
    let bytes = raw.as_bytes();
    let mut i = 0;
    let skip_ws = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_ws(i);
        if i >= bytes.len() {
            return;
        }
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let password = is_password_key(&raw[key_start..i]);
        i = skip_ws(i);
        if i >= bytes.len() || bytes[i] != b'=' {
            if password {
                spans.push((i.min(bytes.len()), bytes.len()));
            }
            return;
        }
        i = skip_ws(i + 1);
        let value_start = i;
        if i < bytes.len() && bytes[i] == b'\'' {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => break,
                    Some(b'\\') => i += 2,
                    Some(b'\'') => {
                        i += 1;
                        break;
                    }
                    Some(_) => i += 1,
                }
            }
        } else {
            while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
        }
        let value_end = i.min(bytes.len());
        if password {
            spans.push((value_start, value_end));
        }
        i = value_end;
    }
}

/// ADO.NET / ODBC: `key=value` pairs separated by `;`; a value may be wrapped in `{}` (`}}`
/// escapes), `"` or `'` (doubled to escape).
fn ado_password_spans(raw: &str, spans: &mut Vec<(usize, usize)>) {
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && bytes[i] != b';' {
            i += 1;
        }
        if i >= bytes.len() || bytes[i] == b';' {
            i += 1;
            continue;
        }
        let password = is_password_key(&raw[key_start..i]);
        i += 1;
        while i < bytes.len() && bytes[i] == b' ' {
            i += 1;
        }
        let value_start = i;
        let close = match bytes.get(i) {
            Some(b'{') => Some(b'}'),
            Some(b'"') => Some(b'"'),
            Some(b'\'') => Some(b'\''),
            _ => None,
        };
        match close {
            Some(close) => {
                i += 1;
                loop {
                    match bytes.get(i) {
                        None => break,
                        Some(&b) if b == close && bytes.get(i + 1) == Some(&close) => i += 2,
                        Some(&b) if b == close => {
                            i += 1;
                            break;
                        }
                        Some(_) => i += 1,
                    }
                }
            }
            None => {
                while i < bytes.len() && bytes[i] != b';' {
                    i += 1;
                }
            }
        }
        if password {
            spans.push((value_start, i.min(bytes.len())));
        }
        // Whatever follows a closing quote up to the ';' is not part of the value.
        while i < bytes.len() && bytes[i] != b';' {
            i += 1;
        }
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use proptest::strategy::Strategy;

    use super::*;

    #[test]
    fn every_secret_key_is_hidden_in_every_form() {
        assert_eq!(
            redact("host=db password=a sslpassword=SslKeyPass77 user=app"),
            "host=db password=*** sslpassword=*** user=app"
        );
        assert_eq!(
            redact("postgres://app:pw@db/test?sslpassword=SslKeyPass77&sslmode=require"),
            "postgres://app:***@db/test?sslpassword=***&sslmode=require"
        );
        assert_eq!(
            redact("Server=x;Access Token=eyJhbGci;Client_Secret=abc;User Id=u"),
            "Server=x;Access Token=***;Client_Secret=***;User Id=u"
        );
        let alone = redact("S3cretPassw0rd!");
        assert!(!alone.contains("S3cret"), "{alone}");
        assert_eq!(redact(""), "");
    }

    #[test]
    fn ado_passwords_are_hidden() {
        let s = "Server=tcp:db,1433;Database=q;User Id=sa;Password=S3cret!;Encrypt=true";
        let r = redact(s);
        assert!(!r.contains("S3cret"), "{r}");
        assert!(r.contains("Password=***"));
        assert!(r.contains("User Id=sa"));
        // Without spaces libpq would read all of it as the password, so all of it is hidden.
        assert_eq!(redact("Pwd=abc;Server=x"), "Pwd=***");
        assert_eq!(redact("Server=x;Pwd=abc"), "Server=x;Pwd=***");
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
    fn every_libpq_form_is_hidden() {
        assert_eq!(
            redact("host=db password = S3cretPw! user=app"),
            "host=db password = *** user=app"
        );
        assert_eq!(
            redact("password='S3cret Pw!' host=db"),
            "password=*** host=db"
        );
        assert_eq!(
            redact(r"password='it\'s a secret' host=db"),
            "password=*** host=db"
        );
        assert_eq!(
            redact("host=db password='open quote"),
            "host=db password=***"
        );
        assert_eq!(redact("host=db password"), "host=db password***");
    }

    #[test]
    fn url_passwords_with_reserved_characters_are_hidden() {
        assert_eq!(
            redact("postgres://user:S3c/retPw!@host/db"),
            "postgres://user:***@host/db"
        );
        assert_eq!(
            redact("postgres://user:p@ss@host/db?sslmode=off&password=x%20y"),
            "postgres://user:***@host/db?sslmode=off&password=***"
        );
    }

    #[test]
    fn ado_quoted_and_braced_values_are_hidden() {
        assert_eq!(
            redact("Server=x;Password={S3cret;Pw};Database=q"),
            "Server=x;Password=***;Database=q"
        );
        assert_eq!(
            redact("Server=x;Password=\"S3c;\"\"ret\";Database=q"),
            "Server=x;Password=***;Database=q"
        );
        assert_eq!(
            redact("Server=x; Pwd = 'a;b' ;Database=q"),
            "Server=x; Pwd = *** ;Database=q"
        );
    }

    /// Characters only a generated password holds; none may survive redaction.
    const MARKERS: &str = "#!~^QXZ";

    fn generated_password() -> impl proptest::strategy::Strategy<Value = String> {
        "[#!~^QXZ ;'\"{}@/?=\\\\]{0,12}".prop_map(|p| format!("Q{p}Z"))
    }

    fn every_form(pw: &str) -> Vec<String> {
        let libpq = pw.replace('\\', "\\\\").replace('\'', "\\'");
        let mut forms = vec![
            format!("host=db user=app password='{libpq}' dbname=test"),
            format!("host=db password = '{libpq}'"),
            format!("password='{libpq}'"),
            format!("postgres://app:{pw}@db:5432/test?sslmode=off"),
            format!(
                "postgres://app@db/test?password={}",
                pw.replace('&', "%26").replace('#', "%23")
            ),
            format!(
                "Server=tcp:db,1433;User Id=sa;Password={{{}}};Encrypt=true",
                pw.replace('}', "}}")
            ),
            format!(
                "Server=tcp:db,1433;Pwd=\"{}\";Encrypt=true",
                pw.replace('"', "\"\"")
            ),
        ];
        if !pw.contains([' ', '\'', '\\', ';']) {
            forms.push(format!("host=db password={pw} user=app"));
            forms.push(format!("Server=db;Password={pw};Database=q"));
        }
        forms
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(10_000))]
        #[test]
        fn no_generated_password_survives_redaction(pw in generated_password()) {
            for form in every_form(&pw) {
                let shown = redact(&form);
                proptest::prop_assert!(
                    !shown.contains(|c| MARKERS.contains(c)),
                    "{form} -> {shown}"
                );
            }
        }
    }

    #[test]
    fn debug_and_display_never_show_the_password() {
        let c = ConnectionString::new("Server=x;Password=topsecret");
        assert!(!format!("{c:?}").contains("topsecret"));
        assert!(!c.to_string().contains("topsecret"));
        assert_eq!(c.expose(), "Server=x;Password=topsecret");
    }
}
