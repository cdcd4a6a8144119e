//! Summaries of load runs, as the load tests read them: a run passed, a state appeared and
//! cleared, a condition's episodes stayed within the control bounds, a timeline's columns.

use serde_json::Value;

pub fn assert_passed(name: &str, summary: &Value) {
    assert_eq!(summary["passed"], true, "{name}: {summary:#}");
    assert_eq!(summary["expectations_met"], true, "{name}");
    assert_eq!(
        summary["control_violations"].as_array().map(Vec::len),
        Some(0),
        "{name}: {summary:#}"
    );
    assert_eq!(summary["messages_lost"], 0, "{name}");
    assert_eq!(summary["cleared"], true, "{name}");
    assert!(summary["messages_sent"].as_u64().unwrap() > 0, "{name}");
    assert_eq!(
        summary["messages_sent"], summary["messages_processed"],
        "{name}: every message processed"
    );
}

/// Seconds a direction spent in a state (0 when never).
pub fn seconds_in(summary: &Value, direction: &str, state: u8) -> f64 {
    summary["states_observed"][direction][state.to_string()]
        .as_f64()
        .unwrap_or(0.0)
}

/// The state appeared and the run ended back at 0 in both directions.
pub fn assert_appeared_and_cleared(name: &str, summary: &Value, direction: &str, state: u8) {
    assert!(
        seconds_in(summary, direction, state) > 0.0,
        "{name}: {direction} state {state} never appeared: {summary:#}"
    );
    assert_eq!(
        summary["cleared"], true,
        "{name}: did not return to state 0"
    );
}

/// Every episode of `condition` engaged within 2 ticks, peaked at most at `peak`, flipped at
/// most twice and recovered within 10 s; at least one episode happened.
pub fn assert_controlled(name: &str, summary: &Value, condition: &str, peak: f64) {
    let episodes = episodes_of(summary, condition);
    assert!(
        !episodes.is_empty(),
        "{name}: no {condition} episode: {summary:#}"
    );
    for e in episodes {
        assert!(e["engage_samples"].as_u64().unwrap() <= 2, "{name}: {e}");
        assert!(e["peak_ratio"].as_f64().unwrap() <= peak, "{name}: {e}");
        assert!(e["flips"].as_u64().unwrap() <= 2, "{name}: {e}");
        assert!(
            e["recovery_seconds"].as_f64().unwrap() <= 10.0,
            "{name}: {e}"
        );
    }
}

/// The named columns of every row of a run's `timeline.csv`; removes the run's directory.
pub fn timeline_columns<const N: usize>(
    out: &std::path::Path,
    names: [&str; N],
) -> Vec<[String; N]> {
    let csv = std::fs::read_to_string(out.join("timeline.csv")).unwrap();
    let _ = std::fs::remove_dir_all(out);
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let columns = names.map(|name| header.iter().position(|c| *c == name).unwrap());
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .map(|f| columns.map(|c| f[c].to_string()))
        .collect()
}

/// The run's episodes of `condition`.
pub fn episodes_of<'a>(s: &'a Value, condition: &str) -> Vec<&'a Value> {
    s["episodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["condition"] == condition)
        .collect()
}

pub fn assert_one_episode(name: &str, s: &Value, condition: &str) {
    assert_eq!(
        episodes_of(s, condition).len(),
        1,
        "{name}: {:#}",
        s["episodes"]
    );
}

/// The record of phase `name`.
pub fn phase<'a>(summary: &'a Value, name: &str) -> &'a Value {
    summary["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no phase {name}: {summary:#}"))
}

pub fn number(v: &Value, field: &str) -> f64 {
    v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
}
