//! A simulated host (the "plant") that the host's own throttling service runs against, in
//! paused tokio time.
//!
//! The service is the one a host runs (`service::run`): it senses through the plant, which is
//! its probe (the queue, its depth, messages in process, sessions), its limit sink and its
//! resource sensor; it decides with the host's policy; and it sets the real admissions
//! ([`Throttle`]) and the queue's real concurrency gate, reading the delivery ceiling every few
//! milliseconds between ticks as it does in a host. Nothing here senses, decides or admits on
//! its own, so what the bed measures is what a host does.
//!
//! The world: sends are offered to the publisher, wait out publishing's admission and are
//! stored at the rate the store allows (an insert holds a database session for its duration);
//! receivers wait out delivery's admission, take a gate permit and start their receive as the
//! ceiling's allowance lets them, as a host's receive turn does; handlers run for a latency
//! while holding memory, threads or sessions. Time is tokio's, paused on one thread: it jumps
//! to the next timer whenever every task waits, so minutes of behaviour take a fraction of a
//! second.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{LatencyDistribution, MemoryThreshold, ThrottlingConfig};
use crate::metrics::Metrics;
use crate::names::QueueName;
use crate::queue::gate::ConcurrencyGate;
use crate::throttling::controller::{MachineFacts, QueueLoad};
use crate::throttling::quality::{self, CauseSpan, Episode, Tick};
use crate::throttling::sensors::{ResourceReadings, ResourceSensor};
use crate::throttling::service::{
    self, HostProbe, LimitSink, QueueReading, ServiceParts, ThrottleControl,
};
use crate::throttling::{Clock, Condition, Direction, Throttle, TokioClock};

pub(super) const MIB: f64 = 1048576.0;
/// What the rest of the machine uses: the simulated system memory is this plus the host's.
pub(super) const OTHERS_MEMORY: f64 = 64.0 * MIB;

/// What the simulated world does in one phase.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phase {
    pub seconds: f64,
    /// Sends offered per second to publishing (counted when offered, as the host counts them).
    pub offered_per_sec: f64,
    /// Inserts the store completes per second at most.
    pub store_per_sec: f64,
    /// Handler latency, seconds: the mean of `latencies`.
    pub latency: f64,
    /// How handler latencies spread around their mean, as the simulate handler's do.
    pub latencies: LatencyDistribution,
    /// Memory a message holds while in its handler, bytes.
    pub memory_per_message: f64,
    /// Threads a message holds while in its handler (1: a blocking handler).
    pub threads_per_message: f64,
    /// Database sessions a message holds while in its handler (1: its receive's connection).
    pub sessions_per_message: f64,
    /// How long an insert holds its connection, seconds: the publisher's own sessions.
    pub insert_seconds: f64,
    /// The conditions this phase causes: their episodes' recovery is measured from its end.
    pub causes: &'static [Condition],
    /// Senders that each wait for their send's admission before offering the next (a retry
    /// of failed messages, a handler sending in a loop): at most this many sends wait at once,
    /// offered at up to `offered_per_sec`. None: the sends come whether or not earlier ones
    /// have been admitted (an open loop).
    pub closed_loop: Option<usize>,
}

impl Phase {
    /// `seconds` of `offered_per_sec` sends, a fast store and 50 ms handlers holding nothing.
    pub(super) fn new(seconds: f64, offered_per_sec: f64) -> Self {
        Phase {
            seconds,
            offered_per_sec,
            store_per_sec: f64::INFINITY,
            latency: 0.05,
            latencies: LatencyDistribution::Fixed,
            memory_per_message: 0.0,
            threads_per_message: 0.0,
            sessions_per_message: 0.0,
            insert_seconds: 0.0,
            causes: &[],
            closed_loop: None,
        }
    }

    /// The sends come from `senders` that each wait for their last send's admission.
    pub(super) fn closed_loop(self, senders: usize) -> Self {
        Phase {
            closed_loop: Some(senders),
            ..self
        }
    }

    /// Marks the phase as causing `causes`.
    pub(super) fn causes(self, causes: &'static [Condition]) -> Self {
        Phase { causes, ..self }
    }

    pub(super) fn threads(self, threads_per_message: f64) -> Self {
        Phase {
            threads_per_message,
            ..self
        }
    }

    pub(super) fn sessions(self, sessions_per_message: f64) -> Self {
        Phase {
            sessions_per_message,
            ..self
        }
    }

    /// Each insert holds a connection for `insert_seconds`.
    pub(super) fn inserts(self, insert_seconds: f64) -> Self {
        Phase {
            insert_seconds,
            ..self
        }
    }

    pub(super) fn latency(self, latency: f64) -> Self {
        Phase { latency, ..self }
    }

    /// Handler latencies spread as `latencies` around their mean.
    pub(super) fn spread(self, latencies: LatencyDistribution) -> Self {
        Phase { latencies, ..self }
    }

    pub(super) fn memory(self, memory_per_message: f64) -> Self {
        Phase {
            memory_per_message,
            ..self
        }
    }

    pub(super) fn store(self, store_per_sec: f64) -> Self {
        Phase {
            store_per_sec,
            ..self
        }
    }
}

/// Settings for the simulated host: 64 MiB process memory threshold, no in-process or
/// database size threshold, the sample interval given.
pub(super) fn config(sample: f64) -> ThrottlingConfig {
    ThrottlingConfig {
        sample_interval: Duration::from_secs_f64(sample),
        process_memory: MemoryThreshold::Bytes((64.0 * MIB) as u64),
        in_process_per_cpu: 1000,
        database_size: 0,
        ..ThrottlingConfig::default()
    }
}

/// A run's record.
pub(super) struct Outcome {
    pub ticks: Vec<Tick>,
    /// Handler completions per phase.
    pub completed: Vec<f64>,
    /// At each tick: messages started and messages done so far, and messages in handlers.
    pub delivered: Vec<(u64, u64, u64)>,
    /// Inserts stored per phase.
    pub stored: Vec<f64>,
    /// Sends still waiting in publishing's admission at the end.
    pub left_unsent: usize,
    /// When the phases offered their causes.
    pub causes: Vec<CauseSpan>,
    /// At each tick: messages stored and waiting to be received, plus sends waiting in
    /// publishing's admission (what database size must work off after a flood).
    pub pending: Vec<f64>,
}

impl Outcome {
    /// Every episode, scored as `throttlehost load` scores a run.
    pub(super) fn episodes(&self, resume_ratio: f64) -> Vec<Episode> {
        quality::episodes(&self.ticks, resume_ratio, &self.causes)
    }

    /// The ticks at which either direction was not at state 0: (seconds, states).
    pub(crate) fn throttled_ticks(&self) -> Vec<(f64, [u8; 2])> {
        self.ticks
            .iter()
            .filter(|t| t.states != [0, 0])
            .map(|t| (t.t, t.states))
            .collect()
    }

    /// Episodes judged in `direction`.
    pub(super) fn episodes_in(&self, direction: Direction, resume_ratio: f64) -> Vec<Episode> {
        self.episodes(resume_ratio)
            .into_iter()
            .filter(|e| e.direction == direction)
            .collect()
    }

    /// Messages started over messages done between the ticks at `from` and `to` seconds:
    /// delivery's incoming over outgoing.
    pub(super) fn delivery_ratio(&self, from: f64, to: f64) -> f64 {
        let at = |s: f64| {
            let i = self
                .ticks
                .iter()
                .position(|t| t.t >= s)
                .unwrap_or(self.ticks.len() - 1);
            self.delivered[i]
        };
        let (a, b) = (at(from), at(to));
        (b.0 - a.0) as f64 / (b.1 - a.1).max(1) as f64
    }
}

/// The machine the simulated host runs on.
const MACHINE: MachineFacts = MachineFacts {
    total_memory: 1 << 34,
    cpus: 1,
};

/// Threads the simulated process has with nothing running.
const BASE_THREADS: f64 = 10.0;

/// Memory the simulated process holds with nothing running.
const BASE_MEMORY: f64 = 16.0 * MIB;

/// How far a sender or the store may catch up on slots that fell due while the timer slept:
/// tokio's timer wakes to the millisecond, and rates finer than that are served in small
/// batches, as the admission serves a fine pace.
const CATCH_UP: Duration = Duration::from_millis(1);

/// What the simulated world holds, counts and notes.
struct World {
    phase: Phase,
    /// Which of the run's phases is on (closed-loop senders stop when it changes).
    phase_index: usize,
    /// Messages stored that no receive has taken.
    backlog: u64,
    /// Messages in their handlers, and what they hold between them.
    in_handlers: u64,
    memory: f64,
    threads: f64,
    sessions: f64,
    /// Inserts holding a connection now.
    inserting: u64,
    /// Sends offered and not yet admitted by publishing.
    unsent: u64,
    /// When the store takes its next insert, and the closed-loop senders their next offer.
    next_store: Instant,
    next_offer: Instant,
    stored_total: u64,
    started_total: u64,
    done_total: u64,
    /// The world at each tick of the service.
    at_ticks: Vec<AtTick>,
    /// Draws handler latencies, from a fixed seed.
    draws: XorShift,
}

/// The world as a tick of the service saw it.
struct AtTick {
    t: f64,
    /// Messages started, done, in handlers.
    delivered: (u64, u64, u64),
    /// Messages stored and not received, plus sends waiting in publishing's admission.
    pending: f64,
}

/// What a message holds in its handler, from the phase it started in.
#[derive(Clone, Copy)]
struct Holding {
    latency: f64,
    memory: f64,
    threads: f64,
    sessions: f64,
}

/// The simulated host as the throttling service sees it: its probe (queue, depth, messages
/// in process, sessions), its limit sink (the queue's gate) and, through [`Sensor`], its
/// process.
struct Plant {
    world: Mutex<World>,
    queue: QueueName,
    max: u32,
    gate: Arc<ConcurrencyGate>,
    /// One permit per stored message that no receiver has claimed yet: a receiver goes for a
    /// message it knows is there, as the monitor model receives what its peek saw.
    stored: Semaphore,
    /// The index of the phase on: publishers with nothing to offer wait for it to change.
    phase_on: tokio::sync::watch::Sender<usize>,
    clock: TokioClock,
}

impl Plant {
    fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn phase(&self) -> (usize, Phase) {
        let w = self.world();
        (w.phase_index, w.phase)
    }

    fn process_memory(&self) -> f64 {
        BASE_MEMORY + self.world().memory
    }

    /// A receive took a stored message: it starts in its handler, holding what the phase says.
    fn start_message(&self) -> Holding {
        let mut w = self.world();
        let spread = w.draws.unit();
        let holding = Holding {
            latency: match w.phase.latencies {
                LatencyDistribution::Fixed => w.phase.latency,
                LatencyDistribution::Uniform => w.phase.latency * 2.0 * spread,
                LatencyDistribution::Exponential => -w.phase.latency * (1.0 - spread).ln(),
            },
            memory: w.phase.memory_per_message,
            threads: w.phase.threads_per_message,
            sessions: w.phase.sessions_per_message,
        };
        w.backlog -= 1;
        w.started_total += 1;
        w.in_handlers += 1;
        w.memory += holding.memory;
        w.threads += holding.threads;
        w.sessions += holding.sessions;
        holding
    }

    fn finish_message(&self, holding: Holding) {
        let mut w = self.world();
        w.done_total += 1;
        w.in_handlers -= 1;
        w.memory -= holding.memory;
        w.threads -= holding.threads;
        w.sessions -= holding.sessions;
    }

    /// When the store takes this insert: at the phase's rate, in the order asked.
    fn store_slot(&self) -> Instant {
        let mut w = self.world();
        let now = Instant::now();
        let rate = w.phase.store_per_sec;
        if !rate.is_finite() {
            return now;
        }
        // Capacity not used is not saved up for later.
        let slot = w.next_store.max(now - CATCH_UP);
        w.next_store = slot + Duration::from_secs_f64(1.0 / rate);
        slot
    }

    /// When a closed-loop sender may offer its next send: the senders share the phase's
    /// rate, and what a waiting sender could not offer is not saved up for later.
    fn offer_slot(&self, rate: f64) -> Instant {
        let mut w = self.world();
        let slot = w.next_offer.max(Instant::now() - CATCH_UP);
        w.next_offer = slot + Duration::from_secs_f64(1.0 / rate);
        slot
    }

    fn stored_one(&self) {
        let mut w = self.world();
        w.backlog += 1;
        w.stored_total += 1;
        drop(w);
        self.stored.add_permits(1);
    }

    fn totals(&self) -> (u64, u64) {
        let w = self.world();
        (w.done_total, w.stored_total)
    }
}

impl HostProbe for Plant {
    fn in_process(&self) -> u64 {
        self.world().in_handlers
    }

    fn database_sessions(&self) -> u64 {
        let w = self.world();
        (w.inserting as f64 + w.sessions).round() as u64
    }

    /// The service reads the queues once per tick, before it decides: the plant notes there
    /// what the world was at the tick.
    fn queues(&self) -> Vec<QueueReading> {
        let t = self.clock.now().as_secs_f64();
        let mut w = self.world();
        let at_tick = AtTick {
            t,
            delivered: (w.started_total, w.done_total, w.in_handlers),
            pending: (w.backlog + w.unsent) as f64,
        };
        w.at_ticks.push(at_tick);
        vec![QueueReading {
            load: QueueLoad {
                name: self.queue.clone(),
                max: self.max,
                in_flight: self.gate.in_flight(),
            },
            depth: w.backlog,
            limit: self.gate.effective(),
            downstream_limit: None,
            fleet_share: None,
        }]
    }

    fn database_size(&self, _max_age: Duration) -> u64 {
        self.world().backlog
    }
}

impl LimitSink for Plant {
    fn set_limit(&self, _queue: &QueueName, limit: u32) {
        self.gate.set_limit(limit);
    }
}

/// Draws in [0, 1) from a fixed seed, so a run's noise and latencies are the same each time.
struct XorShift(u64);

impl XorShift {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % 1_000_000) as f64 / 1_000_000.0
    }
}

/// The simulated process's memory and threads, with `noise` bytes either way on its memory
/// (the allocator's caches, other threads).
struct Sensor {
    plant: Arc<Plant>,
    noise: f64,
    draws: XorShift,
}

impl Sensor {
    fn jitter(&mut self) -> f64 {
        self.noise * (2.0 * self.draws.unit() - 1.0)
    }
}

impl ResourceSensor for Sensor {
    fn read(&mut self) -> ResourceReadings {
        let memory = self.plant.process_memory() + self.jitter();
        ResourceReadings {
            process_memory: memory as u64,
            system_memory_used: (OTHERS_MEMORY + memory) as u64,
            threads: (BASE_THREADS + self.plant.world().threads) as u64,
        }
    }

    fn machine(&self) -> MachineFacts {
        MACHINE
    }
}

/// Runs `phases` on a host with one queue of `max`.
pub(super) fn simulate(cfg: ThrottlingConfig, max: u32, phases: &[Phase]) -> Outcome {
    simulate_noisy(cfg, max, phases, 0.0)
}

/// [`simulate`] with a memory sensor that reads up to `noise` bytes off either way.
pub(super) fn simulate_noisy(
    cfg: ThrottlingConfig,
    max: u32,
    phases: &[Phase],
    noise: f64,
) -> Outcome {
    run(cfg, max, 0, phases, noise)
}

/// [`simulate`] starting with `backlog` messages already stored.
pub(super) fn simulate_with_backlog(
    cfg: ThrottlingConfig,
    max: u32,
    backlog: u64,
    phases: &[Phase],
) -> Outcome {
    run(cfg, max, backlog, phases, 0.0)
}

/// Runs the world and the host's throttling service in paused time, on one thread.
fn run(cfg: ThrottlingConfig, max: u32, backlog: u64, phases: &[Phase], noise: f64) -> Outcome {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime")
        .block_on(run_paused(cfg, max, backlog, phases, noise))
}

async fn run_paused(
    cfg: ThrottlingConfig,
    max: u32,
    backlog: u64,
    phases: &[Phase],
    noise: f64,
) -> Outcome {
    let first = *phases.first().expect("at least one phase");
    let now = Instant::now();
    let plant = Arc::new(Plant {
        world: Mutex::new(World {
            phase: first,
            phase_index: 0,
            backlog,
            in_handlers: 0,
            memory: 0.0,
            threads: 0.0,
            sessions: 0.0,
            inserting: 0,
            unsent: 0,
            next_store: now,
            next_offer: now,
            stored_total: 0,
            started_total: 0,
            done_total: 0,
            at_ticks: Vec::new(),
            draws: XorShift(0x9e37_79b9_7f4a_7c15),
        }),
        queue: QueueName::new("q").expect("a valid name"),
        max,
        gate: Arc::new(ConcurrencyGate::new(max)),
        stored: Semaphore::new(backlog as usize),
        phase_on: tokio::sync::watch::Sender::new(0),
        clock: TokioClock::new(),
    });
    let throttle = Arc::new(Throttle::default());
    let control = Arc::new(ThrottleControl::new(cfg, MACHINE));
    let mut decisions = control.subscribe();
    let stop = CancellationToken::new();
    let service = tokio::spawn(service::run(
        ServiceParts {
            control,
            sensor: Box::new(Sensor {
                plant: plant.clone(),
                noise,
                draws: XorShift(0x2545_f491_4f6c_dd1d),
            }),
            clock: Arc::new(plant.clock),
            throttle: throttle.clone(),
            probe: plant.clone(),
            limits: plant.clone(),
            metrics: Metrics::new(),
        },
        stop.clone(),
    ));
    for _ in 0..max {
        tokio::spawn(receive_forever(plant.clone(), throttle.clone()));
    }
    tokio::spawn(offer_open_loop(plant.clone(), throttle.clone()));
    let mut out = Outcome {
        ticks: Vec::new(),
        completed: Vec::new(),
        delivered: Vec::new(),
        stored: Vec::new(),
        left_unsent: 0,
        causes: Vec::new(),
        pending: Vec::new(),
    };
    for (index, phase) in phases.iter().enumerate() {
        let start = plant.clock.now().as_secs_f64();
        out.causes
            .extend(phase.causes.iter().map(|&condition| CauseSpan {
                condition,
                start,
                end: start + phase.seconds,
            }));
        {
            let mut w = plant.world();
            w.phase = *phase;
            w.phase_index = index;
        }
        plant.phase_on.send_replace(index);
        for _ in 0..phase.closed_loop.unwrap_or(0) {
            tokio::spawn(send_in_turn(plant.clone(), throttle.clone(), index));
        }
        let (done_before, stored_before) = plant.totals();
        tokio::time::sleep(Duration::from_secs_f64(phase.seconds)).await;
        let (done, stored) = plant.totals();
        out.completed.push((done - done_before) as f64);
        out.stored.push((stored - stored_before) as f64);
    }
    stop.cancel();
    service.await.expect("the service ran to its stop");
    let w = plant.world();
    out.left_unsent = w.unsent as usize;
    for at_tick in &w.at_ticks {
        let snapshot = decisions.try_recv().expect("a decision for every tick");
        out.ticks.push(quality::tick(at_tick.t, &snapshot.decision));
        out.delivered.push(at_tick.delivered);
        out.pending.push(at_tick.pending);
    }
    out
}

/// A receiver, as a host's receive turn goes: once a message is there for it, it waits out
/// delivery's admission, takes a permit of the queue's gate and starts its receive if the
/// ceiling's allowance still has room (else gives the permit back and waits again); the
/// message then runs in its handler, holding the permit.
async fn receive_forever(plant: Arc<Plant>, throttle: Arc<Throttle>) {
    loop {
        match plant.stored.acquire().await {
            Ok(claim) => claim.forget(),
            Err(_) => return,
        }
        let (permit, receiving) = loop {
            throttle.delivery.admit().await;
            let permit = plant.gate.acquire().await;
            if let Some(receiving) = throttle.delivery.start() {
                break (permit, receiving);
            }
        };
        let holding = plant.start_message();
        throttle.delivery.message_started();
        throttle.delivery_rates.incoming();
        drop(receiving);
        tokio::time::sleep(Duration::from_secs_f64(holding.latency)).await;
        plant.finish_message(holding);
        throttle.delivery_rates.outgoing();
        drop(permit);
    }
}

/// The open-loop publisher: sends come at the phase's rate whether or not earlier ones have
/// been admitted, each waiting on its own.
async fn offer_open_loop(plant: Arc<Plant>, throttle: Arc<Throttle>) {
    let mut next = Instant::now();
    let mut phase_on = plant.phase_on.subscribe();
    loop {
        let (_, phase) = plant.phase();
        if phase.closed_loop.is_some() || phase.offered_per_sec <= 0.0 {
            if phase_on.changed().await.is_err() {
                return;
            }
            next = Instant::now();
            continue;
        }
        // Sends due while the timer slept (rates finer than its millisecond) go at once.
        if next > Instant::now() {
            tokio::time::sleep_until(next).await;
            continue;
        }
        tokio::spawn(send(plant.clone(), throttle.clone()));
        next += Duration::from_secs_f64(1.0 / phase.offered_per_sec);
    }
}

/// One closed-loop sender of phase `index`: it offers its next send only once publishing has
/// admitted the last (a retry of failed messages, a handler sending in a loop).
async fn send_in_turn(plant: Arc<Plant>, throttle: Arc<Throttle>, index: usize) {
    loop {
        let (now_on, phase) = plant.phase();
        if now_on != index {
            return;
        }
        if phase.offered_per_sec <= 0.0 {
            // Nothing to offer in this phase: the sender ends with it.
            return;
        }
        let slot = plant.offer_slot(phase.offered_per_sec);
        if slot > Instant::now() {
            tokio::time::sleep_until(slot).await;
        }
        admit_send(&plant, &throttle).await;
        tokio::spawn(store(plant.clone(), throttle.clone()));
    }
}

/// One send: offered, admitted, stored.
async fn send(plant: Arc<Plant>, throttle: Arc<Throttle>) {
    admit_send(&plant, &throttle).await;
    store(plant, throttle).await;
}

/// Counts a send as offered (as the host counts a request), then waits until publishing
/// admits it.
async fn admit_send(plant: &Plant, throttle: &Throttle) {
    plant.world().unsent += 1;
    throttle.publishing_rates.incoming();
    throttle.publishing.admit().await;
    plant.world().unsent -= 1;
}

/// Stores an admitted send when the store can take it; the insert holds a connection for the
/// phase's insert time.
async fn store(plant: Arc<Plant>, throttle: Arc<Throttle>) {
    let slot = plant.store_slot();
    if slot > Instant::now() {
        tokio::time::sleep_until(slot).await;
    }
    let insert = plant.phase().1.insert_seconds;
    if insert > 0.0 {
        plant.world().inserting += 1;
        tokio::time::sleep(Duration::from_secs_f64(insert)).await;
        plant.world().inserting -= 1;
    }
    plant.stored_one();
    throttle.publishing_rates.outgoing();
}

/// Every episode meets the control bounds: engaged within 2 samples, peak at most `peak` x
/// its threshold (not for rate imbalance, whose value is the offered load), at most 2 state
/// changes, state 0 within 10 s of the cause ending.
pub(super) fn assert_controlled(episodes: &[Episode], peak: f64) {
    assert!(!episodes.is_empty(), "no episode");
    // What each run measured, for `-- --nocapture` (a test's output shows only then).
    for e in episodes {
        println!(
            "{:?} {:?}: crossed at {:.1} s, engaged after {:?} samples, peak {:.3}, {} flips, state 0 after {:?} s",
            e.condition,
            e.direction,
            e.crossed_at,
            e.engage_samples,
            e.peak_ratio,
            e.flips,
            e.recovery_seconds
        );
    }
    for e in episodes {
        assert!(e.engage_samples.is_some_and(|n| n <= 2), "{e:?}");
        if quality::bounds_peak(e.condition) {
            assert!(e.peak_ratio <= peak, "{e:?}");
        }
        assert!(e.flips <= 2, "{e:?}");
        assert!(e.recovery_seconds.is_some_and(|s| s <= 10.0), "{e:?}");
    }
}
