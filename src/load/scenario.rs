//! The load-test scenario file: the host's own `[transport]`, `[[queues]]` and `[throttling]`
//! tables, thresholds relative to the machine at start, and a list of phases.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::units::{self, ByteSize};
use crate::config::{
    ConfigError, LatencyDistribution, OverrideMode, QueueConfig, SimulateConfig, ThrottlingConfig,
    TransportConfig,
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
    /// The states it must show and the losses it may have.
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
    /// Thresholds set from the machine's state at start, so a scenario works on any machine.
    #[serde(default)]
    pub relative: RelativeThresholds,
    /// Messages written to the first phase's queue before the host starts (a backlog).
    #[serde(default)]
    pub prefill: u64,
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

/// What the run must show.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
    /// whether or not earlier sends have finished).
    #[serde(default)]
    pub publish_rate: f64,
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
    /// Parses a scenario file's text, with located errors.
    pub fn parse(text: &str, origin: &str) -> Result<Scenario, ConfigError> {
        let scenario: Scenario = crate::config::load::deserialize_located(text, origin)?;
        let mut problems = Vec::new();
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
        for (i, phase) in scenario.phases.iter().enumerate() {
            if !(phase.publish_rate >= 0.0 && phase.publish_rate.is_finite()) {
                problems.push((
                    format!("phases[{i}].publish_rate"),
                    format!("{} is not a rate >= 0", phase.publish_rate),
                ));
            }
            if let Some(q) = &phase.queue
                && !scenario.queues.iter().any(|c| &c.name == q)
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
        // The host-level checks apply to the embedded tables too.
        let as_config = crate::config::Config {
            transport: scenario.transport.clone(),
            queues: scenario.queues.clone(),
            throttling: scenario.throttling.clone(),
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
