//! What a run leaves behind: `timeline.csv`, `summary.json`, a one-screen text summary, and
//! the live table the demo prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use serde::Serialize;

use super::record;
use super::record::{RunResult, Sample};
use super::scenario::Expect;
use crate::config::units::format_byte_size;
use crate::throttling::Direction;
use crate::throttling::controller::DirectionDecision;
use crate::throttling::quality::{self, Episode};

/// `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Scenario name.
    pub scenario: String,
    /// Transport description.
    pub transport: String,
    /// Length of the run, seconds.
    pub duration_seconds: f64,
    /// Per direction, each state code seen and its total seconds.
    pub states_observed: BTreeMap<&'static str, BTreeMap<String, f64>>,
    /// The states the scenario expects, per direction.
    pub expected_states: BTreeMap<&'static str, Vec<u8>>,
    /// Expected states that did not appear (`delivery:4`).
    pub missing_states: Vec<String>,
    /// States that appeared although the scenario forbids them.
    pub unexpected_states: Vec<String>,
    /// Every expected state appeared.
    pub expectations_met: bool,
    /// Both directions were back at state 0 at the end.
    pub cleared: bool,
    /// Longest wait imposed on an admission, either direction, seconds.
    pub max_delay_seconds: f64,
    /// The same per direction.
    pub max_delay_seconds_by_direction: BTreeMap<&'static str, f64>,
    /// Highest RSS seen.
    pub peak_rss_bytes: u64,
    /// Messages accepted by the publish path.
    pub messages_sent: u64,
    /// Handled successfully.
    pub messages_processed: u64,
    /// Moved to the error queue.
    pub messages_in_error_queue: u64,
    /// Dropped as expired.
    pub messages_expired: u64,
    /// Poison rows.
    pub messages_poison: u64,
    /// Sent minus processed, error, expired (by id), minus still queued.
    pub messages_lost: u64,
    /// Still in a queue at the end.
    pub messages_remaining: u64,
    /// Handled successfully more than once.
    pub messages_duplicated: u64,
    /// Messages of a keyed backlog handled out of their key's order or beside another of it.
    pub key_order_violations: u64,
    /// The first such violation, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_key_order_violation: Option<String>,
    /// Messages of a staged backlog that started before the stage before theirs had ended.
    pub stage_barrier_violations: u64,
    /// The first such violation, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_stage_barrier_violation: Option<String>,
    /// Sends refused by the publish path.
    pub send_failures: u64,
    /// Messages done by each host process: the run's own first, then its peers.
    pub messages_done_by_process: Vec<u64>,
    /// Peer processes that failed to run or stop cleanly, in words.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peer_failures: Vec<String>,
    /// Messages in flight across the processes (a queue with a fleet-wide limit): the most at
    /// once, and the refill after a killed peer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_in_flight: Option<super::in_flight::FleetInFlight>,
    /// Messages done per second from the first phase to the last message done.
    pub throughput_per_second: f64,
    /// Seconds from the first phase's start to the last message done.
    pub busy_seconds: f64,
    /// Lowest effective concurrency limit seen per queue.
    pub min_concurrency_limit: BTreeMap<String, u32>,
    /// Phases with start and end, seconds.
    pub phases: Vec<PhaseRecord>,
    /// Control quality per episode (a guarded resource crossing its threshold).
    pub episodes: Vec<Episode>,
    /// Control bounds of `[expect]` that an episode broke, in words.
    pub control_violations: Vec<String>,
    /// expectations met, control bounds held, cleared, nothing lost.
    pub passed: bool,
}

/// A phase in `summary.json`, with what the handlers' downstream saw in it.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseRecord {
    /// Name.
    pub name: String,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
    /// Handler calls (attempts, failed ones included) per second in the phase.
    pub calls_per_second: f64,
    /// Handler calls per second from the first sample of the phase in outage mode to its end
    /// (None when no queue was in outage mode in it).
    pub calls_per_second_in_outage: Option<f64>,
    /// Seconds from the phase's start to the first sample in outage mode.
    pub outage_detected_after: Option<f64>,
    /// Messages done (any outcome) per second in the phase.
    pub done_per_second: f64,
    /// Handler call latency in the phase, milliseconds: median, 99th percentile.
    pub latency_p50_ms: Option<f64>,
    /// See `latency_p50_ms`.
    pub latency_p99_ms: Option<f64>,
    /// The first queue's effective limit, averaged over the second half of the phase.
    pub mean_limit_second_half: Option<f64>,
}

/// The value at `share` (0 to 1) of sorted `values`.
fn percentile(values: &[f32], share: f64) -> Option<f64> {
    let last = values.len().checked_sub(1)?;
    let at = ((last as f64) * share).round() as usize;
    Some(f64::from(values[at.min(last)]))
}

/// A phase's record from the samples taken in it.
fn phase_record(p: &super::record::PhaseSpan, samples: &[super::record::Sample]) -> PhaseRecord {
    let inside: Vec<&super::record::Sample> = samples
        .iter()
        .filter(|s| s.t >= p.start && s.t <= p.end)
        .collect();
    let rate = |from: Option<&&super::record::Sample>, f: fn(&super::record::Sample) -> u64| {
        let (first, last) = (from?, inside.last()?);
        let seconds = last.t - first.t;
        (seconds > 0.0).then(|| (f(last) - f(first).min(f(last))) as f64 / seconds)
    };
    let outage_from = inside.iter().find(|s| s.outage);
    let half = (p.start + p.end) / 2.0;
    let limits: Vec<f64> = inside
        .iter()
        .filter(|s| s.t >= half)
        .filter_map(|s| s.queues.first().map(|q| f64::from(q.1)))
        .collect();
    let ms = |v: Option<f64>| v.map(|s| (s * 10_000.0).round() / 10.0);
    PhaseRecord {
        name: p.name.clone(),
        start: round1(p.start),
        end: round1(p.end),
        calls_per_second: round1(rate(inside.first(), |s| s.calls).unwrap_or(0.0)),
        calls_per_second_in_outage: rate(outage_from, |s| s.calls).map(round1),
        outage_detected_after: outage_from.map(|s| round1(s.t - p.start)),
        done_per_second: round1(rate(inside.first(), |s| s.done).unwrap_or(0.0)),
        latency_p50_ms: ms(percentile(&p.latencies, 0.5)),
        latency_p99_ms: ms(percentile(&p.latencies, 0.99)),
        mean_limit_second_half: (!limits.is_empty())
            .then(|| round1(limits.iter().sum::<f64>() / limits.len() as f64)),
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Builds the summary of a run.
pub fn summarize(run: &RunResult) -> Summary {
    let observed = Observed::of(run);
    let states = observed.states;
    let e = &run.expect;
    let (missing, unexpected) = state_expectations(e, &states);
    let (max_delay, peak_rss, min_limit) =
        (observed.max_delay, observed.peak_rss, observed.min_limit);
    let a = &run.accounting;
    let done = a.processed + a.in_error_queue + a.expired + a.poison;
    let throughput = if run.busy_seconds > 0.0 {
        done as f64 / run.busy_seconds
    } else {
        0.0
    };
    let expectations_met = missing.is_empty() && unexpected.is_empty();
    let (episodes, control_violations) = scored_episodes(run);
    let passed = expectations_met
        && control_violations.is_empty()
        && run.cleared
        && a.lost == 0
        && a.order_violations == 0
        && a.stage_violations == 0
        && a.peer_failures.is_empty();
    Summary {
        scenario: run.scenario.clone(),
        transport: run.transport.clone(),
        duration_seconds: round1(run.samples.last().map(|s| s.t).unwrap_or(0.0)),
        states_observed: states,
        expected_states: BTreeMap::from([
            ("delivery", e.delivery_states.clone()),
            ("publishing", e.publishing_states.clone()),
        ]),
        missing_states: missing,
        unexpected_states: unexpected,
        expectations_met,
        cleared: run.cleared,
        max_delay_seconds: max_delay.values().copied().fold(0.0, f64::max),
        max_delay_seconds_by_direction: max_delay,
        peak_rss_bytes: peak_rss,
        messages_sent: a.sent,
        messages_processed: a.processed,
        messages_in_error_queue: a.in_error_queue,
        messages_expired: a.expired,
        messages_poison: a.poison,
        messages_lost: a.lost,
        messages_remaining: a.remaining,
        messages_duplicated: a.duplicated,
        key_order_violations: a.order_violations,
        first_key_order_violation: a.first_order_violation.clone(),
        stage_barrier_violations: a.stage_violations,
        first_stage_barrier_violation: a.first_stage_violation.clone(),
        send_failures: a.send_failures,
        messages_done_by_process: a.done_by_process.clone(),
        peer_failures: a.peer_failures.clone(),
        fleet_in_flight: a.fleet_in_flight.clone(),
        throughput_per_second: throughput.round(),
        busy_seconds: round1(run.busy_seconds),
        min_concurrency_limit: min_limit,
        phases: run
            .phases
            .iter()
            .map(|p| phase_record(p, &run.samples))
            .collect(),
        passed,
        episodes,
        control_violations,
    }
}

/// The run's episodes, scored from its ticks and the phases that offered each cause, and
/// the bounds they broke (none judged in a direction the run left uncontrolled) with the
/// fleet limit's.
fn scored_episodes(run: &RunResult) -> (Vec<Episode>, Vec<String>) {
    let episodes = quality::episodes(
        &record::ticks(&run.samples),
        run.resume_ratio,
        &record::cause_spans(&run.phases),
    );
    let controlled: Vec<Episode> = episodes
        .iter()
        .filter(|e| !run.uncontrolled.contains(&e.direction))
        .cloned()
        .collect();
    let mut violations = control_violations(&run.expect, &controlled);
    violations.extend(fleet_violations(
        &run.expect,
        run.accounting.fleet_in_flight.as_ref(),
    ));
    (episodes, violations)
}

/// The expected states that were not seen, and the absent ones that were, as
/// `direction:code`.
fn state_expectations(
    e: &Expect,
    states: &BTreeMap<&'static str, BTreeMap<String, f64>>,
) -> (Vec<String>, Vec<String>) {
    let seen = |direction: &str, code: &u8| {
        states
            .get(direction)
            .is_some_and(|m| m.contains_key(&code.to_string()))
    };
    let mut missing = Vec::new();
    let mut unexpected = Vec::new();
    for (direction, expected, absent) in [
        ("delivery", &e.delivery_states, &e.delivery_absent),
        ("publishing", &e.publishing_states, &e.publishing_absent),
    ] {
        missing.extend(
            expected
                .iter()
                .filter(|c| !seen(direction, c))
                .map(|c| format!("{direction}:{c}")),
        );
        unexpected.extend(
            absent
                .iter()
                .filter(|c| seen(direction, c))
                .map(|c| format!("{direction}:{c}")),
        );
    }
    (missing, unexpected)
}

/// What a run's samples show: seconds in each state per direction (rounded to 0.1 s), the
/// longest wait per direction, peak RSS, and each queue's lowest limit.
struct Observed {
    states: BTreeMap<&'static str, BTreeMap<String, f64>>,
    max_delay: BTreeMap<&'static str, f64>,
    peak_rss: u64,
    min_limit: BTreeMap<String, u32>,
}

impl Observed {
    fn of(run: &RunResult) -> Self {
        let mut states: BTreeMap<&'static str, BTreeMap<String, f64>> = BTreeMap::new();
        let mut max_delay: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut min_limit: BTreeMap<String, u32> = BTreeMap::new();
        let mut peak_rss = 0;
        let mut previous_t = 0.0;
        for s in &run.samples {
            let dt = s.t - previous_t;
            previous_t = s.t;
            for direction in Direction::ALL {
                let d = s.snapshot.decision.direction(direction);
                *states
                    .entry(direction.name())
                    .or_default()
                    .entry(d.state.to_string())
                    .or_default() += dt;
                let wait = max_delay.entry(direction.name()).or_default();
                *wait = wait.max(d.effective_wait().as_secs_f64());
            }
            peak_rss = peak_rss.max(s.snapshot.readings.process_memory);
            for (name, limit, _, _) in &s.queues {
                let m = min_limit.entry(name.clone()).or_insert(*limit);
                *m = (*m).min(*limit);
            }
        }
        for per_direction in states.values_mut() {
            for seconds in per_direction.values_mut() {
                *seconds = round1(*seconds);
            }
        }
        Observed {
            states,
            max_delay,
            peak_rss,
            min_limit,
        }
    }
}

/// The fleet-wide bounds of `expect` that the run broke, in words.
fn fleet_violations(
    expect: &Expect,
    seen: Option<&super::in_flight::FleetInFlight>,
) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(max) = expect.max_fleet_in_flight {
        match seen {
            None => {
                out.push("no fleet-wide in-flight count was kept (no queue has fleet_max)".into())
            }
            Some(f) if f.peak > max => out.push(format!(
                "{} messages were in flight at once across the processes (max {max})",
                f.peak
            )),
            _ => {}
        }
    }
    if let Some(max) = expect.max_refill_after_kill_seconds {
        match seen.map(|f| f.refilled_after_kill_seconds) {
            Some(Some(s)) if s <= max => {}
            Some(Some(s)) => out.push(format!(
                "the processes left took {s:.1}s to fill the killed peer's place (max {max}s)"
            )),
            _ => out.push("the killed peer's place was never filled again".into()),
        }
    }
    out
}

/// The control bounds of `expect` that `episodes` break, in words.
pub fn control_violations(expect: &Expect, episodes: &[Episode]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(min) = expect.min_episodes
        && (episodes.len() as u32) < min
    {
        out.push(format!(
            "{} control episodes, expected at least {min}",
            episodes.len()
        ));
    }
    for e in episodes {
        let name = format!(
            "{} ({}) at {:.1}s",
            e.condition.name(),
            e.direction.name(),
            e.crossed_at
        );
        match (expect.max_engage_samples, e.engage_samples) {
            (Some(_), None) => out.push(format!("{name}: never engaged")),
            (Some(max), Some(n)) if n > max => out.push(format!(
                "{name}: engaged {n} ticks after the crossing (max {max})"
            )),
            _ => {}
        }
        let peak_bound = match e.condition {
            _ if !quality::bounds_peak(e.condition) => None,
            crate::throttling::Condition::DatabaseSize => expect
                .max_database_size_peak_ratio
                .or(expect.max_peak_ratio),
            _ => expect.max_peak_ratio,
        };
        if let Some(max) = peak_bound
            && e.peak_ratio > max
        {
            out.push(format!(
                "{name}: peaked at {:.2} x its threshold (max {max})",
                e.peak_ratio
            ));
        }
        if let Some(max) = expect.max_flips
            && e.flips > max
        {
            out.push(format!("{name}: {} state flips (max {max})", e.flips));
        }
        match (expect.max_recovery_seconds, e.recovery_seconds) {
            (Some(_), None) => out.push(format!("{name}: never returned to state 0")),
            (Some(max), Some(s)) if s > max => out.push(format!(
                "{name}: state 0 came {s:.1}s after the cause ended (max {max}s)"
            )),
            _ => {}
        }
    }
    out
}

fn active_list(d: &DirectionDecision) -> String {
    let names: Vec<&str> = d.active().map(|c| c.condition.name()).collect();
    names.join("|")
}

/// The columns of `timeline.csv` before each queue's limit, in flight and depth.
const CSV_COLUMNS: &str = "t_seconds,phase,delivery_state,delivery_wait_seconds,delivery_active,delivery_incoming_per_second,delivery_outgoing_per_second,\
publishing_state,publishing_wait_seconds,publishing_active,publishing_incoming_per_second,publishing_outgoing_per_second,\
process_memory_bytes,process_memory_threshold_bytes,system_memory_used_bytes,system_memory_threshold_bytes,\
in_process,in_process_threshold,threads,threads_threshold,database_size,database_size_threshold,\
database_sessions,database_sessions_threshold,messages_sent,messages_done,\
delivery_waiting,delivery_pace_per_second,publishing_waiting,publishing_pace_per_second,database_sessions_mean";

/// Writes `timeline.csv`: one row per sample.
pub fn write_csv(run: &RunResult, path: &Path) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let queue_names: Vec<String> = run
        .samples
        .first()
        .map(|s| s.queues.iter().map(|q| q.0.clone()).collect())
        .unwrap_or_default();
    let mut header = String::from(CSV_COLUMNS);
    for q in &queue_names {
        let _ = write!(header, ",limit_{q},in_flight_{q},depth_{q}");
    }
    writeln!(out, "{header}")?;
    for s in &run.samples {
        writeln!(out, "{}", csv_row(s))?;
    }
    out.flush()
}

/// One sample as a row of `timeline.csv`.
fn csv_row(s: &Sample) -> String {
    let d = &s.snapshot.decision;
    let r = &s.snapshot.readings;
    let th = &s.snapshot.thresholds;
    let off = |t: Option<u64>| t.unwrap_or(0);
    let mut row = format!(
        "{:.3},{},{},{:.6},{},{:.1},{:.1},{},{:.6},{},{:.1},{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.1},{},{:.1},{}",
        s.t,
        csv_field(&s.phase),
        d.delivery.state,
        d.delivery.effective_wait().as_secs_f64(),
        active_list(&d.delivery),
        r.delivery.incoming_per_sec,
        r.delivery.outgoing_per_sec,
        d.publishing.state,
        d.publishing.effective_wait().as_secs_f64(),
        active_list(&d.publishing),
        r.publishing.incoming_per_sec,
        r.publishing.outgoing_per_sec,
        r.process_memory,
        off(th.process_memory),
        r.system_memory_used,
        off(th.system_memory),
        r.in_process,
        off(th.in_process),
        r.threads,
        off(th.threads),
        r.database_size,
        off(th.database_size),
        r.database_sessions,
        off(th.database_sessions),
        s.sent,
        s.done,
        r.delivery.waiting,
        d.delivery.pace_rate.unwrap_or(0.0),
        r.publishing.waiting,
        d.publishing.pace_rate.unwrap_or(0.0),
        // Empty when nothing guards the sessions (the ceiling keeps no mean then).
        r.database_sessions_mean
            .map_or(String::new(), |m| format!("{m:.1}")),
    );
    for (_, limit, in_flight, depth) in &s.queues {
        let _ = write!(row, ",{limit},{in_flight},{depth}");
    }
    row
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Writes `timeline.csv`, `timeline.svg` and `summary.json` into `dir`.
pub fn write_outputs(run: &RunResult, summary: &Summary, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    write_csv(run, &dir.join("timeline.csv"))?;
    super::chart::write_svg(run, &dir.join("timeline.svg"))?;
    let json = serde_json::to_string_pretty(summary).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("summary.json"), json + "\n")
}

/// The one-screen text summary.
pub fn text_summary(s: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "scenario {} on {} ({:.1}s)",
        s.scenario, s.transport, s.duration_seconds
    );
    out.push_str(&states_summary(s));
    text_details(s, &mut out);
    out
}

/// The states each direction went through, with seconds.
pub fn states_summary(s: &Summary) -> String {
    let mut out = String::new();
    for (direction, states) in &s.states_observed {
        let direction_enum = Direction::parse(direction).unwrap_or(Direction::Delivery);
        let list: Vec<String> = states
            .iter()
            .map(|(code, secs)| {
                let name = crate::throttling::state_name(direction_enum, code.parse().unwrap_or(0));
                format!("{code} {name} {secs:.1}s")
            })
            .collect();
        let _ = writeln!(out, "  {direction:<10} states: {}", list.join(", "));
    }
    out
}

fn text_details(s: &Summary, out: &mut String) {
    episode_lines(s, out);
    let _ = writeln!(
        out,
        "  max delay {:.3}s   peak RSS {}   throughput {:.0} msg/s",
        s.max_delay_seconds,
        format_byte_size(s.peak_rss_bytes),
        s.throughput_per_second
    );
    message_lines(s, out);
    if !s.min_concurrency_limit.is_empty() {
        let limits: Vec<String> = s
            .min_concurrency_limit
            .iter()
            .map(|(q, l)| format!("{q} {l}"))
            .collect();
        let _ = writeln!(out, "  lowest concurrency limit: {}", limits.join(", "));
    }
    verdict_line(s, out);
}

/// Each episode's control quality, then each violation of the bounds.
fn episode_lines(s: &Summary, out: &mut String) {
    for e in &s.episodes {
        let or_never = |v: Option<String>| v.unwrap_or_else(|| "never".into());
        let _ = writeln!(
            out,
            "  episode {} ({}) at {:.1}s: engaged after {} ticks, peak {:.2} x threshold, {} flips, state 0 {} after the cause ended",
            e.condition.name(),
            e.direction.name(),
            e.crossed_at,
            or_never(e.engage_samples.map(|n| n.to_string())),
            e.peak_ratio,
            e.flips,
            or_never(e.recovery_seconds.map(|r| format!("{r:.1}s"))),
        );
    }
    for v in &s.control_violations {
        let _ = writeln!(out, "  CONTROL: {v}");
    }
}

/// What became of the messages: in all, by process, and in flight across the processes.
fn message_lines(s: &Summary, out: &mut String) {
    let _ = writeln!(
        out,
        "  messages: sent {}  processed {}  error queue {}  expired {}  remaining {}  duplicated {}  LOST {}",
        s.messages_sent,
        s.messages_processed,
        s.messages_in_error_queue,
        s.messages_expired,
        s.messages_remaining,
        s.messages_duplicated,
        s.messages_lost
    );
    if s.messages_done_by_process.len() > 1 {
        let each: Vec<String> = s
            .messages_done_by_process
            .iter()
            .map(u64::to_string)
            .collect();
        let _ = writeln!(
            out,
            "  processes: {} (this one, then its peers), messages done by each: {}",
            each.len(),
            each.join(" / ")
        );
    }
    if let Some(f) = &s.fleet_in_flight {
        let refill = f
            .refilled_after_kill_seconds
            .map(|r| format!(", place of the killed peer filled again {r:.1}s after the kill"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  in flight across the processes: at most {}{refill}",
            f.peak
        );
    }
}

/// PASS, or FAIL with every reason.
fn verdict_line(s: &Summary, out: &mut String) {
    let verdict = if s.passed { "PASS" } else { "FAIL" };
    let mut reasons = Vec::new();
    if !s.missing_states.is_empty() {
        reasons.push(format!(
            "expected states not seen: {}",
            s.missing_states.join(", ")
        ));
    }
    if !s.unexpected_states.is_empty() {
        reasons.push(format!(
            "forbidden states seen: {}",
            s.unexpected_states.join(", ")
        ));
    }
    if !s.cleared {
        reasons.push("throttling did not clear at the end".into());
    }
    if s.messages_lost > 0 {
        reasons.push(format!("{} messages lost", s.messages_lost));
    }
    if s.stage_barrier_violations > 0 {
        reasons.push(format!(
            "{} stage-barrier violations (first: {})",
            s.stage_barrier_violations,
            s.first_stage_barrier_violation.as_deref().unwrap_or("?")
        ));
    }
    for failure in &s.peer_failures {
        reasons.push(failure.clone());
    }
    if s.key_order_violations > 0 {
        reasons.push(format!(
            "{} key-order violations (first: {})",
            s.key_order_violations,
            s.first_key_order_violation.as_deref().unwrap_or("?")
        ));
    }
    let _ = writeln!(
        out,
        "  {verdict}{}",
        if reasons.is_empty() {
            String::new()
        } else {
            format!(": {}", reasons.join("; "))
        }
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::ThrottlingConfig;
    use crate::load::record::Accounting;
    use crate::names::QueueName;
    use crate::throttling::controller::{
        Controller, MachineFacts, QueueLoad, Readings, Thresholds,
    };
    use crate::throttling::service::Snapshot;
    use std::time::Duration;

    const MACHINE: MachineFacts = MachineFacts {
        total_memory: 1 << 30,
        cpus: 1,
    };

    /// A run whose in-process count follows `in_process` (one value per 0.25 s tick, threshold
    /// 50), decided by the real controller.
    fn run_of(in_process: &[u64], expect: Expect, lost: u64, cleared: bool) -> RunResult {
        let config = ThrottlingConfig {
            in_process_per_cpu: 50,
            ..ThrottlingConfig::default()
        };
        let thresholds = Thresholds::resolve(&config, MACHINE);
        let mut controller = Controller::new(config, thresholds);
        let samples = in_process
            .iter()
            .enumerate()
            .map(|(i, &value)| {
                let t = i as f64 * 0.25;
                let readings = Readings {
                    in_process: value,
                    threads: 1,
                    ..Readings::default()
                };
                let loads = [QueueLoad {
                    name: QueueName::new("orders").expect("a valid name"),
                    max: 100,
                    in_flight: value as u32,
                }];
                let decision = controller.tick(Duration::from_secs_f64(t), &readings, &loads);
                Sample {
                    t,
                    phase: "p".into(),
                    snapshot: Arc::new(Snapshot {
                        enabled: true,
                        decision,
                        readings,
                        thresholds,
                        machine: MACHINE,
                        queues: Vec::new(),
                    }),
                    queues: Vec::new(),
                    sent: 0,
                    done: 0,
                    calls: 0,
                    outage: false,
                }
            })
            .collect();
        RunResult {
            scenario: "hand-built".into(),
            transport: "memory".into(),
            samples,
            phases: Vec::new(),
            accounting: Accounting {
                sent: 100,
                processed: 100 - lost,
                lost,
                ..Accounting::default()
            },
            busy_seconds: 10.0,
            cleared,
            expect,
            resume_ratio: 0.9,
            uncontrolled: Vec::new(),
        }
    }

    fn expect_state_3() -> Expect {
        Expect {
            delivery_states: vec![3],
            max_engage_samples: Some(2),
            max_peak_ratio: Some(1.15),
            max_flips: Some(2),
            max_recovery_seconds: Some(10.0),
            min_episodes: Some(1),
            ..Expect::default()
        }
    }

    /// Crosses 50, held at 52 for a second, then falls away (and the limit grows back).
    const CONTROLLED: &[u64] = &[
        10, 30, 49, 52, 52, 52, 52, 40, 20, 10, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5,
    ];

    #[test]
    fn a_controlled_episode_passes() {
        let s = summarize(&run_of(CONTROLLED, expect_state_3(), 0, true));
        assert!(s.passed, "{s:#?}");
        assert_eq!(s.missing_states, Vec::<String>::new());
        assert_eq!(s.episodes.len(), 1);
        assert!(
            s.control_violations.is_empty(),
            "{:?}",
            s.control_violations
        );
        assert_eq!(s.throughput_per_second, 10.0);
    }

    #[test]
    fn a_lost_message_fails_the_run() {
        let s = summarize(&run_of(CONTROLLED, expect_state_3(), 1, true));
        assert!(!s.passed);
        assert_eq!(s.messages_lost, 1);
    }

    #[test]
    fn a_missing_state_and_an_unwanted_one_fail_the_run() {
        let mut expect = expect_state_3();
        expect.delivery_states = vec![4];
        expect.delivery_absent = vec![3];
        let s = summarize(&run_of(CONTROLLED, expect, 0, true));
        assert!(!s.passed);
        assert_eq!(s.missing_states, vec!["delivery:4".to_string()]);
        assert_eq!(s.unexpected_states, vec!["delivery:3".to_string()]);
    }

    #[test]
    fn an_overshoot_fails_the_run_by_its_bound() {
        let overshoot = &[10, 30, 49, 80, 60, 52, 40, 20, 10, 5, 5];
        let s = summarize(&run_of(overshoot, expect_state_3(), 0, true));
        assert!(!s.passed);
        assert!(
            s.control_violations
                .iter()
                .any(|v| v.contains("peaked at 1.60 x its threshold (max 1.15)")),
            "{:?}",
            s.control_violations
        );
    }

    #[test]
    fn not_clearing_and_too_few_episodes_fail_the_run() {
        let s = summarize(&run_of(CONTROLLED, expect_state_3(), 0, false));
        assert!(!s.passed, "did not return to state 0");
        let mut expect = expect_state_3();
        expect.min_episodes = Some(2);
        let s = summarize(&run_of(CONTROLLED, expect, 0, true));
        assert!(!s.passed);
        assert!(
            s.control_violations[0].contains("1 control episodes, expected at least 2"),
            "{:?}",
            s.control_violations
        );
    }
}
