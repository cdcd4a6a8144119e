//! `throttlehost demo`: runs on a machine without a database, serves /metrics while it runs,
//! and exits 0 when --duration ends.
// A plain (non-async) test: blocking sleeps are what it wants.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn get(url: &str) -> Option<String> {
    let mut response = ureq::get(url).call().ok()?;
    response.body_mut().read_to_string().ok()
}

#[test]
fn demo_runs_for_its_duration_serves_metrics_and_exits_zero() {
    let port = common::free_port();
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args([
            "demo",
            "--duration",
            "6",
            "--admin",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut metrics = None;
    while started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(500));
        if let Some(text) = get(&format!("http://127.0.0.1:{port}/metrics"))
            && text.contains("throttlehost_messages_processed_total")
        {
            metrics = Some(text);
            break;
        }
    }
    let metrics = metrics.expect("/metrics answered with processed counters while the demo ran");
    assert!(metrics.contains("throttlehost_throttling_state{direction=\"delivery\"}"));
    let status = get(&format!("http://127.0.0.1:{port}/status")).expect("/status answers");
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["queues"][0]["name"], "orders");
    let output = child.wait_with_output().unwrap();
    let elapsed = started.elapsed();
    assert!(output.status.success(), "exit status {}", output.status);
    assert!(
        elapsed >= Duration::from_secs(5) && elapsed < Duration::from_secs(25),
        "{elapsed:?}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("phase 1/5: steady"), "live table printed");
    assert!(stdout.contains("delivery"), "{stdout}");
}
