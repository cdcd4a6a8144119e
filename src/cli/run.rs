//! `throttlehost run`: the host, with reloads and graceful shutdown.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::reload;

/// The longest wait between tries to reach a database that is down at start.
const MAX_RETRY_INTERVAL: Duration = Duration::from_secs(30);

/// Runs until SIGTERM or Ctrl-C.
pub async fn run(path: &Path) -> ExitCode {
    let config = match super::read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    // A database that is down at start is waited for (supervisors start hosts and databases
    // in any order); anything else that stops the start is reported at once.
    let mut retry_in = Duration::from_secs(1);
    let host = loop {
        match HostBuilder::new(config.clone())
            .config_path(path)
            .start()
            .await
        {
            Ok(h) => break h,
            Err(e) if e.is_unreachable_database() && config.host.wait_for_database => {
                tracing::warn!(
                    database = %config.transport.connection_string,
                    error = %e,
                    retry_in_seconds = retry_in.as_secs(),
                    "database not reachable; starting once it answers"
                );
                tokio::select! {
                    _ = &mut shutdown => return ExitCode::SUCCESS,
                    _ = tokio::time::sleep(retry_in) => {}
                }
                retry_in = (retry_in * 2).min(MAX_RETRY_INTERVAL);
            }
            Err(e) => {
                eprintln!(
                    "error: {e} (database: {})",
                    config.transport.connection_string
                );
                return ExitCode::from(1);
            }
        }
    };
    if let Some(address) = host.admin_address() {
        println!("throttlehost running; console: http://{address}/ (also /status and /metrics)");
    }
    // SIGHUP reloads even when the file cannot be watched (watch logs why).
    let (mut triggers, _guard) = reload::watch(path);
    let mut failed = false;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = host.controller_failed() => {
                tracing::error!("the throttling controller stopped unexpectedly; shutting the host down");
                eprintln!("error: the throttling controller stopped unexpectedly (see the log); the host shut down so a supervisor can restart it");
                failed = true;
                break;
            }
            Some(trigger) = triggers.recv() => {
                tracing::info!(?trigger, "reloading configuration");
                let _ = host.inner().reload();
            }
        }
    }
    let report = host.shutdown().await;
    if !report.drained {
        eprintln!(
            "{} in-flight messages were rolled back (they return to their queues)",
            report.rolled_back
        );
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
