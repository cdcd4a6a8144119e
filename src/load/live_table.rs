//! The live table `throttlehost demo` and `load --display table` print once a second: each
//! direction's state, wait, rates and active conditions, each queue's limit, in flight and
//! depth, and the resources beside their thresholds.

use std::fmt::Write as _;

use super::record::Sample;
use super::units::format_wait;
use crate::config::units::format_byte_size;
use crate::status::QueueStatus;
use crate::throttling::Condition;
use crate::throttling::controller::ConditionStatus;

fn condition_text(c: &ConditionStatus) -> String {
    let fmt = |v: f64| match c.condition {
        Condition::ProcessMemory | Condition::SystemMemory => format_byte_size(v as u64),
        Condition::RateImbalance => format!("{v:.0}/s"),
        _ => format!("{v:.0}"),
    };
    if c.condition == Condition::Override {
        "override".into()
    } else {
        format!(
            "{} {}/{}",
            c.condition.name(),
            fmt(c.value),
            fmt(c.threshold)
        )
    }
}

/// The live table at `sample`, with the receiving `queues` as they are now.
pub(crate) fn render(
    queues: &[QueueStatus],
    sample: &Sample,
    phase: &str,
    index: usize,
    phases: usize,
    admin: Option<std::net::SocketAddr>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out);
    let admin = admin
        .map(|a| format!("   http://{a}/status"))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "t={:>5.1}s  phase {}/{}: {}{}",
        sample.t,
        index + 1,
        phases.max(1),
        phase,
        admin
    );
    direction_rows(sample, &mut out);
    queue_rows(queues, &mut out);
    resource_row(sample, &mut out);
    out
}

/// The live table's rows for the two directions: state, wait, rates, active conditions.
fn direction_rows(sample: &Sample, out: &mut String) {
    let d = &sample.snapshot.decision;
    let r = &sample.snapshot.readings;
    let _ = writeln!(
        out,
        "  {:<11}{:<38}{:>8}  {:>15}  active conditions",
        "direction", "state", "wait", "in/out msg/s"
    );
    for (name, dd, rates) in [
        ("delivery", &d.delivery, r.delivery),
        ("publishing", &d.publishing, r.publishing),
    ] {
        let conditions: Vec<String> = dd.active().map(condition_text).collect();
        let _ = writeln!(
            out,
            "  {:<11}{:<38}{:>8}  {:>15}  {}",
            name,
            format!("{} {}", dd.state, dd.state_name),
            format_wait(dd.effective_wait()),
            format!(
                "{:.0}/{:.0}",
                rates.incoming_per_sec, rates.outgoing_per_sec
            ),
            if conditions.is_empty() {
                "-".into()
            } else {
                conditions.join(", ")
            }
        );
    }
}

/// The live table's row per receiving queue.
fn queue_rows(queues: &[QueueStatus], out: &mut String) {
    let _ = writeln!(
        out,
        "  {:<24}{:<9}{:>5}{:>7}{:>11}{:>8}",
        "queue", "model", "max", "limit", "in-flight", "depth"
    );
    for q in queues {
        let model = format!("{:?}", q.model).to_lowercase();
        let _ = writeln!(
            out,
            "  {:<24}{:<9}{:>5}{:>7}{:>11}{:>8}",
            q.name, model, q.max, q.limit, q.in_flight, q.depth
        );
    }
}

/// The live table's resources beside their thresholds.
fn resource_row(sample: &Sample, out: &mut String) {
    let r = &sample.snapshot.readings;
    let th = &sample.snapshot.thresholds;
    let threshold = |t: Option<u64>, bytes: bool| match t {
        None => "off".to_string(),
        Some(v) if bytes => format_byte_size(v),
        Some(v) => v.to_string(),
    };
    let _ = writeln!(
        out,
        "  rss {} (threshold {})  in-process {} ({})  threads {} ({})  db size {} ({})  sessions {} ({})",
        format_byte_size(r.process_memory),
        threshold(th.process_memory, true),
        r.in_process,
        threshold(th.in_process, false),
        r.threads,
        threshold(th.threads, false),
        r.database_size,
        threshold(th.database_size, false),
        r.database_sessions,
        threshold(th.database_sessions, false),
    );
}
