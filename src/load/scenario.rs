//! The load-test scenario file: the host's own `[transport]`, `[[queues]]` and `[throttling]`
//! tables, thresholds relative to the machine at start, and a list of phases.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::units::{self, ByteSize};
use crate::config::{
    ConfigError, FleetConfig, LatencyDistribution, OverrideMode, QueueConfig, SimulateConfig,
    ThrottlingConfig, TransportConfig, TransportKind,
};

/// A scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name (used in reports).
    pub name: String,
    /// What it shows.
    #[serde(default)]
    pub description: String,
    /// What the run must show: states, absent states and control-quality bounds. Without
    /// it, every episode is still held to the goals (see [`Expect`]), and nothing may be lost.
    #[serde(default)]
    pub expect: Expect,
    /// Where the queues are, in the host configuration's form.
    #[serde(default)]
    pub transport: TransportConfig,
    /// Admin address for the run (`"off"` by default; the demo serves one).
    #[serde(default = "admin_off")]
    pub admin_address: String,
    /// Queues, their concurrency and handlers (simulate handlers are the usual choice).
    pub queues: Vec<QueueConfig>,
    /// Throttling settings for the run.
    #[serde(default)]
    pub throttling: ThrottlingConfig,
    /// The instance registry and fleet-wide limits' settings of every host of the run.
    #[serde(default)]
    pub fleet: FleetConfig,
    /// Thresholds set from the machine's state at start, so a scenario works on any machine.
    #[serde(default)]
    pub relative: RelativeThresholds,
    /// Messages written to the first phase's queue before the host starts (a backlog).
    #[serde(default)]
    pub prefill: u64,
    /// Keys of the backlog: with N above 0 the prefill's messages carry the queue's ordering
    /// key header (`[queues.ordering] key_header`) with N values in turn, and the run checks
    /// from its ledger that each key's messages were handled in order, one at a time.
    #[serde(default)]
    pub prefill_keys: u32,
    /// How the backlog's keys follow each other: `turns` (key 0, 1, ... N-1, 0, 1, ...: a
    /// key's messages are N rows apart) or `shuffled` (each key still has its share, in a
    /// fixed pseudo-random order, so a key's next message is often a few rows behind).
    #[serde(default)]
    pub prefill_key_layout: KeyLayout,
    /// Stages of the backlog: with N above 0 the prefill is cut into N runs of messages in
    /// send order, stage 100, 200, ... (`throttlehost.ExecutionStage`), each naming the one
    /// before (`throttlehost.PreviousStage`), and the run checks from its ledger that no
    /// message of a stage started before every message of the stage before it had ended.
    /// Needs `[queues.ordering] stages = true` on the prefilled queue.
    #[serde(default)]
    pub prefill_stages: u32,
    /// Body size of generated messages.
    #[serde(default = "default_body")]
    pub message_size: ByteSize,
    /// Longest wait for the queues to drain after the last phase.
    #[serde(default = "default_drain", with = "units::duration")]
    pub drain_timeout: Duration,
    /// Longest wait, after draining, for both directions to leave their throttling states.
    #[serde(default = "default_settle", with = "units::duration")]
    pub settle_timeout: Duration,
    /// The phases, in order.
    pub phases: Vec<Phase>,
    /// How many times the list of phases plays (a cause switched on and off repeatedly).
    #[serde(default = "one_round")]
    pub rounds: u32,
    /// Host processes on the queues (1 to 8): the run's own host and `processes - 1` peers,
    /// each a `throttlehost load-peer` process with its own pool, receivers and controller,
    /// reporting to the run's ledger. Above 1 only on a database transport.
    #[serde(default = "one_process")]
    pub processes: u32,
    /// The scenario file's text (what peers are started with).
    #[serde(skip)]
    pub source: String,
}

/// How a keyed backlog's keys follow each other (`prefill_key_layout`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyLayout {
    /// Key 0, 1, ... N-1, then 0 again.
    #[default]
    Turns,
    /// The same shares in a fixed pseudo-random order.
    Shuffled,
}

impl KeyLayout {
    /// The key of each of `count` messages over `keys` keys.
    pub fn keys(self, count: u64, keys: u32) -> Vec<u32> {
        let keys = u64::from(keys.max(1));
        let mut order: Vec<u32> = (0..count).map(|i| (i % keys) as u32).collect();
        if self == KeyLayout::Shuffled {
            // Fisher-Yates with a fixed xorshift: the same backlog on every run.
            let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
            for i in (1..order.len()).rev() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                order.swap(i, (rng % (i as u64 + 1)) as usize);
            }
        }
        order
    }
}

fn one_process() -> u32 {
    1
}

/// The most processes a scenario may run.
pub const MAX_PROCESSES: u32 = 8;

fn one_round() -> u32 {
    1
}

fn admin_off() -> String {
    "off".into()
}
fn default_body() -> ByteSize {
    ByteSize(200)
}
fn default_drain() -> Duration {
    Duration::from_secs(60)
}
fn default_settle() -> Duration {
    Duration::from_secs(30)
}

/// What the run must show. Every control episode is held to the goals unless the scenario
/// says otherwise: engaged within [`GOAL_ENGAGE_SAMPLES`] ticks of its crossing, peaked at
/// most at [`GOAL_PEAK_RATIO`] of its threshold ([`GOAL_DATABASE_SIZE_PEAK_RATIO`] for the
/// database size), at most [`GOAL_FLIPS`] state changes, state 0 within
/// [`GOAL_RECOVERY_SECONDS`] of its cause ending. A scenario loosens a bound by naming it
/// (`max_recovery_seconds = inf` lifts it), and says why in its comment.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Delivery state codes that must appear.
    #[serde(default)]
    pub delivery_states: Vec<u8>,
    /// Publishing state codes that must appear.
    #[serde(default)]
    pub publishing_states: Vec<u8>,
    /// Delivery state codes that must not appear.
    #[serde(default)]
    pub delivery_absent: Vec<u8>,
    /// Publishing state codes that must not appear.
    #[serde(default)]
    pub publishing_absent: Vec<u8>,
    /// At least this many control episodes (a guarded resource crossing its threshold).
    #[serde(default)]
    pub min_episodes: Option<u32>,
    /// Every episode engages within this many controller ticks of the crossing.
    #[serde(default = "goal_engage_samples")]
    pub max_engage_samples: Option<u32>,
    /// Every episode's resource peaks at most at this multiple of its threshold.
    #[serde(default = "goal_peak_ratio")]
    pub max_peak_ratio: Option<f64>,
    /// Database size episodes peak at most at this multiple (tighter: it is paced).
    #[serde(default = "goal_database_size_peak_ratio")]
    pub max_database_size_peak_ratio: Option<f64>,
    /// Every episode changes its direction's state at most this many times.
    #[serde(default = "goal_flips")]
    pub max_flips: Option<u32>,
    /// Every episode is back at state 0 (no delay, no pace, full limits) within this many
    /// seconds of its cause ending.
    #[serde(default = "goal_recovery_seconds")]
    pub max_recovery_seconds: Option<f64>,
    /// The messages in flight across every process (from the ledger's start and end times)
    /// never pass this (a queue's `fleet_max`).
    #[serde(default)]
    pub max_fleet_in_flight: Option<u32>,
    /// After a phase's `kill_peer`, the processes left have as many in flight as before the
    /// kill within this many seconds.
    #[serde(default)]
    pub max_refill_after_kill_seconds: Option<f64>,
}

/// The goal for how soon an episode engages: ticks after its crossing.
pub const GOAL_ENGAGE_SAMPLES: u32 = 2;
/// The goal for an episode's peak: a multiple of its threshold.
pub const GOAL_PEAK_RATIO: f64 = 1.15;
/// The goal for a database size episode's peak (it is paced, so tighter).
pub const GOAL_DATABASE_SIZE_PEAK_RATIO: f64 = 1.10;
/// The goal for an episode's state changes.
pub const GOAL_FLIPS: u32 = 2;
/// The goal for state 0 after an episode's cause ends, seconds.
pub const GOAL_RECOVERY_SECONDS: f64 = 10.0;

fn goal_engage_samples() -> Option<u32> {
    Some(GOAL_ENGAGE_SAMPLES)
}

fn goal_peak_ratio() -> Option<f64> {
    Some(GOAL_PEAK_RATIO)
}

fn goal_database_size_peak_ratio() -> Option<f64> {
    Some(GOAL_DATABASE_SIZE_PEAK_RATIO)
}

fn goal_flips() -> Option<u32> {
    Some(GOAL_FLIPS)
}

fn goal_recovery_seconds() -> Option<f64> {
    Some(GOAL_RECOVERY_SECONDS)
}

impl Default for Expect {
    /// The goals, and no state required or refused.
    fn default() -> Self {
        Expect {
            delivery_states: Vec::new(),
            publishing_states: Vec::new(),
            delivery_absent: Vec::new(),
            publishing_absent: Vec::new(),
            min_episodes: None,
            max_engage_samples: goal_engage_samples(),
            max_peak_ratio: goal_peak_ratio(),
            max_database_size_peak_ratio: goal_database_size_peak_ratio(),
            max_flips: goal_flips(),
            max_recovery_seconds: goal_recovery_seconds(),
            max_fleet_in_flight: None,
            max_refill_after_kill_seconds: None,
        }
    }
}

/// Thresholds resolved at start. Each replaces the matching `[throttling]` setting.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelativeThresholds {
    /// Process memory threshold = RSS at start + this.
    pub process_memory_above_baseline: Option<ByteSize>,
    /// System memory threshold = system used memory at start + this.
    pub system_memory_above_baseline: Option<ByteSize>,
    /// Thread threshold = threads at start + this (rounded to whole threads per CPU).
    pub threads_above_baseline: Option<u64>,
    /// In-process threshold as a total, not per CPU (rounded to whole messages per CPU).
    pub in_process: Option<u64>,
    /// Database sessions threshold as a total, not per CPU.
    pub database_sessions: Option<u64>,
}

/// One phase of load.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    /// Name shown in progress, timeline and chart.
    pub name: String,
    /// How long it lasts (scaled by `--duration-scale`).
    #[serde(with = "units::duration")]
    pub duration: Duration,
    /// Messages per second offered to the publish path (open loop: requests keep arriving
    /// whether or not earlier sends have finished). With `producers`, a cap on their total.
    #[serde(default)]
    pub publish_rate: f64,
    /// Ramps the open-loop rate linearly from `publish_rate` at the phase's start to this at
    /// its end.
    #[serde(default)]
    pub publish_rate_end: Option<f64>,
    /// Closed-loop senders: each sends one message, waits until it is stored (through any
    /// throttling wait), then sends the next. 0: open loop at `publish_rate`.
    #[serde(default)]
    pub producers: u32,
    /// Sets the MaximumConcurrencyLevel of the phase's queue from this phase on (as a config
    /// reload would).
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// Messages sent at the start of the phase, as fast as the publish path takes them.
    #[serde(default)]
    pub burst: u64,
    /// Target queue; default: the first queue.
    #[serde(default)]
    pub queue: Option<String>,
    /// Time-to-be-received of the messages sent in this phase.
    #[serde(default, with = "units::optional_duration_opt")]
    pub ttbr: Option<Duration>,
    /// Changes to every simulate handler's knobs from this phase on.
    #[serde(default)]
    pub handler: Option<KnobChange>,
    /// Delivery override from this phase on.
    #[serde(default)]
    pub delivery_override: Option<OverrideMode>,
    /// Publishing override from this phase on.
    #[serde(default)]
    pub publishing_override: Option<OverrideMode>,
    /// End the phase early once every queue is empty.
    #[serde(default)]
    pub until_drained: bool,
    /// Every this-many-th message sent in the phase is poisoned: a simulate handler fails it on
    /// every attempt (0: none).
    #[serde(default)]
    pub poison_every: u64,
    /// Switches the phase's queue's latency-aware limit on or off from this phase on (the
    /// other `[queues.latency_limit]` settings stay).
    #[serde(default)]
    pub latency_limit: Option<bool>,
    /// Kills peer process N (1 and up, below `processes`) with SIGKILL at the phase's start:
    /// its messages in flight roll back in the database, and nothing may be lost.
    #[serde(default)]
    pub kill_peer: Option<u32>,
    /// Pauses peer process N (1 and up, below `processes`) with SIGSTOP for the phase and
    /// resumes it with SIGCONT at its end: its database sessions stay open and its handlers
    /// stop where they are, as those of a frozen machine do.
    #[serde(default)]
    pub pause_peer: Option<u32>,
    /// The throttling conditions this phase's load causes (`process_memory`, `in_process`,
    /// `rate_imbalance`, ...): an episode's recovery is measured from the end of the phase that
    /// caused it, not from what the controller made of it. Unnamed, from the last sample its
    /// value was at or above the resume line.
    #[serde(default)]
    pub causes: Vec<crate::throttling::Condition>,
}

impl Phase {
    /// The open-loop rate `elapsed` into a phase lasting `length`.
    pub fn rate_at(&self, elapsed: Duration, length: Duration) -> f64 {
        match self.publish_rate_end {
            Some(end) if !length.is_zero() => {
                let share = (elapsed.as_secs_f64() / length.as_secs_f64()).clamp(0.0, 1.0);
                self.publish_rate + (end - self.publish_rate) * share
            }
            _ => self.publish_rate,
        }
    }
}

/// Partial simulate knobs: what is set changes, the rest stays.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnobChange {
    /// Mean latency.
    #[serde(default, with = "units::optional_duration_opt")]
    pub latency: Option<Duration>,
    /// Latency distribution.
    pub latency_distribution: Option<LatencyDistribution>,
    /// Memory held per message.
    pub memory_per_message: Option<ByteSize>,
    /// CPU burned per message.
    #[serde(default, with = "units::optional_duration_opt")]
    pub cpu_work: Option<Duration>,
    /// Block a thread for the latency.
    pub blocking: Option<bool>,
    /// Failure rate.
    pub failure_rate: Option<f64>,
    /// Calls the simulated downstream serves at once (0: unlimited).
    pub downstream_capacity: Option<u32>,
}

impl KnobChange {
    /// The knobs after this change.
    pub fn apply(&self, mut knobs: SimulateConfig) -> SimulateConfig {
        if let Some(v) = self.latency {
            knobs.latency = v;
        }
        if let Some(v) = self.latency_distribution {
            knobs.latency_distribution = v;
        }
        if let Some(v) = self.memory_per_message {
            knobs.memory_per_message = v;
        }
        if let Some(v) = self.downstream_capacity {
            knobs.downstream_capacity = v;
        }
        if let Some(v) = self.cpu_work {
            knobs.cpu_work = v;
        }
        if let Some(v) = self.blocking {
            knobs.blocking = v;
        }
        if let Some(v) = self.failure_rate {
            knobs.failure_rate = v;
        }
        knobs
    }
}

impl Scenario {
    /// `prefill_keys` needs the prefilled queue to be ordered by a key header.
    fn prefill_keys_problem(&self) -> Option<(String, String)> {
        if self.prefill_keys == 0 {
            return None;
        }
        self.prefilled_queue()
            .and_then(|q| q.ordering.key_header())
            .is_none()
            .then(|| {
                (
                    "prefill_keys".to_string(),
                    "needs the prefilled queue to name its key: [queues.ordering] key_header"
                        .to_string(),
                )
            })
    }

    /// `processes` within range, and above 1 only where other processes can reach the queues.
    fn processes_problem(&self) -> Option<(String, String)> {
        let problem = if !(1..=MAX_PROCESSES).contains(&self.processes) {
            format!(
                "{} is out of range: 1 (this process alone) to {MAX_PROCESSES}",
                self.processes
            )
        } else if self.processes > 1 && self.transport.kind == TransportKind::Memory {
            "more than one process needs a database transport (postgres or sqlserver): the memory transport lives in one process".to_string()
        } else {
            return None;
        };
        Some(("processes".to_string(), problem))
    }

    /// `prefill_stages` needs the prefilled queue to keep stages, and a message per stage.
    fn prefill_stages_problem(&self) -> Option<(String, String)> {
        if self.prefill_stages == 0 {
            return None;
        }
        let problem = if !self.prefilled_queue().is_some_and(|q| q.ordering.stages) {
            "needs the prefilled queue to keep stages: [queues.ordering] stages = true".to_string()
        } else if u64::from(self.prefill_stages) > self.prefill {
            format!(
                "{} stages need at least as many prefilled messages (prefill = {})",
                self.prefill_stages, self.prefill
            )
        } else {
            return None;
        };
        Some(("prefill_stages".to_string(), problem))
    }

    /// The queue the backlog is stored in: the first phase's, else the first queue.
    fn prefilled_queue(&self) -> Option<&QueueConfig> {
        let target = self.phases.first().and_then(|p| p.queue.clone());
        match &target {
            Some(name) => self.queues.iter().find(|q| &q.name == name),
            None => self.queues.first(),
        }
    }

    /// Every phase's settings within range and naming what exists (queues, peers).
    fn phase_problems(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        for (i, phase) in self.phases.iter().enumerate() {
            if !(phase.publish_rate >= 0.0 && phase.publish_rate.is_finite()) {
                problems.push((
                    format!("phases[{i}].publish_rate"),
                    format!("{} is not a rate >= 0", phase.publish_rate),
                ));
            }
            if let Some(end) = phase.publish_rate_end
                && !(end >= 0.0 && end.is_finite())
            {
                problems.push((
                    format!("phases[{i}].publish_rate_end"),
                    format!("{end} is not a rate >= 0"),
                ));
            }
            for (field, peer) in [
                ("kill_peer", phase.kill_peer),
                ("pause_peer", phase.pause_peer),
            ] {
                if let Some(n) = peer
                    && !(1..self.processes).contains(&n)
                {
                    problems.push((
                        format!("phases[{i}].{field}"),
                        format!(
                            "{n} is not a peer: peers are numbered 1 to processes - 1 ({})",
                            self.processes.saturating_sub(1)
                        ),
                    ));
                }
            }
            if phase.max_concurrency == Some(0) {
                problems.push((
                    format!("phases[{i}].max_concurrency"),
                    "0 would stop the queue for good; the least is 1".to_string(),
                ));
            }
            if let Some(q) = &phase.queue
                && !self.queues.iter().any(|c| &c.name == q)
            {
                problems.push((
                    format!("phases[{i}].queue"),
                    format!("`{q}` is not one of the scenario's queues"),
                ));
            }
            if let Some(rate) = phase.handler.as_ref().and_then(|h| h.failure_rate)
                && !(0.0..=1.0).contains(&rate)
            {
                problems.push((
                    format!("phases[{i}].handler.failure_rate"),
                    format!("{rate} is not between 0.0 and 1.0"),
                ));
            }
        }
        problems
    }

    /// Parses a scenario file's text, with located errors.
    pub fn parse(text: &str, origin: &str) -> Result<Scenario, ConfigError> {
        let mut scenario: Scenario = crate::config::load::deserialize_located(text, origin)?;
        scenario.source = text.to_string();
        let mut problems = Vec::new();
        problems.extend(scenario.processes_problem());
        if scenario.queues.is_empty() {
            problems.push((
                "queues".to_string(),
                "a scenario needs at least one queue".to_string(),
            ));
        }
        if scenario.phases.is_empty() {
            problems.push((
                "phases".to_string(),
                "a scenario needs at least one phase".to_string(),
            ));
        }
        problems.extend(scenario.prefill_keys_problem());
        problems.extend(scenario.prefill_stages_problem());
        if scenario.rounds == 0 {
            problems.push((
                "rounds".to_string(),
                "0 rounds would play no phase; the least is 1".to_string(),
            ));
        }
        problems.extend(scenario.phase_problems());
        // The host-level checks apply to the embedded tables too.
        let as_config = crate::config::Config {
            transport: scenario.transport.clone(),
            queues: scenario.queues.clone(),
            throttling: scenario.throttling.clone(),
            fleet: scenario.fleet.clone(),
            ..crate::config::Config::default()
        };
        problems.extend(crate::config::validate::validate(&as_config));
        if problems.is_empty() {
            return Ok(scenario);
        }
        Err(ConfigError::Invalid {
            origin: origin.to_string(),
            problems: problems
                .into_iter()
                .map(|(key, message)| crate::config::load::Problem {
                    line: crate::config::load::locate(text, &key),
                    key,
                    message,
                })
                .collect(),
        })
    }

    /// Reads a scenario file.
    pub fn load(path: &std::path::Path) -> Result<Scenario, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "name = 't'\n\n[expect]\nmin_episodes = 1\n[[queues]]\nname = 'q'\n";

    #[test]
    fn every_episode_is_held_to_the_goals_unless_the_scenario_says_otherwise() {
        let phase = "[[phases]]\nname = 'p'\nduration = '1s'\n";
        let without = format!("name = 't'\n[[queues]]\nname = 'q'\n{phase}");
        let e = Scenario::parse(&without, "t.toml").unwrap().expect;
        assert_eq!(e.max_engage_samples, Some(2));
        assert_eq!(e.max_peak_ratio, Some(1.15));
        assert_eq!(e.max_database_size_peak_ratio, Some(1.10));
        assert_eq!(e.max_flips, Some(2));
        assert_eq!(e.max_recovery_seconds, Some(10.0));
        let loosened = format!(
            "name = 't'\n[expect]\nmax_flips = 4\nmax_recovery_seconds = inf\n[[queues]]\nname = 'q'\n{phase}"
        );
        let e = Scenario::parse(&loosened, "t.toml").unwrap().expect;
        assert_eq!(e.max_flips, Some(4));
        assert_eq!(e.max_recovery_seconds, Some(f64::INFINITY));
        assert_eq!(
            e.max_engage_samples,
            Some(2),
            "the others stay at the goals"
        );
    }

    #[test]
    fn a_ramp_goes_from_the_start_rate_to_the_end_rate() {
        let text = format!(
            "{BASE}[[phases]]\nname = 'ramp'\nduration = '10s'\npublish_rate = 100\npublish_rate_end = 300\n"
        );
        let s = Scenario::parse(&text, "t.toml").unwrap();
        let p = &s.phases[0];
        let length = Duration::from_secs(10);
        assert_eq!(p.rate_at(Duration::ZERO, length), 100.0);
        assert_eq!(p.rate_at(Duration::from_secs(5), length), 200.0);
        assert_eq!(p.rate_at(Duration::from_secs(20), length), 300.0);
        assert_eq!(s.rounds, 1);
    }

    #[test]
    fn rounds_producers_and_a_phase_max_parse_and_are_checked() {
        let text = format!(
            "rounds = 3\n{BASE}[[phases]]\nname = 'p'\nduration = '1s'\nproducers = 4\nmax_concurrency = 2\n"
        );
        let s = Scenario::parse(&text, "t.toml").unwrap();
        assert_eq!((s.rounds, s.phases[0].producers), (3, 4));
        assert_eq!(s.phases[0].max_concurrency, Some(2));

        let text = format!(
            "rounds = 0\n{BASE}[[phases]]\nname = 'p'\nduration = '1s'\nmax_concurrency = 0\npublish_rate_end = -1\n"
        );
        let err = Scenario::parse(&text, "t.toml").unwrap_err().to_string();
        for key in [
            "rounds",
            "phases[0].max_concurrency",
            "phases[0].publish_rate_end",
        ] {
            assert!(err.contains(key), "{key} not named in: {err}");
        }
    }

    #[test]
    fn processes_keys_and_stages_are_checked_with_their_names() {
        let phase = "[[phases]]\nname = 'p'\nduration = '1s'\n";
        let text = format!("processes = 0\nprefill = 2\nprefill_stages = 3\n{BASE}{phase}");
        let err = Scenario::parse(&text, "t.toml").unwrap_err().to_string();
        for (key, why) in [
            ("processes", "out of range"),
            ("prefill_stages", "stages = true"),
        ] {
            assert!(err.contains(key) && err.contains(why), "{key}: {err}");
        }
        // More than one process on the memory transport (the default).
        let text = format!("processes = 3\n{BASE}{phase}");
        let err = Scenario::parse(&text, "t.toml").unwrap_err().to_string();
        assert!(
            err.contains("processes") && err.contains("database transport"),
            "{err}"
        );
        // Stages on a queue that keeps them, more than the messages.
        let text = format!(
            "prefill = 2\nprefill_stages = 3\n{BASE}[queues.ordering]\nstages = true\n{phase}"
        );
        let err = Scenario::parse(&text, "t.toml").unwrap_err().to_string();
        assert!(err.contains("at least as many prefilled messages"), "{err}");
        let text = format!(
            "prefill = 30\nprefill_stages = 3\n{BASE}[queues.ordering]\nstages = true\n{phase}"
        );
        let s = Scenario::parse(&text, "t.toml").unwrap();
        assert_eq!((s.prefill_stages, s.processes), (3, 1));
        assert_eq!(s.source, text, "peers are started with the scenario's text");
    }

    #[test]
    fn a_killed_peer_must_be_one_of_the_peers() {
        let phase = "[[phases]]\nname = 'p'\nduration = '1s'\nkill_peer = 2\n";
        let err = Scenario::parse(&format!("{BASE}{phase}"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("phases[0].kill_peer") && err.contains("not a peer"),
            "{err}"
        );
        let fleet = "[fleet]\nshare_interval = '10s'\n";
        let err = Scenario::parse(&format!("{BASE}{fleet}{phase}"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("fleet.share_interval"), "{err}");
        let paused = "[[phases]]\nname = 'p'\nduration = '1s'\npause_peer = 1\n";
        let err = Scenario::parse(&format!("{BASE}{paused}"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("phases[0].pause_peer") && err.contains("not a peer"),
            "{err}"
        );
    }

    #[test]
    fn a_shuffled_layout_gives_every_key_its_share_in_another_order() {
        let turns = KeyLayout::Turns.keys(100, 7);
        let shuffled = KeyLayout::Shuffled.keys(100, 7);
        assert_eq!(&turns[..8], &[0, 1, 2, 3, 4, 5, 6, 0]);
        assert_ne!(turns, shuffled);
        let mut sorted = shuffled.clone();
        sorted.sort_unstable();
        let mut expected = turns.clone();
        expected.sort_unstable();
        assert_eq!(sorted, expected, "the same shares");
        assert_eq!(
            shuffled,
            KeyLayout::Shuffled.keys(100, 7),
            "the same on every run"
        );
    }
}
