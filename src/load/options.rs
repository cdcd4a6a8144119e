//! How a scenario is run (`LoadOptions`, shown how: `Display`), why it could not be
//! (`LoadError`), and the host configuration it runs with (`host_config`): what the runner
//! and its peer processes both start from.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::scenario::Scenario;
use crate::config::{Config, HostConfig};
use crate::host::HostError;
use crate::throttling::sensors::ResourceSensor;
use crate::transport::TransportError;

/// How progress is shown while a scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Display {
    /// Nothing.
    Quiet,
    /// One progress line (on stderr).
    Progress,
    /// The demo's live table (on stdout), once a second.
    Table,
}

/// How to run a scenario.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Multiplies every phase duration.
    pub duration_scale: f64,
    /// Replaces the transport schema (isolates parallel runs on one database).
    pub schema: Option<String>,
    /// Replaces the transport connection string.
    pub connection_string: Option<String>,
    /// Replaces the admin address (`"off"` for none).
    pub admin_address: Option<String>,
    /// Progress display.
    pub display: Display,
    /// Repeat the phases until this much time has passed (the demo); None: once.
    pub repeat_for: Option<Duration>,
    /// Repeat until cancelled (the demo without `--duration`).
    pub repeat_forever: bool,
    /// Cancelled on Ctrl-C: the run stops its phases early and drains.
    pub stop: CancellationToken,
    /// Account for every message by id (off for endless demo runs).
    pub track_ids: bool,
    /// Wait for the queues to drain and the states to clear at the end (off for the demo).
    pub drain: bool,
    /// The program a scenario's peer processes run (`load-peer`); None: this program.
    pub peer_program: Option<std::path::PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            duration_scale: 1.0,
            schema: None,
            connection_string: None,
            admin_address: None,
            display: Display::Quiet,
            repeat_for: None,
            repeat_forever: false,
            stop: CancellationToken::new(),
            track_ids: true,
            drain: true,
            peer_program: None,
        }
    }
}

/// Why a run could not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The scenario's host could not start.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The transport failed outside the host.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A scenario queue name is not a valid name.
    #[error(transparent)]
    QueueName(#[from] crate::names::InvalidName),
    /// A peer process (`processes` above 1) could not be started.
    #[error("cannot start a peer process (scenario setting `processes`): {0}")]
    Peer(#[source] std::io::Error),
}

/// The host configuration a scenario runs with, thresholds resolved against `sensor`.
pub fn host_config(
    scenario: &Scenario,
    options: &LoadOptions,
    sensor: &mut dyn ResourceSensor,
) -> Config {
    let mut transport = scenario.transport.clone();
    if let Some(schema) = &options.schema {
        transport.schema = schema.clone();
    }
    if let Some(cs) = &options.connection_string {
        transport.connection_string = crate::config::ConnectionString::new(cs.clone());
    }
    let mut throttling = scenario.throttling.clone();
    let baseline = sensor.read();
    let cpus = sensor.machine().cpus.max(1);
    let per_cpu = |total: u64| total.div_ceil(cpus).max(1);
    let r = &scenario.relative;
    if let Some(above) = r.process_memory_above_baseline {
        throttling.process_memory =
            crate::config::MemoryThreshold::Bytes(baseline.process_memory + above.bytes());
    }
    if let Some(above) = r.system_memory_above_baseline {
        throttling.system_memory =
            crate::config::MemoryThreshold::Bytes(baseline.system_memory_used + above.bytes());
    }
    if let Some(above) = r.threads_above_baseline {
        throttling.threads_per_cpu = per_cpu(baseline.threads + above);
    }
    if let Some(total) = r.in_process {
        throttling.in_process_per_cpu = per_cpu(total);
    }
    if let Some(total) = r.database_sessions {
        throttling.database_sessions_per_cpu = per_cpu(total);
    }
    Config {
        host: HostConfig {
            name: format!("load-{}", scenario.name),
            instance_id: "load".into(),
            admin_address: options
                .admin_address
                .clone()
                .unwrap_or_else(|| scenario.admin_address.clone()),
            shutdown_timeout: Duration::from_secs(10),
            create_queues: true,
            worker_threads: 0,
            wait_for_database: false,
        },
        transport,
        queues: scenario.queues.clone(),
        throttling,
        fleet: scenario.fleet.clone(),
        ..Config::default()
    }
}
