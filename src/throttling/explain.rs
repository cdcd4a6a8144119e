//! Throttling in words: what holds a direction back, what was done about it, and what has to
//! happen for it to end. `/status` serves these sentences and `throttlehost status` prints them,
//! so an operator reads "process memory 312 MiB, 104 % of its 300 MiB threshold" rather than
//! two raw floats.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::controller::{ConditionStatus, DirectionDecision};
use super::{Condition, Direction};
use crate::config::units::format_byte_size;
use crate::names::QueueName;

/// What a condition measures, for printing its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Measure {
    /// Bytes, printed as KiB/MiB/GiB.
    Bytes,
    /// A count with a unit word ("messages", "threads", "sessions").
    Count(&'static str),
    /// Messages per second.
    Rate,
    /// The user override (on/off).
    Switch,
}

impl Condition {
    /// What this condition's value and threshold measure.
    pub fn measure(self) -> Measure {
        match self {
            Condition::ProcessMemory | Condition::SystemMemory => Measure::Bytes,
            Condition::InProcess | Condition::DatabaseSize => Measure::Count("messages"),
            Condition::Threads => Measure::Count("threads"),
            Condition::DatabaseSessions => Measure::Count("sessions"),
            Condition::RateImbalance => Measure::Rate,
            Condition::Override => Measure::Switch,
            Condition::DownstreamOutage => Measure::Count("failed attempts in a row"),
            Condition::DownstreamLatency => Measure::Count("ms handler latency"),
        }
    }

    /// The condition's name in words ("process memory").
    pub fn words(self) -> &'static str {
        match self {
            Condition::RateImbalance => "incoming rate",
            Condition::ProcessMemory => "process memory",
            Condition::SystemMemory => "system memory",
            Condition::InProcess => "messages in process",
            Condition::Threads => "threads",
            Condition::DatabaseSize => "database size",
            Condition::DatabaseSessions => "database sessions",
            Condition::Override => "the throttling override",
            Condition::DownstreamOutage => "a queue's downstream (outage mode)",
            Condition::DownstreamLatency => "a queue's handler latency (latency-aware limit)",
        }
    }
}

/// A value in the condition's unit: "312 MiB", "1 200 messages", "95 msg/s".
pub(crate) fn format_value(measure: Measure, value: f64) -> String {
    match measure {
        Measure::Bytes => format_byte_size(value.max(0.0) as u64),
        Measure::Count(unit) => format!("{:.0} {unit}", value),
        Measure::Rate => format!("{value:.0} msg/s"),
        Measure::Switch => if value > 0.0 { "on" } else { "off" }.to_string(),
    }
}

/// One condition against its threshold, in words.
pub(crate) fn describe_condition(c: &ConditionStatus, resume_ratio: f64) -> String {
    let measure = c.condition.measure();
    match measure {
        Measure::Switch => "the throttling override is set to throttle".to_string(),
        Measure::Rate => format!(
            "incoming {} against {} allowed (outgoing x overdrive); resumes below {}",
            format_value(measure, c.value),
            format_value(measure, c.threshold),
            format_value(measure, c.threshold * resume_ratio),
        ),
        _ if c.threshold <= 0.0 => format!(
            "{} {} (threshold off)",
            c.condition.words(),
            format_value(measure, c.value)
        ),
        _ => format!(
            "{} {}, {:.0} % of its {} threshold; resumes below {} ({:.0} %)",
            c.condition.words(),
            format_value(measure, c.value),
            100.0 * c.value / c.threshold,
            format_value(measure, c.threshold),
            format_value(measure, c.threshold * resume_ratio),
            100.0 * resume_ratio,
        ),
    }
}

/// A direction's throttling explained; absent when the direction is not throttled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Explanation {
    /// The condition behind the state, with its value, threshold and resume line.
    pub cause: String,
    /// Each action in effect: the delay, the pace, every reduced queue limit.
    pub actions: Vec<String>,
    /// What has to happen for the state to return to 0.
    pub clears_when: String,
}

/// Explains `decision`. `limits` holds each queue's (max, effective limit); only delivery
/// reduces limits, so publishing ignores them.
pub(crate) fn explain(
    decision: &DirectionDecision,
    resume_ratio: f64,
    limits: &BTreeMap<QueueName, (u32, u32)>,
) -> Option<Explanation> {
    if decision.state == 0 {
        return None;
    }
    let cause_condition = decision.cause?;
    let status = decision
        .conditions
        .iter()
        .find(|c| c.condition == cause_condition);
    let mut cause = match status {
        Some(c) => describe_condition(c, resume_ratio),
        None => cause_condition.words().to_string(),
    };
    // Recovering says what is measured, not that the cause is gone: the value under its
    // resume line may be the actions' doing (handlers holding memory still run, fewer of
    // them), and saying "the cause has cleared" then was wrong for 1-4 polls in 15-25.
    if decision.recovering {
        cause = format!("under its resume line: {cause}");
    }
    Some(Explanation {
        cause,
        actions: actions_in_effect(decision, limits),
        clears_when: clears_when(decision.recovering, status, resume_ratio),
    })
}

/// The delay, the pace and (delivery) every reduced queue limit, in words.
fn actions_in_effect(
    decision: &DirectionDecision,
    limits: &BTreeMap<QueueName, (u32, u32)>,
) -> Vec<String> {
    let (one, many) = match decision.direction {
        Direction::Delivery => ("receive", "receives"),
        Direction::Publishing => ("send", "sends"),
    };
    let mut actions = Vec::new();
    if !decision.delay.is_zero() {
        actions.push(format!(
            "each {one} waits {}",
            format_duration(decision.delay)
        ));
    }
    if let Some(rate) = decision.pace_rate {
        actions.push(format!("{many} paced at {rate:.0} msg/s"));
    }
    if decision.direction == Direction::Delivery {
        for (queue, (max, limit)) in limits {
            if limit < max {
                actions.push(format!("queue {queue}: concurrency limit {max} -> {limit}"));
            }
        }
    }
    actions
}

/// What has to happen for the state to return to 0, given the cause's `status`.
fn clears_when(recovering: bool, status: Option<&ConditionStatus>, resume_ratio: f64) -> String {
    let resume_line =
        |c: &ConditionStatus| format_value(c.condition.measure(), c.threshold * resume_ratio);
    match (recovering, status) {
        (true, Some(c)) if c.condition != Condition::Override && c.threshold > 0.0 => format!(
            "the actions above relax while {} stays below {}; back to 0 once they have",
            c.condition.words(),
            resume_line(c)
        ),
        (true, _) => "the actions above relax; back to 0 once they have".to_string(),
        (false, Some(c)) if c.condition == Condition::Override => {
            "the override is set back to none".to_string()
        }
        (false, Some(c)) if c.threshold > 0.0 => format!(
            "{} falls below {}, then the actions relax",
            c.condition.words(),
            resume_line(c)
        ),
        (false, _) => "the cause clears, then the actions relax".to_string(),
    }
}

/// "120 ms", "2.5 s", "5 min".
pub(crate) fn format_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 120.0 {
        format!("{:.1} s", s)
    } else {
        format!("{:.0} min", s / 60.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OverrideMode;

    fn decision(direction: Direction, recovering: bool) -> DirectionDecision {
        DirectionDecision {
            direction,
            state: 4,
            state_name: "process memory",
            recovering,
            cause: Some(Condition::ProcessMemory),
            delay: Duration::from_millis(120),
            pace: None,
            pace_rate: None,
            state_duration: Duration::from_secs(3),
            override_mode: OverrideMode::None,
            conditions: vec![ConditionStatus {
                condition: Condition::ProcessMemory,
                state: 4,
                active: !recovering,
                value: 312.0 * 1024.0 * 1024.0,
                threshold: 300.0 * 1024.0 * 1024.0,
            }],
        }
    }

    #[test]
    fn names_the_cause_in_units_the_action_and_the_resume_line() {
        let limits = BTreeMap::from([
            (QueueName::new("orders").unwrap(), (64, 18)),
            (QueueName::new("audit").unwrap(), (4, 4)),
        ]);
        let e = explain(&decision(Direction::Delivery, false), 0.9, &limits).unwrap();
        assert_eq!(
            e.cause,
            "process memory 312MiB, 104 % of its 300MiB threshold; resumes below 270MiB (90 %)"
        );
        assert_eq!(
            e.actions,
            vec![
                "each receive waits 120 ms".to_string(),
                "queue orders: concurrency limit 64 -> 18".to_string()
            ]
        );
        assert_eq!(
            e.clears_when,
            "process memory falls below 270MiB, then the actions relax"
        );
    }

    #[test]
    fn publishing_shows_its_pace_and_no_queue_limits() {
        let mut d = decision(Direction::Publishing, false);
        d.delay = Duration::ZERO;
        d.pace_rate = Some(95.4);
        let limits = BTreeMap::from([(QueueName::new("orders").unwrap(), (64, 18))]);
        let e = explain(&d, 0.9, &limits).unwrap();
        assert_eq!(e.actions, vec!["sends paced at 95 msg/s".to_string()]);
    }

    #[test]
    fn recovering_says_what_is_measured_not_that_the_cause_is_gone() {
        let e = explain(&decision(Direction::Delivery, true), 0.9, &BTreeMap::new()).unwrap();
        assert!(
            e.cause.starts_with("under its resume line: process memory"),
            "{}",
            e.cause
        );
        assert!(!e.cause.contains("cleared") && !e.clears_when.contains("cleared"));
        assert!(
            e.clears_when
                .starts_with("the actions above relax while process memory stays below"),
            "{}",
            e.clears_when
        );
    }

    #[test]
    fn state_zero_has_no_explanation() {
        let mut d = decision(Direction::Delivery, false);
        d.state = 0;
        assert_eq!(explain(&d, 0.9, &BTreeMap::new()), None);
    }

    #[test]
    fn a_zero_threshold_reads_as_off() {
        let off = ConditionStatus {
            condition: Condition::DatabaseSize,
            state: 6,
            active: false,
            value: 12.0,
            threshold: 0.0,
        };
        assert_eq!(
            describe_condition(&off, 0.9),
            "database size 12 messages (threshold off)"
        );
    }
}
