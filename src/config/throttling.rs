//! The `[throttling]` section: thresholds, severities and each direction's settings, with BizTalk's
//! defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::MemoryThreshold;
use super::units;

/// A direction's override, as BizTalk's "throttling override".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OverrideMode {
    /// Throttle by the conditions.
    #[default]
    None,
    /// Always throttle, at the override severity (state 10 delivery, 11 publishing).
    Throttle,
    /// Never throttle this direction (conditions are still measured and shown).
    Never,
}

impl OverrideMode {
    /// BizTalk's counter value: 0 none, 1 throttle, 2 never.
    pub fn code(self) -> u8 {
        match self {
            OverrideMode::None => 0,
            OverrideMode::Throttle => 1,
            OverrideMode::Never => 2,
        }
    }
}

/// `[throttling]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ThrottlingConfig {
    /// Master switch. Off: no delays, no limit changes; conditions are still measured.
    pub enabled: bool,
    /// How often sensors are read and states decided.
    #[serde(with = "units::duration")]
    pub sample_interval: Duration,
    /// A condition clears when its value falls below threshold x this (hysteresis).
    pub resume_ratio: f64,
    /// ... and has stayed below it this long (hysteresis in time): a value that the control
    /// holds at its line and that dips under it for a sample is one episode, not a state
    /// change per dip, even with `resume_ratio = 1.0`.
    #[serde(with = "units::duration")]
    pub resume_after: Duration,
    /// A direction that throttled on a measured cause keeps showing it (recovering) until
    /// the cause has been clear this long, so a cause that comes back within it (a sawtooth,
    /// a periodic batch) is one state, not a flip each time. Overrides end at once.
    #[serde(with = "units::duration")]
    pub min_dwell: Duration,
    /// First delay when a resource condition begins.
    #[serde(with = "units::duration")]
    pub initial_delay: Duration,
    /// Process memory (RSS) threshold: "25%" of physical memory, "1.5GiB" or "off".
    pub process_memory: MemoryThreshold,
    /// System-wide used physical memory threshold.
    pub system_memory: MemoryThreshold,
    /// Messages handed to handlers and not done, per CPU (0 = off).
    pub in_process_per_cpu: u64,
    /// Threads in the process, per CPU (0 = off).
    pub threads_per_cpu: u64,
    /// Messages in the queues this host receives from and publishes to (0 = off).
    pub database_size: u64,
    /// Count the error queues in the database size.
    pub database_size_includes_error_queue: bool,
    /// Longest age of a queue depth used for the database size before it is peeked again.
    #[serde(with = "units::duration")]
    pub database_size_refresh: Duration,
    /// Database connections in use, per CPU (0 = off).
    pub database_sessions_per_cpu: u64,
    /// Under memory, thread or session pressure a queue's limit is cut to the messages in
    /// flight x min(this, target / value), the target being midway between resume line and
    /// threshold: this is the gentlest cut (floor 1, never deeper than a quarter).
    pub concurrency_decrease_ratio: f64,
    /// Below the resume line a limit grows by its headroom share per sample (up to doubling
    /// far below the line) and by at least this step.
    pub concurrency_increase_step: u32,
    /// Severity (1-1000) of each resource condition: scales its delay (severity / 100 x
    /// (100 ms x overage + 100 ms x overage-seconds)).
    pub severity: SeverityConfig,
    /// Delivery: queue -> handler.
    pub delivery: DirectionConfig,
    /// Publishing: sends -> queue.
    pub publishing: DirectionConfig,
}

impl Default for ThrottlingConfig {
    fn default() -> Self {
        ThrottlingConfig {
            enabled: true,
            sample_interval: Duration::from_millis(500),
            resume_ratio: 0.9,
            resume_after: Duration::from_secs(1),
            min_dwell: Duration::from_secs(3),
            initial_delay: Duration::from_millis(10),
            process_memory: MemoryThreshold::Percent(25.0),
            system_memory: MemoryThreshold::Off,
            in_process_per_cpu: 1000,
            threads_per_cpu: 0,
            database_size: 50_000,
            database_size_includes_error_queue: false,
            database_size_refresh: Duration::from_secs(5),
            database_sessions_per_cpu: 0,
            concurrency_decrease_ratio: 0.9,
            concurrency_increase_step: 1,
            severity: SeverityConfig::default(),
            delivery: DirectionConfig::default(),
            publishing: DirectionConfig::default(),
        }
    }
}

/// `[throttling.severity]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SeverityConfig {
    /// Process memory (BizTalk default 500).
    pub process_memory: u32,
    /// System memory.
    pub system_memory: u32,
    /// In-process messages (BizTalk default 75).
    pub in_process: u32,
    /// Thread count.
    pub threads: u32,
    /// Database size (BizTalk default 1).
    pub database_size: u32,
    /// Database sessions.
    pub database_sessions: u32,
}

impl Default for SeverityConfig {
    fn default() -> Self {
        SeverityConfig {
            process_memory: 500,
            system_memory: 500,
            in_process: 75,
            threads: 100,
            database_size: 1,
            database_sessions: 100,
        }
    }
}

/// `[throttling.delivery]` and `[throttling.publishing]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DirectionConfig {
    /// Rate overdrive factor in percent: throttle when incoming > outgoing x this / 100.
    pub overdrive_percent: u32,
    /// Sliding window the rates are measured over.
    #[serde(with = "units::duration")]
    pub sampling_window: Duration,
    /// Fewer messages than this in the window: no rate throttling.
    pub min_samples: u64,
    /// Cap of the throttling delay.
    #[serde(with = "units::duration")]
    pub max_delay: Duration,
    /// `none`, `throttle` or `never`.
    #[serde(rename = "override")]
    pub override_mode: OverrideMode,
    /// Severity of the forced condition when override = throttle.
    pub override_severity: u32,
}

impl Default for DirectionConfig {
    fn default() -> Self {
        DirectionConfig {
            overdrive_percent: 125,
            sampling_window: Duration::from_secs(15),
            min_samples: 100,
            max_delay: Duration::from_secs(300),
            override_mode: OverrideMode::None,
            override_severity: 100,
        }
    }
}
