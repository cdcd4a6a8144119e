//! What a tick reads: the machine, the thresholds resolved on it, the readings, the downstream
//! guards and the ceiling's holds.

use serde::Serialize;

use crate::config::ThrottlingConfig;
use crate::throttling::rates::RateReading;
use crate::throttling::{Condition, Direction};

/// What the machine looks like, for thresholds given per CPU or as a share of memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MachineFacts {
    /// Physical memory (or the cgroup limit, when lower), bytes.
    pub total_memory: u64,
    /// CPUs available to the process.
    pub cpus: u64,
}

/// Resolved thresholds; None = condition off.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[non_exhaustive]
pub struct Thresholds {
    /// Bytes of process RSS.
    pub process_memory: Option<u64>,
    /// Bytes of system used memory.
    pub system_memory: Option<u64>,
    /// In-process messages.
    pub in_process: Option<u64>,
    /// Threads.
    pub threads: Option<u64>,
    /// Messages in the host's queues.
    pub database_size: Option<u64>,
    /// Connections in use.
    pub database_sessions: Option<u64>,
}

impl Thresholds {
    /// Applies the settings to this machine.
    pub fn resolve(config: &ThrottlingConfig, machine: MachineFacts) -> Self {
        let per_cpu = |v: u64| (v > 0).then(|| v.saturating_mul(machine.cpus.max(1)));
        Thresholds {
            process_memory: config.process_memory.resolve(machine.total_memory),
            system_memory: config.system_memory.resolve(machine.total_memory),
            in_process: per_cpu(config.in_process_per_cpu),
            threads: per_cpu(config.threads_per_cpu),
            database_size: (config.database_size > 0).then_some(config.database_size),
            database_sessions: per_cpu(config.database_sessions_per_cpu),
        }
    }

    /// The threshold of one condition (None: off, or not a resource condition).
    pub fn of(&self, condition: Condition) -> Option<u64> {
        match condition {
            Condition::ProcessMemory => self.process_memory,
            Condition::SystemMemory => self.system_memory,
            Condition::InProcess => self.in_process,
            Condition::Threads => self.threads,
            Condition::DatabaseSize => self.database_size,
            Condition::DatabaseSessions => self.database_sessions,
            Condition::RateImbalance
            | Condition::Override
            | Condition::DownstreamOutage
            | Condition::DownstreamLatency => None,
        }
    }
}

/// Sensor values for one tick. Not `#[non_exhaustive]`: whoever drives a [`Controller`](super::Controller)
/// (a simulation, a benchmark) builds it, most fields left at their defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Readings {
    /// Process resident memory, bytes.
    pub process_memory: u64,
    /// System used physical memory, bytes.
    pub system_memory_used: u64,
    /// Messages handed to handlers and not done.
    pub in_process: u64,
    /// Threads in the process.
    pub threads: u64,
    /// Messages in the host's queues.
    pub database_size: u64,
    /// Database connections in use.
    pub database_sessions: u64,
    /// Database connections in use, averaged over the delivery ceiling's reads since the
    /// last tick, when it guards them.
    pub database_sessions_mean: Option<f64>,
    /// Messages waiting in this host's receiving queues that have room below their limits
    /// (their last known depths): the backlog a delivery pace can be holding back.
    pub queued: u64,
    /// Messages in process in queues whose receives are at their limit (the gate full): the
    /// receives those queues make wait for handlers to finish, not for messages to arrive.
    /// Delivery's rate imbalance is judged only when most of what is in process is there (see
    /// `receives_wait_for_handlers` in `controller/conditions.rs`).
    pub in_process_at_limit: u64,
    /// How fast the stored backlog drains (messages/s over the last seconds), when known:
    /// what publishing is paced against under publishing pressure.
    pub database_drain_per_sec: Option<f64>,
    /// Delivery rates.
    pub delivery: RateReading,
    /// Publishing rates.
    pub publishing: RateReading,
    /// What the delivery ceiling measured for each guarded resource on which it held receives
    /// back since the last tick (see [`CeilingHolds`]).
    pub held: CeilingHolds,
    /// What the queues' downstream guards do (outage mode, the latency-aware limit).
    pub downstream: DownstreamGuards,
}

/// The queues' downstream guards as delivery conditions: the worst queue of each kind. The
/// queues decide when they are on (`queue::downstream`); the controller shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DownstreamGuards {
    /// Outage mode: failed attempts in a row against `consecutive_failures`.
    pub outage: GuardCondition,
    /// Latency-aware limit: the last interval's latency (ms) against the line it rose past.
    pub latency: GuardCondition,
}

/// One downstream guard: on or off, with the value and threshold it is judged by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GuardCondition {
    /// On (decided by the queue).
    pub active: bool,
    /// Its value.
    pub value: f64,
    /// Its threshold.
    pub threshold: f64,
}

impl DownstreamGuards {
    /// The guard a downstream condition shows.
    pub fn of(&self, condition: Condition) -> GuardCondition {
        match condition {
            Condition::DownstreamLatency => self.latency,
            _ => self.outage,
        }
    }
}

/// The resources the delivery ceiling guards between ticks: each grows with the messages in
/// process (memory they hold, in the process and so on the machine; blocking threads they
/// occupy; connections they keep open; the count itself), so it can be bounded by how many
/// receives start.
pub const CEILING_GUARDED: [Condition; 5] = [
    Condition::ProcessMemory,
    Condition::SystemMemory,
    Condition::Threads,
    Condition::DatabaseSessions,
    Condition::InProcess,
];

/// For each resource of [`CEILING_GUARDED`] on which the ceiling held receives back since the
/// last tick, because they would take it past its threshold: how many messages in process
/// fit under the threshold at what each one costs now.
///
/// A held condition is acting, so it shows as active (throttling that acts is never state
/// 0), and the delivery limits are cut to the tightest room of an estimated cost
/// ([`CeilingHolds::tightest`]), so that the limit an operator sees is the concurrency the
/// resource allows, not a number the ceiling quietly undercuts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CeilingHolds {
    /// Messages in process that process memory has room for.
    pub process_memory: Option<u64>,
    /// Messages in process that the machine's memory has room for.
    pub system_memory: Option<u64>,
    /// Messages in process that the thread threshold has room for.
    pub threads: Option<u64>,
    /// Messages in process that the database session threshold has room for.
    pub database_sessions: Option<u64>,
    /// Messages in process that the in-process threshold has room for: the threshold.
    pub in_process: Option<u64>,
}

impl CeilingHolds {
    /// The room measured for `condition`, when the ceiling held receives back on it.
    pub fn of(&self, condition: Condition) -> Option<u64> {
        let mut copy = *self;
        copy.slot(condition).and_then(|slot| *slot)
    }

    /// Records a hold on `condition` with this room (the largest seen since the last tick:
    /// the ceiling's estimate only grows as messages turn out cheaper).
    pub fn record(&mut self, condition: Condition, room: u64) {
        if let Some(slot) = self.slot(condition) {
            *slot = Some(slot.map_or(room, |r| r.max(room)));
        }
    }

    fn slot(&mut self, condition: Condition) -> Option<&mut Option<u64>> {
        match condition {
            Condition::ProcessMemory => Some(&mut self.process_memory),
            Condition::SystemMemory => Some(&mut self.system_memory),
            Condition::Threads => Some(&mut self.threads),
            Condition::DatabaseSessions => Some(&mut self.database_sessions),
            Condition::InProcess => Some(&mut self.in_process),
            _ => None,
        }
    }

    /// The smallest room among the held resources whose cost per message the ceiling
    /// estimates and for which `counts` (the condition is active). The in-process count is
    /// left out: its room is the threshold, exact, and the ceiling holds all queues together
    /// to it, so the busiest queues take what idle ones do not use. Cut to it, each queue's
    /// limit was a share of the threshold by its max, and a host whose maxes add up above the
    /// threshold showed every limit below its max in state 0.
    pub fn tightest(&self, counts: impl Fn(Condition) -> bool) -> Option<u64> {
        CEILING_GUARDED
            .into_iter()
            .filter(|c| *c != Condition::InProcess && counts(*c))
            .filter_map(|c| self.of(c))
            .min()
    }
}

impl Readings {
    pub(super) fn value(&self, condition: Condition) -> f64 {
        match condition {
            Condition::ProcessMemory => self.process_memory as f64,
            Condition::SystemMemory => self.system_memory_used as f64,
            Condition::InProcess => self.in_process as f64,
            Condition::Threads => self.threads as f64,
            Condition::DatabaseSize => self.database_size as f64,
            Condition::DatabaseSessions => self.database_sessions as f64,
            Condition::DownstreamOutage => self.downstream.outage.value,
            Condition::DownstreamLatency => self.downstream.latency.value,
            Condition::RateImbalance | Condition::Override => 0.0,
        }
    }

    pub(super) fn rates(&self, direction: Direction) -> RateReading {
        match direction {
            Direction::Delivery => self.delivery,
            Direction::Publishing => self.publishing,
        }
    }
}
