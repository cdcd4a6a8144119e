//! Connection settings as libpq reads them (URL, environment, password file), and driver errors
//! told as transport errors.

use tokio_postgres::error::SqlState;

use crate::transport::{QueueName, TransportError};

/// A URL whose password holds an unencoded `@` is read by every driver as a host name after
/// the first `@`: a name lookup error that says nothing of the password. Say what it is.
pub(super) fn check_url_userinfo(raw: &str) -> Result<(), TransportError> {
    let Some(rest) = raw
        .strip_prefix("postgres://")
        .or_else(|| raw.strip_prefix("postgresql://"))
    else {
        return Ok(());
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    if authority.matches('@').count() > 1 {
        return Err(TransportError::Setting {
            setting: "transport.connection_string",
            message: "the URL's user or password holds an `@`; write it percent-encoded as %40 (and `:` as %3A, `/` as %2F)".into(),
        });
    }
    Ok(())
}

/// Fills what the connection string leaves out from the environment variables libpq reads
/// (`PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`, `PGPASSWORD`) and then from the password file
/// (`PGPASSFILE`, else `~/.pgpass`), as a PostgreSQL user expects.
pub(super) fn libpq_environment(pg: &mut tokio_postgres::Config) {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if pg.get_hosts().is_empty()
        && let Some(hosts) = var("PGHOST")
    {
        for host in hosts.split(',') {
            pg.host(host.trim());
        }
    }
    if pg.get_ports().is_empty()
        && let Some(port) = var("PGPORT").and_then(|p| p.trim().parse::<u16>().ok())
    {
        pg.port(port);
    }
    if pg.get_user().is_none()
        && let Some(user) = var("PGUSER")
    {
        pg.user(&user);
    }
    if pg.get_dbname().is_none()
        && let Some(db) = var("PGDATABASE")
    {
        pg.dbname(&db);
    }
    if pg.get_password().is_some() {
        return;
    }
    if let Some(password) = var("PGPASSWORD") {
        pg.password(password);
        return;
    }
    let file = var("PGPASSFILE")
        .map(std::path::PathBuf::from)
        .or_else(|| var("HOME").map(|h| std::path::Path::new(&h).join(".pgpass")));
    if let Some(text) = file.and_then(|f| std::fs::read_to_string(f).ok())
        && let Some(password) = password_file_entry(pg, &text)
    {
        pg.password(password);
    }
}

/// The password of the first line of a libpq password file (`host:port:database:user:password`,
/// `*` matching anything, `\:` and `\\` escaped) that matches these settings.
pub(super) fn password_file_entry(pg: &tokio_postgres::Config, text: &str) -> Option<String> {
    use tokio_postgres::config::Host;
    let host = match pg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(Host::Unix(_)) | None => "localhost".to_string(),
        #[cfg(not(unix))]
        None => "localhost".to_string(),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = pg.get_user().unwrap_or_default().to_string();
    let db = pg
        .get_dbname()
        .map(str::to_string)
        .unwrap_or_else(|| user.clone());
    let wanted = [host, port, db, user];
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .find_map(|line| {
            let mut fields = Vec::new();
            let mut field = String::new();
            let mut chars = line.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => field.extend(chars.next()),
                    ':' if fields.len() < 4 => fields.push(std::mem::take(&mut field)),
                    c => field.push(c),
                }
            }
            fields.push(field);
            (fields.len() == 5
                && fields[..4]
                    .iter()
                    .zip(&wanted)
                    .all(|(f, w)| f == "*" || f == w))
            .then(|| fields.pop().unwrap_or_default())
        })
}

pub(super) fn map_error(e: tokio_postgres::Error, queue: Option<&QueueName>) -> TransportError {
    if let Some(db) = e.as_db_error() {
        let code = db.code();
        if *code == SqlState::UNDEFINED_TABLE {
            return TransportError::QueueNotFound(
                queue
                    .map(|q| q.to_string())
                    .unwrap_or_else(|| db.message().to_string()),
            );
        }
        if *code == SqlState::T_R_DEADLOCK_DETECTED {
            return TransportError::Deadlock(db.message().to_string());
        }
        let class = &code.code()[..2];
        let message = format!("{} (SQLSTATE {})", db.message(), code.code());
        if class == "28" {
            // Not an outage: waiting will not make the password right.
            return TransportError::Login(format!(
                "the server refused the login: {message}; check the user and password in transport.connection_string (or PGUSER, PGPASSWORD, PGPASSFILE)"
            ));
        }
        let mapped = if class == "08" || class == "57" {
            TransportError::connection(message)
        } else {
            TransportError::database(message)
        };
        return mapped.caused_by(e);
    }
    let mapped = if e.is_closed() {
        TransportError::connection("the connection was closed")
    } else {
        // tokio-postgres prints its kind only ("error performing TLS handshake"); the cause
        // says what went wrong ("invalid peer certificate: UnknownIssuer", "Connection
        // refused").
        let mut message = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            message.push_str(&format!(": {c}"));
            cause = c.source();
        }
        if message.contains("password missing") {
            return TransportError::Login(
                "the server asks for a password and none was given: set it in transport.connection_string, PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)".into(),
            );
        }
        TransportError::connection(message)
    };
    mapped.caused_by(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unencoded_at_in_a_url_password_is_named() {
        let e = check_url_userinfo("postgres://app:p@ss@db/test").unwrap_err();
        assert!(e.to_string().contains("%40"), "{e}");
        assert!(check_url_userinfo("postgres://app:p%40ss@db/test?x=a@b").is_ok());
        assert!(check_url_userinfo("host=db password=p@ss").is_ok());
    }

    #[test]
    fn the_password_file_is_read_as_libpq_reads_it() {
        let pg: tokio_postgres::Config = "host=db.example port=5433 user=app dbname=orders"
            .parse()
            .unwrap();
        let file = "# comment\nother:5433:orders:app:wrong\ndb.example:5433:*:app:pa\\:ss\\\\word\n*:*:*:*:fallback\n";
        assert_eq!(
            password_file_entry(&pg, file).as_deref(),
            Some("pa:ss\\word")
        );
        let other: tokio_postgres::Config = "host=x user=u".parse().unwrap();
        assert_eq!(
            password_file_entry(&other, file).as_deref(),
            Some("fallback")
        );
        assert_eq!(password_file_entry(&other, "x:1:2:3:4\n"), None);
    }
}
