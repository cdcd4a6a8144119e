//! Connection settings from an ADO.NET connection string, and tiberius errors told as transport
//! errors.

use crate::transport::{QueueName, TransportError};

/// Parses an ADO.NET connection string into a tiberius configuration. Errors never contain
/// the password.
pub fn parse_connection_string(raw: &str) -> Result<tiberius::Config, TransportError> {
    tiberius::Config::from_ado_string(raw).map_err(|e| {
        let mut message = e.to_string();
        for secret in password_values(raw) {
            message = message.replace(&secret, "***");
        }
        TransportError::Setting {
            setting: "transport.connection_string",
            message: format!(
                "not a usable ADO.NET connection string ({message}): {}",
                crate::config::secret::redact(raw)
            ),
        }
    })
}

/// Says once per process that the server's certificate is trusted without validation, when
/// the connection string asks for it (the driver's own warning, on every new connection, is
/// off by default: see the CLI's log filter).
pub(super) fn warn_once_if_trusting(raw: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let trusting = raw.split(';').any(|part| {
        let (key, value) = part.split_once('=').unwrap_or((part, ""));
        key.trim().eq_ignore_ascii_case("TrustServerCertificate")
            && ["true", "yes"].contains(&value.trim().to_ascii_lowercase().as_str())
    });
    if trusting && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "TrustServerCertificate=true: the SQL Server's certificate is trusted without validation"
        );
    }
}

/// The database an ADO.NET connection string names (`Database` or `Initial Catalog`).
pub(super) fn catalog_in_connection_string(raw: &str) -> Option<String> {
    raw.split(';')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| {
            matches!(
                k.trim().to_ascii_lowercase().as_str(),
                "database" | "initial catalog"
            )
        })
        .map(|(_, v)| v.trim().trim_matches(['\'', '"']).to_string())
        .rfind(|v| !v.is_empty())
}

pub(super) fn password_values(raw: &str) -> Vec<String> {
    raw.split(';')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| matches!(k.trim().to_ascii_lowercase().as_str(), "password" | "pwd"))
        .map(|(_, v)| v.trim().trim_matches(['\'', '"']).to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

/// The code Babelfish gives a PostgreSQL error it has no SQL Server number for.
const BABELFISH_UNMAPPED: u32 = 33_557_097;

/// Turns a tiberius error into a transport error that says what happened.
pub(super) fn map_error(e: tiberius::error::Error, queue: Option<&QueueName>) -> TransportError {
    use tiberius::error::Error;
    match &e {
        Error::Server(token) => match token.code() {
            208 => TransportError::QueueNotFound(
                queue
                    .map(|q| q.to_string())
                    .unwrap_or_else(|| token.message().to_string()),
            ),
            1205 => TransportError::Deadlock(token.message().to_string()),
            // Babelfish reports a missing table (or the missing schema it would be in, which
            // SQL Server reports as 208 too) as PostgreSQL's error under its catch-all code.
            BABELFISH_UNMAPPED
                if (token.message().starts_with("relation \"")
                    || token.message().starts_with("schema \""))
                    && token.message().ends_with("does not exist") =>
            {
                TransportError::QueueNotFound(
                    queue
                        .map(|q| q.to_string())
                        .unwrap_or_else(|| token.message().to_string()),
                )
            }
            code => {
                TransportError::database(format!("{} (error {code})", token.message())).caused_by(e)
            }
        },
        Error::Io { .. } | Error::Tls(_) | Error::Routing { .. } | Error::Protocol(_) => {
            TransportError::connection(e.to_string()).caused_by(e)
        }
        _ => TransportError::database(e.to_string()).caused_by(e),
    }
}

/// A server error leaves the connection usable (XACT_ABORT has rolled back what needs it); any
/// other error may leave it out of step with the server.
pub(super) fn is_server_error(e: &tiberius::error::Error) -> bool {
    matches!(e, tiberius::error::Error::Server(_))
}

/// An integer column in whatever width the server sends it: SQL Server and Babelfish differ
/// (`sys.dm_exec_sessions.session_id` is smallint on one and int on the other).
pub fn int_at(row: &tiberius::Row, index: usize) -> Option<i64> {
    row.try_get::<u8, _>(index)
        .ok()
        .flatten()
        .map(i64::from)
        .or_else(|| row.try_get::<i16, _>(index).ok().flatten().map(i64::from))
        .or_else(|| row.try_get::<i32, _>(index).ok().flatten().map(i64::from))
        .or_else(|| row.try_get::<i64, _>(index).ok().flatten())
}
