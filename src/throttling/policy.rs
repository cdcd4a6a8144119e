//! The host's one throttling policy: the [`Controller`]'s decision at each tick and, between
//! ticks, the delivery [`Ceiling`] that holds receives at the thresholds that decision arms.
//!
//! Both halves used to be wired together twice, once by the throttling service and once by
//! the simulation bed, each taking the ceiling's holds into the next tick's readings and
//! arming the ceiling from the decision on its own (the bed armed it whether or not delivery
//! throttling applied). Here they are one unit: the service calls [`Policy::tick`] with what
//! it sensed and [`Policy::between_ticks`] with what the guarded resources use now, and
//! nothing else decides (the simulation bed runs the service itself). The controller stays a pure function of its readings (its
//! unit tests feed it holds directly); the ceiling stays the fast path that applies its
//! thresholds every few milliseconds.

use std::time::Duration;

use tokio::time::Instant;

use super::ceiling::{AdmissionCounts, Ceiling, Usage};
use super::controller::{Controller, Decision, QueueLoad, Readings, Thresholds};
use super::{Condition, Direction};
use crate::config::{OverrideMode, ThrottlingConfig};

/// The controller and the delivery ceiling it arms, as one policy.
#[derive(Debug)]
pub(crate) struct Policy {
    controller: Controller,
    ceiling: Ceiling,
}

impl Policy {
    /// A policy with these settings and thresholds; the ceiling is armed by the first tick.
    pub(crate) fn new(config: ThrottlingConfig, thresholds: Thresholds) -> Self {
        Policy {
            controller: Controller::new(config, thresholds),
            ceiling: Ceiling::default(),
        }
    }

    /// One tick: where the ceiling held receives back since the last tick goes into the
    /// readings (the controller shows that condition as acting and cuts the limits to the
    /// room measured), the controller decides, and its decision arms the ceiling for the
    /// time until the next tick. Returns the decision and the readings it was made from.
    pub(crate) fn tick(
        &mut self,
        now: Duration,
        readings: Readings,
        queues: &[QueueLoad],
    ) -> (Decision, Readings) {
        let readings = Readings {
            held: self.ceiling.take_holds(),
            database_sessions_mean: self.ceiling.take_sessions_mean(),
            ..readings
        };
        let decision = self.controller.tick(now, &readings, queues);
        let limits_total = decision.queue_limits.values().map(|l| u64::from(*l)).sum();
        self.arm(limits_total);
        (decision, readings)
    }

    /// Bounds the receives out and messages in process at once (see
    /// [`Ceiling::bound_at_once`]).
    pub(crate) fn bound_at_once(&mut self, at_once: Option<u64>) {
        self.ceiling.bound_at_once(at_once);
    }

    /// Arms the ceiling for queue limits that add up to `limits_total`: every guarded
    /// resource with a threshold, while delivery throttling applies (enabled, and not
    /// overridden to "never"); each tick does this with its decision's limits.
    fn arm(&mut self, limits_total: u64) {
        let config = self.controller.config();
        let applies = config.enabled && config.delivery.override_mode != OverrideMode::Never;
        let thresholds = *self.controller.thresholds();
        self.ceiling.arm(&thresholds, applies, limits_total);
    }

    /// Between ticks: how many more receives delivery may start now, given what the guarded
    /// resources use and what the admission has let through; None when nothing is guarded.
    pub(crate) fn between_ticks(
        &mut self,
        now: Instant,
        usage: Usage,
        counts: AdmissionCounts,
    ) -> Option<u64> {
        if !self.ceiling.is_armed() {
            return None;
        }
        self.ceiling.enforce(now, usage, counts)
    }

    /// Whether the ceiling guards anything (then it is read every few milliseconds).
    pub(crate) fn ceiling_armed(&self) -> bool {
        self.ceiling.is_armed()
    }

    /// Whether the ceiling guards `condition` (what the next read must sense).
    pub(crate) fn guards(&self, condition: Condition) -> bool {
        self.ceiling.guards(condition)
    }

    /// When the ceiling wants its next read: sooner while receives press against it.
    pub(crate) fn next_read_in(&self) -> Duration {
        self.ceiling.next_read_in()
    }

    /// Replaces the settings (hot reload); delays and limits carry over.
    pub(crate) fn reconfigure(&mut self, config: ThrottlingConfig, thresholds: Thresholds) {
        self.controller.reconfigure(config, thresholds);
    }

    /// Sets a direction's override until the next reload.
    pub(crate) fn set_override(&mut self, direction: Direction, mode: OverrideMode) {
        self.controller.set_override(direction, mode);
    }

    /// The settings in force (overrides included).
    pub(crate) fn config(&self) -> &ThrottlingConfig {
        self.controller.config()
    }

    /// The thresholds in force.
    pub(crate) fn thresholds(&self) -> &Thresholds {
        self.controller.thresholds()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MemoryThreshold;
    use crate::names::QueueName;
    use crate::throttling::controller::MachineFacts;

    fn policy(config: ThrottlingConfig) -> Policy {
        let machine = MachineFacts {
            total_memory: 1 << 34,
            cpus: 1,
        };
        let thresholds = Thresholds::resolve(&config, machine);
        Policy::new(config, thresholds)
    }

    fn memory_config() -> ThrottlingConfig {
        ThrottlingConfig {
            process_memory: MemoryThreshold::Bytes(100 << 20),
            ..ThrottlingConfig::default()
        }
    }

    fn queue(in_flight: u32) -> [QueueLoad; 1] {
        [QueueLoad {
            name: QueueName::new("q").expect("a valid name"),
            max: 64,
            in_flight,
        }]
    }

    /// Memory near its threshold with messages that each cost 4 MiB.
    fn pressing(in_process: u64) -> Usage {
        Usage {
            process_memory: (60 << 20) + in_process * (4 << 20),
            in_process,
            ..Usage::default()
        }
    }

    #[test]
    fn a_tick_arms_the_ceiling_and_the_next_tick_shows_what_it_held() {
        let mut p = policy(memory_config());
        assert!(
            !p.ceiling_armed(),
            "nothing is guarded before the first tick"
        );
        let quiet = Readings {
            process_memory: 60 << 20,
            ..Readings::default()
        };
        let (first, _) = p.tick(Duration::ZERO, quiet, &queue(0));
        assert_eq!(first.delivery.state, 0);
        assert!(p.ceiling_armed() && p.guards(Condition::ProcessMemory));
        // Between ticks, receives press against the threshold: the ceiling holds them.
        let start = Instant::now();
        let mut held_any = false;
        for step in 0..40u64 {
            let counts = AdmissionCounts {
                started: step,
                held: true,
                ..AdmissionCounts::default()
            };
            let now = start + Duration::from_millis(5 * step);
            held_any |= p
                .between_ticks(now, pressing(9), counts)
                .is_some_and(|a| a < 64);
        }
        assert!(held_any, "the ceiling held receives back");
        let (second, readings) = p.tick(
            Duration::from_millis(250),
            Readings {
                process_memory: pressing(9).process_memory,
                in_process: 9,
                ..quiet
            },
            &queue(9),
        );
        assert!(
            readings.held.of(Condition::ProcessMemory).is_some(),
            "the holds went into the tick's readings"
        );
        assert_eq!(
            second.delivery.state, 4,
            "held receives are memory pressure"
        );
    }

    #[test]
    fn with_delivery_overridden_to_never_the_ceiling_guards_nothing() {
        let mut config = memory_config();
        config.delivery.override_mode = OverrideMode::Never;
        let mut p = policy(config);
        p.tick(Duration::ZERO, Readings::default(), &queue(0));
        assert!(!p.ceiling_armed());
        assert_eq!(
            p.between_ticks(Instant::now(), pressing(30), AdmissionCounts::default()),
            None
        );
    }
}
