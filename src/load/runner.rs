//! Runs a scenario: starts a host in this process on the scenario's transport, drives the
//! phases through the host's publish path, samples the controller every sample interval,
//! waits for the queues to drain and the states to clear, and accounts for every message.
//!
//! This file is the face: a run from preparation to result. The rooms: `generate` (offered
//! load), `session` (the phases played), `recorder` (ticks) and `ledger` (every message).

use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

mod generate;
mod ledger;
mod recorder;
mod session;

use self::generate::{MAX_OUTSTANDING_SENDS, store_backlog};
use self::ledger::Ledger;
use self::recorder::Recorder;
use self::session::{Session, delayed_waiting};

use super::options::{LoadError, LoadOptions, host_config};
use super::peer::Peers;
use super::record::{Accounting, RunResult};
use super::scenario::{Phase, Scenario};
use crate::config::{Config, HandlerConfig, OverrideMode, TransportKind};
use crate::handlers::SimulateHandler;
use crate::host::HostBuilder;
use crate::throttling::Direction;
use crate::throttling::sensors::SystemSensor;
use crate::transport::{self, QueueAdmin, QueueName, Transport};

/// What a run starts from: the host's configuration, the transport with fresh tables and the
/// backlog stored, the ledger that accounts for every message, and the message body.
struct Prepared {
    config: Config,
    transport: Arc<dyn Transport>,
    queue_names: Vec<QueueName>,
    ledger: Arc<Ledger>,
    body: Vec<u8>,
}

async fn prepare(scenario: &Scenario, options: &LoadOptions) -> Result<Prepared, LoadError> {
    let mut sensor = SystemSensor::new();
    let config = host_config(scenario, options, &mut sensor);
    let transport: Arc<dyn Transport> = transport::connect(&config.transport).await?;
    let queue_names = fresh_tables(scenario, &config, transport.admin()).await?;
    let fleet_limited = scenario
        .queues
        .iter()
        .any(|q| q.concurrency.fleet_max.is_some());
    let mut ledger = Ledger::new(options.track_ids, fleet_limited);
    ledger.subscribers = scenario
        .queues
        .iter()
        .filter(|q| !q.subscribe.is_empty())
        .filter_map(|q| QueueName::new(&q.name).ok())
        .collect();
    let ledger = Arc::new(ledger);
    *ledger
        .done_by_process
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = vec![0; scenario.processes as usize];
    let body = vec![b'x'; scenario.message_size.bytes() as usize];
    store_backlog(scenario, &transport, &body, &ledger).await?;
    Ok(Prepared {
        config,
        transport,
        queue_names,
        ledger,
        body,
    })
}

/// Messages still in the queues or their delayed tables after a run.
async fn left_in(transport: &dyn Transport, queue_names: &[QueueName]) -> u64 {
    let mut remaining = 0;
    for q in queue_names {
        remaining += transport.peek_depth(q).await.unwrap_or(0);
        remaining += delayed_waiting(transport, q).await;
    }
    remaining
}

/// Runs a scenario to the end.
pub async fn run(scenario: &Scenario, options: &LoadOptions) -> Result<RunResult, LoadError> {
    let Prepared {
        config,
        transport,
        queue_names,
        ledger,
        body,
    } = prepare(scenario, options).await?;
    let resume_ratio = config.throttling.resume_ratio;
    let uncontrolled = uncontrolled_directions(&config);
    let simulated = simulate_handlers(&config);
    let (host, peers) =
        start_hosts(scenario, options, &config, &transport, &ledger, &simulated).await?;
    let started = Instant::now();
    let mut session = Session {
        scenario,
        options,
        recorder: Recorder::start(&host.handle(), &simulated, started, ledger.clone()),
        host: host.handle(),
        sample_interval: config.throttling.sample_interval,
        settings: config,
        simulated: simulated.into_iter().map(|(_, handler)| handler).collect(),
        admin: host.admin_address(),
        ledger,
        body,
        started,
        sends: TaskTracker::new(),
        outstanding: Arc::new(Semaphore::new(MAX_OUTSTANDING_SENDS)),
        shown_at: f64::NEG_INFINITY,
        spans: Vec::new(),
        peers,
        peer_signal_failures: Vec::new(),
    };
    let (busy_seconds, peer_failures, cleared) = session.run_through().await;
    let remaining = left_in(transport.as_ref(), &queue_names).await;
    let Session {
        recorder,
        spans,
        ledger,
        ..
    } = session;
    let samples = recorder.finish().await;
    host.shutdown().await;
    let phase_start = spans.first().map(|s| s.start).unwrap_or(0.0);
    Ok(RunResult {
        scenario: scenario.name.clone(),
        transport: transport.describe(),
        samples,
        phases: spans,
        accounting: Accounting {
            peer_failures,
            ..ledger.accounting(remaining)
        },
        busy_seconds: (busy_seconds - phase_start).max(0.0),
        cleared,
        expect: scenario.expect.clone(),
        resume_ratio,
        uncontrolled,
    })
}

/// The directions whose override is `never`: their episodes are shown but not judged.
fn uncontrolled_directions(config: &Config) -> Vec<Direction> {
    let throttling = &config.throttling;
    [
        (Direction::Delivery, &throttling.delivery),
        (Direction::Publishing, &throttling.publishing),
    ]
    .into_iter()
    .filter(|(_, d)| d.override_mode == OverrideMode::Never)
    .map(|(direction, _)| direction)
    .collect()
}

/// The host under load, on the run's transport, telling the ledger what it handles, with the
/// run's simulate handlers; then the scenario's peer processes (if one cannot start, the host
/// stops again).
async fn start_hosts(
    scenario: &Scenario,
    options: &LoadOptions,
    config: &Config,
    transport: &Arc<dyn Transport>,
    ledger: &Arc<Ledger>,
    simulated: &[(String, Arc<SimulateHandler>)],
) -> Result<(crate::host::Host, Option<Peers>), LoadError> {
    let mut builder = HostBuilder::new(config.clone())
        .transport(transport.clone())
        .observer(ledger.clone());
    for (queue, handler) in simulated {
        builder = builder.shared_handler(queue, handler.clone());
    }
    let host = builder.start().await?;
    let peers = match start_peers(scenario, options, ledger) {
        Ok(peers) => peers,
        Err(e) => {
            host.shutdown().await;
            return Err(e);
        }
    };
    if let Some(addr) = host.admin_address() {
        tracing::info!("status: http://{addr}/status  metrics: http://{addr}/metrics");
    }
    Ok((host, peers))
}

/// A simulate handler for each queue configured with one, by queue name: the run holds them
/// itself, to turn their knobs phase by phase and read the latencies they saw, and the host
/// takes them as handlers registered by name.
fn simulate_handlers(config: &Config) -> Vec<(String, Arc<SimulateHandler>)> {
    config
        .queues
        .iter()
        .filter_map(|q| match &q.handler {
            Some(HandlerConfig::Simulate(knobs)) => Some((
                q.name.clone(),
                Arc::new(SimulateHandler::new(knobs.clone())),
            )),
            _ => None,
        })
        .collect()
}

/// The scenario's peer processes (`processes` above 1), reporting into the ledger.
fn start_peers(
    scenario: &Scenario,
    options: &LoadOptions,
    ledger: &Arc<Ledger>,
) -> Result<Option<Peers>, LoadError> {
    let count = scenario.processes.saturating_sub(1);
    if count == 0 {
        return Ok(None);
    }
    let sink = ledger.clone();
    Peers::spawn(
        count,
        scenario,
        options,
        Arc::new(move |source, event| sink.record(source, event)),
    )
    .map(Some)
}

/// The scenario's queues; on a database, their tables (and their error queues') dropped and
/// made anew, since a database keeps what earlier runs left.
async fn fresh_tables(
    scenario: &Scenario,
    config: &Config,
    transport: &dyn QueueAdmin,
) -> Result<Vec<QueueName>, LoadError> {
    let mut queue_names = Vec::new();
    for q in &scenario.queues {
        let name = QueueName::new(&q.name)?;
        if config.transport.kind != TransportKind::Memory {
            transport.reset_queue(&name).await?;
            transport
                .reset_queue(&QueueName::new(&q.error_queue)?)
                .await?;
        }
        queue_names.push(name);
    }
    Ok(queue_names)
}

fn first_queue(scenario: &Scenario, phase: &Phase) -> QueueName {
    let name = phase.queue.as_deref().unwrap_or(&scenario.queues[0].name);
    QueueName::new(name).expect("scenario queue names are validated")
}
