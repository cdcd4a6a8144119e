//! Reading a configuration file into [`Config`], with errors a person can act on: each names
//! the file, the line, the key path (`queues[0].concurrency.max`) and what was wrong with the
//! value. Syntax, type and unknown-key errors come from the TOML parser; the checks across
//! fields come from [`super::validate`] and are located in the file afterwards.

use std::fmt;
use std::path::{Path, PathBuf};

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::validate::validate;
use super::{Config, QueueConfig, defaults};
/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file was read but is not a valid configuration.
    #[error("{}", render_problems(.origin, .problems))]
    Invalid {
        /// File name or other origin shown in messages.
        origin: String,
        /// Every problem found, in file order where known.
        problems: Vec<Problem>,
    },
}

/// One thing wrong in a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// 1-based line, when the key could be found in the file.
    pub line: Option<usize>,
    /// Dotted key path such as `throttling.delivery.max_delay`; empty for syntax errors.
    pub key: String,
    /// What is wrong and, where possible, what to write instead.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(line) = self.line {
            write!(f, "{line}: ")?;
        }
        if !self.key.is_empty() {
            write!(f, "`{}`: ", self.key)?;
        }
        f.write_str(&self.message)
    }
}

fn render_problems(origin: &str, problems: &[Problem]) -> String {
    let mut out = String::new();
    for (i, p) in problems.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(origin);
        out.push(':');
        out.push_str(&p.to_string());
    }
    out
}

impl ConfigError {
    /// The problems, if the file was read.
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid { problems, .. } => problems,
            ConfigError::Read { .. } => &[],
        }
    }
}

/// Reads and validates a configuration file.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_str(&text, &path.display().to_string())
}

/// Why the file at `path` exposes what `config` keeps secret, if it does: a password in the
/// connection string or an admin token, in a file every user of the machine may read (or,
/// worse, write). None where permissions cannot be read (not Unix) or nothing is secret.
pub fn exposed_secrets(path: &Path, config: &Config) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let connection = &config.transport.connection_string;
        let has_password = connection.redacted() != connection.expose();
        let has_token = !config.admin.token.expose().is_empty();
        if !(has_password || has_token) {
            return None;
        }
        let mode = std::fs::metadata(path).ok()?.permissions().mode();
        let what = match (has_password, has_token) {
            (true, true) => "a database password and the admin token",
            (true, false) => "a database password",
            _ => "the admin token",
        };
        let who = match (mode & 0o002 != 0, mode & 0o004 != 0) {
            (true, _) => "every user of this machine may change it",
            (false, true) => "every user of this machine may read it",
            _ => return None,
        };
        Some(format!(
            "{} holds {what} and {who} (mode {:o}); make it readable by the host's user only, e.g. chmod 0640",
            path.display(),
            mode & 0o777
        ))
    }
    #[cfg(not(unix))]
    {
        let _ = (path, config);
        None
    }
}

/// Parses and validates configuration text; `origin` names it in error messages.
pub fn parse_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let config = deserialize_config(text, origin)?;
    let problems: Vec<Problem> = validate(&config)
        .into_iter()
        .map(|(key, message)| Problem {
            line: locate(text, &key),
            key,
            message,
        })
        .collect();
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::Invalid {
            origin: origin.to_string(),
            problems,
        })
    }
}

/// Deserializes any TOML document type with located, key-naming errors. Used for host
/// configurations and load-test scenarios alike.
pub fn deserialize_located<T: serde::de::DeserializeOwned>(
    text: &str,
    origin: &str,
) -> Result<T, ConfigError> {
    let deserializer = toml::de::Deserializer::parse(text).map_err(|e| syntax(text, origin, e))?;
    deserialize_from(deserializer, text, origin, "")
}

/// A host configuration: [`deserialize_located`] with `[queue_defaults]` merged into every
/// `[[queues]]` entry first (see [`super::defaults`]); the defaults are also checked on their
/// own, so a mistake in them is named once, under their own key.
fn deserialize_config(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let mut root = DeTable::parse(text).map_err(|e| syntax(text, origin, e))?;
    let span = root.span();
    if let Some(defaults) = defaults::apply(root.get_mut()) {
        let table = match defaults.get_ref() {
            DeValue::Table(table) if !table.contains_key("name") => table.clone(),
            _ => {
                return Err(ConfigError::Invalid {
                    origin: origin.to_string(),
                    problems: vec![Problem {
                        line: Some(line_of(text, defaults.span().start)),
                        key: defaults::SECTION.to_string(),
                        message: "expected a table of queue settings without `name` (each \
                              [[queues]] entry names its queue)"
                            .to_string(),
                    }],
                });
            }
        };
        let alone = toml::de::Deserializer::from(Spanned::new(defaults.span(), table));
        deserialize_from::<QueueConfig>(alone, text, origin, defaults::SECTION)?;
    }
    deserialize_from(
        toml::de::Deserializer::from(Spanned::new(span, root.into_inner())),
        text,
        origin,
        "",
    )
}

/// The parser's own error: the document is not TOML.
fn syntax(text: &str, origin: &str, e: toml::de::Error) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.to_string(),
        problems: vec![Problem {
            line: e.span().map(|s| line_of(text, s.start)),
            key: String::new(),
            message: first_line(e.message()),
        }],
    }
}

/// Deserializes a parsed document (or a part of it under the key `under`), naming the key and
/// the line of the first value that does not fit.
fn deserialize_from<T: serde::de::DeserializeOwned>(
    deserializer: toml::de::Deserializer<'_>,
    text: &str,
    origin: &str,
    under: &str,
) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let key = match (under, clean_path(&e.path().to_string())) {
            ("", key) => key,
            (under, key) if key.is_empty() => under.to_string(),
            (under, key) => format!("{under}.{key}"),
        };
        let inner = e.inner();
        let line = inner
            .span()
            .map(|s| line_of(text, s.start))
            .or_else(|| locate(text, &key));
        ConfigError::Invalid {
            origin: origin.to_string(),
            problems: vec![Problem {
                line,
                key,
                message: first_line(inner.message()),
            }],
        }
    })
}

/// serde_path_to_error writes `?` for an unknown position and `.` for the root.
fn clean_path(path: &str) -> String {
    if path == "." || path == "?" {
        String::new()
    } else {
        path.to_string()
    }
}

fn first_line(message: &str) -> String {
    message.trim().to_string()
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// Finds the line of a dotted key path (`queues[1].concurrency.max`) in the TOML text: the
/// deepest part of the path that exists there. None when the text does not parse.
pub fn locate(text: &str, path: &str) -> Option<usize> {
    let root = DeTable::parse(text).ok()?;
    let mut table: &DeTable = root.get_ref();
    let mut found: Option<usize> = None;
    for segment in split_path(path) {
        let (name, index) = segment;
        let (key, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == name)?;
        found = Some(line_of(text, key.span().start));
        let mut value: &toml::Spanned<DeValue> = value;
        if let Some(i) = index {
            let array = value.get_ref().as_array()?;
            value = array.get(i)?;
            found = Some(line_of(text, value.span().start));
        }
        match value.get_ref().as_table() {
            Some(t) => table = t,
            None => break,
        }
    }
    found
}

fn split_path(path: &str) -> Vec<(&str, Option<usize>)> {
    path.split('.')
        .filter(|s| !s.is_empty())
        .map(|seg| match seg.find('[') {
            Some(open) => {
                let index = seg[open + 1..].trim_end_matches(']').parse().ok();
                (&seg[..open], index)
            }
            None => (seg, None),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_the_default_configuration() {
        assert_eq!(parse_str("", "t").unwrap(), Config::default());
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let text = "[host]\nname = \"a\"\nnmae = \"b\"\n";
        let err = parse_str(text, "t.toml").unwrap_err();
        let p = &err.problems()[0];
        assert_eq!(p.line, Some(3), "{err}");
        assert!(p.message.contains("nmae"), "{err}");
        assert!(
            err.to_string().starts_with("t.toml:3: `host.nmae`"),
            "{err}"
        );
    }

    #[test]
    fn wrong_type_names_the_key_path_value_and_line() {
        let text = "[[queues]]\nname = \"a\"\n[[queues]]\nname = \"b\"\n[queues.concurrency]\nmax = \"lots\"\n";
        let err = parse_str(text, "t.toml").unwrap_err();
        let p = &err.problems()[0];
        assert_eq!(p.key, "queues[1].concurrency.max", "{err}");
        assert_eq!(p.line, Some(6), "{err}");
        assert!(p.message.contains("lots"), "{err}");
    }

    #[test]
    fn bad_unit_value_is_named() {
        let text = "[throttling]\nprocess_memory = \"lots\"\n";
        let err = parse_str(text, "t.toml").unwrap_err();
        let p = &err.problems()[0];
        assert_eq!(p.key, "throttling.process_memory");
        assert_eq!(p.line, Some(2));
        assert!(p.message.contains("lots"));
    }

    #[test]
    fn syntax_error_has_a_line() {
        let err = parse_str("[host\nname = 1", "t.toml").unwrap_err();
        assert_eq!(err.problems()[0].line, Some(1), "{err}");
    }

    #[test]
    fn queue_defaults_apply_to_every_queue_and_a_queues_own_setting_wins_key_by_key() {
        let text = "[queue_defaults]\nimmediate_retries = 2\n[queue_defaults.concurrency]\n\
                    model = \"fixed\"\nmax = 4\n\n[[queues]]\nname = \"a\"\n\n\
                    [[queues]]\nname = \"b\"\nimmediate_retries = 0\n\
                    [queues.concurrency]\nmax = 64\n";
        let config = parse_str(text, "t").unwrap();
        let [a, b] = &config.queues[..] else {
            panic!("{:?}", config.queues)
        };
        assert_eq!(
            (a.immediate_retries, a.concurrency.model, a.concurrency.max),
            (2, crate::config::ConcurrencyModel::Fixed, 4)
        );
        assert_eq!(
            (b.immediate_retries, b.concurrency.model, b.concurrency.max),
            (0, crate::config::ConcurrencyModel::Fixed, 64),
            "b sets retries and max, and takes the model"
        );
        assert_eq!(
            a.error_queue, "error",
            "what neither sets keeps its default"
        );
    }

    #[test]
    fn a_mistake_in_the_queue_defaults_is_named_under_their_key_at_its_line() {
        let text = "[[queues]]\nname = \"a\"\n\n[queue_defaults.concurrency]\nmax = \"lots\"\n";
        let err = parse_str(text, "t").unwrap_err();
        let p = &err.problems()[0];
        assert_eq!(p.key, "queue_defaults.concurrency.max", "{err}");
        assert_eq!(p.line, Some(5), "{err}");
        let unknown = parse_str("[queue_defaults]\nretries = 1\n", "t").unwrap_err();
        assert_eq!(
            unknown.problems()[0].key,
            "queue_defaults.retries",
            "{unknown}"
        );
        assert_eq!(unknown.problems()[0].line, Some(2), "{unknown}");
        let named = parse_str("[queue_defaults]\nname = \"a\"\n", "t").unwrap_err();
        assert_eq!(named.problems()[0].key, "queue_defaults", "{named}");
        assert!(named.to_string().contains("without `name`"), "{named}");
        let scalar = parse_str("queue_defaults = 3\n", "t").unwrap_err();
        assert_eq!(scalar.problems()[0].line, Some(1), "{scalar}");
    }

    #[test]
    fn locate_finds_nested_array_entries() {
        let text =
            "[[queues]]\nname = \"a\"\n\n[[queues]]\nname = \"b\"\n[queues.concurrency]\nmax = 0\n";
        assert_eq!(locate(text, "queues[1].concurrency.max"), Some(7));
        assert_eq!(locate(text, "queues[0].name"), Some(2));
        assert_eq!(locate(text, "queues[1]"), Some(4));
    }
}
