//! The three MaximumConcurrencyLevel models against PostgreSQL: exactly-once draining, the
//! adaptive ramp and the monitor's bound; the cost of an idle queue under virtual time.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::Transport;
use throttlehost::transport::memory::MemoryTransport;

use common::{Counting, PgBacklog, Probe, ProbeHandler, q, wait_until};

async fn drains_exactly_once(model: ConcurrencyModel) {
    let backlog = PgBacklog::new("work", 10_000, 16).await;
    let (transport, sent) = (&backlog.transport, &backlog.sent);
    let probe = Probe::new(Duration::ZERO);
    let host = backlog.host(backlog.config(model, 8), &probe).await;
    wait_until(Duration::from_secs(120), "10 000 messages handled", || {
        probe.handled() >= 10_000
    })
    .await;
    // Shutdown lets the last handled messages commit before it returns.
    host.shutdown().await;
    let ids = probe.ids.lock().unwrap().clone();
    let handled: HashSet<String> = ids.iter().cloned().collect();
    assert_eq!(ids.len(), 10_000, "no message handled twice");
    assert_eq!(&handled, sent, "every message handled");
    assert!(probe.peak.load(std::sync::atomic::Ordering::SeqCst) <= 8);
    assert_eq!(transport.peek_depth(&q("work")).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_drains_ten_thousand_exactly_once() {
    drains_exactly_once(ConcurrencyModel::Fixed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_drains_ten_thousand_exactly_once() {
    drains_exactly_once(ConcurrencyModel::Adaptive).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_drains_ten_thousand_exactly_once() {
    drains_exactly_once(ConcurrencyModel::Monitor).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_ramps_up_to_max_under_a_backlog_and_back_to_one_when_idle() {
    let backlog = PgBacklog::new("work", 3000, 16).await;
    let probe = Probe::new(Duration::from_millis(5));
    let mut config = backlog.config(ConcurrencyModel::Adaptive, 6);
    config.queues[0].concurrency.peek_interval = Duration::from_millis(200);
    let host = backlog.host(config, &probe).await;
    let handle = host.handle();
    let loops = || handle.queue_status("work").unwrap().loops;
    assert!(loops() <= 2, "starts with one loop, got {}", loops());
    wait_until(Duration::from_secs(60), "ramp up to max (6 loops)", || {
        loops() == 6
    })
    .await;
    assert!(loops() <= 6, "never above max");
    wait_until(Duration::from_secs(60), "the backlog handled", || {
        probe.handled() >= 3000
    })
    .await;
    wait_until(Duration::from_secs(10), "ramp down to one loop", || {
        loops() == 1
    })
    .await;
    let status = host.status();
    assert_eq!(status.queues[0].loops, 1);
    // The last loop stays: a message sent now is still received.
    backlog
        .transport
        .send(
            &q("work"),
            &throttlehost::message::OutgoingMessage::new("after the ramp-down"),
        )
        .await
        .unwrap();
    wait_until(Duration::from_secs(10), "a late message handled", || {
        probe.handled() >= 3001
    })
    .await;
    assert!(loops() >= 1, "never below one");
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_never_has_more_than_max_in_flight() {
    let backlog = PgBacklog::new("work", 600, 16).await;
    let probe = Probe::new(Duration::from_millis(20));
    let host = backlog
        .host(backlog.config(ConcurrencyModel::Monitor, 5), &probe)
        .await;
    let handle = host.handle();
    wait_until(Duration::from_secs(60), "600 messages handled", || {
        probe.handled() >= 600
    })
    .await;
    // Read before shutdown: the gate's peak since start, as `/status` shows it.
    let peak_in_flight = handle.queue_status("work").unwrap().peak_in_flight;
    host.shutdown().await;
    let peak = probe.peak.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(peak, 5, "handlers ran 5 at a time at most, and did reach 5");
    // The gate records its own peak on every permit taken, so nothing between samples escapes.
    assert!(
        peak_in_flight <= 5,
        "receives + handlers never above max: {peak_in_flight}"
    );
}

/// Runs a host on the memory transport under paused (virtual) time and returns the (receives,
/// peeks) it issued in a window of `seconds`, starting 3 s after `messages` were sent into its
/// queue (handlers take `latency`; `key_header` orders the queue by that header). The
/// statements a receiver issues do not depend on the transport, so counting them at the
/// transport boundary under virtual time is exact and takes milliseconds instead of a minute.
async fn queue_statements(
    model: ConcurrencyModel,
    key_header: Option<&str>,
    messages: Vec<OutgoingMessage>,
    latency: Duration,
    seconds: u64,
) -> (u64, u64) {
    let memory: Arc<dyn Transport> = Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
    memory.admin().create_queue(&q("idle")).await.unwrap();
    for message in &messages {
        memory.send(&q("idle"), message).await.unwrap();
    }
    let counting = Counting::new(memory);
    let mut config = common::memory_config("idle");
    config.host.admin_address = "off".into();
    config.queues[0].concurrency.model = model;
    config.queues[0].concurrency.max = 8;
    config.queues[0].concurrency.peek_interval = Duration::from_secs(1);
    if let Some(header) = key_header {
        config.queues[0].ordering.key_header = header.into();
    }
    let host = HostBuilder::new(config)
        .transport(counting.clone())
        .handler("idle", ProbeHandler(Probe::new(latency)))
        .start()
        .await
        .unwrap();
    // Let start-up polling settle, then count a clean window.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (r0, p0) = (counting.receives(), counting.depth_looks());
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let counts = (counting.receives() - r0, counting.depth_looks() - p0);
    host.shutdown().await;
    counts
}

/// The statements an idle, unordered queue issues in `seconds` (see [`queue_statements`]).
async fn idle_statements(model: ConcurrencyModel, seconds: u64) -> (u64, u64) {
    queue_statements(model, None, Vec::new(), Duration::ZERO, seconds).await
}

#[tokio::test(start_paused = true)]
async fn an_idle_queue_costs_at_most_one_statement_per_peek_interval() {
    for model in [
        ConcurrencyModel::Monitor,
        ConcurrencyModel::Fixed,
        ConcurrencyModel::Adaptive,
    ] {
        let (receives, peeks) = idle_statements(model, 60).await;
        assert_eq!(
            receives, 0,
            "{model:?}: an idle queue is peeked, not received from"
        );
        assert!(
            (58..=61).contains(&peeks),
            "{model:?}: {peeks} peeks in 60 s with peek_interval 1 s"
        );
    }
}

/// An ordered queue is peeked like any other when empty, and while its only message waits
/// for its key's message in a handler it costs at most a peek and a receive per peek interval
/// (the peek counts the waiting message; the receive finds nothing and the peeker backs off).
#[tokio::test(start_paused = true)]
async fn an_ordered_queue_costs_no_more_when_idle_or_waiting_for_a_key() {
    const KEY: &str = "Sales.OrderId";
    for model in [
        ConcurrencyModel::Monitor,
        ConcurrencyModel::Fixed,
        ConcurrencyModel::Adaptive,
    ] {
        let (receives, peeks) =
            queue_statements(model, Some(KEY), Vec::new(), Duration::ZERO, 60).await;
        assert_eq!(receives, 0, "{model:?}: an idle ordered queue is peeked");
        assert!(
            (58..=61).contains(&peeks),
            "{model:?}: {peeks} peeks in 60 s with peek_interval 1 s"
        );
        // Two messages of one key: the first stays in its handler through the window, the
        // second waits for it.
        let same_key = (0..2u8)
            .map(|n| OutgoingMessage::new(vec![n]).with_header(KEY, "7"))
            .collect();
        let (receives, peeks) =
            queue_statements(model, Some(KEY), same_key, Duration::from_secs(600), 60).await;
        assert!(
            receives <= 62 && peeks <= 62,
            "{model:?}: {receives} receives and {peeks} peeks in 60 s while a key waits"
        );
    }
}

/// The monitor's first peeks are one read of every queue's depth, made before the receivers
/// start: twenty idle queues send no peek of their own as the host starts (on PostgreSQL a
/// thousand queues spent three quarters of a second peeking one by one before the first
/// message was handled), and a queue that held messages has them handled.
#[tokio::test(start_paused = true)]
async fn the_first_peeks_are_one_read_of_every_queues_depth() {
    let memory: Arc<dyn Transport> = Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
    let names: Vec<String> = (0..20).map(|i| format!("q{i:02}")).collect();
    for name in &names {
        memory.admin().create_queue(&q(name)).await.unwrap();
    }
    for n in 0..3u8 {
        memory
            .send(&q("q00"), &OutgoingMessage::new(vec![n]))
            .await
            .unwrap();
    }
    let counting = Counting::new(memory);
    let mut config = common::memory_config("q00");
    config.host.admin_address = "off".into();
    let template = config.queues.remove(0);
    config.queues = names
        .iter()
        .map(|name| {
            let mut queue = template.clone();
            queue.name = name.clone();
            queue.concurrency.model = ConcurrencyModel::Monitor;
            queue.concurrency.peek_interval = Duration::from_secs(30);
            queue
        })
        .collect();
    let probe = Probe::new(Duration::ZERO);
    let mut builder = HostBuilder::new(config).transport(counting.clone());
    for name in &names {
        builder = builder.handler(name, ProbeHandler(probe.clone()));
    }
    let host = builder.start().await.unwrap();
    let reads = counting
        .depth_reads
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(reads >= 1, "the depths were read together before receiving");
    wait_until(
        Duration::from_secs(5),
        "the waiting messages handled",
        || probe.handled() >= 3,
    )
    .await;
    // Only the queue that had messages peeks again, after they were taken (at once, then
    // after 50 ms): the idle ones peek next at their interval.
    let peeks = counting.peeks();
    assert!(
        peeks <= 2,
        "{peeks} peeks: the idle queues peeked by themselves at start"
    );
    host.shutdown().await;
}
