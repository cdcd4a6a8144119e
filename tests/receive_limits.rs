//! The effective limit: lowered under load it is obeyed at once, also by receives that were
//! out when it shrank; a reloaded max applies without a restart.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::transport::Transport;

use common::{Counting, PgBacklog, PgSchema, Probe, ProbeHandler, q, wait_until};

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

/// Receives that were out when the limit came down (held here as a frozen server holds them,
/// the way a fleet share is taken back from a host whose database froze) bring their messages
/// after it: all but what the new limit allows go back to the queue instead of running past
/// it, and are handled later within it. Before, every one ran at once.
async fn receives_out_across_a_lowered_limit_give_their_messages_back(
    model: ConcurrencyModel,
    receive_batch: u32,
) {
    let memory = Arc::new(throttlehost::transport::memory::MemoryTransport::new(
        TransactionMode::ReceiveOnly,
    ));
    let counting = Counting::new(memory.clone());
    let messages: Vec<_> = (0..4)
        .map(|i| throttlehost::message::OutgoingMessage::new(format!("m{i}")))
        .collect();
    memory.admin().create_queue(&q("work")).await.unwrap();
    memory.send_batch(&q("work"), &messages).await.unwrap();
    counting.stall_receives(true);
    let probe = Probe::new(Duration::from_millis(20));
    let mut config = common::memory_config("work");
    config.queues[0].concurrency.model = model;
    config.queues[0].concurrency.max = 4;
    config.queues[0].concurrency.receive_batch = receive_batch;
    let host = HostBuilder::new(config.clone())
        .transport(counting.clone() as Arc<dyn Transport>)
        .handler("work", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    // Four single receives, or one batch of four.
    let out = 4 / receive_batch as u64;
    wait_until(Duration::from_secs(10), "all 4 messages taken", || {
        counting.stalled() == out
    })
    .await;
    if receive_batch > 1 {
        assert_eq!(
            *counting.batches.lock().unwrap(),
            [4],
            "the messages out across the change came in one batch of four"
        );
    }

    config.queues[0].concurrency.max = 1;
    assert!(host.handle().apply_config(config).is_empty());
    counting.stall_receives(false);
    wait_until(Duration::from_secs(10), "all 4 handled", || {
        probe.handled() == 4
    })
    .await;
    assert_eq!(
        probe.peak.load(Ordering::SeqCst),
        1,
        "handlers at once after the limit came down to 1"
    );
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn fixed_gives_back_what_came_past_a_lowered_limit() {
    receives_out_across_a_lowered_limit_give_their_messages_back(ConcurrencyModel::Fixed, 1).await;
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_came_past_a_lowered_limit_goes_back_whole() {
    receives_out_across_a_lowered_limit_give_their_messages_back(ConcurrencyModel::Fixed, 4).await;
}

#[tokio::test(start_paused = true)]
async fn monitor_gives_back_what_came_past_a_lowered_limit() {
    receives_out_across_a_lowered_limit_give_their_messages_back(ConcurrencyModel::Monitor, 1)
        .await;
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
