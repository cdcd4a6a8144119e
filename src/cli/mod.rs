//! Subcommands of the binary. Library errors are turned into messages and exit codes here:
//! 0 success, 1 failure, 2 invalid input (configuration, arguments).

pub mod demo;
pub mod errors;
pub mod load;
pub mod queues;
pub mod run;
pub mod send;
pub mod service;
pub mod status;
pub mod subscriptions;
pub mod waiting;

use std::path::Path;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

/// Exit code for invalid input.
pub const INVALID: u8 = 2;

/// Logs go to stderr; `RUST_LOG` filters them. Demo and load default to warnings only, so
/// their own output stays readable.
pub fn init_logging(json: bool, quiet_default: bool) {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref(), quiet_default);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// The log filter: `RUST_LOG` when set and valid, else `info` (`warn` with `quiet_default`).
/// The SQL Server driver's own lines are off unless `RUST_LOG` names it: it logs every server
/// error at ERROR (thousands of handled lock timeouts a minute on Babelfish, each counted in
/// `throttlehost_lock_conflicts_total` instead) and its certificate warning on every new
/// connection (the transport says it once). PostgreSQL's notices (`relation ... already
/// exists, skipping` for every idempotent CREATE at start) show only at `warn` and above
/// unless `RUST_LOG` names `tokio_postgres`.
pub fn log_filter(rust_log: Option<&str>, quiet_default: bool) -> EnvFilter {
    let default = if quiet_default { "warn" } else { "info" };
    let mut filter = rust_log
        .and_then(|text| EnvFilter::try_new(text).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let named = |driver: &str| rust_log.is_some_and(|text| text.contains(driver));
    if !named("tiberius") {
        filter = filter.add_directive("tiberius=off".parse().expect("a valid directive"));
    }
    if !named("tokio_postgres") {
        filter = filter.add_directive("tokio_postgres=warn".parse().expect("a valid directive"));
    }
    filter
}

/// Reads a configuration, printing every problem; None (after printing) when invalid.
pub fn read_config(path: &Path) -> Result<throttlehost::Config, ExitCode> {
    throttlehost::config::load_file(path).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(INVALID)
    })
}

/// `config check`: prints the effective configuration or the problems.
pub fn config_check(path: &Path) -> ExitCode {
    let config = match read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // The connection string as the driver reads it: what every command would refuse is
    // refused here, not at the first `run`.
    if let Err(e) = driver_accepts(&config.transport) {
        eprintln!("error: {e}");
        return ExitCode::from(INVALID);
    }
    if let Err(e) = memory_threshold_can_start(&config) {
        eprintln!("error: {e}");
        return ExitCode::from(INVALID);
    }
    if let Some(exposed) = throttlehost::config::exposed_secrets(path, &config) {
        eprintln!("warning: {exposed}");
    }
    match toml::to_string_pretty(&config) {
        Ok(text) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let written = writeln!(
                out,
                "# {}: valid; effective configuration with defaults filled in",
                path.display()
            )
            .and_then(|()| out.write_all(text.as_bytes()))
            .and_then(|()| out.flush());
            match written {
                // A reader that stopped early (`| head`) is no error.
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    eprintln!("error: cannot print the configuration: {e}");
                    ExitCode::from(1)
                }
                _ => ExitCode::SUCCESS,
            }
        }
        Err(e) => {
            eprintln!("error: cannot print the configuration: {e}");
            ExitCode::from(1)
        }
    }
}

/// Refuses an absolute `throttling.process_memory` that `run` would refuse at start: at or
/// below the memory of this process, which does less than a host does before it handles
/// anything.
fn memory_threshold_can_start(config: &throttlehost::Config) -> Result<(), String> {
    use throttlehost::config::MemoryThreshold;
    use throttlehost::throttling::sensors::{ResourceSensor, SystemSensor};
    let MemoryThreshold::Bytes(limit) = config.throttling.process_memory else {
        return Ok(());
    };
    let own = SystemSensor::new().read().process_memory;
    match config.throttling.enabled && limit <= own {
        true => Err(format!(
            "throttling.process_memory: {} is at or below what even this command uses ({}); a host uses more before it handles anything, so `run` would refuse it",
            throttlehost::config::ByteSize(limit),
            throttlehost::config::ByteSize(own)
        )),
        false => Ok(()),
    }
}

/// Builds the configured transport's driver settings without connecting: the connection
/// string parsed by the driver's own parser.
fn driver_accepts(transport: &throttlehost::config::TransportConfig) -> Result<(), String> {
    use throttlehost::config::TransportKind;
    let built = match transport.kind {
        TransportKind::Memory => return Ok(()),
        TransportKind::Postgres => {
            throttlehost::transport::postgres::PostgresTransport::new(transport).map(|_| ())
        }
        TransportKind::Sqlserver => {
            throttlehost::transport::sqlserver::SqlServerTransport::new(transport).map(|_| ())
        }
    };
    built.map_err(|e| match e.to_string() {
        named if named.contains("connection_string") => named,
        other => format!("transport.connection_string: {other}"),
    })
}

/// Waits for Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn the_sql_server_driver_is_quiet_unless_asked_for() {
        assert!(log_filter(None, false).to_string().contains("tiberius=off"));
        assert!(log_filter(None, true).to_string().contains("warn"));
        let asked = log_filter(Some("info,tiberius=debug"), false).to_string();
        assert!(asked.contains("tiberius=debug") && !asked.contains("tiberius=off"));
        let other = log_filter(Some("throttlehost=debug"), false).to_string();
        assert!(other.contains("throttlehost=debug") && other.contains("tiberius=off"));
    }

    #[test]
    fn postgres_notices_are_quiet_unless_asked_for() {
        assert!(
            log_filter(None, false)
                .to_string()
                .contains("tokio_postgres=warn")
        );
        let asked = log_filter(Some("tokio_postgres=info"), false).to_string();
        assert!(!asked.contains("tokio_postgres=warn"), "{asked}");
    }
}
