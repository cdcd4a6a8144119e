//! Builds the [`crate::status::HostStatus`] document from a running host.

use std::collections::BTreeMap;

use super::HostInner;
use crate::names::QueueName;
use crate::queue::QueueRuntime;
use crate::status::{
    DirectionStatus, FleetShareStatus, HostStatus, QueueStatus, ResourceStatus, ThrottlingStatus,
};
use crate::throttling::controller::{Decision, DirectionDecision};
use crate::throttling::explain::{describe_condition, explain};
use crate::throttling::{Condition, Direction};

fn direction_status(
    d: &DirectionDecision,
    rates: crate::throttling::rates::RateReading,
    resume_ratio: f64,
    limits: &BTreeMap<QueueName, (u32, u32)>,
    override_scope: crate::status::OverrideScope,
) -> DirectionStatus {
    DirectionStatus {
        state: d.state,
        state_name: d.state_name,
        delay_seconds: d.delay.as_secs_f64(),
        pacing_interval_seconds: d.pace.map(|p| p.as_secs_f64()),
        pace_messages_per_second: d.pace_rate,
        recovering: d.recovering,
        explanation: explain(d, resume_ratio, limits),
        state_duration_seconds: d.state_duration.as_secs_f64(),
        override_mode: d.override_mode,
        override_scope,
        active_conditions: d.active().copied().collect(),
        incoming_per_second: rates.incoming_per_sec,
        outgoing_per_second: rates.outgoing_per_sec,
        samples: rates.samples,
    }
}

pub(super) fn build(host: &HostInner) -> HostStatus {
    let config = host.config();
    let resume_ratio = config.throttling.resume_ratio;
    let throttling = host.control.snapshot().map(|s| {
        let d = &s.decision;
        let limits: BTreeMap<QueueName, (u32, u32)> = s
            .queues
            .iter()
            .map(|q| {
                let limit = d.queue_limits.get(&q.load.name).copied();
                (
                    q.load.name.clone(),
                    (q.load.max, limit.unwrap_or(q.load.max)),
                )
            })
            .collect();
        let resources = resource_statuses(d, resume_ratio);
        ThrottlingStatus {
            sampled_at_seconds: d.at.as_secs_f64(),
            enabled: s.enabled,
            delivery: direction_status(
                d.direction(Direction::Delivery),
                s.readings.delivery,
                resume_ratio,
                &limits,
                host.override_scope(Direction::Delivery),
            ),
            publishing: direction_status(
                d.direction(Direction::Publishing),
                s.readings.publishing,
                resume_ratio,
                &limits,
                host.override_scope(Direction::Publishing),
            ),
            resources,
        }
    });
    HostStatus {
        host: config.host.name.clone(),
        instance: host.instance.clone(),
        transport: host.transport.describe(),
        transaction_mode: config.transport.transaction_mode,
        uptime_seconds: host.started.elapsed().as_secs_f64(),
        receiving: host.is_receiving(),
        in_process: host.in_process(),
        database_silent_seconds: host
            .transport
            .host_hooks()
            .and_then(|hooks| hooks.silent_for())
            .map(|d| d.as_secs_f64()),
        throttling,
        queues: host.queues.iter().map(|q| queue_status(q)).collect(),
    }
}

/// The resources both directions watch, each once (rate imbalance and overrides belong to
/// one direction and are shown there).
fn resource_statuses(d: &Decision, resume_ratio: f64) -> Vec<ResourceStatus> {
    let mut resources: Vec<ResourceStatus> = Vec::new();
    for dir in [&d.delivery, &d.publishing] {
        for c in &dir.conditions {
            let shared = !matches!(c.condition, Condition::RateImbalance | Condition::Override);
            if shared && !resources.iter().any(|r| r.condition == c.condition) {
                let on = c.threshold > 0.0;
                resources.push(ResourceStatus {
                    condition: c.condition,
                    value: c.value,
                    threshold: on.then_some(c.threshold),
                    resume_below: on.then_some(c.threshold * resume_ratio),
                    percent_of_threshold: on.then(|| 100.0 * c.value / c.threshold),
                    active: c.active,
                    text: describe_condition(c, resume_ratio),
                });
            }
        }
    }
    resources
}

/// One receiving queue as `/status` shows it.
fn queue_status(q: &QueueRuntime) -> QueueStatus {
    let settings = q.settings();
    let (succeeded_total, failed_total) = q.outcome_totals();
    QueueStatus {
        name: q.name().to_string(),
        model: q.model(),
        max: settings.max,
        limit: q.gate().effective(),
        fleet: settings.fleet_max.map(|fleet_max| FleetShareStatus {
            fleet_max,
            share: q.gate().fleet_share().min(fleet_max),
        }),
        in_flight: q.gate().in_flight(),
        peak_in_flight: q.gate().peak(),
        depth: q.depth().get(),
        loops: q.loops(),
        leads: q.leads(),
        delayed_moves: q.delayed_moves(),
        circuit_breaker: q.breaker().describe(),
        error_queue: q.error_queue().to_string(),
        error_queue_depth: q.error_depth().get(),
        succeeded_total,
        failed_total,
        downstream: q.downstream().reading(),
    }
}

/// What this host writes into the instance registry with each heartbeat: its state per
/// direction (code, name, cause, delay), messages in process and the rates, from the latest
/// controller tick.
pub(super) fn fleet_summary(host: &HostInner) -> serde_json::Value {
    let direction = |d: &DirectionDecision, rates: crate::throttling::rates::RateReading| {
        serde_json::json!({
            "state": d.state,
            "state_name": d.state_name,
            "cause": d.cause,
            "recovering": d.recovering,
            "delay_seconds": d.delay.as_secs_f64(),
            "incoming_per_second": rates.incoming_per_sec,
            "outgoing_per_second": rates.outgoing_per_sec,
        })
    };
    let throttling = host.control.snapshot().map(|s| {
        serde_json::json!({
            "delivery": direction(&s.decision.delivery, s.readings.delivery),
            "publishing": direction(&s.decision.publishing, s.readings.publishing),
        })
    });
    // The queues this host receives from, with the depth it knows: the instances leading a
    // queue publish their readings here for the others (`fleet::lead`).
    let queues: serde_json::Map<String, serde_json::Value> = host
        .queues
        .iter()
        .map(|q| (q.name().to_string(), q.depth().get().into()))
        .collect();
    // The queues whose delayed tables this host moves: only those lead a queue (`fleet::lead`).
    let moves_delayed: Vec<String> = host
        .queues
        .iter()
        .filter(|q| host.moves_delayed(q))
        .map(|q| q.name().to_string())
        .collect();
    serde_json::json!({
        "instance": host.instance,
        "in_process": host.in_process(),
        "receiving": host.is_receiving(),
        "throttling": throttling,
        "queues": queues,
        "moves_delayed": moves_delayed,
    })
}
