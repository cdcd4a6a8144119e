//! Every metric named in DESIGN section 6 appears in /metrics of a running host. In paused
//! time: the host runs on the test's single-threaded runtime and each scrape on a blocking
//! thread, during which tokio does not move a paused clock.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{HandlerConfig, OverrideMode, SimulateConfig};
use throttlehost::message::OutgoingMessage;
use throttlehost::throttling::Direction;

/// DESIGN section 6, written out here on purpose (not taken from the code's catalogue).
const DESIGN_METRICS: &[&str] = &[
    "throttling_state{direction=\"delivery\"}",
    "throttling_state{direction=\"publishing\"}",
    "throttling_delay_seconds{direction=",
    "throttling_state_duration_seconds{direction=",
    "throttling_override{direction=",
    "throttling_condition_active{direction=\"delivery\",condition=\"process_memory\"}",
    "throttling_condition_active{direction=\"publishing\",condition=\"database_size\"}",
    "process_memory_bytes ",
    "process_memory_threshold_bytes ",
    "system_memory_used_bytes ",
    "system_memory_threshold_bytes ",
    "in_process_messages ",
    "in_process_messages_threshold ",
    "threads ",
    "threads_threshold ",
    "database_size_messages ",
    "database_size_threshold ",
    "database_sessions ",
    "database_sessions_threshold ",
    "rate_messages_per_second{direction=\"delivery\",side=\"incoming\"}",
    "rate_messages_per_second{direction=\"publishing\",side=\"outgoing\"}",
    "concurrency_limit{queue=\"orders\"}",
    "concurrency_max{queue=\"orders\"}",
    "in_flight{queue=\"orders\"}",
    "receive_loops{queue=\"orders\"}",
    "queue_depth{queue=\"orders\"}",
    "messages_received_total{queue=\"orders\"}",
    "messages_processed_total{queue=\"orders\",outcome=\"success\"}",
    "messages_processed_total{queue=\"orders\",outcome=\"retry\"}",
    "messages_processed_total{queue=\"orders\",outcome=\"error\"}",
    "messages_processed_total{queue=\"orders\",outcome=\"expired\"}",
    "messages_processed_total{queue=\"orders\",outcome=\"poison\"}",
    "messages_published_total{queue=\"orders\"}",
    "receive_attempts_total{queue=\"orders\",result=\"message\"}",
    "receive_attempts_total{queue=\"orders\",result=\"empty\"}",
    "receive_attempts_total{queue=\"orders\",result=\"error\"}",
    "config_reloads_total{result=",
    "handler_duration_seconds_bucket{queue=\"orders\",le=",
    "throttling_wait_seconds_bucket{direction=",
];

/// `host`'s `/metrics` text (the answer must be 200).
async fn metrics_text(host: &throttlehost::Host) -> String {
    let url = format!("http://{}/metrics", host.admin_address().unwrap());
    let (status, text, _) =
        tokio::task::spawn_blocking(move || common::http("GET", &url, b"", &[]))
            .await
            .unwrap();
    assert_eq!(status, 200);
    text
}

#[tokio::test(start_paused = true)]
async fn every_design_metric_is_exported() {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Simulate(SimulateConfig {
        latency: Duration::from_millis(1),
        failure_rate: 0.3,
        ..SimulateConfig::default()
    }));
    config.queues[0].immediate_retries = 1;
    config.throttling.publishing.override_mode = throttlehost::config::OverrideMode::Throttle;
    let dir = std::env::temp_dir().join(format!("th-metrics-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("host.toml");
    std::fs::write(&path, "[host]\nadmin_address = 'off'\n").unwrap();
    let host = HostBuilder::new(config).start().await.unwrap();
    // At once, not one after another: publishing is overridden to throttle, so each send
    // waits the delay in force, which grows while the override lasts (one after another,
    // the 40 took from under a second to over a minute, by when the first tick came).
    let sends = (0..40).map(|i| host.send("orders", OutgoingMessage::new(format!("m{i}"))));
    for sent in futures_util::future::join_all(sends).await {
        sent.unwrap();
    }
    let _ = host.handle().reload_from(&path);
    // Some series come with the first tick or upkeep after the sends: asked until all are
    // there (or the deadline), not after a fixed pause a busy machine may outlast.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (text, missing) = loop {
        let text = metrics_text(&host).await;
        let missing: Vec<&&str> = DESIGN_METRICS
            .iter()
            .filter(|m| !text.contains(&format!("throttlehost_{m}")))
            .collect();
        if missing.is_empty() || std::time::Instant::now() > deadline {
            break (text, missing);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        missing.is_empty(),
        "missing from /metrics: {missing:?}\n{text}"
    );
    assert!(
        text.contains("# HELP throttlehost_throttling_state "),
        "described"
    );
    assert!(
        text.contains("# TYPE throttlehost_handler_duration_seconds histogram"),
        "a real histogram"
    );
    host.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends held by a publishing override show as waiting in its admission, and leave it when
/// the override ends; delivery, with nothing held, shows none.
#[tokio::test(start_paused = true)]
async fn requests_held_in_an_admission_show_as_waiting() {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Simulate(SimulateConfig::default()));
    config.throttling.publishing.override_mode = OverrideMode::Throttle;
    let host = Arc::new(HostBuilder::new(config).start().await.unwrap());
    let url = format!("http://{}/metrics", host.admin_address().unwrap());
    let waiting = move |direction: &'static str| {
        let url = url.clone();
        async move {
            let (_, text, _) =
                tokio::task::spawn_blocking(move || common::http("GET", &url, b"", &[]))
                    .await
                    .unwrap();
            let line = format!("throttlehost_throttling_waiting{{direction=\"{direction}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&line))
                .map(|v| v.trim().parse::<f64>().unwrap())
        }
    };
    // A send every 20 ms, each its own task: under the override's delay (100 ms and more)
    // a few wait in the admission at any tick.
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let (host, stop) = (host.clone(), stop.clone());
        tokio::spawn(async move {
            let mut sends = Vec::new();
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let (host, message) = (host.clone(), OutgoingMessage::new(format!("m{i}")));
                sends.push(tokio::spawn(
                    async move { host.send("orders", message).await },
                ));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            sends
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut seen = None;
    while tokio::time::Instant::now() < deadline && !seen.is_some_and(|n| n >= 1.0) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        seen = waiting("publishing").await;
    }
    assert!(
        seen.is_some_and(|n| n >= 1.0),
        "publishing waiting: {seen:?}"
    );
    assert_eq!(waiting("delivery").await, Some(0.0));
    stop.store(true, Ordering::Relaxed);
    let sends = sender.await.unwrap();
    host.handle()
        .set_override(Direction::Publishing, OverrideMode::None);
    for send in sends {
        send.await.unwrap().unwrap();
    }
    let mut left = None;
    while tokio::time::Instant::now() < deadline + Duration::from_secs(5) && left != Some(0.0) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = waiting("publishing").await;
    }
    assert_eq!(left, Some(0.0), "all sent");
    let host = Arc::into_inner(host).expect("the sends are done");
    host.shutdown().await;
}

/// A queue set to `metrics = false` exports no series of its own, while its messages are
/// handled and counted in `status` as any other queue's: with many queues, an operator keeps
/// the series to the queues charted.
#[tokio::test(start_paused = true)]
async fn a_queue_with_metrics_off_has_no_series_and_is_still_counted() {
    let mut config = common::memory_config("charted");
    config.queues[0].handler = Some(HandlerConfig::Noop);
    let mut quiet = config.queues[0].clone();
    quiet.name = "quiet".into();
    quiet.metrics = false;
    config.queues.push(quiet);
    let host = HostBuilder::new(config).start().await.unwrap();
    for queue in ["charted", "quiet"] {
        for i in 0..5 {
            host.send(queue, OutgoingMessage::new(format!("m{i}")))
                .await
                .unwrap();
        }
    }
    common::wait_until(Duration::from_secs(20), "both queues drained", || {
        let status = host.status();
        status.queues.iter().all(|q| q.succeeded_total == 5)
    })
    .await;
    let text = metrics_text(&host).await;
    assert!(
        text.contains("throttlehost_messages_received_total{queue=\"charted\"} 5"),
        "{text}"
    );
    assert!(!text.contains("queue=\"quiet\""), "{text}");
    host.shutdown().await;
}
