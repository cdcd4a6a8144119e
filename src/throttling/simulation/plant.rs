//! A simulated host for the throttling policy (the "plant"), in simulated time.
//!
//! Sends are offered to a publisher, wait out publishing's delay and pace, and are stored at
//! the rate the store allows (an insert holds a database session for its duration); stored
//! messages wait in a backlog; receivers take them as their queue's limit, delivery's delay
//! and pace and the delivery ceiling allow; handlers run for a latency while holding memory,
//! threads or sessions, and finish. Time moves in 10 ms steps. The policy is the host's own
//! [`Policy`]: its delivery ceiling reads the usage at every step, after the step's receives
//! started (as the service's reads every few milliseconds see whatever just started; read
//! before them, each message of a 20 ms handler showed in one read of two, and the sessions'
//! mean read half of what was in use), and its controller ticks every sample interval on
//! readings built as the service builds them (the same [`RateWindow`]s and [`DrainMeter`]).
//! Minutes of behaviour take milliseconds, and a run is the same every time.

use std::collections::VecDeque;
use std::time::Duration;

use crate::config::{MemoryThreshold, ThrottlingConfig};
use crate::names::QueueName;
use crate::throttling::ceiling::{AdmissionCounts, Usage};
use crate::throttling::controller::{MachineFacts, QueueLoad, Readings, Thresholds};
use crate::throttling::policy::Policy;
use crate::throttling::quality::{self, CauseSpan, Episode, Tick};
use crate::throttling::rates::{DrainMeter, RateWindow};
use crate::throttling::{Condition, Direction};

pub(super) const MIB: f64 = 1048576.0;
const STEP: f64 = 0.01;
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
    /// Handler latency, seconds.
    pub latency: f64,
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

/// One direction's admission: the delay every admission waits and the pace between them.
#[derive(Debug, Default)]
struct Admission {
    delay: f64,
    pace: Option<f64>,
    /// Admissions the pace has let accrue (at most one pace interval's worth when idle).
    credit: f64,
}

impl Admission {
    fn set(&mut self, delay: Duration, pace: Option<Duration>) {
        self.delay = delay.as_secs_f64();
        self.pace = pace.map(|p| p.as_secs_f64()).filter(|p| *p > 0.0);
        if self.pace.is_none() {
            self.credit = 0.0;
        }
    }

    /// Admissions the pace allows this step, out of `wanted`.
    fn paced(&mut self, wanted: f64) -> f64 {
        self.accrue();
        self.take(wanted)
    }

    /// The pace's credit for one step.
    fn accrue(&mut self) {
        if let Some(p) = self.pace {
            self.credit = (self.credit + STEP / p).min(1.0 + STEP / p);
        }
    }

    /// Admissions out of `wanted` that the credit accrued so far allows.
    fn take(&mut self, wanted: f64) -> f64 {
        match self.pace {
            None => wanted,
            Some(_) => {
                let n = wanted.min(self.credit.floor());
                self.credit -= n;
                n
            }
        }
    }
}

/// The simulated host's state.
struct World {
    base_memory: f64,
    /// Sends waiting in publishing's admission: when each was offered, and the delay then.
    offered: VecDeque<(f64, f64)>,
    offer_credit: f64,
    /// Sends admitted, waiting for the store.
    admitted: f64,
    /// Connections the inserts of this step hold (an insert's share of a step).
    insert_sessions: f64,
    store_credit: f64,
    backlog: f64,
    /// Each running message: its remaining seconds and what it holds.
    running: Vec<Running>,
    /// Receivers' start credit under a delivery delay.
    receive_credit: f64,
    offered_total: u64,
    stored_total: u64,
    started_total: u64,
    done_total: u64,
}

/// A message in its handler.
struct Running {
    left: f64,
    memory: f64,
    threads: f64,
    sessions: f64,
}

/// Threads the simulated process has with nothing running.
const BASE_THREADS: f64 = 10.0;

impl World {
    fn memory(&self) -> f64 {
        self.base_memory + self.running.iter().map(|r| r.memory).sum::<f64>()
    }

    fn threads(&self) -> u64 {
        (BASE_THREADS + self.running.iter().map(|r| r.threads).sum::<f64>()) as u64
    }

    /// What the delivery ceiling reads, with `noise` on the process's memory.
    fn usage(&self, noise: f64) -> Usage {
        let process_memory = self.memory() + noise;
        Usage {
            process_memory: process_memory as u64,
            system_memory_used: (OTHERS_MEMORY + process_memory) as u64,
            in_process: self.running.len() as u64,
            threads: self.threads(),
            database_sessions: self.sessions(),
        }
    }

    fn sessions(&self) -> u64 {
        (self.insert_sessions + self.running.iter().map(|r| r.sessions).sum::<f64>()).round() as u64
    }
}

/// Runs `phases` on a host with one queue of `max`.
pub(super) fn simulate(cfg: ThrottlingConfig, max: u32, phases: &[Phase]) -> Outcome {
    simulate_noisy(cfg, max, phases, 0.0)
}

/// [`simulate`] with a memory sensor that reads up to `noise` bytes off either way (the
/// allocator's caches, other threads), from a fixed seed.
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

fn run(cfg: ThrottlingConfig, max: u32, backlog: u64, phases: &[Phase], noise: f64) -> Outcome {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut jitter = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        noise * ((seed % 2001) as f64 / 1000.0 - 1.0)
    };
    let machine = MachineFacts {
        total_memory: 1 << 34,
        cpus: 1,
    };
    let sample = cfg.sample_interval.as_secs_f64();
    let thresholds = Thresholds::resolve(&cfg, machine);
    // The host's own policy: the controller at each tick, the delivery ceiling in between.
    let mut policy = Policy::new(cfg.clone(), thresholds);
    policy.arm(u64::from(max));
    // The ceiling's clock: simulated seconds after this instant.
    let origin = tokio::time::Instant::now();
    let mut windows: [RateWindow; 2] = Default::default();
    let mut drain = DrainMeter::default();
    let mut w = World {
        base_memory: 16.0 * MIB,
        offered: VecDeque::new(),
        offer_credit: 0.0,
        admitted: 0.0,
        insert_sessions: 0.0,
        store_credit: 0.0,
        backlog: backlog as f64,
        running: Vec::new(),
        receive_credit: 0.0,
        offered_total: 0,
        stored_total: 0,
        started_total: 0,
        done_total: 0,
    };
    // What the ceiling allowed at its last read: it holds until the next one. Its first read
    // is of the host before anything started.
    let mut allowance = policy
        .between_ticks(origin, w.usage(0.0), AdmissionCounts::default())
        .map_or(f64::MAX, |a| a as f64);
    let mut delivery = Admission::default();
    let mut publishing = Admission::default();
    let mut limit = max;
    let (mut t, mut next_tick) = (0.0, 0.0);
    let mut out = Outcome {
        ticks: Vec::new(),
        completed: Vec::new(),
        delivered: Vec::new(),
        stored: Vec::new(),
        left_unsent: 0,
        causes: Vec::new(),
        pending: Vec::new(),
    };
    for phase in phases {
        let end = t + phase.seconds;
        out.causes
            .extend(phase.causes.iter().map(|&condition| CauseSpan {
                condition,
                start: t,
                end,
            }));
        let (done_before, stored_before) = (w.done_total, w.stored_total);
        while t < end {
            publish(&mut w, phase, &mut publishing, t);
            // Handlers finish.
            let before = w.running.len();
            w.running.retain_mut(|r| {
                r.left -= STEP;
                r.left > 0.0
            });
            w.done_total += (before - w.running.len()) as u64;
            // Receivers: each free slot starts a message once the admission lets it.
            let free = limit.saturating_sub(w.running.len() as u32) as f64;
            w.receive_credit += if delivery.delay > 0.0 {
                limit as f64 * STEP / (delivery.delay + phase.latency)
            } else {
                f64::MAX / 4.0
            };
            let wanted = free
                .min(w.backlog.floor())
                .min(w.receive_credit.floor())
                .max(0.0);
            let starts = delivery.paced(wanted.min(allowance));
            let held = starts < wanted && starts >= allowance;
            w.started_total += starts as u64;
            for _ in 0..starts as u32 {
                w.running.push(Running {
                    left: phase.latency,
                    memory: phase.memory_per_message,
                    threads: phase.threads_per_message,
                    sessions: phase.sessions_per_message,
                });
            }
            w.backlog -= starts;
            w.receive_credit = (w.receive_credit - starts).min(limit as f64);
            // The ceiling reads what is in use now, the receives just started included, and
            // allows what may start until its next read.
            let usage = w.usage(jitter());
            let counts = AdmissionCounts {
                started: w.started_total,
                held,
                ..AdmissionCounts::default()
            };
            let now = origin + Duration::from_secs_f64(t);
            allowance = policy
                .between_ticks(now, usage, counts)
                .map_or(f64::MAX, |a| a as f64);
            t += STEP;
            if t + 1e-9 < next_tick {
                continue;
            }
            next_tick += sample;
            let now = Duration::from_secs_f64(t);
            let process_memory = w.memory() + jitter();
            let mut readings = Readings {
                process_memory: process_memory as u64,
                system_memory_used: (OTHERS_MEMORY + process_memory) as u64,
                in_process: w.running.len() as u64,
                threads: w.threads(),
                database_sessions: w.sessions(),
                database_size: w.backlog as u64,
                // As the service counts it: only while the queue has room below its limit.
                queued: if (w.running.len() as u32) < limit {
                    w.backlog as u64
                } else {
                    0
                },
                in_process_at_limit: if (w.running.len() as u32) >= limit {
                    w.running.len() as u64
                } else {
                    0
                },
                ..Readings::default()
            };
            readings.delivery = windows[0].record(
                now,
                (w.started_total, w.done_total),
                cfg.delivery.sampling_window,
            );
            readings.delivery.waiting = (free - starts).min(w.backlog).max(0.0) as u64;
            readings.publishing = windows[1].record(
                now,
                (w.offered_total, w.stored_total),
                cfg.publishing.sampling_window,
            );
            readings.publishing.waiting = w.offered.len() as u64;
            readings.database_drain_per_sec =
                drain.record(now, w.stored_total, readings.database_size);
            let (d, _) = policy.tick(
                now,
                readings,
                &[QueueLoad {
                    name: QueueName::new("q").expect("a valid name"),
                    max,
                    in_flight: w.running.len() as u32,
                }],
            );
            limit = d.queue_limits["q"];
            delivery.set(d.delivery.delay, d.delivery.pace);
            publishing.set(d.publishing.delay, d.publishing.pace);
            out.ticks.push(quality::tick(t, &d));
            out.delivered
                .push((w.started_total, w.done_total, w.running.len() as u64));
            out.pending.push(w.backlog + w.offered.len() as f64);
        }
        out.completed.push((w.done_total - done_before) as f64);
        out.stored.push((w.stored_total - stored_before) as f64);
    }
    out.left_unsent = w.offered.len();
    out
}

/// One step of the publisher: sends are offered, wait out the delay and the pace, and are
/// stored as fast as the store allows.
fn publish(w: &mut World, phase: &Phase, admission: &mut Admission, t: f64) {
    w.offer_credit += phase.offered_per_sec * STEP;
    match phase.closed_loop {
        None => {
            offer(w, admission, t, usize::MAX);
            let ready = ready(w, admission, t);
            let admitted = admission.paced(ready);
            w.offered.drain(..admitted as usize);
            w.admitted += admitted;
        }
        // Each sender offers its next send as soon as the last is admitted, so within a step
        // a sender goes round as often as its speed and the admission let it.
        Some(senders) => {
            admission.accrue();
            loop {
                offer(w, admission, t, senders);
                let admitted = admission.take(ready(w, admission, t));
                w.offered.drain(..admitted as usize);
                w.admitted += admitted;
                if admitted == 0.0 || w.offer_credit < 1.0 {
                    break;
                }
            }
            // What a waiting sender could not offer is not saved up for later.
            w.offer_credit = w.offer_credit.min(1.0);
        }
    }
    // Capacity not used in a step is not saved up for later.
    let capacity = phase.store_per_sec.min(1e9) * STEP;
    w.store_credit = (w.store_credit + capacity).min(capacity + 1.0);
    let stored = w.admitted.min(w.store_credit.floor());
    w.admitted -= stored;
    w.store_credit -= stored;
    w.stored_total += stored as u64;
    w.backlog += stored;
    w.insert_sessions = stored * phase.insert_seconds / STEP;
}

/// Offers what the senders' speed has accrued, up to `senders` waiting at once.
fn offer(w: &mut World, admission: &Admission, t: f64, senders: usize) {
    while w.offer_credit >= 1.0 && w.offered.len() < senders {
        w.offer_credit -= 1.0;
        w.offered.push_back((t, admission.delay));
        w.offered_total += 1;
    }
}

/// Sends at the head of the line that have waited out their delay: the delay in force when
/// each asked, or less if it has relaxed since (waiters are woken when it does).
fn ready(w: &World, admission: &Admission, t: f64) -> f64 {
    w.offered
        .iter()
        .take_while(|(at, delay)| t - at >= delay.min(admission.delay))
        .count() as f64
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
