//! Delayed retries, forwarding from a delayed table and outage mode, through a whole host on
//! the memory transport (the same dispatcher and mover run on every transport; the delayed
//! tables themselves are covered per transport by tests/conformance.rs).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use async_trait::async_trait;
use throttlehost::config::{Config, QueueConfig, TransactionMode};
use throttlehost::message::{FORWARD_DESTINATION_HEADER, OutgoingMessage, RETRIES_HEADER};
use throttlehost::transport::memory::MemoryTransport;
use throttlehost::transport::{Payload, Transport};
use throttlehost::{Context, Handler, HandlerError, HostBuilder};

use common::{q, wait_until};

/// A downstream that fails while `down` is set, counting calls and what it saw.
#[derive(Default)]
struct Downstream {
    down: AtomicBool,
    /// Fail this many first calls (on top of `down`).
    fail_first: AtomicU64,
    calls: AtomicU64,
    succeeded: AtomicU64,
    call_times: std::sync::Mutex<Vec<Instant>>,
    retries_seen: std::sync::Mutex<Vec<Option<String>>>,
}

struct Calls(Arc<Downstream>);

#[async_trait]
impl Handler for Calls {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let d = &self.0;
        let n = d.calls.fetch_add(1, Ordering::SeqCst);
        d.call_times.lock().unwrap().push(Instant::now());
        tokio::time::sleep(Duration::from_millis(2)).await;
        if d.down.load(Ordering::SeqCst) || n < d.fail_first.load(Ordering::SeqCst) {
            return Err("downstream unavailable".into());
        }
        assert!(
            ctx.message().header(FORWARD_DESTINATION_HEADER).is_none(),
            "the handler never sees the forward destination"
        );
        d.retries_seen
            .lock()
            .unwrap()
            .push(ctx.message().header(RETRIES_HEADER).map(str::to_string));
        d.succeeded.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn name(&self) -> &str {
        "downstream"
    }
}

fn config(immediate: u32, delayed: u32, increment: Duration) -> Config {
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.host.shutdown_timeout = Duration::from_secs(5);
    let mut qc = QueueConfig {
        name: "orders".into(),
        immediate_retries: immediate,
        ..QueueConfig::default()
    };
    qc.concurrency.max = 8;
    qc.concurrency.peek_interval = Duration::from_millis(100);
    qc.recoverability.delayed_retries = Some(delayed);
    qc.recoverability.delayed_retry_increment = increment;
    qc.outage.consecutive_failures = 0;
    config.queues.push(qc);
    config
}

async fn start(config: Config, d: &Arc<Downstream>) -> (throttlehost::Host, Arc<dyn Transport>) {
    let transport: Arc<dyn Transport> =
        Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
    let host = HostBuilder::new(config)
        .transport(transport.clone())
        .handler("orders", Calls(d.clone()))
        .start()
        .await
        .unwrap();
    (host, transport)
}

async fn error_messages(t: &dyn Transport) -> Vec<throttlehost::Message> {
    let mut out = Vec::new();
    while let Some(r) = t.receive(&q("error")).await.unwrap() {
        if let Payload::Message(m) = r.payload() {
            out.push(m.clone());
        }
        r.commit().await.unwrap();
    }
    out
}

#[tokio::test(start_paused = true)]
async fn a_message_failing_every_attempt_reaches_the_error_queue_after_its_delayed_retries() {
    let d = Arc::new(Downstream::default());
    d.down.store(true, Ordering::SeqCst);
    let (host, transport) = start(config(2, 2, Duration::from_millis(150)), &d).await;
    let sent = Instant::now();
    let message = OutgoingMessage::new("bad").with_header("Custom", "kept");
    host.send("orders", message.clone()).await.unwrap();
    let status = || host.status().queues[0].failed_total;
    wait_until(Duration::from_secs(10), "the error queue", || status() == 1).await;
    assert!(
        sent.elapsed() >= Duration::from_millis(450),
        "waited 150 ms then 300 ms between deliveries, took {:?}",
        sent.elapsed()
    );
    assert_eq!(
        d.calls.load(Ordering::SeqCst),
        9,
        "3 deliveries of 1 + 2 immediate attempts"
    );
    let errors = error_messages(transport.as_ref()).await;
    assert_eq!(errors.len(), 1);
    let m = &errors[0];
    assert_eq!(m.logical_id(), message.logical_id());
    assert_eq!(m.header("Custom"), Some("kept"));
    assert_eq!(m.header(RETRIES_HEADER), None, "retry counters are removed");
    assert_eq!(m.header(FORWARD_DESTINATION_HEADER), None);
    assert_eq!(m.header("NServiceBus.FailedQ"), Some("orders"));
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_message_that_recovers_during_its_delayed_retries_is_handled_once() {
    let d = Arc::new(Downstream::default());
    d.fail_first.store(4, Ordering::SeqCst);
    let (host, transport) = start(config(2, 3, Duration::from_millis(100)), &d).await;
    host.send("orders", OutgoingMessage::new("flaky"))
        .await
        .unwrap();
    wait_until(Duration::from_secs(10), "a success", || {
        d.succeeded.load(Ordering::SeqCst) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        d.calls.load(Ordering::SeqCst),
        5,
        "3 failed, 1 failed after the delay, 1 ok"
    );
    assert_eq!(
        *d.retries_seen.lock().unwrap(),
        vec![Some("1".to_string())],
        "handled on its first delayed retry"
    );
    assert!(error_messages(transport.as_ref()).await.is_empty());
    let moved = host.status().queues[0].succeeded_total;
    assert_eq!(moved, 1);
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_delayed_send_is_handled_when_due_and_one_for_another_queue_is_sent_on() {
    let d = Arc::new(Downstream::default());
    let mut config = config(0, 0, Duration::from_secs(1));
    config.queues.push(QueueConfig {
        name: "audit".into(),
        handler: Some(throttlehost::config::HandlerConfig::Noop),
        ..QueueConfig::default()
    });
    let (host, transport) = start(config, &d).await;
    let sent = Instant::now();
    host.send(
        "orders",
        OutgoingMessage::new("later").with_delay(Duration::from_millis(600)),
    )
    .await
    .unwrap();
    wait_until(Duration::from_secs(10), "the delayed message", || {
        d.succeeded.load(Ordering::SeqCst) == 1
    })
    .await;
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_millis(1500),
        "handled when due, not before and not a back-off later: {took:?}"
    );
    // Stored in orders' table for audit: moved into orders, then sent on to audit.
    let for_audit = OutgoingMessage::new("audit me")
        .with_header(FORWARD_DESTINATION_HEADER, "audit")
        .with_delay(Duration::ZERO);
    host.send("orders", for_audit).await.unwrap();
    wait_until(Duration::from_secs(10), "the forwarded message", || {
        host.status()
            .queues
            .iter()
            .any(|q| q.name == "audit" && q.succeeded_total == 1)
    })
    .await;
    assert_eq!(
        d.calls.load(Ordering::SeqCst),
        1,
        "orders' handler never saw it"
    );
    assert!(error_messages(transport.as_ref()).await.is_empty());
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_outage_switches_the_queue_to_one_paced_attempt_and_loses_nothing_to_the_error_queue() {
    let d = Arc::new(Downstream::default());
    d.down.store(true, Ordering::SeqCst);
    let mut config = config(5, 3, Duration::from_millis(500));
    config.queues[0].outage.consecutive_failures = 10;
    config.queues[0].outage.pause = Duration::from_millis(200);
    config.queues[0].outage.max_pause = Duration::from_millis(400);
    let (host, transport) = start(config, &d).await;
    for i in 0..40 {
        host.send("orders", OutgoingMessage::new(format!("m{i}")))
            .await
            .unwrap();
    }
    wait_until(Duration::from_secs(5), "outage mode", || {
        host.status().queues[0].downstream.outage
    })
    .await;
    let detected = Instant::now();
    assert_eq!(host.status().queues[0].limit, 1, "one message at a time");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = d
        .call_times
        .lock()
        .unwrap()
        .iter()
        .filter(|t| **t > detected + Duration::from_millis(500))
        .count();
    // 2.5 s at one call per 200-400 ms: at most 13 calls, however many messages wait.
    assert!(during <= 13, "{during} calls in 2.5 s of outage mode");
    d.down.store(false, Ordering::SeqCst);
    wait_until(Duration::from_secs(20), "every message handled", || {
        d.succeeded.load(Ordering::SeqCst) == 40
    })
    .await;
    let s = host.status();
    assert!(!s.queues[0].downstream.outage, "the first success ended it");
    assert_eq!(s.queues[0].failed_total, 0);
    assert!(error_messages(transport.as_ref()).await.is_empty());
    wait_until(Duration::from_secs(5), "limits back to max", || {
        host.status().queues[0].limit == 8
    })
    .await;
    host.shutdown().await;
}

/// Delayed messages count in the database size (they will join the queue), as their mover
/// reads them, and leave it once handled.
#[tokio::test(start_paused = true)]
async fn delayed_messages_count_in_the_database_size() {
    let d = Arc::new(Downstream::default());
    let mut config = config(0, 0, Duration::from_secs(1));
    config.throttling.sample_interval = Duration::from_millis(100);
    let (host, _transport) = start(config, &d).await;
    for i in 0..30 {
        host.send(
            "orders",
            // Due well after the last send, on a busy machine too: a move that starts while
            // sends still count in would make the sum a moving target.
            OutgoingMessage::new(format!("later {i}")).with_delay(Duration::from_secs(3)),
        )
        .await
        .unwrap();
    }
    let database_size = || {
        host.status()
            .throttling
            .and_then(|t| {
                t.resources
                    .iter()
                    .find(|r| r.condition == throttlehost::throttling::Condition::DatabaseSize)
                    .map(|r| r.value)
            })
            .unwrap_or(0.0)
    };
    wait_until(
        Duration::from_secs(5),
        "30 delayed in the database size",
        || database_size() >= 30.0,
    )
    .await;
    assert_eq!(database_size(), 30.0, "counted once, not as queued too");
    wait_until(Duration::from_secs(10), "handled when due", || {
        d.succeeded.load(Ordering::SeqCst) == 30
    })
    .await;
    wait_until(
        Duration::from_secs(5),
        "the database size falls back",
        || database_size() == 0.0,
    )
    .await;
    host.shutdown().await;
}
