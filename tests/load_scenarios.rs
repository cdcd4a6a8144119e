//! Every shipped load scenario, scaled down, through the real `throttlehost load` command: the
//! expected throttling states appear, clear afterwards, and no message is lost (counted by
//! id). Scenarios run one at a time: process memory, threads and CPU are shared resources.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `load/<name>.toml` at `scale` and returns its summary and output directory.
fn run(name: &str, scale: f64, schema: Option<&str>) -> (Value, PathBuf) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = std::env::temp_dir().join(format!("th-load-{name}-{}", uuid::Uuid::new_v4()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_throttlehost"));
    cmd.args([
        "load",
        &format!("load/{name}.toml"),
        "--duration-scale",
        &scale.to_string(),
        "--out",
    ])
    .arg(&out)
    .env("RUST_LOG", "error");
    if let Some(schema) = schema {
        cmd.args([
            "--schema",
            schema,
            "--connection-string",
            &common::database_url(),
        ]);
    }
    let output = cmd.output().unwrap();
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).unwrap_or_else(|e| {
            panic!(
                "{name}: no summary.json ({e}); stderr: {}",
                String::from_utf8_lossy(&output.stderr)
            )
        }),
    )
    .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{name} failed:\n{text}\n{summary:#}"
    );
    (summary, out)
}

fn assert_passed(name: &str, summary: &Value) {
    assert_eq!(summary["passed"], true, "{name}: {summary:#}");
    assert_eq!(summary["messages_lost"], 0, "{name}");
    assert_eq!(summary["cleared"], true, "{name}");
    assert!(summary["messages_sent"].as_u64().unwrap() > 0, "{name}");
    assert_eq!(
        summary["messages_sent"], summary["messages_processed"],
        "{name}: every message processed"
    );
}

fn scenario(name: &str, scale: f64) -> Value {
    let (summary, out) = run(name, scale, None);
    assert_passed(name, &summary);
    let _ = std::fs::remove_dir_all(out);
    summary
}

fn pg_scenario(name: &str, scale: f64) -> Value {
    let schema = common::PgSchema::new();
    let (summary, out) = run(name, scale, Some(&schema.name));
    assert_passed(name, &summary);
    let _ = std::fs::remove_dir_all(out);
    summary
}

#[test]
fn process_memory_writes_its_timeline_chart_and_summary() {
    let (summary, out) = run("process-memory", 0.6, None);
    assert_passed("process-memory", &summary);
    assert!(
        summary["states_observed"]["delivery"]["4"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        summary["min_concurrency_limit"]["orders"].as_u64().unwrap() < 32,
        "the limit shrank"
    );
    assert!(summary["peak_rss_bytes"].as_u64().unwrap() > 48 << 20);
    let csv = std::fs::read_to_string(out.join("timeline.csv")).unwrap();
    let mut lines = csv.lines();
    let header = lines.next().unwrap();
    for column in [
        "t_seconds",
        "delivery_state",
        "delivery_active",
        "process_memory_bytes",
        "process_memory_threshold_bytes",
        "limit_orders",
    ] {
        assert!(header.split(',').any(|c| c == column), "column {column}");
    }
    assert!(
        csv.contains(",4,") && csv.contains("process_memory"),
        "the episode is in the timeline"
    );
    assert!(lines.count() > 40, "a row per sample");
    let svg = std::fs::read_to_string(out.join("timeline.svg")).unwrap();
    assert!(
        svg.starts_with("<svg")
            && svg.contains("process memory pressure")
            && svg.contains("memory-hungry handlers")
    );
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn system_memory() {
    let s = scenario("system-memory", 0.6);
    assert!(s["states_observed"]["delivery"]["5"].as_f64().unwrap() > 0.0);
}

#[test]
fn in_process_messages() {
    scenario("in-process", 0.6);
}

#[test]
fn thread_count() {
    scenario("threads", 0.6);
}

#[test]
fn delivery_rate_imbalance() {
    scenario("delivery-rate", 0.6);
}

#[test]
fn publishing_rate_imbalance() {
    scenario("publishing-rate", 0.6);
}

#[test]
fn override_delivery() {
    scenario("override-delivery", 0.5);
}

#[test]
fn override_publishing() {
    scenario("override-publishing", 0.5);
}

#[test]
fn override_never() {
    let s = scenario("override-never", 0.6);
    assert_eq!(
        s["states_observed"]["delivery"].as_object().unwrap().len(),
        1,
        "delivery stays at 0"
    );
}

#[test]
fn mixed() {
    scenario("mixed", 0.6);
}

#[test]
fn drain_memory() {
    let s = scenario("drain", 1.0);
    assert_eq!(s["messages_processed"], 20000);
    assert!(s["throughput_per_second"].as_f64().unwrap() > 0.0);
}

#[test]
fn database_size_on_postgres() {
    pg_scenario("database-size", 0.6);
}

#[test]
fn database_sessions_on_postgres() {
    pg_scenario("database-sessions", 0.6);
}

#[test]
fn drain_on_postgres() {
    let s = pg_scenario("drain-postgres", 1.0);
    assert_eq!(s["messages_processed"], 20000);
}

#[test]
fn a_bad_scenario_is_rejected_with_its_line() {
    let path = std::env::temp_dir().join(format!("th-bad-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(&path, "name = 'x'\n[[queues]]\nname = 'q'\n[[phases]]\nname = 'p'\nduration = '1s'\npublish_rate = -5\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["load"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(":7:") && stderr.contains("phases[0].publish_rate"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(path);
}
