//! The delivery ceiling: a hard bound on receives at the thresholds of the resources that grow
//! with the messages in process, checked every few milliseconds between ticks.
//!
//! The controller acts once per tick. When each message starts to cost more (a bigger
//! payload, a handler that holds more memory, a handler that blocks a thread, a slow handler
//! that keeps its connection), the receives started within one tick can carry the resource
//! far past its threshold before the next tick cuts. The ceiling reads each guarded resource
//! ([`CEILING_GUARDED`]: process and system memory, threads, database sessions, the
//! in-process count) every
//! [`CEILING_INTERVAL`] and lets through only what fits under every threshold: the room left
//! divided by what a message in process costs, less what it let through in the last
//! [`CEILING_SETTLE`] and that does not show yet. It counts what it let through where it
//! shows: messages handed to handlers and receives out now (`Admission::started`); a
//! receive that comes back empty does not count, and neither does a receiver that waits.
//!
//! What a message costs is the larger of two measures: the **average** (the value above the
//! idle process, over the messages in process) and the **margin** (what the value rose by over
//! the last [`CEILING_MARGINAL_WINDOW`], over the receives let through a settle time earlier).
//! The average alone lags when messages start to cost more: with 60 cheap messages in process,
//! the first costly ones look cheap, and a burst of them got through. A plain stop at the
//! threshold is not enough either: what one completion frees would let every waiting receive
//! through at once, and what they take shows only milliseconds later. The ceiling never stops
//! the last message (nothing else would free anything).
//!
//! Whenever receives wait on it, the controller hears of it at the next tick
//! ([`CeilingHolds`]), with how many messages the resource has room for: it shows the
//! condition as active (throttling that acts is never state 0) and cuts the delivery limits
//! to that room.
//!
//! The in-process count needs no estimate: a message costs one, and the room is the threshold
//! less the messages in process and the receives out now, which the ceiling lets through
//! first come, first served whichever queue they are for.
//!
//! The ceiling is pure: the service reads the values and the admission's counters, hands them
//! to [`Ceiling::enforce`] and applies the allowance it returns.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::Condition;
use super::controller::{CEILING_GUARDED, CeilingHolds, Thresholds};

/// How often the ceiling reads the guarded resources between ticks.
pub(crate) const CEILING_INTERVAL: Duration = Duration::from_millis(5);
/// How long a receive let through counts as not showing yet: what it costs shows
/// only once it has been received and its handler has allocated, blocked or kept its
/// connection. Longer is not simply safer: 75 ms held `mixed`'s memory peaks at 0.92-1.14 x
/// (1.07-1.36 x at 25 ms), but a receive counted here stays counted after its message is done,
/// and on `database-sessions` (20 ms handlers, a limit of 10) the receives of the last 75 ms
/// filled the room: the ceiling held delivery at 4 msg/s with no session in use. (Database
/// sessions no longer count it at all: a receive's connection shows at once.)
pub(crate) const CEILING_SETTLE: Duration = Duration::from_millis(25);
/// Over how long the ceiling measures what the latest messages added...
pub(crate) const CEILING_MARGINAL_WINDOW: Duration = Duration::from_millis(50);
/// ...or longer, up to [`CEILING_MARGINAL_WINDOW_MAX`], until the window holds this many
/// receives. At a few receives per window one message's cost showing a read late counts it
/// for the next receive as well: at 28 receives a second into 4 MiB handlers the margin
/// read 8 MiB, the estimate sat at its cap of a tenth of the threshold, and the ceiling held
/// the process at 0.69-0.77 x its memory threshold with the limit cut from 32 to 7.
pub(crate) const CEILING_MARGINAL_RECEIVES: u64 = 4;
/// The longest window the margin is measured over.
pub(crate) const CEILING_MARGINAL_WINDOW_MAX: Duration = Duration::from_millis(250);
/// How long a measured margin stays in the estimate. While messages finish, what they free
/// hides what the latest ones add: the value falls or holds still although each new message
/// costs as much as before, and the average over the messages in process (cheap ones among
/// them) made room for a burst that carried `mixed` to 1.16-1.21 x. So the estimate is the
/// largest margin measured this long back, and a cost that really fell is forgotten after it.
pub(crate) const CEILING_MARGIN_MEMORY: Duration = Duration::from_secs(1);
/// The longest pause between reads while the host is quiet (nothing in process, nothing
/// admitted since the last read): reading every 5 ms cost an idle host 1.4 % of a core.
pub(crate) const CEILING_QUIET_INTERVAL: Duration = Duration::from_millis(40);

/// The guarded resources' values at one read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Process RSS, bytes.
    pub process_memory: u64,
    /// The machine's used memory, bytes.
    pub system_memory_used: u64,
    /// Threads in the process.
    pub threads: u64,
    /// Database connections in use.
    pub database_sessions: u64,
    /// Messages in process.
    pub in_process: u64,
}

impl Usage {
    fn of(&self, condition: Condition) -> u64 {
        match condition {
            Condition::ProcessMemory => self.process_memory,
            Condition::SystemMemory => self.system_memory_used,
            Condition::Threads => self.threads,
            Condition::DatabaseSessions => self.database_sessions,
            Condition::InProcess => self.in_process,
            _ => 0,
        }
    }
}

/// What the ceiling sees of delivery's admission at one read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AdmissionCounts {
    /// Receives let through so far: messages handed to handlers, plus receives out now
    /// ([`super::admission::Admission::started`]).
    pub started: u64,
    /// Receives out now: each may bring a message, so each takes room of the in-process
    /// count.
    pub receiving: u64,
    /// Receives were waiting on an allowance that had run out.
    pub held: bool,
}

/// One guarded resource while the ceiling runs.
#[derive(Debug)]
struct Guard {
    condition: Condition,
    threshold: u64,
    /// The value at the last read with nothing in process.
    idle: Option<u64>,
    /// The lowest value read with nothing in process: for threads, the process's own (the
    /// blocking pool keeps a thread some seconds after its message, and the next message
    /// reuses it).
    lowest_idle: Option<u64>,
    /// Recent reads: when, the value, and the receives let through so far then.
    reads: VecDeque<(Instant, u64, u64)>,
    /// What one message cost at the last read with messages in process.
    last_per_message: Option<f64>,
    /// The margins measured within [`CEILING_MARGIN_MEMORY`]: when, and the margin.
    margins: VecDeque<(Instant, f64)>,
}

impl Guard {
    fn new(condition: Condition, threshold: u64) -> Self {
        Guard {
            condition,
            threshold,
            idle: None,
            lowest_idle: None,
            reads: VecDeque::new(),
            last_per_message: None,
            margins: VecDeque::new(),
        }
    }

    /// The largest margin measured within [`CEILING_MARGIN_MEMORY`], `fresh` (this read's)
    /// included.
    fn remembered_margin(&mut self, now: Instant, fresh: Option<f64>) -> Option<f64> {
        while self
            .margins
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > CEILING_MARGIN_MEMORY)
        {
            self.margins.pop_front();
        }
        if let Some(margin) = fresh {
            // Only what could become the largest needs keeping.
            while self.margins.back().is_some_and(|(_, m)| *m <= margin) {
                self.margins.pop_back();
            }
            self.margins.push_back((now, margin));
        }
        self.margins.front().map(|(_, m)| *m)
    }

    /// Records this read and returns what fits under the threshold now.
    /// `pending_bound`: how many of the receives let through can hold anything now (the
    /// messages in process plus the receives the queue limits let out).
    fn read(
        &mut self,
        now: Instant,
        value: u64,
        in_process: u64,
        admission: AdmissionCounts,
        pending_bound: u64,
    ) -> Fit {
        let started = admission.started;
        if in_process == 0 {
            // What the process holds by itself now, including what it kept from earlier
            // messages (allocator caches, lingering blocking threads, pooled connections):
            // none of it is freed by messages ending.
            self.idle = Some(value);
            self.lowest_idle = Some(self.lowest_idle.map_or(value, |l| l.min(value)));
        }
        let fresh = self.margin(now, value, started);
        let remembered = self.remembered_margin(now, fresh);
        // Near the threshold, a cost forgotten while messages finish lets a burst through
        // (the documentation of CEILING_MARGIN_MEMORY). Far below it, a remembered margin
        // only holds receives back for nothing: the runtime growing at start-up, read as a
        // costly first message, held `mixed` at 0.15 x for a second.
        let margin = if value.saturating_mul(2) >= self.threshold {
            remembered
        } else {
            fresh
        };
        let recent = self.recent_receives(now, admission, pending_bound);
        let estimate = Estimate {
            idle: self.idle,
            margin,
            last: self.last_per_message,
        };
        let mut fit = fit(self.threshold, value, in_process, estimate, recent);
        if in_process > 0 {
            self.last_per_message = Some(fit.per_message);
        }
        if self.condition == Condition::Threads
            && let Some(base) = self.lowest_idle
            && value > base
        {
            // Some handler blocks. Threads stay in the blocking pool after their message and
            // the next message reuses them, so the count above says little about what the
            // messages in process hold now. At one thread per message, the threshold has
            // room for `threshold - base` messages in process, however many idle pool
            // threads linger; whichever bound admits more still keeps threads under it.
            let room = self.threshold.saturating_sub(base).max(1);
            let reuse = room.saturating_sub(in_process + recent);
            if reuse > fit.allowance {
                fit.allowance = reuse;
                fit.room = fit.room.max(room);
                fit.measured = true;
            }
        }
        fit
    }

    /// Receives let through within a settle time, whose cost may not show yet.
    fn recent_receives(&self, now: Instant, admission: AdmissionCounts, pending_bound: u64) -> u64 {
        let started = admission.started;
        if self.condition == Condition::DatabaseSessions {
            // A receive takes its connection as it starts and keeps it while its message is
            // in process: its cost is in the pool's count at once, and only a receive out now
            // may not have its connection yet. Counting the receives of the last settle time
            // as well counted each twice: on `database-sessions` (20 ms handlers) those were
            // in process and in the count, and the ceiling held delivery at about 200 msg/s
            // with the sessions at half their threshold, showing state 8 meanwhile.
            admission.receiving.min(pending_bound)
        } else {
            self.reads
                .iter()
                .rev()
                .find(|(at, _, _)| now.duration_since(*at) >= CEILING_SETTLE)
                .or(self.reads.front())
                .map_or(0, |(_, _, then)| started.saturating_sub(*then))
                // At thousands of messages a second most of them are done already, and a message
                // done holds nothing: only those still in flight can cost what does not show.
                .min(pending_bound)
        }
    }

    /// Records this read and returns what the value rose by per receive over the last window,
    /// from the receives started a settle time before it (whose cost shows in it).
    fn margin(&mut self, now: Instant, value: u64, started: u64) -> Option<f64> {
        let keep = CEILING_MARGINAL_WINDOW_MAX + CEILING_SETTLE + CEILING_INTERVAL;
        while self
            .reads
            .front()
            .is_some_and(|(at, _, _)| now.duration_since(*at) > keep)
        {
            self.reads.pop_front();
        }
        self.reads.push_back((now, value, started));
        // The latest read at least `ago` old.
        let at = |ago: Duration| {
            self.reads
                .iter()
                .rev()
                .find(|(at, _, _)| now.duration_since(*at) >= ago)
                .copied()
        };
        let (_, _, started_until) = at(CEILING_SETTLE)?;
        // (value before, receives) over `window`, when the reads reach that far back.
        let over = |window: Duration| {
            let (_, before, _) = at(window)?;
            let (_, _, started_from) = at(window + CEILING_SETTLE)?;
            Some((before, started_until.saturating_sub(started_from)))
        };
        // The shortest window from CEILING_MARGINAL_WINDOW up that holds enough receives, or
        // the longest the reads cover.
        let mut window = CEILING_MARGINAL_WINDOW;
        let mut measured = over(window)?;
        while measured.1 < CEILING_MARGINAL_RECEIVES && window < CEILING_MARGINAL_WINDOW_MAX {
            window = (window * 2).min(CEILING_MARGINAL_WINDOW_MAX);
            match over(window) {
                Some(longer) => measured = longer,
                None => break,
            }
        }
        let (before, started) = measured;
        let rise = value.saturating_sub(before);
        (started > 0 && rise > 0).then(|| rise as f64 / started as f64)
    }
}

/// The delivery ceiling (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Ceiling {
    /// The resources guarded until the next tick, each with its threshold.
    guards: Vec<Guard>,
    /// The queues' limits together at the last tick, or [`Ceiling::at_once`] when fewer: the
    /// most receives that can be in process at once, so an allowance this large could not
    /// bind.
    limits_total: u64,
    /// The most receives out and messages in process there can be at once whatever the
    /// queues' limits add up to (the transport's sessions, when each holds one); `None`: no
    /// such bound.
    at_once: Option<u64>,
    /// The guard whose allowance bound delivery at the last read, and whether it bound on a
    /// measured cost (not the cautious guess before any message was measured).
    binding: Option<(Condition, bool)>,
    /// What the ceiling measured where it held receives back since the last tick.
    held: CeilingHolds,
    /// The receives let through at the last read.
    last_started: u64,
    /// Reads in a row that found the host quiet: the pause before the next one doubles with
    /// each, up to [`CEILING_QUIET_INTERVAL`]; any admission or message in process ends it.
    quiet_reads: u32,
    /// The database sessions read since the last tick, summed, and the reads.
    sessions_read: (u64, u64),
}

impl Ceiling {
    /// Arms the guards for the time until the next tick: every guarded resource with a
    /// threshold, while delivery throttling applies. `limits_total` is the queues' limits
    /// together.
    pub(crate) fn arm(&mut self, thresholds: &Thresholds, applies: bool, limits_total: u64) {
        self.limits_total = self.at_once.map_or(limits_total, |n| limits_total.min(n));
        // Always, not only once a value is near its threshold: what each message costs can
        // jump at once (a new payload), and from a sixth of the threshold, the receives
        // started within one 250 ms tick carried RSS to 1.15 x before the next tick armed it.
        let armed = |c: Condition| thresholds.of(c).filter(|&t| applies && t > 0);
        self.guards
            .retain(|g| armed(g.condition) == Some(g.threshold));
        for condition in CEILING_GUARDED {
            if let Some(threshold) = armed(condition)
                && !self.guards.iter().any(|g| g.condition == condition)
            {
                self.guards.push(Guard::new(condition, threshold));
            }
        }
    }

    /// Bounds the receives out and messages in process at once to `at_once` (`None`: no
    /// bound). Where every one holds a database session from its receive to its commit, the
    /// pool is the bound: a host of 1 000 queues with a limit of 8 each has 8 000 receives
    /// started, waiting for 40 connections, and counted as 8 000 messages about to be in
    /// process they held the in-process count at its threshold (2 000), and kept every
    /// admission off its fast path, with 40 messages in process at most.
    pub(crate) fn bound_at_once(&mut self, at_once: Option<u64>) {
        self.at_once = at_once;
    }

    /// Whether any resource is guarded (the service then reads every [`CEILING_INTERVAL`]).
    pub(crate) fn is_armed(&self) -> bool {
        !self.guards.is_empty()
    }

    /// How long until the next read: [`CEILING_INTERVAL`] while messages come, longer while
    /// the host is quiet.
    pub(crate) fn next_read_in(&self) -> Duration {
        (CEILING_INTERVAL * 2u32.pow(self.quiet_reads.min(3))).min(CEILING_QUIET_INTERVAL)
    }

    /// Whether the ceiling guards `condition` now (the service reads only what it needs).
    pub(crate) fn guards(&self, condition: Condition) -> bool {
        self.guards.iter().any(|g| g.condition == condition)
    }

    /// Where the ceiling held receives back since the last call.
    pub(crate) fn take_holds(&mut self) -> CeilingHolds {
        std::mem::take(&mut self.held)
    }

    /// The database sessions in use, averaged over the reads since the last call, when it
    /// guards them. A tick's one count is a sample of a value that moves by several within
    /// milliseconds (a receive takes a connection as it starts, a send for its insert).
    pub(crate) fn take_sessions_mean(&mut self) -> Option<f64> {
        let (sum, reads) = std::mem::take(&mut self.sessions_read);
        (reads > 0).then(|| sum as f64 / reads as f64)
    }

    /// One read: returns how many more receives may start until the next read (`None`: no
    /// limit).
    pub(crate) fn enforce(
        &mut self,
        now: Instant,
        usage: Usage,
        admission: AdmissionCounts,
    ) -> Option<u64> {
        // The receives waiting now were held by the guard that bound at the last read. A
        // hold on the guess made before any message was measured lasts one read and is not
        // pressure: it is not reported (it showed as state 9 at a fifth of the threshold).
        let quiet = usage.in_process == 0 && admission.started == self.last_started;
        self.quiet_reads = if quiet { self.quiet_reads + 1 } else { 0 };
        self.last_started = admission.started;
        let held_by = match self.binding {
            Some((condition, true)) if admission.held => Some(condition),
            _ => None,
        };
        let mut tightest: Option<(Condition, Fit)> = None;
        for guard in &mut self.guards {
            let value = usage.of(guard.condition);
            if guard.condition == Condition::DatabaseSessions {
                self.sessions_read.0 += value;
                self.sessions_read.1 += 1;
            }
            let pending_bound = usage.in_process + self.limits_total;
            let fit = if guard.condition == Condition::InProcess {
                let taken = usage.in_process + admission.receiving;
                counted_fit(
                    guard.threshold,
                    self.at_once.map_or(taken, |n| taken.min(n)),
                )
            } else {
                guard.read(now, value, usage.in_process, admission, pending_bound)
            };
            // A hold whose cause is gone by this read (the value fell since the last one) is
            // not pressure: reported, it showed a memory condition a tick after its messages
            // had ended, and the state flipped back to 4 from an override.
            if held_by == Some(guard.condition) && fit.allowance < self.limits_total {
                self.held.record(guard.condition, fit.room);
            }
            if tightest.is_none_or(|(_, t)| fit.allowance < t.allowance) {
                tightest = Some((guard.condition, fit));
            }
        }
        // An allowance no burst could use up leaves admissions on their fast path.
        let binding = tightest.filter(|(_, fit)| fit.allowance < self.limits_total);
        self.binding = binding.map(|(c, fit)| (c, fit.measured));
        binding.map(|(_, fit)| fit.allowance)
    }
}

/// What the ceiling measured for one resource at one read.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Fit {
    /// How many more receives may start now.
    allowance: u64,
    /// How many messages in process fit under the threshold, at what one costs now.
    room: u64,
    /// What one message costs, as estimated at this read.
    per_message: f64,
    /// The cost was measured (messages in process now, or earlier), not guessed.
    measured: bool,
}

/// What fits under a threshold on a count of messages (the in-process count): `taken`, the
/// messages in process and the receives out that may bring one, each cost one.
fn counted_fit(threshold: u64, taken: u64) -> Fit {
    Fit {
        // Never stop the last message, as for every guard (a threshold of 0 is off).
        allowance: threshold.saturating_sub(taken).max(u64::from(taken == 0)),
        room: threshold,
        per_message: 1.0,
        measured: true,
    }
}

/// What the ceiling knows of what a message costs, besides the value now.
#[derive(Debug, Clone, Copy, Default)]
struct Estimate {
    /// The value with nothing in process.
    idle: Option<u64>,
    /// What the value rose by per receive started lately.
    margin: Option<f64>,
    /// What one message cost at the last read with messages in process.
    last: Option<f64>,
}

/// What fits under the threshold now.
fn fit(
    threshold: u64,
    value: u64,
    in_process: u64,
    estimate: Estimate,
    recently_started: u64,
) -> Fit {
    let limit = threshold as f64;
    // With messages in process, what they hold on average (a value at or below the idle
    // process: nothing measurable); with none, what one held when last measured.
    let average = match estimate.idle {
        Some(idle) if in_process > 0 => value.saturating_sub(idle) as f64 / in_process as f64,
        // Messages were in process at every read so far (a host that starts on a backlog):
        // the idle process was never seen. The whole value over the messages is the most one
        // can hold; the guess of a twentieth of the threshold alone held a process at
        // 0.003 x its memory threshold and showed it as state 4.
        None if in_process > 0 => {
            (value as f64 / in_process as f64).min(estimate.last.unwrap_or(limit / 20.0))
        }
        _ => estimate.last.unwrap_or(limit / 20.0),
    };
    let per_message = average
        .max(estimate.margin.unwrap_or(0.0))
        .clamp(limit / 1000.0, limit / 10.0);
    let idle = estimate.idle.unwrap_or(0).min(value);
    let room = ((limit - idle as f64) / per_message).floor().max(1.0) as u64;
    let fits = ((limit - value as f64) / per_message).floor().max(0.0) as u64;
    let mut allowance = fits.saturating_sub(recently_started);
    if in_process == 0 {
        // Never stop the last message: nothing in process would free anything.
        allowance = allowance.max(1);
    }
    Fit {
        allowance,
        room,
        per_message,
        measured: in_process > 0 || estimate.last.is_some() || estimate.margin.is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn idle(value: u64) -> Estimate {
        Estimate {
            idle: Some(value),
            ..Estimate::default()
        }
    }

    #[test]
    fn the_ceiling_stops_at_the_threshold_but_never_the_last_message() {
        let threshold = 100 * MIB;
        let at = |value, in_process| fit(threshold, value, in_process, idle(20 * MIB), 0);
        assert_eq!(at(100 * MIB, 3).allowance, 0);
        assert_eq!(at(130 * MIB, 3).allowance, 0);
        assert_eq!(
            at(120 * MIB, 0).allowance,
            1,
            "nothing in process: one may start"
        );
    }

    /// The in-process count is guarded exactly: what starts now is the threshold less the
    /// messages in process and the receives out, a hold on it is reported with the threshold
    /// as its room, and with nothing in process one may always start.
    #[test]
    fn the_in_process_count_is_held_at_its_threshold_exactly() {
        let mut ceiling = Ceiling::default();
        let thresholds = Thresholds {
            in_process: Some(40),
            ..Thresholds::default()
        };
        ceiling.arm(&thresholds, true, 200);
        let usage = |in_process| Usage {
            in_process,
            ..Usage::default()
        };
        let counts = |receiving, held| AdmissionCounts {
            started: 0,
            receiving,
            held,
        };
        let now = Instant::now();
        assert_eq!(ceiling.enforce(now, usage(30), counts(6, false)), Some(4));
        assert_eq!(ceiling.enforce(now, usage(36), counts(4, true)), Some(0));
        assert_eq!(ceiling.take_holds().in_process, Some(40));
        assert_eq!(ceiling.enforce(now, usage(0), counts(0, false)), Some(40));
        // An allowance no burst could use up (the queues' limits together are 30) does not bind.
        ceiling.arm(&thresholds, true, 30);
        assert_eq!(ceiling.enforce(now, usage(2), counts(0, false)), None);
        assert_eq!(counted_fit(40, 0).allowance, 40);
        assert_eq!(counted_fit(0, 0).allowance, 1, "never the last message");
    }

    /// Receives waiting for one of 40 sessions are not 8 000 messages about to be in process:
    /// bounded at 40 at once, an in-process threshold of 2 000 is far away, and admissions
    /// keep their fast path.
    #[test]
    fn receives_beyond_the_sessions_do_not_count_toward_the_in_process_count() {
        let thresholds = Thresholds {
            in_process: Some(2_000),
            ..Thresholds::default()
        };
        let usage = Usage {
            in_process: 30,
            ..Usage::default()
        };
        let counts = AdmissionCounts {
            started: 0,
            receiving: 8_000,
            held: false,
        };
        let now = Instant::now();
        let mut unbounded = Ceiling::default();
        unbounded.arm(&thresholds, true, 8_000);
        assert_eq!(unbounded.enforce(now, usage, counts), Some(0));
        let mut bounded = Ceiling::default();
        bounded.bound_at_once(Some(40));
        bounded.arm(&thresholds, true, 8_000);
        assert_eq!(bounded.enforce(now, usage, counts), None);
        // Below the bound the threshold holds as before.
        let thresholds = Thresholds {
            in_process: Some(20),
            ..thresholds
        };
        bounded.arm(&thresholds, true, 8_000);
        assert_eq!(bounded.enforce(now, usage, counts), Some(0));
    }

    #[test]
    fn the_ceiling_admits_what_fits_and_measures_the_room() {
        let threshold = 100 * MIB;
        // 10 in process hold 80 MiB above an idle 10 MiB: 8 MiB each; 10 MiB left fits one,
        // and the threshold has room for 11 such messages above the idle process.
        let f = fit(threshold, 90 * MIB, 10, idle(10 * MIB), 0);
        assert_eq!((f.allowance, f.room), (1, 11));
        // ... and none once one was admitted and does not show yet.
        let f = fit(threshold, 90 * MIB, 10, idle(10 * MIB), 1);
        assert_eq!(f.allowance, 0);
        // Far below the threshold the same arithmetic: a burst of costly receives cannot
        // start all at once (4 in process at 4 MiB each, 44 MiB left: 11 more).
        let f = fit(threshold, 56 * MIB, 4, idle(40 * MIB), 0);
        assert_eq!((f.allowance, f.room), (11, 15));
        // A value no higher than the idle process: the messages cost nothing measurable, so
        // a burst of them is not held back (a thousandth of the threshold each).
        let f = fit(threshold, 14 * MIB, 14, idle(14 * MIB), 15);
        assert_eq!(f.allowance, 860 - 15);
        // With no idle reading the estimate is a twentieth of the threshold (5 MiB)...
        let f = fit(threshold, 80 * MIB, 4, Estimate::default(), 0);
        assert_eq!((f.allowance, f.room), (4, 20));
        // ... or, with messages in process, the whole value over them when that is less
        // (8 MiB over 4: 2 MiB each, 46 more fit).
        let f = fit(threshold, 8 * MIB, 4, Estimate::default(), 0);
        assert_eq!((f.allowance, f.room), (46, 50));
    }

    #[test]
    fn what_the_latest_receives_added_outweighs_a_cheap_average() {
        let threshold = 100 * MIB;
        // 60 cheap messages hold 12 MiB above an idle 30 MiB (0.2 MiB each), but the latest
        // receives added 6 MiB each: 58 MiB left fits 9 of those, not 290 cheap ones.
        let cheap = fit(threshold, 42 * MIB, 60, idle(30 * MIB), 0);
        assert_eq!(cheap.allowance, 290);
        let costly = Estimate {
            margin: Some(6.0 * MIB as f64),
            ..idle(30 * MIB)
        };
        let f = fit(threshold, 42 * MIB, 60, costly, 0);
        assert_eq!((f.allowance, f.room), (9, 11));
    }

    #[tokio::test(start_paused = true)]
    async fn the_margin_is_the_rise_over_the_receives_admitted_a_settle_time_before() {
        let mut guard = Guard::new(Condition::ProcessMemory, 1 << 30);
        let mut rss = 40 * MIB;
        // Two receives admitted per read, past a settle time and a window; each shows 4 MiB a
        // settle time later.
        let mut last = None;
        let mut admitted = 0;
        let reads = ((CEILING_SETTLE + CEILING_MARGINAL_WINDOW).as_millis() / 5) as u64 + 10;
        for read in 0..reads {
            let shown = read.saturating_sub(CEILING_SETTLE.as_millis() as u64 / 5);
            rss = 40 * MIB + shown * 2 * 4 * MIB;
            last = guard.margin(Instant::now(), rss, admitted);
            admitted += 2;
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        let margin = last.expect("a margin once the window is full");
        assert!(
            (margin - 4.0 * MIB as f64).abs() < 0.5 * MIB as f64,
            "about 4 MiB per receive: {} MiB (rss {} MiB)",
            margin / MIB as f64,
            rss / MIB
        );
        // Receives admitted while RSS holds still (others freed as much): no fresh margin,
        // but the one measured is remembered for a while, and then forgotten.
        let mut remembered = guard.remembered_margin(Instant::now(), last);
        for _ in 0..reads {
            last = guard.margin(Instant::now(), rss, admitted);
            remembered = guard.remembered_margin(Instant::now(), last);
            admitted += 2;
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        assert_eq!(last, None);
        assert_eq!(remembered, Some(margin), "still within the margin memory");
        tokio::time::advance(CEILING_MARGIN_MEMORY).await;
        assert_eq!(guard.remembered_margin(Instant::now(), None), None);
    }

    /// A receive every 35 ms, each adding 4 MiB that shows 25 to 35 ms later: a 50 ms window
    /// holds one or two receives and at times the cost of one more, so the largest margin of
    /// the last second read 8 MiB. Measured over at least 4 receives it stays near 4 MiB
    /// (once the reads reach back over the longest window).
    #[tokio::test(start_paused = true)]
    async fn few_receives_per_window_do_not_double_the_margin() {
        let mut guard = Guard::new(Condition::ProcessMemory, 1 << 30);
        let (mut admitted, mut shows_at) = (0u64, Vec::new());
        let mut largest: f64 = 0.0;
        for read in 0..400u64 {
            if read % 7 == 0 {
                admitted += 1;
                shows_at.push(read + 5 + 2 * (admitted % 2));
            }
            let shown = shows_at.iter().filter(|&&at| at <= read).count() as u64;
            let fresh = guard.margin(Instant::now(), 40 * MIB + shown * 4 * MIB, admitted);
            let remembered = guard.remembered_margin(Instant::now(), fresh);
            // Once the reads cover the longest window and a margin memory since.
            if let Some(m) = remembered.filter(|_| read >= 260) {
                largest = largest.max(m);
            }
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        let largest = largest / MIB as f64;
        assert!(
            (3.0..=5.0).contains(&largest),
            "the largest margin {largest:.1} MiB"
        );
    }

    /// Costly messages replace cheap ones while older costly ones finish: the value falls,
    /// yet what each new one adds has not changed. The ceiling keeps charging it.
    #[tokio::test(start_paused = true)]
    async fn a_falling_value_does_not_make_the_next_messages_look_cheap() {
        let threshold = 100 * MIB;
        let mut ceiling = Ceiling::default();
        ceiling.arm(
            &Thresholds {
                process_memory: Some(threshold),
                ..Thresholds::default()
            },
            true,
            120,
        );
        let quiet = Usage {
            process_memory: 20 * MIB,
            ..Usage::default()
        };
        ceiling.enforce(Instant::now(), quiet, AdmissionCounts::default());
        tokio::time::advance(CEILING_INTERVAL).await;
        // 50 cheap messages in process; one costly receive admitted per read, each showing
        // 6 MiB a settle time later, until RSS is at 74 MiB.
        let mut admitted = 0u64;
        let mut rss = 20 * MIB;
        let settle_reads = CEILING_SETTLE.as_millis() as u64 / 5;
        // (And 20 reads more with nothing admitted, so the margin is measured whole.)
        for read in 0..(9 + settle_reads + 20) {
            if (settle_reads..settle_reads + 9).contains(&read) {
                rss += 6 * MIB;
            }
            let usage = Usage {
                process_memory: rss,
                in_process: 50,
                ..Usage::default()
            };
            let counts = AdmissionCounts {
                started: admitted,
                held: false,
                ..AdmissionCounts::default()
            };
            ceiling.enforce(Instant::now(), usage, counts);
            admitted += u64::from(read < 9);
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        // Three costly ones finish: RSS falls to 56 MiB with 47 in process (0.8 MiB each on
        // average). 44 MiB left has room for about 7 more at 6 MiB, not 55 at the average.
        let mut allowance = None;
        for _ in 0..20 {
            let usage = Usage {
                process_memory: 56 * MIB,
                in_process: 47,
                ..Usage::default()
            };
            let counts = AdmissionCounts {
                started: admitted,
                held: false,
                ..AdmissionCounts::default()
            };
            allowance = ceiling.enforce(Instant::now(), usage, counts);
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        assert!(
            allowance.is_some_and(|a| (6..=8).contains(&a)),
            "{allowance:?}"
        );
    }

    fn thresholds(threads: u64, sessions: u64) -> Thresholds {
        Thresholds {
            threads: Some(threads),
            database_sessions: Some(sessions),
            ..Thresholds::default()
        }
    }

    /// Handlers that each block a thread: the thread guard lets through only as many as the
    /// threshold has threads for, and reports the hold with its room.
    #[tokio::test(start_paused = true)]
    async fn blocking_handlers_are_held_at_the_thread_threshold() {
        let mut ceiling = Ceiling::default();
        ceiling.arm(&thresholds(26, 1000), true, 48);
        assert!(ceiling.guards(Condition::Threads) && !ceiling.guards(Condition::ProcessMemory));
        // The idle process has 10 threads; every admitted receive starts one more thread.
        let (mut admitted, mut in_process) = (0u64, 0u64);
        let mut peak_threads = 0;
        let mut held_seen = false;
        for _ in 0..200 {
            let usage = Usage {
                threads: 10 + in_process,
                in_process,
                ..Usage::default()
            };
            peak_threads = peak_threads.max(usage.threads);
            // Everyone wants in: 48 receives wait while the limits allow 48.
            let allowance = ceiling.enforce(
                Instant::now(),
                usage,
                AdmissionCounts {
                    started: admitted,
                    held: held_seen,
                    ..AdmissionCounts::default()
                },
            );
            let granted = allowance.unwrap_or(48).min(48 - in_process);
            held_seen = allowance.is_some_and(|a| a < 48 - in_process);
            admitted += granted;
            in_process += granted;
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        assert!(peak_threads <= 26, "threads peaked at {peak_threads}");
        assert!(
            in_process >= 15,
            "it lets the threshold's worth in: {in_process}"
        );
        let holds = ceiling.take_holds();
        assert_eq!(holds.threads, Some(16), "{holds:?}");
        assert_eq!(holds.database_sessions, None);
        assert_eq!(ceiling.take_holds(), CeilingHolds::default(), "taken once");
    }

    /// After an episode of blocking handlers the pool keeps its threads for seconds: they
    /// are reused by the next messages, so they must not hold delivery at one message.
    #[tokio::test(start_paused = true)]
    async fn lingering_pool_threads_are_reused_not_charged_again() {
        let mut ceiling = Ceiling::default();
        ceiling.arm(&thresholds(20, 1000), true, 48);
        let idle = Usage {
            threads: 4,
            ..Usage::default()
        };
        ceiling.enforce(Instant::now(), idle, AdmissionCounts::default());
        tokio::time::advance(CEILING_INTERVAL).await;
        // 19 threads (15 idle in the pool), one message in process: 15 more may start.
        let lingering = Usage {
            threads: 19,
            in_process: 1,
            ..Usage::default()
        };
        let allowance = ceiling.enforce(Instant::now(), lingering, AdmissionCounts::default());
        assert_eq!(allowance, Some(15));
        // Async handlers (threads at the process's own count): the thread guard stays open.
        tokio::time::advance(Duration::from_secs(1)).await;
        let busy = Usage {
            threads: 4,
            in_process: 40,
            ..Usage::default()
        };
        let allowance = ceiling.enforce(Instant::now(), busy, AdmissionCounts::default());
        assert_eq!(allowance, None);
    }

    /// Before any message was measured, the ceiling guesses a twentieth of the threshold per
    /// message: receives it holds on that guess are not reported as pressure.
    #[tokio::test(start_paused = true)]
    async fn a_hold_on_the_first_guess_is_not_pressure() {
        let mut ceiling = Ceiling::default();
        ceiling.arm(&thresholds(20, 1000), true, 48);
        let idle = Usage {
            threads: 4,
            ..Usage::default()
        };
        let first = ceiling.enforce(Instant::now(), idle, AdmissionCounts::default());
        assert_eq!(first, Some(16), "a twentieth of 20 threads each: 16 fit");
        tokio::time::advance(CEILING_INTERVAL).await;
        let busy = Usage {
            threads: 4,
            in_process: 16,
            ..Usage::default()
        };
        let held = AdmissionCounts {
            started: 16,
            held: true,
            ..AdmissionCounts::default()
        };
        assert_eq!(
            ceiling.enforce(Instant::now(), busy, held),
            None,
            "measured: cheap"
        );
        assert_eq!(ceiling.take_holds(), CeilingHolds::default());
    }

    /// A host that starts on a backlog has messages in process at its first read, so the
    /// idle value is unknown: far below the threshold, that is no reason to hold receives
    /// back, and nothing is reported as pressure.
    #[tokio::test(start_paused = true)]
    async fn a_host_busy_from_its_first_read_is_not_held_far_below_the_threshold() {
        let mut ceiling = Ceiling::default();
        let memory = Thresholds {
            process_memory: Some(6 * 1024 * MIB),
            ..Thresholds::default()
        };
        ceiling.arm(&memory, true, 16);
        for read in 1..=20u64 {
            let busy = Usage {
                process_memory: 20 * MIB + read * 64 * 1024,
                in_process: 16,
                ..Usage::default()
            };
            let counts = AdmissionCounts {
                started: 16 * read,
                held: true,
                ..AdmissionCounts::default()
            };
            assert_eq!(
                ceiling.enforce(Instant::now(), busy, counts),
                None,
                "read {read}: 20 MiB of 6 GiB binds nothing"
            );
            tokio::time::advance(CEILING_INTERVAL).await;
        }
        assert_eq!(ceiling.take_holds(), CeilingHolds::default());
    }

    /// Receives held at the last read, whose cause is gone by this one (their costly messages
    /// ended and the value fell), are released without being reported as pressure.
    #[tokio::test(start_paused = true)]
    async fn a_hold_whose_cause_has_gone_is_not_reported() {
        let mut ceiling = Ceiling::default();
        let memory = Thresholds {
            process_memory: Some(100 * MIB),
            ..Thresholds::default()
        };
        ceiling.arm(&memory, true, 16);
        let idle = Usage {
            process_memory: 20 * MIB,
            ..Usage::default()
        };
        ceiling.enforce(Instant::now(), idle, AdmissionCounts::default());
        tokio::time::advance(CEILING_INTERVAL).await;
        // 8 messages hold 9 MiB each: 92 MiB, nothing more fits.
        let full = Usage {
            process_memory: 92 * MIB,
            in_process: 8,
            ..Usage::default()
        };
        let started = AdmissionCounts {
            started: 8,
            held: false,
            ..AdmissionCounts::default()
        };
        assert_eq!(ceiling.enforce(Instant::now(), full, started), Some(0));
        tokio::time::advance(CEILING_INTERVAL).await;
        let held = AdmissionCounts {
            started: 8,
            held: true,
            ..AdmissionCounts::default()
        };
        assert_eq!(ceiling.enforce(Instant::now(), full, held), Some(0));
        assert!(
            ceiling.take_holds().of(Condition::ProcessMemory).is_some(),
            "held"
        );
        tokio::time::advance(CEILING_INTERVAL).await;
        // They ended: the value is back near idle, with two cheap messages in process.
        let fallen = Usage {
            process_memory: 21 * MIB,
            in_process: 2,
            ..Usage::default()
        };
        assert_eq!(
            ceiling.enforce(Instant::now(), fallen, held),
            None,
            "open again"
        );
        assert_eq!(
            ceiling.take_holds(),
            CeilingHolds::default(),
            "not pressure"
        );
    }

    /// A quiet host is read less often; the first admission brings the 5 ms reads back.
    #[test]
    fn reads_slow_down_while_quiet_and_resume_with_the_first_admission() {
        let mut ceiling = Ceiling::default();
        ceiling.arm(&thresholds(26, 1000), true, 48);
        let now = Instant::now();
        let idle = Usage {
            threads: 10,
            ..Usage::default()
        };
        let mut pauses = Vec::new();
        for _ in 0..6 {
            ceiling.enforce(now, idle, AdmissionCounts::default());
            pauses.push(ceiling.next_read_in().as_millis());
        }
        assert_eq!(pauses, vec![10, 20, 40, 40, 40, 40]);
        let admitted = AdmissionCounts {
            started: 1,
            held: false,
            ..AdmissionCounts::default()
        };
        ceiling.enforce(now, idle, admitted);
        assert_eq!(ceiling.next_read_in(), CEILING_INTERVAL);
    }

    #[test]
    fn guards_follow_the_thresholds_and_the_override() {
        let mut ceiling = Ceiling::default();
        ceiling.arm(&Thresholds::default(), true, 10);
        assert!(!ceiling.is_armed(), "no threshold: nothing guarded");
        ceiling.arm(&thresholds(26, 12), false, 10);
        assert!(
            !ceiling.is_armed(),
            "delivery throttling off: nothing guarded"
        );
        ceiling.arm(&thresholds(26, 12), true, 10);
        assert!(ceiling.guards(Condition::Threads) && ceiling.guards(Condition::DatabaseSessions));
    }

    /// An allowance at least the queues' limits together could never bind: admissions stay
    /// on their fast path.
    #[test]
    fn an_allowance_that_cannot_bind_leaves_delivery_open() {
        let mut ceiling = Ceiling::default();
        ceiling.arm(&thresholds(1000, 1000), true, 8);
        let usage = Usage {
            threads: 10,
            database_sessions: 3,
            in_process: 2,
            ..Usage::default()
        };
        let now = Instant::now();
        assert_eq!(
            ceiling.enforce(now, usage, AdmissionCounts::default()),
            None
        );
    }

    /// A receive's connection is in the pool's count from the moment it starts, so the
    /// sessions guard adds only the receives out now to the count, not every receive of the
    /// last settle time: with 20 ms handlers those are in process and counted already, and
    /// counted twice they held delivery at half the threshold.
    #[test]
    fn sessions_count_each_receive_once() {
        let mut ceiling = Ceiling::default();
        let sessions = Thresholds {
            database_sessions: Some(10),
            ..Thresholds::default()
        };
        ceiling.arm(&sessions, true, 20);
        let start = Instant::now();
        let read = |ceiling: &mut Ceiling, step: u64, in_process: u64, receiving: u64| {
            let usage = Usage {
                database_sessions: in_process + receiving,
                in_process,
                ..Usage::default()
            };
            let counts = AdmissionCounts {
                started: step + receiving,
                receiving,
                held: false,
            };
            ceiling.enforce(start + Duration::from_millis(5 * step), usage, counts)
        };
        // The idle pool holds nothing; then a receive starts every 5 ms read and 4 messages,
        // each with its connection, are in process.
        read(&mut ceiling, 0, 0, 0);
        let mut allowance = None;
        for step in 1..20 {
            allowance = read(&mut ceiling, step, 4, 0);
        }
        assert_eq!(allowance, Some(6), "10 sessions, 4 in use: 6 more fit");
        // Two receives out now that have their connections: counted once in the pool and
        // once as receives out (one may not have its connection yet), never by the time
        // they started.
        assert_eq!(read(&mut ceiling, 20, 4, 2), Some(2));
        // What the next tick hears: the sessions' mean over the reads since the last one.
        let mean = ceiling.take_sessions_mean().expect("sessions are guarded");
        assert!((mean - 82.0 / 21.0).abs() < 1e-9, "{mean}");
        assert_eq!(ceiling.take_sessions_mean(), None, "no read since");
    }
}
