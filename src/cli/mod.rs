//! Subcommands of the binary. Library errors are turned into messages and exit codes here:
//! 0 success, 1 failure, 2 invalid input (configuration, arguments).

pub mod demo;
pub mod load;
pub mod queues;
pub mod run;
pub mod send;
pub mod status;
pub mod waiting;

use std::path::Path;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

/// Exit code for invalid input.
pub const INVALID: u8 = 2;

/// Logs go to stderr; `RUST_LOG` filters them. Demo and load default to warnings only, so
/// their own output stays readable.
pub fn init_logging(json: bool, quiet_default: bool) {
    let default = if quiet_default { "warn" } else { "info" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
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
