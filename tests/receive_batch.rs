//! Batch receive (`receive_batch` above 1) on PostgreSQL, in every concurrency model: every
//! message handled once, never more in flight than the limit, and any throttling wait turns
//! the batch into single receives.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{ConcurrencyModel, OverrideMode};
use throttlehost::throttling::Direction;
use throttlehost::transport::Transport;

use common::{Counting, PgBacklog, Probe, ProbeHandler, wait_until};

async fn a_batch_queue_drains_every_message_once_within_its_limit(model: ConcurrencyModel) {
    let backlog = PgBacklog::new("work", 3000, 30).await;
    let counting = Counting::new(backlog.transport.clone());
    let probe = Probe::new(Duration::from_millis(1));
    let mut config = backlog.config(model, 16);
    config.queues[0].concurrency.receive_batch = 8;
    config.throttling.enabled = false;
    let host = HostBuilder::new(config)
        .transport(counting.clone() as Arc<dyn Transport>)
        .handler("work", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), "3000 handled", || {
        probe.handled() >= 3000
    })
    .await;
    host.shutdown().await;

    let handled = probe.ids.lock().unwrap().clone();
    let unique: HashSet<String> = handled.iter().cloned().collect();
    assert_eq!(handled.len(), 3000, "each message once");
    assert_eq!(unique, backlog.sent);
    assert!(probe.peak.load(Ordering::SeqCst) <= 16, "within max");
    let batches = counting.batches.lock().unwrap().clone();
    assert!(
        batches.iter().all(|&n| n <= 8),
        "no batch above receive_batch: {batches:?}"
    );
    let batched: usize = batches.iter().filter(|&&n| n > 1).sum();
    assert!(
        batched >= 1500,
        "most messages came in batches ({batched} of 3000; sizes {batches:?})"
    );
    assert!(
        backlog
            .transport
            .receive(&backlog.queue)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_receives_in_batches() {
    a_batch_queue_drains_every_message_once_within_its_limit(ConcurrencyModel::Fixed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_receives_in_batches() {
    a_batch_queue_drains_every_message_once_within_its_limit(ConcurrencyModel::Adaptive).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_receives_in_batches() {
    a_batch_queue_drains_every_message_once_within_its_limit(ConcurrencyModel::Monitor).await;
}

/// While delivery is throttled every receive waits its delay alone: no batch forms, so
/// throttling bites a batch queue exactly as hard as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_batch_queue_receives_one_message_at_a_time() {
    let backlog = PgBacklog::new("work", 0, 20).await;
    let counting = Counting::new(backlog.transport.clone());
    let probe = Probe::new(Duration::ZERO);
    let mut config = backlog.config(ConcurrencyModel::Fixed, 8);
    config.queues[0].concurrency.receive_batch = 8;
    config.throttling.sample_interval = Duration::from_millis(100);
    let host = HostBuilder::new(config)
        .transport(counting.clone() as Arc<dyn Transport>)
        .handler("work", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    override_delivery(&host, OverrideMode::Throttle).await;
    // A batch receive admitted while delivery was still open may still be on its way to the
    // database (its statement waits for a connection on a busy machine); it takes what is
    // there when it runs. Throttling holds back what it admits from now on.
    wait_until(
        Duration::from_secs(5),
        "the batch receives admitted before the override are back",
        || counting.batches_out() == 0,
    )
    .await;
    common::fill(&backlog.transport, &backlog.queue, 40).await;
    wait_until(Duration::from_secs(60), "40 handled", || {
        probe.handled() >= 40
    })
    .await;
    // Throttled, no batch receive runs at all: every message came by a single receive.
    let batches = counting.batches.lock().unwrap().clone();
    assert!(batches.is_empty(), "throttled, yet batches: {batches:?}");
    assert!(counting.receives() >= 40, "one receive per message");

    // The override lifted, batches form again.
    override_delivery(&host, OverrideMode::None).await;
    common::fill(&backlog.transport, &backlog.queue, 400).await;
    wait_until(Duration::from_secs(60), "440 handled", || {
        probe.handled() >= 440
    })
    .await;
    let batches = counting.batches.lock().unwrap().clone();
    assert!(
        batches.iter().any(|&n| n > 1),
        "unthrottled, batches form: {batches:?}"
    );
    host.shutdown().await;
}

/// Sets the delivery override and waits until the admission follows it.
async fn override_delivery(host: &throttlehost::Host, mode: OverrideMode) {
    host.handle().set_override(Direction::Delivery, mode);
    let open = mode != OverrideMode::Throttle;
    wait_until(
        Duration::from_secs(5),
        "delivery follows the override",
        || host.handle().delivery_is_open() == open,
    )
    .await;
}
