//! The shipped load scenarios that need the wall clock, scaled down, through the real
//! `throttlehost load` command: those on PostgreSQL, and those whose cause is a real resource
//! of the process (its memory, its threads, the machine's memory). The memory-transport
//! scenarios with simulated causes run in paused time in tests/load_paused.rs. Each test
//! states what it expects itself (which states appear and clear, control quality per episode,
//! nothing lost by id) instead of trusting the run's own `passed`. A scenario whose verdict
//! hangs on time or memory (control bounds, detection times, latencies, peaks) runs alone:
//! process memory, threads and CPU are shared resources. Those that check only what was done
//! (every message once, key order, stage barriers, error-queue counts) may run two at a time
//! with each other, and do not ask the command's verdict where it would judge control.
//!
//! The real-resource scenarios whose control bounds `src/throttling/simulation/` checks in
//! simulated time are ignored here, so their verdicts do not hang on the machine's load;
//! `cargo test --test load_scenarios -- --ignored` runs them.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde_json::Value;

use common::load::*;

/// Held for writing by a run that must be alone, for reading by one that may share.
static TURNS: RwLock<()> = RwLock::new(());

/// Scenarios whose tests check only what was done, not how fast or how well held.
const CORRECTNESS_ONLY: &[&str] = &[
    "drain",
    "drain-postgres",
    "drain-postgres-batch",
    "drain-postgres-ordered",
    "drain-postgres-forward",
    "publish-fanout",
    "ordered-three-hosts",
    "staged-three-hosts",
];

/// This run's turn: shared with other correctness-only runs, else alone.
enum Turn<'a> {
    Shared(#[allow(dead_code)] RwLockReadGuard<'a, ()>),
    Alone(#[allow(dead_code)] RwLockWriteGuard<'a, ()>),
}

impl Turn<'static> {
    fn shared() -> Self {
        Turn::Shared(TURNS.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn alone() -> Self {
        Turn::Alone(TURNS.write().unwrap_or_else(|e| e.into_inner()))
    }
}

fn turn(name: &str) -> Turn<'static> {
    if CORRECTNESS_ONLY.contains(&name) {
        Turn::shared()
    } else {
        Turn::alone()
    }
}

/// PostgreSQL connections the runs sharing a turn may hold together: the server's default
/// `max_connections` is 100 with 3 kept for superusers, and the tests' own clients need a few.
/// Two three-host runs (3 pools of 20) started side by side once and a peer was refused with
/// "too many clients already".
const CONNECTION_BUDGET: u32 = 80;

static CONNECTIONS_IN_USE: Mutex<u32> = Mutex::new(0);
static CONNECTIONS_RETURNED: Condvar = Condvar::new();

/// The connections a run of `load/<name>.toml` may open, taken from the budget until dropped.
struct Connections(u32);

impl Connections {
    fn take_for(name: &str) -> Self {
        let wanted = connections_of(name).min(CONNECTION_BUDGET);
        let mut in_use = CONNECTIONS_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        while *in_use + wanted > CONNECTION_BUDGET {
            in_use = CONNECTIONS_RETURNED
                .wait(in_use)
                .unwrap_or_else(|e| e.into_inner());
        }
        *in_use += wanted;
        Connections(wanted)
    }
}

impl Drop for Connections {
    fn drop(&mut self) {
        let mut in_use = CONNECTIONS_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        *in_use -= self.0;
        CONNECTIONS_RETURNED.notify_all();
    }
}

/// Each process's pool plus its listener and the run's own connection, for every process of
/// a PostgreSQL scenario; none for the memory transport.
fn connections_of(name: &str) -> u32 {
    let text = std::fs::read_to_string(format!("load/{name}.toml")).unwrap();
    let scenario: toml::Table = toml::from_str(&text).unwrap();
    let transport = scenario.get("transport").and_then(|t| t.as_table());
    if transport.and_then(|t| t.get("kind")?.as_str()) != Some("postgres") {
        return 0;
    }
    let pool = transport
        .and_then(|t| t.get("pool_size")?.as_integer())
        .unwrap_or(20);
    let processes = scenario
        .get("processes")
        .and_then(|p| p.as_integer())
        .unwrap_or(1);
    u32::try_from(processes * (pool + 2)).unwrap()
}

/// Runs `load/<name>.toml` at `scale` and returns its summary and output directory; the run
/// must pass.
fn run(name: &str, scale: f64, schema: Option<&str>) -> (Value, PathBuf) {
    let (summary, out, output) = run_unscored(name, scale, schema);
    let text = String::from_utf8_lossy(&output.stdout);
    // The run's and its peers' own words (a peer that could not start says why only there).
    let said = String::from_utf8_lossy(&output.stderr);
    let said: Vec<&str> = said.lines().rev().take(40).collect();
    assert!(
        output.status.success(),
        "{name} failed:\n{text}\n{summary:#}\nlast of its standard error:\n{}",
        said.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    (summary, out)
}

/// Runs `load/<name>.toml` at `scale`: its summary, output directory and the process output,
/// whether or not the run passed.
fn run_unscored(
    name: &str,
    scale: f64,
    schema: Option<&str>,
) -> (Value, PathBuf, std::process::Output) {
    let _turn = turn(name);
    let _connections = Connections::take_for(name);
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
    (summary, out, output)
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
    assert_appeared_and_cleared("process-memory", &summary, "delivery", 4);
    assert_controlled("process-memory", &summary, "process_memory", 1.15);
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
#[ignore = "wall-clock; its bounds are checked in simulated time by src/throttling/simulation/ (run: cargo test --test load_scenarios -- --ignored)"]
fn system_memory() {
    let s = scenario("system-memory", 0.6);
    assert_appeared_and_cleared("system-memory", &s, "delivery", 5);
    assert_appeared_and_cleared("system-memory", &s, "publishing", 5);
    assert_controlled("system-memory", &s, "system_memory", 1.15);
}

#[test]
#[ignore = "wall-clock; its bounds are checked in simulated time by src/throttling/simulation/ (run: cargo test --test load_scenarios -- --ignored)"]
fn thread_count() {
    let s = scenario("threads", 0.6);
    assert_appeared_and_cleared("threads", &s, "delivery", 9);
    assert_controlled("threads", &s, "threads", 1.15);
}

#[test]
#[ignore = "wall-clock; memory's bounds are checked in simulated time by src/throttling/simulation/, a hand-over to an override by quality's unit tests and override_delivery (run: cargo test --test load_scenarios -- --ignored)"]
fn mixed() {
    let s = scenario("mixed", 0.6);
    // In-process (3) cannot show here: its exact ceiling keeps it at the threshold while
    // memory leads.
    for (direction, state) in [("delivery", 4), ("delivery", 10), ("publishing", 11)] {
        assert_appeared_and_cleared("mixed", &s, direction, state);
    }
    // Memory is held although the handlers turn costly while 60 cheap ones are in process;
    // the override that follows takes over from it (one flip out, not a flap).
    assert_controlled("mixed", &s, "process_memory", 1.15);
}

#[test]
fn drain_memory() {
    let s = scenario("drain", 1.0);
    assert_eq!(s["messages_processed"], 20000);
    assert!(s["throughput_per_second"].as_f64().unwrap() > 0.0);
}

/// Full length: the flood must outgrow the threshold even when a busy CI machine stores only
/// ~180 messages a second (at 0.6 x it peaked at 1 055 of 1 500 there).
#[test]
fn database_size_on_postgres() {
    let s = pg_scenario("database-size", 1.0);
    assert_appeared_and_cleared("database-size", &s, "publishing", 6);
    assert_controlled("database-size", &s, "database_size", 1.10);
}

/// Only the publisher changes: it floods past the threshold and slows, the consumers go on
/// as before. State 6 ends within 10 s of the flood ending, the depth within 1.10 x.
#[test]
#[ignore = "wall-clock; the release after an open-loop flood is checked in simulated time by src/throttling/simulation/ (run: cargo test --test load_scenarios -- --ignored)"]
fn database_size_after_an_open_loop_flood_on_postgres() {
    let s = pg_scenario("database-size-open-loop", 1.0);
    assert_appeared_and_cleared("database-size-open-loop", &s, "publishing", 6);
    assert_controlled("database-size-open-loop", &s, "database_size", 1.10);
}

/// Memory per message doubling step by step: each step is held under 1.15 x the threshold
/// (the memory ceiling stops new receives between ticks).
#[test]
#[ignore = "wall-clock; its bounds are checked in simulated time by src/throttling/simulation/ (run: cargo test --test load_scenarios -- --ignored)"]
fn memory_per_message_rising_in_steps_is_held_at_the_threshold() {
    let s = scenario("memory-steps", 0.6);
    assert_appeared_and_cleared("memory-steps", &s, "delivery", 4);
    assert_controlled("memory-steps", &s, "process_memory", 1.15);
}

/// Slow, memory-hungry handlers push in-process and process memory at once: memory (4) leads
/// and is held; in-process never passes 1.15 x either (memory engages first and keeps it
/// below its line, so it need not have an episode of its own).
#[test]
#[ignore = "wall-clock; its bounds are checked in simulated time by src/throttling/simulation/ (run: cargo test --test load_scenarios -- --ignored)"]
fn two_causes_at_once_are_both_held() {
    let (s, out) = run("together", 0.6, None);
    assert_passed("together", &s);
    assert_appeared_and_cleared("together", &s, "delivery", 4);
    assert_controlled("together", &s, "process_memory", 1.15);
    // In-process, tick by tick from the timeline.
    let csv = std::fs::read_to_string(out.join("timeline.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let column = |name: &str| header.iter().position(|c| *c == name).unwrap();
    let (value, threshold) = (column("in_process"), column("in_process_threshold"));
    let peak = lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter_map(|f| {
            let t: f64 = f[threshold].parse().ok()?;
            (t > 0.0).then(|| f[value].parse::<f64>().unwrap_or(0.0) / t)
        })
        .fold(0.0f64, f64::max);
    assert!(
        peak > 0.5 && peak <= 1.15,
        "together: in-process peaked at {peak:.2} x its threshold"
    );
    let _ = std::fs::remove_dir_all(out);
}

#[test]
#[ignore = "wall-clock; its bounds are checked in simulated time by src/throttling/simulation/ (run: cargo test --test load_scenarios -- --ignored)"]
fn database_sessions_on_postgres() {
    let s = pg_scenario("database-sessions", 0.6);
    assert_appeared_and_cleared("database-sessions", &s, "publishing", 8);
    assert_appeared_and_cleared("database-sessions", &s, "delivery", 8);
    // The publisher's own sends come on top of what the ceiling lets delivery hold.
    assert_controlled("database-sessions", &s, "database_sessions", 1.35);
}

#[test]
fn drain_on_postgres() {
    let s = pg_scenario("drain-postgres", 1.0);
    assert_eq!(s["messages_processed"], 20000);
}

/// Batch receive on PostgreSQL: everything drained once, in a small process.
#[test]
fn batch_drain_on_postgres() {
    let s = pg_scenario("drain-postgres-batch", 1.0);
    assert_eq!(s["messages_processed"], 20000);
    assert_eq!(s["messages_duplicated"], 0);
    // The test's debug build peaks at 39.5-42 MiB (release: 21 MiB), the load tool's ledger
    // of 20 000 messages included; holding the backlog's payloads would add far more.
    let rss = s["peak_rss_bytes"].as_u64().unwrap();
    assert!(
        rss <= 48 << 20,
        "peak RSS {rss} bytes while draining in batches"
    );
}

/// An ordered backlog on PostgreSQL: 10 000 messages over 1 000 keys drained in key order
/// (the ledger fails the run on any violation), nothing lost or repeated.
#[test]
fn ordered_drain_on_postgres() {
    let s = pg_scenario("drain-postgres-ordered", 1.0);
    assert_eq!(s["messages_processed"], 10000);
    assert_eq!(s["messages_duplicated"], 0);
    assert_eq!(s["key_order_violations"], 0);
}

/// Key order between processes: three host processes (this run's and two peers) drain
/// one ordered queue of shuffled keys; every process handles part of it, and the ledger,
/// fed by all three, finds every key in order and nothing lost or doubled.
#[test]
fn three_host_processes_keep_every_keys_order() {
    let s = pg_scenario("ordered-three-hosts", 1.0);
    assert_eq!(s["messages_processed"], 10000);
    assert_eq!(s["messages_duplicated"], 0);
    assert_eq!(s["key_order_violations"], 0);
    assert_every_process_took_part("ordered-three-hosts", &s, 3);
}

/// Stage barriers between processes: ten stages over three host processes, none started
/// before the stage before it had ended in any process.
#[test]
fn three_host_processes_keep_the_stage_barriers() {
    let s = pg_scenario("staged-three-hosts", 1.0);
    assert_eq!(s["messages_processed"], 3000);
    assert_eq!(s["messages_duplicated"], 0);
    assert_eq!(s["stage_barrier_violations"], 0);
    assert_every_process_took_part("staged-three-hosts", &s, 3);
}

/// The run reports `processes` counts of messages done, each above zero, adding up to all.
fn assert_every_process_took_part(name: &str, s: &Value, processes: usize) {
    let done: Vec<u64> = s["messages_done_by_process"]
        .as_array()
        .unwrap_or_else(|| panic!("{name}: {s:#}"))
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(done.len(), processes, "{name}: {done:?}");
    assert!(
        done.iter().all(|&n| n > 0),
        "{name}: a process handled nothing: {done:?}"
    );
    assert_eq!(
        done.iter().sum::<u64>(),
        s["messages_processed"].as_u64().unwrap(),
        "{name}"
    );
}

/// Key order while the controller governs the queue: the in-process condition holds an
/// ordered queue of 500 keys at its threshold and clears; no key runs out of order.
///
/// Everything the scenario expects is checked except how soon state 0 comes after the
/// cause: a debug build beside the rest of the suite recovers later than the release build
/// the bound is scored on (it read 10.9 and 11.7 s on a busy machine), and the recovery of
/// the in-process condition is checked in simulated time by src/throttling/simulation/.
#[test]
fn ordered_work_obeys_the_in_process_threshold() {
    let schema = common::PgSchema::new();
    let (s, out, _) = run_unscored("ordered-postgres", 1.0, Some(&schema.name));
    let _ = std::fs::remove_dir_all(out);
    let violations: Vec<&str> = s["control_violations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .filter(|v| !v.contains("after the cause ended"))
        .collect();
    assert!(violations.is_empty(), "ordered-postgres: {violations:?}");
    assert_eq!(s["missing_states"], serde_json::json!([]), "{s:#}");
    assert_eq!(s["messages_lost"], 0);
    assert_appeared_and_cleared("ordered-postgres", &s, "delivery", 3);
    for e in episodes_of(&s, "in_process") {
        assert!(e["engage_samples"].as_u64().unwrap() <= 2, "{e}");
        assert!(e["peak_ratio"].as_f64().unwrap() <= 1.15, "{e}");
        assert!(e["flips"].as_u64().unwrap() <= 2, "{e}");
    }
    assert_eq!(s["messages_processed"], 10000);
    assert_eq!(s["key_order_violations"], 0);
    // The delivery ceiling holds the count; the queue's limit is left at its max.
    assert_eq!(s["min_concurrency_limit"]["orders"], 64);
}

/// A batch's outbox on PostgreSQL: every message drained once and its forwarded copy
/// stored once, by the multi-row insert each batch commits with.
#[test]
fn forwarding_batch_drain_on_postgres() {
    let schema = common::PgSchema::new();
    let (summary, out) = run("drain-postgres-forward", 0.25, Some(&schema.name));
    assert_passed("drain-postgres-forward", &summary);
    let _ = std::fs::remove_dir_all(out);
    let processed = summary["messages_processed"].as_u64().unwrap();
    assert!(processed >= 5000, "{summary:#}");
    assert_eq!(summary["messages_duplicated"], 0);
    let forwarded: i64 = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let client = schema.client().await;
        let table = format!("\"{}\".\"forwarded\"", schema.name);
        client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0)
    });
    assert_eq!(forwarded as u64, processed, "one copy per message");
}

/// Publish/subscribe under throttling on PostgreSQL: each order's event reaches its three
/// subscribers once (processed = 4 x sent: the order and three copies), and the subscribers'
/// growth throttles publishing (state 6), handlers' events included. What was done, not how
/// well the growth was held: this run shares the machine with other correctness runs, so the
/// command's own verdict, which includes the episode's control bounds, is not asked (one read
/// a peak of 1.13 against 1.12 while a build ran beside the suite). How well database size is
/// held is `database_size_on_postgres`'s question, which runs alone, and the simulation's.
#[test]
fn a_handlers_events_reach_three_subscribers_under_throttling() {
    let schema = common::PgSchema::new();
    let (s, out, _) = run_unscored("publish-fanout", 1.0, Some(&schema.name));
    let _ = std::fs::remove_dir_all(out);
    assert_eq!(s["expectations_met"], true, "{s:#}");
    // Written only when a peer process failed to run or stop cleanly.
    assert!(s.get("peer_failures").is_none(), "{s:#}");
    let sent = s["messages_sent"].as_u64().unwrap();
    assert!(sent > 500, "{s:#}");
    assert_eq!(s["messages_processed"].as_u64().unwrap(), 4 * sent, "{s:#}");
    for field in [
        "messages_lost",
        "messages_duplicated",
        "messages_in_error_queue",
    ] {
        assert_eq!(s[field], 0, "{field}: {s:#}");
    }
    assert!(seconds_in(&s, "publishing", 6) > 0.0, "{s:#}");
    assert_eq!(s["cleared"], true, "{s:#}");
}

/// A memory condition on a batch queue: every receive turns single while delivery is
/// throttled, the limit shrinks, memory stays under its bound and the state clears.
#[test]
#[ignore = "wall-clock; memory's bounds are checked in simulated time by src/throttling/simulation/ and on the real host by process_memory_writes_its_timeline_chart_and_summary, single receives while throttled by tests/receive_batch.rs (run: cargo test --test load_scenarios -- --ignored)"]
fn process_memory_with_batch_receive() {
    let s = scenario("process-memory-batch", 0.6);
    assert_appeared_and_cleared("process-memory-batch", &s, "delivery", 4);
    assert_controlled("process-memory-batch", &s, "process_memory", 1.15);
    assert!(
        s["min_concurrency_limit"]["orders"].as_u64().unwrap() < 32,
        "the limit shrank"
    );
}

/// Runs `throttlehost load` on a scenario text that must be rejected; returns its stderr.
fn rejected(text: &str) -> String {
    let path = std::env::temp_dir().join(format!("th-rejected-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(&path, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["load"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(path);
    assert_eq!(out.status.code(), Some(2), "not rejected");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_bad_scenario_is_rejected_with_its_line() {
    let stderr = rejected(
        "name = 'x'\n[[queues]]\nname = 'q'\n[expect]\ndelivery_states = [3]\n[[phases]]\nname = 'p'\nduration = '1s'\npublish_rate = -5\n",
    );
    assert!(
        stderr.contains(":9:") && stderr.contains("phases[0].publish_rate"),
        "{stderr}"
    );
}

#[test]
fn an_unmet_state_expectation_fails_the_run() {
    // The in-process scenario expecting a state it cannot show (5, system memory) fails.
    let text = std::fs::read_to_string("load/in-process.toml")
        .unwrap()
        .replace("delivery_states = [3]", "delivery_states = [5]");
    let path = std::env::temp_dir().join(format!("th-wrong-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(&path, text).unwrap();
    // It checks only that the run fails, so it may share its turn.
    let _turn = Turn::shared();
    let out_dir = std::env::temp_dir().join(format!("th-wrong-out-{}", uuid::Uuid::new_v4()));
    let out = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["load"])
        .arg(&path)
        .args(["--duration-scale", "0.1", "--out"])
        .arg(&out_dir)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["passed"], false);
    assert_eq!(summary["missing_states"][0], "delivery:5");
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_dir_all(out_dir);
}

/// A fleet-wide limit across processes while one is paused: three host processes share
/// `fleet_max = 12` over 10 000 messages of 50 ms; peer 1 is paused (SIGSTOP) for 30 s after
/// 10 s and resumed. Its handlers stop mid-run and its sessions stay open; the others count it
/// as gone after 10 s but keep off its share while its sessions are open, so when it resumes
/// the ledger never sees more than 12 running at once; nothing is lost. Before, its share was
/// taken at gone_after and its resumed handlers ran beside the others' full 12.
#[test]
#[ignore = "wall-clock, about 60 s (run: cargo test --test load_scenarios -- --ignored)"]
fn a_paused_host_process_never_makes_the_fleet_pass_its_limit() {
    let fleet = pg_scenario("fleet-paused-host", 1.0);
    assert_eq!(fleet["messages_lost"], 0);
    assert_eq!(fleet["messages_processed"], 10000);
    let peak = fleet["fleet_in_flight"]["peak"].as_u64().unwrap();
    assert!(peak <= 12, "{peak} in flight across the processes");
}

/// A fleet-wide limit across processes: three host processes share `fleet_max = 12` over a
/// 5 000-message backlog of 50 ms handlers. The ledger, fed by all three, never sees more than
/// 12 running at once; the first phase (all three alive) drains at >= 90 % of one host with
/// max 12; peer 1 is killed after 10 s and its place is filled again within the gone timeout
/// + 1 s (the scenario's expectations fail the run otherwise); nothing is lost.
#[test]
#[ignore = "wall-clock, about 50 s; the limit itself is checked in tests/fleet_limits.rs (run: cargo test --test load_scenarios -- --ignored)"]
fn three_host_processes_share_a_fleet_wide_limit_and_survive_a_kill() {
    let alone = pg_scenario("fleet-one-host", 1.0);
    let fleet = pg_scenario("fleet-three-hosts", 1.0);
    assert_eq!(fleet["messages_lost"], 0);
    assert_eq!(fleet["messages_processed"], 5000);
    let peak = fleet["fleet_in_flight"]["peak"].as_u64().unwrap();
    assert!(peak <= 12, "{peak} in flight across the processes");
    let refill = fleet["fleet_in_flight"]["refilled_after_kill_seconds"]
        .as_f64()
        .unwrap();
    assert!(
        refill <= 4.0,
        "the killed peer's place filled after {refill} s"
    );
    let one = alone["throughput_per_second"].as_f64().unwrap();
    let three = fleet["phases"][0]["done_per_second"].as_f64().unwrap();
    assert!(
        three >= 0.9 * one,
        "three hosts sharing 12: {three} msg/s, one host with 12: {one} msg/s"
    );
    // The recorded limit is this process's share, not its local max (16): a third of 12
    // while three hosts run, half of it once one is gone.
    let limit = |phase: usize| fleet["phases"][phase]["mean_limit_second_half"].as_f64();
    assert_eq!(limit(0), Some(4.0), "{:#}", fleet["phases"]);
    assert!(
        limit(1).is_some_and(|l| l > 4.0 && l <= 6.0),
        "{:#}",
        fleet["phases"]
    );
    let done: Vec<u64> = fleet["messages_done_by_process"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(
        done.iter().all(|&n| n > 0),
        "every process took part: {done:?}"
    );
}
