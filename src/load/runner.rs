//! Runs a scenario: starts a host in this process on the scenario's transport, drives the
//! phases through the host's publish path, samples the controller every sample interval,
//! waits for the queues to drain and the states to clear, and accounts for every message.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::in_flight::InFlightSpans;
use super::options::{Display, LoadError, LoadOptions, host_config};
use super::peer::{PeerEvent, Peers, now_ns};
use super::record::{Accounting, PhaseSpan, RunResult, Sample};
use super::scenario::{Phase, Scenario};
use crate::config::{Config, OverrideMode, TransportKind};
use crate::dispatch::{DispatchObserver, Outcome};
use crate::host::{HostBuilder, HostInner};
use crate::message::{EXECUTION_STAGE_HEADER, OutgoingMessage, PREVIOUS_STAGE_HEADER};
use crate::throttling::Direction;
use crate::throttling::sensors::SystemSensor;
use crate::transport::{self, QueueAdmin, QueueName, Transport, TransportError};

/// Most sends of a phase waiting at once; beyond this the generator stops offering more (it
/// would otherwise turn a throttled publish path into unbounded memory).
const MAX_OUTSTANDING_SENDS: usize = 100_000;

/// Records every controller tick (subscribed to its decisions, not sampled on a timer of
/// its own), labelled with the phase that was running.
struct Recorder {
    samples: Arc<Mutex<Vec<Sample>>>,
    phase: Arc<Mutex<String>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    fn start(host: &HostInner, started: Instant, ledger: Arc<Ledger>) -> Self {
        let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
        let phase = Arc::new(Mutex::new(String::new()));
        let stop = CancellationToken::new();
        let mut decisions = host.control().subscribe();
        let (samples2, phase2, stop2) = (samples.clone(), phase.clone(), stop.clone());
        let sims = distinct_simulated(host);
        let task = tokio::spawn(async move {
            loop {
                let snapshot = tokio::select! {
                    _ = stop2.cancelled() => return,
                    s = decisions.recv() => s,
                };
                let snapshot = match snapshot {
                    Ok(s) => s,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "the load recorder fell behind the controller");
                        continue;
                    }
                    Err(_) => return,
                };
                let queues = snapshot
                    .queues
                    .iter()
                    .map(|q| {
                        // What the queue's gate allows once this tick is applied: the least
                        // of its max, the controller's limit, the downstream guards' limit
                        // and this instance's fleet share.
                        let limit = snapshot
                            .decision
                            .queue_limits
                            .get(&q.load.name)
                            .copied()
                            .unwrap_or(q.load.max)
                            .min(q.load.max)
                            .min(q.downstream_limit.unwrap_or(u32::MAX))
                            .min(q.fleet_share.unwrap_or(u32::MAX));
                        (q.load.name.clone(), limit, q.load.in_flight, q.depth)
                    })
                    .collect();
                let outage = snapshot.readings.downstream.outage.active;
                let sample = Sample {
                    t: started.elapsed().as_secs_f64(),
                    phase: phase2.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                    snapshot,
                    queues,
                    sent: ledger.sent.load(Ordering::Relaxed),
                    done: ledger.done.load(Ordering::Relaxed),
                    calls: sims.iter().map(|s| s.calls()).sum(),
                    outage,
                };
                samples2
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sample);
            }
        });
        Recorder {
            samples,
            phase,
            stop,
            task,
        }
    }

    fn set_phase(&self, name: &str) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = name.to_string();
    }

    fn latest(&self) -> Option<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .cloned()
    }

    async fn finish(self) -> Vec<Sample> {
        self.stop.cancel();
        let _ = self.task.await;
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The host's simulate handlers, each once (a queue and its instance queue share one).
fn distinct_simulated(host: &HostInner) -> Vec<Arc<crate::handlers::SimulateHandler>> {
    let mut sims: Vec<Arc<crate::handlers::SimulateHandler>> = Vec::new();
    for sim in host.simulated() {
        if !sims.iter().any(|s| Arc::ptr_eq(s, sim)) {
            sims.push(sim.clone());
        }
    }
    sims
}

/// The latencies of every simulate handler since the last take, sorted.
fn take_latencies(host: &HostInner) -> Vec<f32> {
    let mut all: Vec<f32> = distinct_simulated(host)
        .iter()
        .flat_map(|s| s.take_latencies())
        .collect();
    all.sort_by(f32::total_cmp);
    all
}

/// Counts every message by id; the host reports outcomes through [`DispatchObserver`].
#[derive(Default)]
struct Ledger {
    track_ids: bool,
    sent: AtomicU64,
    send_failures: AtomicU64,
    done: AtomicU64,
    /// Per outcome (success, error, expired, poison), counted whether or not ids are tracked.
    outcomes: [AtomicU64; 4],
    last_done: Mutex<Option<Instant>>,
    /// Messages done per process: this one first, then its peers.
    done_by_process: Mutex<Vec<u64>>,
    ids: Mutex<LedgerIds>,
    /// Every handling's start and end across the processes, when a queue has a fleet-wide
    /// limit to check.
    in_flight: Option<Mutex<InFlightSpans>>,
}

/// What the ledger knows per message, keyed compactly so that tracking a 20 000-message
/// backlog costs the measured process well under a megabyte.
#[derive(Default)]
struct LedgerIds {
    /// Per logical id: the last outcome reported and how many successes.
    messages: HashMap<Uuid, Tally>,
    /// Row ids whose logical id is not the row id itself (the id header was set).
    native: HashMap<Uuid, Uuid>,
    /// Per key of a keyed backlog: every handling of its messages, in any process.
    keys: Vec<Vec<KeyRun>>,
    /// Per stage of a staged backlog: every handling of its messages, in any process.
    stages: Vec<Vec<KeyRun>>,
}

impl LedgerIds {
    /// The ledger key of a message the dispatcher reports by row id and logical id.
    fn key_of(&self, id: Uuid, logical_id: Option<&str>) -> Uuid {
        match logical_id {
            Some(l) => ledger_key(l),
            None => self.native.get(&id).copied().unwrap_or(id),
        }
    }
}

/// The outcomes reported for one logical message.
#[derive(Default)]
struct Tally {
    last: Option<Outcome>,
    /// Successful handlings: more than one is a duplicate.
    successes: u32,
    /// Its key and its place among the key's messages (keyed backlogs).
    place: Option<(u32, u32)>,
    /// Its stage (from 0) and its place among the stage's messages (staged backlogs).
    stage: Option<(u32, u32)>,
}

/// One handling of a keyed message: its place among the key's messages, when its handling
/// began and when its last attempt ended (None while it runs, or if it never ended), in
/// nanoseconds of the wall clock ([`now_ns`]), which every process of the machine shares.
#[derive(Clone, Copy)]
struct KeyRun {
    place: u32,
    start: u64,
    end: Option<u64>,
}

/// Checks stage barriers: no handling of a stage began before every handling of the stage
/// before it had ended. Returns how many began too early and the first, in words.
fn stage_barrier_problems(stages: &[Vec<KeyRun>]) -> (u64, Option<String>) {
    let mut count = 0;
    let mut first = None;
    for (s, pair) in stages.windows(2).enumerate() {
        let (before, after) = (&pair[0], &pair[1]);
        // Until when the stage before ran (a handling that never ended: for ever).
        let Some(barrier) = before.iter().map(|r| r.end.unwrap_or(u64::MAX)).max() else {
            continue;
        };
        for run in after.iter().filter(|r| r.start < barrier) {
            count += 1;
            first.get_or_insert(format!(
                "stage {}: message {} started before stage {} had ended",
                (s + 2) * 100,
                run.place,
                (s + 1) * 100
            ));
        }
    }
    (count, first)
}

/// Checks one key's handlings: in the order they began, each is the message due (the one
/// after the last, or the last again after a rollback), and none began before a different
/// message's handling ended. Returns the first violation and how many there were.
fn key_order_problems(key: usize, runs: &[KeyRun]) -> (u64, Option<String>) {
    let mut runs = runs.to_vec();
    runs.sort_by_key(|r| r.start);
    let mut count = 0;
    let mut first = None;
    for pair in runs.windows(2) {
        let (before, after) = (pair[0], pair[1]);
        let problem =
            if after.place != before.place && before.end.is_none_or(|end| end > after.start) {
                Some(format!(
                    "key {key}: message {} started while another of the key was running",
                    after.place
                ))
            } else if after.place > before.place + 1 || after.place < before.place {
                Some(format!(
                    "key {key}: message {} started before message {} ended",
                    after.place,
                    before.place + 1
                ))
            } else {
                None
            };
        if let Some(what) = problem {
            count += 1;
            first.get_or_insert(what);
        }
    }
    if let Some(r) = runs.first().filter(|r| r.place > 0) {
        count += 1;
        first.get_or_insert(format!(
            "key {key}: message {} started before message 0 ended",
            r.place
        ));
    }
    (count, first)
}

/// A logical id as a ledger key: itself when it is a UUID (the host's own ids), else a
/// name-based UUID of its text.
fn ledger_key(logical: &str) -> Uuid {
    Uuid::parse_str(logical)
        .unwrap_or_else(|_| Uuid::new_v5(&Uuid::NAMESPACE_OID, logical.as_bytes()))
}

fn outcome_index(o: Outcome) -> usize {
    match o {
        Outcome::Success => 0,
        Outcome::Error => 1,
        Outcome::Expired => 2,
        Outcome::Poison => 3,
    }
}

impl Ledger {
    fn new(track_ids: bool, track_in_flight: bool) -> Self {
        Ledger {
            track_ids,
            in_flight: track_in_flight.then(Mutex::default),
            ..Ledger::default()
        }
    }

    /// Enters a handling's start or end into the spans, when they are kept.
    fn span(&self, change: impl FnOnce(&mut InFlightSpans)) {
        if let Some(spans) = &self.in_flight {
            change(&mut spans.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    fn ids(&self) -> std::sync::MutexGuard<'_, LedgerIds> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sent(&self, message: &OutgoingMessage) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        if self.track_ids {
            let key = ledger_key(&message.logical_id());
            let mut ids = self.ids();
            if key != message.id {
                ids.native.insert(message.id, key);
            }
            ids.messages.entry(key).or_default();
        }
    }

    /// Records a prefilled message as the `place`-th of key `key`.
    fn sent_keyed(&self, message: &OutgoingMessage, key: u32, place: u32) {
        self.sent(message);
        let mut ids = self.ids();
        let k = ledger_key(&message.logical_id());
        ids.messages.entry(k).or_default().place = Some((key, place));
        if ids.keys.len() <= key as usize {
            ids.keys.resize(key as usize + 1, Vec::new());
        }
    }

    /// Records a prefilled message as the `place`-th of stage `stage` (from 0).
    fn sent_staged(&self, message: &OutgoingMessage, stage: u32, place: u32) {
        let mut ids = self.ids();
        let k = ledger_key(&message.logical_id());
        ids.messages.entry(k).or_default().stage = Some((stage, place));
        if ids.stages.len() <= stage as usize {
            ids.stages.resize(stage as usize + 1, Vec::new());
        }
    }

    /// Enters what process `source` (0: this one) saw.
    fn record(&self, source: usize, event: PeerEvent) {
        match event {
            PeerEvent::Started(s) => {
                self.span(|spans| spans.began(source, s.id, s.at));
                self.began(s.id, s.logical_id.as_deref(), s.at)
            }
            PeerEvent::Handled(s) => {
                self.span(|spans| spans.ended(source, s.id, s.at));
                self.ended(s.id, s.logical_id.as_deref(), s.at)
            }
            PeerEvent::Completed(s, outcome) => {
                self.finished(source, s.id, s.logical_id.as_deref(), outcome)
            }
        }
    }

    fn finished(&self, source: usize, id: Uuid, logical_id: Option<&str>, outcome: Outcome) {
        self.done.fetch_add(1, Ordering::Relaxed);
        self.outcomes[outcome_index(outcome)].fetch_add(1, Ordering::Relaxed);
        *self.last_done.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        {
            let mut by = self
                .done_by_process
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if by.len() <= source {
                by.resize(source + 1, 0);
            }
            by[source] += 1;
        }
        if !self.track_ids {
            return;
        }
        let mut ids = self.ids();
        let key = ids.key_of(id, logical_id);
        let tally = ids.messages.entry(key).or_default();
        tally.last = Some(outcome);
        tally.successes += u32::from(outcome == Outcome::Success);
    }

    /// A keyed message's handling began at `at`.
    fn began(&self, id: Uuid, logical_id: Option<&str>, at: u64) {
        if !self.track_ids {
            return;
        }
        let mut ids = self.ids();
        let key = ids.key_of(id, logical_id);
        let Some(tally) = ids.messages.get(&key) else {
            return;
        };
        let (place, stage) = (tally.place, tally.stage);
        let ids = &mut *ids;
        for (runs, (k, place)) in [(&mut ids.keys, place), (&mut ids.stages, stage)]
            .into_iter()
            .filter_map(|(runs, at_place)| Some((runs, at_place?)))
        {
            if let Some(runs) = runs.get_mut(k as usize) {
                runs.push(KeyRun {
                    place,
                    start: at,
                    end: None,
                });
            }
        }
    }

    /// A keyed message's last attempt ended at `at` (before its unit of work ends, so before
    /// the next of its key can be received).
    fn ended(&self, id: Uuid, logical_id: Option<&str>, at: u64) {
        if !self.track_ids {
            return;
        }
        let mut ids = self.ids();
        let key = ids.key_of(id, logical_id);
        let Some(tally) = ids.messages.get(&key) else {
            return;
        };
        let (place, stage) = (tally.place, tally.stage);
        let ids = &mut *ids;
        for (runs, (k, place)) in [(&mut ids.keys, place), (&mut ids.stages, stage)]
            .into_iter()
            .filter_map(|(runs, at_place)| Some((runs, at_place?)))
        {
            if let Some(run) = runs.get_mut(k as usize).and_then(|runs| {
                runs.iter_mut()
                    .rev()
                    .find(|r| r.place == place && r.end.is_none())
            }) {
                run.end = Some(at);
            }
        }
    }

    fn accounting(&self, remaining: u64) -> Accounting {
        let ids = self.ids();
        let count = |o: Outcome| self.outcomes[outcome_index(o)].load(Ordering::Relaxed);
        let unaccounted = ids.messages.values().filter(|t| t.last.is_none()).count() as u64;
        let (mut order_violations, mut first_order_violation) = (0, None);
        for (key, runs) in ids.keys.iter().enumerate() {
            let (count, first) = key_order_problems(key, runs);
            order_violations += count;
            if first_order_violation.is_none() {
                first_order_violation = first;
            }
        }
        let (stage_violations, first_stage_violation) = stage_barrier_problems(&ids.stages);
        Accounting {
            sent: self.sent.load(Ordering::Relaxed),
            processed: count(Outcome::Success),
            in_error_queue: count(Outcome::Error),
            expired: count(Outcome::Expired),
            poison: count(Outcome::Poison),
            lost: if self.track_ids {
                unaccounted.saturating_sub(remaining)
            } else {
                0
            },
            remaining,
            duplicated: ids.messages.values().filter(|t| t.successes > 1).count() as u64,
            send_failures: self.send_failures.load(Ordering::Relaxed),
            order_violations,
            first_order_violation,
            stage_violations,
            first_stage_violation,
            done_by_process: self
                .done_by_process
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            peer_failures: Vec::new(),
            fleet_in_flight: self
                .in_flight
                .as_ref()
                .map(|spans| spans.lock().unwrap_or_else(|e| e.into_inner()).summary()),
        }
    }
}

impl DispatchObserver for Ledger {
    fn completed(&self, _queue: &QueueName, id: Uuid, logical_id: Option<&str>, outcome: Outcome) {
        self.finished(0, id, logical_id, outcome);
    }

    fn handled(&self, _queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let at = now_ns();
        self.span(|spans| spans.ended(0, id, at));
        self.ended(id, logical_id, at);
    }

    fn started(&self, _queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let at = now_ns();
        self.span(|spans| spans.began(0, id, at));
        self.began(id, logical_id, at);
    }
}

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
    let queue_names = fresh_tables(scenario, &config, transport.as_ref()).await?;
    let fleet_limited = scenario
        .queues
        .iter()
        .any(|q| q.concurrency.fleet_max.is_some());
    let ledger = Arc::new(Ledger::new(options.track_ids, fleet_limited));
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
    let sample_interval = config.throttling.sample_interval;
    let resume_ratio = config.throttling.resume_ratio;
    let host = HostBuilder::new(config)
        .transport(transport.clone())
        .observer(ledger.clone())
        .start()
        .await?;
    let inner = host.inner().clone();
    let peers = match start_peers(scenario, options, &ledger) {
        Ok(peers) => peers,
        Err(e) => {
            host.shutdown().await;
            return Err(e);
        }
    };
    if let Some(addr) = host.admin_address() {
        tracing::info!("status: http://{addr}/status  metrics: http://{addr}/metrics");
    }
    let started = Instant::now();
    let mut session = Session {
        scenario,
        options,
        recorder: Recorder::start(&inner, started, ledger.clone()),
        inner,
        admin: host.admin_address(),
        ledger,
        body,
        started,
        sample_interval,
        sends: TaskTracker::new(),
        outstanding: Arc::new(Semaphore::new(MAX_OUTSTANDING_SENDS)),
        shown_at: f64::NEG_INFINITY,
        spans: Vec::new(),
        peers,
        kill_failures: Vec::new(),
    };
    session.play().await;
    session.stop_load().await;
    let busy_seconds = session.drain().await;
    // The peers finish what they hold in flight and report it before the count is taken.
    let mut peer_failures = match session.peers.take() {
        Some(peers) => peers.stop().await,
        None => Vec::new(),
    };
    peer_failures.append(&mut session.kill_failures);
    let cleared = session.settle().await;
    if options.display == Display::Progress {
        eprintln!();
    }

    let remaining = left_in(transport.as_ref(), &queue_names).await;
    let description = transport.describe();
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
        transport: description,
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
    })
}

/// Stores the scenario's backlog (`prefill`, with its keys and stages) in the first phase's
/// queue, each message in the ledger.
async fn store_backlog(
    scenario: &Scenario,
    transport: &Arc<dyn Transport>,
    body: &[u8],
    ledger: &Arc<Ledger>,
) -> Result<(), TransportError> {
    if scenario.prefill == 0 {
        return Ok(());
    }
    let target = first_queue(scenario, &scenario.phases[0]);
    transport.create_queue(&target).await?;
    let key_header = scenario
        .queues
        .iter()
        .find(|q| q.name == target.as_str())
        .and_then(|q| q.ordering.key_header())
        .filter(|_| scenario.prefill_keys > 0)
        .map(|h| {
            (
                h.to_string(),
                scenario
                    .prefill_key_layout
                    .keys(scenario.prefill, scenario.prefill_keys),
            )
        });
    let backlog = Backlog {
        count: scenario.prefill,
        body,
        keys: key_header,
        stages: scenario.prefill_stages,
    };
    prefill(transport, &target, backlog, ledger).await
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

/// One load run in progress: the host under load, what it records, and the phases so far.
struct Session<'a> {
    scenario: &'a Scenario,
    options: &'a LoadOptions,
    inner: Arc<HostInner>,
    admin: Option<std::net::SocketAddr>,
    recorder: Recorder,
    ledger: Arc<Ledger>,
    body: Vec<u8>,
    started: Instant,
    sample_interval: Duration,
    /// Sends in flight, waited for before the drain.
    sends: TaskTracker,
    outstanding: Arc<Semaphore>,
    /// When the progress line was last shown.
    shown_at: f64,
    spans: Vec<PhaseSpan>,
    /// The peer processes (`processes` above 1), until they are stopped.
    peers: Option<Peers>,
    /// Peers that could not be killed when a phase asked, in words.
    kill_failures: Vec<String>,
}

impl Session<'_> {
    /// Shows progress for `phase` (the `index`-th of `phases`).
    fn show(&mut self, phase: &str, position: (usize, usize)) {
        show(
            self.options.display,
            &self.inner,
            &self.recorder,
            phase,
            position,
            &self.ledger,
            self.admin,
            &mut self.shown_at,
        );
    }

    fn out_of_time(&self) -> bool {
        self.options.stop.is_cancelled()
            || self
                .options
                .repeat_for
                .is_some_and(|t| self.started.elapsed() >= t)
    }

    /// Plays the phases, `rounds` times (or for as long as the options say).
    async fn play(&mut self) {
        let total = self.options.repeat_for;
        let mut round = 0u32;
        'rounds: loop {
            for (index, phase) in self.scenario.phases.iter().enumerate() {
                if self.out_of_time() {
                    break 'rounds;
                }
                let label = if round > 0 {
                    format!("{} (round {})", phase.name, round + 1)
                } else {
                    phase.name.clone()
                };
                self.play_phase(phase, label, index).await;
            }
            round += 1;
            if !(self.options.repeat_forever || total.is_some()) && round >= self.scenario.rounds {
                break;
            }
        }
    }

    /// One phase: its settings applied, its load offered, shown every sample interval.
    async fn play_phase(&mut self, phase: &Phase, label: String, index: usize) {
        let queue = first_queue(self.scenario, phase);
        apply_phase(&self.inner, phase, &queue);
        if let Some(number) = phase.kill_peer {
            self.kill_peer(number as usize);
        }
        let phase_stop = self.options.stop.child_token();
        let length = phase.duration.mul_f64(self.options.duration_scale.max(0.0));
        let length = match self.options.repeat_for {
            Some(t) => length.min(t.saturating_sub(self.started.elapsed())),
            None => length,
        };
        let generator = tokio::spawn(generate(
            self.inner.clone(),
            queue,
            phase.clone(),
            length,
            self.body.clone(),
            self.ledger.clone(),
            self.sends.clone(),
            self.outstanding.clone(),
            phase_stop.clone(),
        ));
        let start = self.started.elapsed().as_secs_f64();
        self.recorder.set_phase(&label);
        take_latencies(&self.inner);
        let phase_end = Instant::now() + length;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.sample_interval) => {}
                _ = self.options.stop.cancelled() => {}
            }
            self.show(&label, (index, self.scenario.phases.len()));
            if self.options.stop.is_cancelled() || Instant::now() >= phase_end {
                break;
            }
            if phase.until_drained && generator.is_finished() && drained(&self.inner).await {
                break;
            }
        }
        phase_stop.cancel();
        let _ = generator.await;
        self.spans.push(PhaseSpan {
            name: label,
            start,
            end: self.started.elapsed().as_secs_f64(),
            latencies: take_latencies(&self.inner),
            causes: phase.causes.clone(),
        });
    }

    /// Kills peer `number` (`kill -9`) and tells the ledger, which ends its handlings then.
    fn kill_peer(&mut self, number: usize) {
        let outcome = match self.peers.as_mut() {
            Some(peers) => peers.kill(number),
            None => Err(format!("there is no peer {number} to kill")),
        };
        match outcome {
            Ok(()) => self.ledger.span(|spans| spans.killed(number, now_ns())),
            Err(e) => self.kill_failures.push(e),
        }
    }

    /// Lets offered sends finish (or fail), lifts the overrides, and stops the simulate
    /// handlers holding memory and threads, so the resource conditions can clear while the
    /// backlog drains; latency and failure rate stay as the last phase left them.
    async fn stop_load(&mut self) {
        self.sends.close();
        if tokio::time::timeout(self.scenario.drain_timeout, self.sends.wait())
            .await
            .is_err()
        {
            tracing::warn!("some sends did not finish within the drain timeout");
        }
        for direction in Direction::ALL {
            self.inner.set_override(direction, OverrideMode::None);
        }
        for sim in self.inner.simulated() {
            let mut knobs = sim.knobs();
            knobs.memory_per_message = crate::config::ByteSize(0);
            knobs.blocking = false;
            sim.set_knobs(knobs);
        }
    }

    /// Waits for the queues to drain (when asked to); returns when the last message was done,
    /// in seconds from the start.
    async fn drain(&mut self) -> f64 {
        let drain_start = self.started.elapsed().as_secs_f64();
        self.recorder.set_phase("drain");
        take_latencies(&self.inner);
        let drain_deadline = Instant::now() + self.scenario.drain_timeout;
        while self.options.drain
            && !drained(&self.inner).await
            && Instant::now() < drain_deadline
            && !self.options.stop.is_cancelled()
        {
            tokio::time::sleep(self.sample_interval).await;
            self.show("drain", (0, 0));
        }
        self.spans.push(PhaseSpan {
            name: "drain".into(),
            start: drain_start,
            end: self.started.elapsed().as_secs_f64(),
            latencies: take_latencies(&self.inner),
            causes: Vec::new(),
        });
        let last_done = *self
            .ledger
            .last_done
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        last_done
            .map(|t| t.duration_since(self.started).as_secs_f64())
            .unwrap_or(0.0)
    }

    /// Waits for both directions to return to state 0; whether they did.
    async fn settle(&mut self) -> bool {
        let settle_start = self.started.elapsed().as_secs_f64();
        self.recorder.set_phase("settle");
        let cleared = if self.options.drain {
            settle(
                &self.recorder,
                self.sample_interval,
                self.scenario.settle_timeout,
                &self.options.stop,
            )
            .await
        } else {
            false
        };
        self.spans.push(PhaseSpan {
            name: "settle".into(),
            start: settle_start,
            end: self.started.elapsed().as_secs_f64(),
            latencies: Vec::new(),
            causes: Vec::new(),
        });
        cleared
    }
}

fn first_queue(scenario: &Scenario, phase: &Phase) -> QueueName {
    let name = phase.queue.as_deref().unwrap_or(&scenario.queues[0].name);
    QueueName::new(name).expect("scenario queue names are validated")
}

fn apply_phase(host: &HostInner, phase: &Phase, queue: &QueueName) {
    if let Some(max) = phase.max_concurrency
        && let Some(q) = host.queue(queue.as_str())
    {
        let mut settings = (*q.settings()).clone();
        settings.max = max;
        q.reconfigure(settings);
    }
    if let Some(on) = phase.latency_limit
        && let Some(q) = host.queue(queue.as_str())
    {
        let mut settings = (*q.settings()).clone();
        settings.latency_limit.enabled = on;
        q.reconfigure(settings);
    }
    if let Some(change) = &phase.handler {
        for sim in host.simulated() {
            sim.set_knobs(change.apply(sim.knobs()));
        }
    }
    if let Some(mode) = phase.delivery_override {
        host.set_override(Direction::Delivery, mode);
    }
    if let Some(mode) = phase.publishing_override {
        host.set_override(Direction::Publishing, mode);
    }
}

/// The backlog a scenario starts with.
struct Backlog<'a> {
    count: u64,
    body: &'a [u8],
    /// The key header and each message's key.
    keys: Option<(String, Vec<u32>)>,
    /// Stages the backlog is cut into, in send order (0: none).
    stages: u32,
}

impl Backlog<'_> {
    /// The stage (from 0) of the `i`-th message.
    fn stage_of(&self, i: u64) -> Option<u32> {
        (self.stages > 0).then(|| (i * u64::from(self.stages) / self.count) as u32)
    }
}

/// Stores the backlog, in batches, each message in the ledger (with its key and its place
/// among the key's messages).
async fn prefill(
    transport: &Arc<dyn Transport>,
    queue: &QueueName,
    backlog: Backlog<'_>,
    ledger: &Arc<Ledger>,
) -> Result<(), TransportError> {
    /// Messages per statement (PostgreSQL stores a batch with one INSERT).
    const BATCH: u64 = 1000;
    let mut places: HashMap<u32, u32> = HashMap::new();
    let mut stage_places: HashMap<u32, u32> = HashMap::new();
    let mut stored = 0;
    while stored < backlog.count {
        let first = stored;
        let (messages, keys): (Vec<OutgoingMessage>, Vec<Option<u32>>) = (first
            ..first + BATCH.min(backlog.count - stored))
            .map(|i| {
                let mut m = OutgoingMessage::new(backlog.body.to_vec());
                if let Some(stage) = backlog.stage_of(i) {
                    m = m.with_header(EXECUTION_STAGE_HEADER, ((stage + 1) * 100).to_string());
                    if stage > 0 {
                        m = m.with_header(PREVIOUS_STAGE_HEADER, (stage * 100).to_string());
                    }
                }
                match &backlog.keys {
                    Some((header, keys)) => {
                        let key = keys[i as usize];
                        (
                            m.with_header(header.clone(), format!("key-{key}")),
                            Some(key),
                        )
                    }
                    None => (m, None),
                }
            })
            .unzip();
        transport.send_batch(queue, &messages).await?;
        for ((message, key), i) in messages.iter().zip(&keys).zip(first..) {
            match key {
                Some(key) => {
                    let place = places.entry(*key).or_insert(0);
                    ledger.sent_keyed(message, *key, *place);
                    *place += 1;
                }
                None => ledger.sent(message),
            }
            if let Some(stage) = backlog.stage_of(i) {
                let place = stage_places.entry(stage).or_insert(0);
                ledger.sent_staged(message, stage, *place);
                *place += 1;
            }
        }
        stored += messages.len() as u64;
    }
    Ok(())
}

/// Offers the phase's burst, then its rate (open loop, possibly ramped) or its closed-loop
/// producers, to the publish path.
#[allow(clippy::too_many_arguments)]
async fn generate(
    host: Arc<HostInner>,
    queue: QueueName,
    phase: Phase,
    length: Duration,
    body: Vec<u8>,
    ledger: Arc<Ledger>,
    sends: TaskTracker,
    outstanding: Arc<Semaphore>,
    stop: CancellationToken,
) {
    let offered_so_far = std::sync::atomic::AtomicU64::new(0);
    let offer = |ledger: &Arc<Ledger>| {
        let Ok(permit) = outstanding.clone().try_acquire_owned() else {
            ledger.send_failures.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let (host, queue, ledger) = (host.clone(), queue.clone(), ledger.clone());
        let mut message = OutgoingMessage::new(body.clone());
        let n = offered_so_far.fetch_add(1, Ordering::Relaxed) + 1;
        if phase.poison_every > 0 && n.is_multiple_of(phase.poison_every) {
            message = message.with_header(crate::handlers::POISON_HEADER, "always");
        }
        if let Some(ttbr) = phase.ttbr {
            message = message.with_time_to_be_received(ttbr);
        }
        sends.spawn(async move {
            match host.publisher().send(&queue, &message).await {
                Ok(()) => ledger.sent(&message),
                Err(e) => {
                    ledger.send_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "a load-test send failed");
                }
            }
            drop(permit);
        });
    };
    for _ in 0..phase.burst {
        if stop.is_cancelled() {
            return;
        }
        offer(&ledger);
        tokio::task::yield_now().await;
    }
    if phase.producers > 0 {
        let cap = (phase.publish_rate > 0.0).then_some(phase.publish_rate);
        produce_closed_loop(host, queue, &phase, cap, body, ledger, stop).await;
        return;
    }
    let peak = phase
        .publish_rate
        .max(phase.publish_rate_end.unwrap_or(0.0));
    if peak <= 0.0 {
        return;
    }
    let start = Instant::now();
    let mut offered = 0u64;
    // Due sends are the integral of the (possibly ramping) rate, summed per tick.
    let mut due = 0.0f64;
    let mut last = Duration::ZERO;
    let tick = Duration::from_secs_f64((1.0 / peak).clamp(0.001, 0.05));
    loop {
        let now = start.elapsed();
        let rate = (phase.rate_at(last, length) + phase.rate_at(now, length)) / 2.0;
        due += rate * (now - last).as_secs_f64();
        last = now;
        while (offered as f64) < due.floor() {
            offer(&ledger);
            offered += 1;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(tick) => {}
        }
    }
}

/// `phase.producers` senders, each waiting for its send before the next; `cap` bounds their
/// total rate.
async fn produce_closed_loop(
    host: Arc<HostInner>,
    queue: QueueName,
    phase: &Phase,
    cap: Option<f64>,
    body: Vec<u8>,
    ledger: Arc<Ledger>,
    stop: CancellationToken,
) {
    let spacing = cap.map(|rate| Duration::from_secs_f64(phase.producers as f64 / rate));
    let mut producers = tokio::task::JoinSet::new();
    for _ in 0..phase.producers {
        let (host, queue, body, ledger, stop) = (
            host.clone(),
            queue.clone(),
            body.clone(),
            ledger.clone(),
            stop.clone(),
        );
        let ttbr = phase.ttbr;
        producers.spawn(async move {
            while !stop.is_cancelled() {
                let started = Instant::now();
                let mut message = OutgoingMessage::new(body.clone());
                if let Some(ttbr) = ttbr {
                    message = message.with_time_to_be_received(ttbr);
                }
                // A send already waiting when the phase ends still completes (nothing offered
                // is dropped); the next one is not started.
                match host.publisher().send(&queue, &message).await {
                    Ok(()) => ledger.sent(&message),
                    Err(e) => {
                        ledger.send_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "a load-test send failed");
                    }
                }
                if let Some(spacing) = spacing {
                    let rest = spacing.saturating_sub(started.elapsed());
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(rest) => {}
                    }
                }
            }
        });
    }
    while producers.join_next().await.is_some() {}
}

/// Waits until both directions are back at state 0 (true: no delay, no pace, full limits, as
/// the controller reports only then) or the timeout passes (false).
async fn settle(
    recorder: &Recorder,
    interval: Duration,
    timeout: Duration,
    stop: &CancellationToken,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        tokio::time::sleep(interval).await;
        if let Some(last) = recorder.latest() {
            let d = &last.snapshot.decision;
            if d.delivery.state == 0 && d.publishing.state == 0 {
                return true;
            }
        }
        if Instant::now() >= deadline || stop.is_cancelled() {
            return false;
        }
    }
}

async fn drained(host: &HostInner) -> bool {
    if host.in_process() > 0 || host.queues().iter().any(|q| q.gate().in_flight() > 0) {
        return false;
    }
    for q in host.queues() {
        match host.transport().peek_depth(q.name()).await {
            Ok(0) => {}
            _ => return false,
        }
        // Delayed retries still waiting will come back: not drained yet.
        if delayed_waiting(host.transport().as_ref(), q.name()).await > 0 {
            return false;
        }
    }
    true
}

/// Messages in `queue`'s delayed table (0 where it has none).
async fn delayed_waiting(transport: &dyn Transport, queue: &QueueName) -> u64 {
    match transport.delayed_delivery() {
        Some(d) => d.delayed_count(queue).await.unwrap_or(0),
        None => 0,
    }
}

#[allow(clippy::too_many_arguments)]
fn show(
    display: Display,
    host: &HostInner,
    recorder: &Recorder,
    phase: &str,
    (index, phases): (usize, usize),
    ledger: &Ledger,
    admin: Option<std::net::SocketAddr>,
    shown_at: &mut f64,
) {
    let Some(last) = recorder.latest() else {
        return;
    };
    let last = &last;
    match display {
        Display::Quiet => {}
        Display::Progress => {
            let d = &last.snapshot.decision;
            let line = format!(
                "[{}/{} {}] t={:.1}s delivery={} ({}) publishing={} ({}) sent={} done={} depth={}",
                index + 1,
                phases.max(1),
                phase,
                last.t,
                d.delivery.state,
                super::units::format_wait(d.delivery.effective_wait()),
                d.publishing.state,
                super::units::format_wait(d.publishing.effective_wait()),
                ledger.sent.load(Ordering::Relaxed),
                ledger.done.load(Ordering::Relaxed),
                last.queues.iter().map(|q| q.3).sum::<u64>(),
            );
            if std::io::stderr().is_terminal() {
                eprint!("\r{line:<120}");
            } else if last.t - *shown_at >= 5.0 {
                *shown_at = last.t;
                eprintln!("{line}");
            }
        }
        Display::Table => {
            // Once a second is enough for a person.
            if last.t.floor() != shown_at.floor() {
                *shown_at = last.t;
                print!(
                    "{}",
                    super::report::table(host, last, phase, index, phases, admin)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::peer::Seen;
    use crate::message::MESSAGE_ID_HEADER;

    fn queue() -> QueueName {
        QueueName::new("orders").unwrap()
    }

    #[test]
    fn the_ledger_counts_lost_and_duplicated_messages_by_logical_id() {
        let ledger = Ledger::new(true, false);
        let plain = OutgoingMessage::new(b"a".to_vec());
        let named = OutgoingMessage::new(b"b".to_vec()).with_header(MESSAGE_ID_HEADER, "order-17");
        let never_seen = OutgoingMessage::new(b"c".to_vec());
        for m in [&plain, &named, &never_seen] {
            ledger.sent(m);
        }
        // The plain one is handled twice; the named one once, reported by its row id only.
        ledger.completed(&queue(), plain.id, None, Outcome::Success);
        ledger.completed(&queue(), plain.id, None, Outcome::Success);
        ledger.completed(&queue(), named.id, None, Outcome::Error);
        let a = ledger.accounting(0);
        assert_eq!((a.sent, a.lost, a.duplicated), (3, 1, 1));
        assert_eq!((a.processed, a.in_error_queue), (2, 1));
        // A forwarded copy is a new row that reports its logical id itself.
        ledger.completed(&queue(), Uuid::new_v4(), Some("order-17"), Outcome::Success);
        assert_eq!(
            ledger.accounting(0).duplicated,
            1,
            "error then success is not a duplicate"
        );
        assert_eq!(
            ledger.accounting(1).lost,
            0,
            "the unseen one is still queued"
        );
    }

    #[test]
    fn the_ledger_sees_a_key_run_out_of_order_or_beside_itself() {
        let m: Vec<OutgoingMessage> = (0..3)
            .map(|_| OutgoingMessage::new(b"x".to_vec()))
            .collect();
        let keyed_ledger = || {
            let ledger = Ledger::new(true, false);
            for (place, message) in m.iter().enumerate() {
                ledger.sent_keyed(message, 0, place as u32);
            }
            ledger
        };
        // Message i handled from `start` to `end` (nanoseconds).
        let run_on = |ledger: &Ledger, i: usize, start: u64, end: u64| {
            ledger.began(m[i].id, None, start);
            ledger.ended(m[i].id, None, end);
        };
        let ledger = keyed_ledger();
        for (i, start) in [(0, 10), (0, 20), (1, 30), (2, 40)] {
            run_on(&ledger, i, start, start + 5);
        }
        assert_eq!(
            ledger.accounting(0).order_violations,
            0,
            "in order, a redelivery included"
        );

        let ledger = keyed_ledger();
        ledger.began(m[0].id, None, 10);
        ledger.began(m[1].id, None, 20);
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 1, "1 began beside 0");
        assert!(a.first_order_violation.unwrap().contains("while another"));

        let ledger = keyed_ledger();
        run_on(&ledger, 0, 10, 15);
        ledger.began(m[2].id, None, 20);
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 1, "2 began before 1");
        assert!(
            a.first_order_violation
                .unwrap()
                .contains("before message 1 ended")
        );
    }

    /// A stage may start only once every message of the stage before it has ended, in
    /// whichever process; its own members may overlap.
    #[test]
    fn the_ledger_sees_a_stage_start_before_the_stage_before_it_ended() {
        let m: Vec<OutgoingMessage> = (0..4)
            .map(|_| OutgoingMessage::new(b"x".to_vec()))
            .collect();
        let staged_ledger = || {
            let ledger = Ledger::new(true, false);
            // Stage 100: m0, m1; stage 200: m2, m3.
            for (i, message) in m.iter().enumerate() {
                ledger.sent(message);
                ledger.sent_staged(message, (i / 2) as u32, (i % 2) as u32);
            }
            ledger
        };
        let seen = |i: usize, at: u64| Seen {
            at,
            id: m[i].id,
            logical_id: None,
        };
        let ledger = staged_ledger();
        for (source, i, start, end) in [
            (1, 0, 10, 30),
            (0, 1, 12, 25),
            (2, 2, 31, 50),
            (0, 3, 32, 40),
        ] {
            ledger.record(source, PeerEvent::Started(seen(i, start)));
            ledger.record(source, PeerEvent::Handled(seen(i, end)));
        }
        let a = ledger.accounting(0);
        assert_eq!(a.stage_violations, 0, "{:?}", a.first_stage_violation);

        let ledger = staged_ledger();
        for (source, i, start, end) in [
            (1, 0, 10, 30),
            (0, 1, 12, 25),
            (2, 2, 29, 50),
            (0, 3, 32, 40),
        ] {
            ledger.record(source, PeerEvent::Started(seen(i, start)));
            ledger.record(source, PeerEvent::Handled(seen(i, end)));
        }
        let a = ledger.accounting(0);
        assert_eq!(a.stage_violations, 1, "m2 began at 29, m0 ended at 30");
        assert!(
            a.first_stage_violation
                .unwrap()
                .contains("stage 200: message 0 started before stage 100 had ended")
        );
    }

    /// Events of peer processes arrive late and out of order; the ledger judges by their
    /// times, not by when they arrived.
    #[test]
    fn the_ledger_judges_key_order_across_processes_by_the_events_times() {
        let m: Vec<OutgoingMessage> = (0..2)
            .map(|_| OutgoingMessage::new(b"x".to_vec()))
            .collect();
        let ledger = Ledger::new(true, false);
        for (place, message) in m.iter().enumerate() {
            ledger.sent_keyed(message, 0, place as u32);
        }
        let seen = |i: usize, at: u64| Seen {
            at,
            id: m[i].id,
            logical_id: None,
        };
        // Process 0 takes message 1 at 30, after peer 1 ended message 0 at 25; peer 1's
        // lines arrive only afterwards.
        ledger.record(0, PeerEvent::Started(seen(1, 30)));
        ledger.record(1, PeerEvent::Started(seen(0, 10)));
        ledger.record(1, PeerEvent::Handled(seen(0, 25)));
        ledger.record(1, PeerEvent::Completed(seen(0, 26), Outcome::Success));
        ledger.record(0, PeerEvent::Handled(seen(1, 40)));
        ledger.record(0, PeerEvent::Completed(seen(1, 41), Outcome::Success));
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 0, "{:?}", a.first_order_violation);
        assert_eq!(a.done_by_process, vec![1, 1]);
        assert_eq!((a.processed, a.lost, a.duplicated), (2, 0, 0));

        // The same, but message 1 began at 20, while message 0 ran elsewhere until 25.
        let ledger = Ledger::new(true, false);
        for (place, message) in m.iter().enumerate() {
            ledger.sent_keyed(message, 0, place as u32);
        }
        ledger.record(0, PeerEvent::Started(seen(1, 20)));
        ledger.record(1, PeerEvent::Started(seen(0, 10)));
        ledger.record(1, PeerEvent::Handled(seen(0, 25)));
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 1);
        assert!(a.first_order_violation.unwrap().contains("while another"));
    }
}
