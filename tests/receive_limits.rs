//! The effective limit: lowered under load it is obeyed at once; a reloaded max applies
//! without a restart.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::transport::Transport;

use common::{PgBacklog, PgSchema, Probe, ProbeHandler, q, wait_until};

async fn lowering_the_limit_is_obeyed_within_one_completion(model: ConcurrencyModel) {
    let backlog = PgBacklog::new("work", 2000, 24).await;
    let probe = Probe::new(Duration::from_millis(100));
    let mut config = backlog.config(model, 16);
    config.transport.pool_size = 24;
    let host = backlog.host(config.clone(), &probe).await;
    wait_until(Duration::from_secs(20), "16 in flight", || {
        probe.current.load(Ordering::SeqCst) == 16
    })
    .await;

    // A config reload; the throttling controller narrows the same gate.
    config.queues[0].concurrency.max = 2;
    let restart = host.handle().apply_config(config);
    assert!(restart.is_empty(), "{restart:?}");
    let calls_at_change = probe.calls.load(Ordering::SeqCst) as usize;
    wait_until(Duration::from_secs(20), "30 more handler calls", || {
        probe.calls.load(Ordering::SeqCst) as usize >= calls_at_change + 30
    })
    .await;
    let starts = probe.starts.lock().unwrap().clone();
    // The 16 in flight drain; no handler starts while 2 or more are running.
    let after: Vec<u64> = starts[calls_at_change..].to_vec();
    assert!(
        after.iter().all(|&c| c <= 2),
        "concurrency seen by handlers started after the change: {after:?}"
    );
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_obeys_a_lower_limit_at_once() {
    lowering_the_limit_is_obeyed_within_one_completion(ConcurrencyModel::Monitor).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_obeys_a_lower_limit_at_once() {
    lowering_the_limit_is_obeyed_within_one_completion(ConcurrencyModel::Fixed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_obeys_a_lower_limit_at_once() {
    lowering_the_limit_is_obeyed_within_one_completion(ConcurrencyModel::Adaptive).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_max_applies_without_restart() {
    let schema = PgSchema::new();
    let dir = std::env::temp_dir().join(format!("th-reload-{}", schema.name));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("host.toml");
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 24).await);
    transport.admin().create_queue(&q("work")).await.unwrap();
    common::fill(&transport, &q("work"), 400).await;
    let mut config = common::pg_config(&schema, "work", ConcurrencyModel::Monitor, 2);
    config.throttling.enabled = false;
    std::fs::write(&path, toml::to_string(&config).unwrap().replace("***", "")).unwrap();
    let probe = Probe::new(Duration::from_millis(50));
    let host = HostBuilder::new(config.clone())
        .config_path(&path)
        .transport(transport.clone())
        .handler("work", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    wait_until(Duration::from_secs(10), "2 in flight", || {
        probe.current.load(Ordering::SeqCst) == 2
    })
    .await;
    assert_eq!(probe.peak.load(Ordering::SeqCst), 2);

    // An invalid file keeps the running settings.
    std::fs::write(
        &path,
        "[[queues]]\nname = 'work'\n[queues.concurrency]\nmax = 'many'\n",
    )
    .unwrap();
    let err = host.handle().reload().unwrap_err();
    assert!(err.contains("queues[0].concurrency.max"), "{err}");
    assert_eq!(host.handle().queue_status("work").unwrap().max, 2);
    assert!(
        host.handle()
            .metrics_text()
            .contains("throttlehost_config_reloads_total{result=\"error\"} 1")
    );

    config.queues[0].concurrency.max = 6;
    let mut text = toml::to_string(&config).unwrap();
    text = text.replace(
        &format!(
            "connection_string = \"{}\"",
            config.transport.connection_string.redacted()
        ),
        &format!(
            "connection_string = \"{}\"",
            config.transport.connection_string.expose()
        ),
    );
    std::fs::write(&path, text).unwrap();
    let restart = host.handle().reload().unwrap();
    assert!(restart.is_empty(), "nothing needs a restart: {restart:?}");
    wait_until(
        Duration::from_secs(10),
        "6 in flight after the reload",
        || probe.current.load(Ordering::SeqCst) == 6,
    )
    .await;
    host.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
