//! Settings change without a restart: `throttlehost run` re-reads its file on SIGHUP and when
//! the file changes; an invalid file keeps the running settings.
// Plain (non-async) tests driving a process: blocking sleeps are what they want.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn config(port: u16, override_mode: &str, max: u32) -> String {
    format!(
        "[host]\nadmin_address = \"127.0.0.1:{port}\"\n[[queues]]\nname = \"orders\"\n[queues.concurrency]\nmax = {max}\n[queues.handler]\nkind = \"noop\"\n[throttling]\nsample_interval = \"100ms\"\n[throttling.delivery]\noverride = \"{override_mode}\"\n"
    )
}

fn status(port: u16) -> Option<serde_json::Value> {
    let mut r = ureq::get(&format!("http://127.0.0.1:{port}/status"))
        .call()
        .ok()?;
    serde_json::from_str(&r.body_mut().read_to_string().ok()?).ok()
}

/// The failed reloads the host has counted (its counter is exported from the start, at 0).
fn failed_reloads(port: u16) -> f64 {
    let text = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("throttlehost_config_reloads_total{result=\"error\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn wait_for(port: u16, what: &str, f: impl Fn(&serde_json::Value) -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if status(port).is_some_and(|s| f(&s)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}: {:?}", status(port));
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sighup_and_file_changes_reload_and_a_bad_file_keeps_the_settings() {
    let port = common::free_port();
    let dir = std::env::temp_dir().join(format!("th-reload-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("host.toml");
    std::fs::write(&path, config(port, "none", 4)).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["run", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let running = Running(child);
    wait_for(port, "the host", |s| {
        s["throttling"]["delivery"]["state"] == 0
    });

    // A file change: override on, max 9.
    std::fs::write(&path, config(port, "throttle", 9)).unwrap();
    wait_for(port, "override from the edited file", |s| {
        s["throttling"]["delivery"]["state"] == 10 && s["queues"][0]["max"] == 9
    });

    // An invalid file: the running settings stay once the host has read it (and counted
    // the failed reload).
    std::fs::write(&path, "[throttling]\nsample_interval = \"fast\"\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while failed_reloads(port) < 1.0 {
        assert!(Instant::now() < deadline, "the bad file read within 15 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let s = status(port).unwrap();
    assert_eq!(s["throttling"]["delivery"]["state"], 10);
    assert_eq!(s["queues"][0]["max"], 9);

    // SIGHUP after a change the watcher might miss (written, then signalled).
    std::fs::write(&path, config(port, "none", 3)).unwrap();
    let pid = running.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    wait_for(port, "override off after SIGHUP", |s| {
        s["throttling"]["delivery"]["state"] == 0 && s["queues"][0]["max"] == 3
    });
    drop(running);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Reload applies each queue's settings to that queue and its instance queue only, even when
/// another queue's name starts with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_reaches_each_queue_and_its_instance_queue_exactly() {
    use throttlehost::config::{Config, HandlerConfig, QueueConfig};
    let queue = |name: &str, max: u32, instance: bool| {
        let mut q = QueueConfig {
            name: name.into(),
            handler: Some(HandlerConfig::Noop),
            ..QueueConfig::default()
        };
        q.concurrency.max = max;
        q.instance_queue.enabled = instance;
        q
    };
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.host.instance_id = "n1".into();
    config.queues = vec![queue("a", 4, true), queue("a.b", 6, false)];
    let host = throttlehost::HostBuilder::new(config.clone())
        .start()
        .await
        .unwrap();
    config.queues[0].concurrency.max = 3;
    config.queues[0].instance_queue.max_concurrency = 2;
    config.queues[1].concurrency.max = 5;
    let restart = host.handle().apply_config(config);
    assert!(restart.is_empty(), "{restart:?}");
    let max = |name: &str| host.handle().queue_status(name).unwrap().max;
    assert_eq!((max("a"), max("a.n1"), max("a.b")), (3, 2, 5));
    host.shutdown().await;
}

/// SIGHUP keeps working when the file cannot be watched (here: its directory does not exist).
#[tokio::test]
async fn sighup_reloads_even_when_the_file_cannot_be_watched() {
    use throttlehost::config::reload::{Trigger, watch};
    let missing = std::env::temp_dir()
        .join(format!("th-missing-{}", std::process::id()))
        .join("host.toml");
    let (mut triggers, guard) = watch(&missing);
    assert!(!guard.watches_file());
    assert!(
        guard.problems()[0].contains(&missing.display().to_string()),
        "{:?}",
        guard.problems()
    );
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let trigger = tokio::time::timeout(Duration::from_secs(5), triggers.recv())
        .await
        .expect("a trigger within 5 s of SIGHUP");
    assert_eq!(trigger, Some(Trigger::Signal));
}
