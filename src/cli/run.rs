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
    let watch = reload::watch(path);
    let (mut triggers, _guard) = match watch {
        Ok((rx, guard)) => (Some(rx), Some(guard)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the configuration file; reload with SIGHUP is off too");
            (None, None)
        }
    };
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            trigger = async {
                match triggers.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                match trigger {
                    Some(t) => {
                        tracing::info!(trigger = ?t, "reloading configuration");
                        let _ = host.inner().reload();
                    }
                    None => triggers = None,
                }
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
