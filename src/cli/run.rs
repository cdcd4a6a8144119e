//! `throttlehost run`: the host, with reloads and graceful shutdown.

use std::path::Path;
use std::process::ExitCode;

use throttlehost::HostBuilder;
use throttlehost::config::reload;

/// Runs until SIGTERM or Ctrl-C.
pub async fn run(path: &Path) -> ExitCode {
    let config = match super::read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let host = match HostBuilder::new(config).config_path(path).start().await {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    // SIGHUP reloads even when the file cannot be watched (watch logs why).
    let (mut triggers, _guard) = reload::watch(path);
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
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
    ExitCode::SUCCESS
}
