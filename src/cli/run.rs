//! `throttlehost run`: the host, with reloads and graceful shutdown.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::reload;

use super::service::{self, ServiceManager};
use super::waiting::Waiting;

/// Starts the host, waiting for a database that does not answer yet (supervisors start hosts
/// and databases in any order) while the admin address says so; anything else that stops the
/// start is reported at once. SIGHUP meanwhile reads the file again; SIGTERM ends the wait
/// (exit 0).
async fn start_host(
    path: &Path,
    mut config: throttlehost::Config,
    mut shutdown: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    triggers: &mut tokio::sync::mpsc::Receiver<reload::Trigger>,
    manager: &ServiceManager,
) -> Result<throttlehost::Host, ExitCode> {
    let mut waiting: Option<Waiting> = None;
    let mut retry_in = Duration::from_secs(1);
    // What was last said at WARN, and when: a database down for an hour is one line per
    // `WAIT_WARN_EVERY` (and one per new reason), not one per try.
    let mut warned: Option<(std::time::Instant, String)> = None;
    loop {
        let e = match try_start(path, &config, &mut waiting).await {
            Ok(host) => return Ok(host),
            Err(e) if e.is_unreachable_database() && config.host.wait_for_database => e,
            Err(e) => {
                if let Some(w) = waiting.take() {
                    w.stop().await;
                }
                eprintln!("error: {e}");
                return Err(ExitCode::from(1));
            }
        };
        say_unreachable(&e, &config, retry_in, &mut warned);
        let reason = format!("waiting for the database: {e}");
        // The next try starts within `retry_in` and gives up on a connection after the
        // connect timeout; the margin covers a slow start-up of the host itself.
        let next_within = retry_in + 2 * config.transport.connect_timeout + START_MARGIN;
        manager.waiting(&reason, next_within);
        match &waiting {
            Some(w) => w.set_reason(reason),
            None => waiting = Waiting::serve(&config.host.admin_address, reason).await,
        }
        tokio::select! {
            _ = &mut shutdown => {
                if let Some(w) = waiting.take() {
                    w.stop().await;
                }
                return Err(ExitCode::SUCCESS);
            }
            _ = tokio::time::sleep(retry_in) => {}
            Some(trigger) = triggers.recv() => match super::read_config(path) {
                Ok(new) => {
                    tracing::info!(?trigger, "configuration read again while waiting for the database; the host starts with it");
                    config = new;
                }
                Err(_) => tracing::warn!(?trigger, "the configuration file is not valid; waiting on with the one read before"),
            },
        }
        retry_in = (retry_in * 2).min(MAX_RETRY_INTERVAL);
    }
}

/// Starts the host; while waiting (the admin endpoint answering in its place), a cheap
/// connection first, and the waiting endpoint is stopped before the host binds its address.
async fn try_start(
    path: &Path,
    config: &throttlehost::Config,
    waiting: &mut Option<Waiting>,
) -> Result<throttlehost::Host, throttlehost::HostError> {
    if waiting.is_some() {
        throttlehost::transport::connect(&config.transport).await?;
    }
    if let Some(w) = waiting.take() {
        w.stop().await;
    }
    HostBuilder::new(config.clone())
        .config_path(path)
        .start()
        .await
}

/// Says at WARN that the database does not answer: once per `WAIT_WARN_EVERY` while the
/// reason stays the same (`warned` holds what was said last, and when), at DEBUG between.
fn say_unreachable(
    e: &throttlehost::HostError,
    config: &throttlehost::Config,
    retry_in: Duration,
    warned: &mut Option<(std::time::Instant, String)>,
) {
    let said = e.to_string();
    let due = warned
        .as_ref()
        .is_none_or(|(at, last)| *last != said || at.elapsed() >= WAIT_WARN_EVERY);
    if due {
        tracing::warn!(
            database = %config.transport.connection_string,
            error = %e,
            retry_in_seconds = retry_in.as_secs_f64(),
            "database not reachable; starting once it answers (said again every {}s while the same)",
            WAIT_WARN_EVERY.as_secs()
        );
        *warned = Some((std::time::Instant::now(), said));
    } else {
        tracing::debug!(error = %e, "database still not reachable");
    }
}

/// How often the same reason for waiting for the database is said again at WARN.
const WAIT_WARN_EVERY: Duration = Duration::from_secs(60);

/// The longest wait between tries to reach a database that is down at start: a host starts
/// within about this of the database answering (a try is one connection attempt).
const MAX_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What a start may take beyond the connection attempts (creating tables, starting
/// receivers), for the service manager's start timeout while waiting.
const START_MARGIN: Duration = Duration::from_secs(10);

/// Runs until SIGTERM or Ctrl-C, telling a service manager how it goes (see `service`).
pub async fn run(path: &Path) -> ExitCode {
    let config = match super::read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(exposed) = throttlehost::config::exposed_secrets(path, &config) {
        tracing::warn!("{exposed}");
    }
    let manager = ServiceManager::from_environment();
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    // SIGHUP reloads from the first moment (even while waiting for the database), and a file
    // that cannot be watched is said once (watch logs why).
    let (mut triggers, _guard) = reload::watch(path);
    let started = start_host(path, config, shutdown.as_mut(), &mut triggers, &manager).await;
    let host = match started {
        Ok(host) => host,
        Err(code) => {
            manager.stopping();
            return code;
        }
    };
    if let Some(address) = host.admin_address() {
        println!("throttlehost running; console: http://{address}/ (also /status and /metrics)");
    }
    manager.ready(service::STARTED);
    let samples = host.handle().throttling_samples();
    tokio::spawn(manager.clone().follow(samples));
    let failed = serve(&host, shutdown.as_mut(), &mut triggers, &manager).await;
    manager.stopping();
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

/// Runs until the shutdown signal or the throttling controller's failure (true), reloading
/// the configuration whenever a trigger comes.
async fn serve(
    host: &throttlehost::Host,
    mut shutdown: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    triggers: &mut tokio::sync::mpsc::Receiver<reload::Trigger>,
    manager: &ServiceManager,
) -> bool {
    loop {
        tokio::select! {
            _ = &mut shutdown => return false,
            _ = host.controller_failed() => {
                tracing::error!("the throttling controller stopped unexpectedly; shutting the host down");
                eprintln!("error: the throttling controller stopped unexpectedly (see the log); the host shut down so a supervisor can restart it");
                return true;
            }
            Some(trigger) = triggers.recv() => {
                tracing::info!(?trigger, "reloading configuration");
                manager.reloading();
                let status = match host.handle().reload() {
                    Ok(_) => "configuration reloaded".to_owned(),
                    Err(e) => format!("reload refused, running on the previous configuration: {e}"),
                };
                manager.ready(&status);
            }
        }
    }
}
