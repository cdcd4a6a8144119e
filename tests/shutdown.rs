//! Graceful shutdown: in-flight messages finish within the timeout or roll back; nothing is
//! lost either way. One test sends a real SIGTERM to `throttlehost run`.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::transport::{Payload, Transport};

use common::{PgBacklog, PgSchema, Probe, q, wait_until};

async fn remaining_ids(transport: &Arc<dyn Transport>, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(r) = transport.receive(&q(queue)).await.unwrap() {
        if let Payload::Message(m) = r.payload() {
            ids.push(m.logical_id());
        }
        r.commit().await.unwrap();
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_work_past_the_timeout_rolls_back_and_stays_queued() {
    let backlog = PgBacklog::new("work", 20, 16).await;
    let (transport, sent) = (&backlog.transport, &backlog.sent);
    let probe = Probe::new(Duration::from_secs(30));
    let host = backlog
        .host(backlog.config(ConcurrencyModel::Monitor, 4), &probe)
        .await;
    wait_until(Duration::from_secs(10), "4 in flight", || {
        probe.current.load(Ordering::SeqCst) == 4
    })
    .await;
    let report = host.shutdown_within(Duration::from_millis(300)).await;
    assert!(!report.drained);
    assert_eq!(report.rolled_back, 4);
    let left: HashSet<String> = remaining_ids(transport, "work").await.into_iter().collect();
    assert_eq!(&left, sent, "all 20 are back in the queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_work_within_the_timeout_finishes() {
    let backlog = PgBacklog::new("work", 20, 16).await;
    let (transport, sent) = (&backlog.transport, &backlog.sent);
    let probe = Probe::new(Duration::from_millis(500));
    let host = backlog
        .host(backlog.config(ConcurrencyModel::Fixed, 4), &probe)
        .await;
    wait_until(Duration::from_secs(10), "4 in flight", || {
        probe.current.load(Ordering::SeqCst) == 4
    })
    .await;
    let report = host.shutdown_within(Duration::from_secs(10)).await;
    assert!(report.drained);
    let handled: HashSet<String> = probe.ids.lock().unwrap().iter().cloned().collect();
    assert!(
        handled.len() >= 4 && handled.len() < 20,
        "{} handled",
        handled.len()
    );
    let left: HashSet<String> = remaining_ids(transport, "work").await.into_iter().collect();
    assert!(left.is_disjoint(&handled));
    assert_eq!(
        &(&left | &handled),
        sent,
        "every message either handled or still queued"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_binary_loses_nothing() {
    let schema = PgSchema::new();
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 8).await);
    transport.admin().create_queue(&q("work")).await.unwrap();
    let sent: HashSet<String> = common::fill(&transport, &q("work"), 30)
        .await
        .into_iter()
        .collect();
    let dir = std::env::temp_dir().join(format!("th-sigterm-{}", schema.name));
    std::fs::create_dir_all(&dir).unwrap();
    let done = dir.join("done.txt");
    let config = format!(
        r#"
[host]
name = "sigterm-test"
admin_address = "off"
shutdown_timeout = "20s"
[transport]
kind = "postgres"
connection_string = "{cs}"
schema = "{schema}"
[[queues]]
name = "work"
[queues.concurrency]
max = 3
[queues.handler]
kind = "command"
program = "sh"
args = ["-c", "sleep 1; echo \"$THROTTLEHOST_MESSAGE_ID\" >> {done}"]
"#,
        cs = schema.connection_string(),
        schema = schema.name,
        done = done.display()
    );
    let config_path = dir.join("host.toml");
    std::fs::write(&config_path, config).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["run", "--config"])
        .arg(&config_path)
        .spawn()
        .unwrap();
    // Signal once the first message has been handled, so the signal lands mid-drain.
    common::wait_until(Duration::from_secs(30), "a first handled message", || {
        std::fs::read_to_string(&done).is_ok_and(|text| !text.is_empty())
    })
    .await;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
    let handled: HashSet<String> = std::fs::read_to_string(&done)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    assert!(
        !handled.is_empty(),
        "some messages were handled before the signal"
    );
    let left: HashSet<String> = remaining_ids(&transport, "work")
        .await
        .into_iter()
        .collect();
    assert!(
        left.is_disjoint(&handled),
        "handled messages were committed"
    );
    assert_eq!(
        &left | &handled,
        sent,
        "nothing lost: {} handled + {} queued",
        handled.len(),
        left.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A receive stuck on a lock another session holds (or a frozen server) does not stretch the
/// shutdown to the command timeout (30 s; before the fix the host exited 26.7 s after
/// SIGTERM): the timeout, then a 2 s grace for the rollback, is the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_when_receives_wait_on_a_lock() {
    let backlog = PgBacklog::new("locked", 10, 10).await;
    let locker = backlog.schema.client().await;
    // EXCLUSIVE blocks the receives' DELETE but not the start-up checks' catalogue reads.
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE \"{}\".\"locked\" IN EXCLUSIVE MODE",
            backlog.schema.name
        ))
        .await
        .unwrap();
    let probe = Probe::new(Duration::ZERO);
    let host = backlog
        .host(backlog.config(ConcurrencyModel::Fixed, 2), &probe)
        .await;
    // Give the receivers time to block on the lock.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    let report = host.shutdown_within(Duration::from_secs(1)).await;
    let took = started.elapsed();
    assert!(!report.drained, "the stuck receives could not finish");
    assert!(
        took < Duration::from_secs(6),
        "shutdown took {took:?} with a 1 s timeout"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
    // The receives that were stuck now return: they must roll back, not run after shutdown.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(probe.handled(), 0, "nothing handled after shutdown");
    let left: i64 = locker
        .query_one(
            &format!(
                "SELECT count(*) FROM \"{}\".\"locked\"",
                backlog.schema.name
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 10, "nothing lost");
}
