//! Recoverability against PostgreSQL: retries, the error queue and its NServiceBus fault
//! headers, panics, timeouts, poison rows and expired messages.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::{Payload, Transport};
use throttlehost::{Context, Handler, HandlerError, HostBuilder};

use common::{PgBacklog, PgSchema, Probe, ProbeHandler, q, wait_until};

async fn error_queue_message(transport: &Arc<dyn Transport>) -> throttlehost::Message {
    for _ in 0..200 {
        if let Some(r) = transport.receive(&q("error")).await.unwrap() {
            let m = match r.payload() {
                Payload::Message(m) => m.clone(),
                other => panic!("{other:?}"),
            };
            r.rollback().await.unwrap();
            return m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing reached the error queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_goes_to_the_error_queue_with_fault_headers_after_its_retries() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    let transport = &backlog.transport;
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.queues[0].immediate_retries = 3;
    config.host.name = "Sales".into();
    let probe = Probe::failing();
    let host = backlog.host(config, &probe).await;
    let sent = OutgoingMessage::new("bad order")
        .with_header("NServiceBus.Retries", "2")
        .with_header("Custom", "kept");
    host.send("orders", sent.clone()).await.unwrap();
    let m = error_queue_message(transport).await;
    assert_eq!(
        probe.calls.load(Ordering::SeqCst),
        4,
        "1 attempt + 3 immediate retries"
    );
    assert_eq!(m.body, b"bad order");
    assert_eq!(m.logical_id(), sent.logical_id());
    assert_eq!(m.header("Custom"), Some("kept"));
    assert_eq!(
        m.header("NServiceBus.Retries"),
        None,
        "retry counters are removed"
    );
    let address = format!("\"{}\".\"orders\"", backlog.schema.name);
    assert_eq!(
        m.header("NServiceBus.FailedQ"),
        Some(address.as_str()),
        "the transport address, as NServiceBus writes it and ServiceControl retries to it"
    );
    assert_eq!(
        m.header("NServiceBus.ExceptionInfo.ExceptionType"),
        Some("throttlehost.HandlerError")
    );
    assert_eq!(
        m.header("NServiceBus.ExceptionInfo.Message"),
        Some("probe told to fail")
    );
    assert_eq!(m.header("NServiceBus.ExceptionInfo.Source"), Some("probe"));
    assert_eq!(
        m.header("NServiceBus.ExceptionInfo.Data.Attempts"),
        Some("4")
    );
    assert_eq!(m.header("NServiceBus.ProcessingEndpoint"), Some("Sales"));
    assert!(m.header("NServiceBus.ProcessingMachine").is_some());
    assert!(m.header("$.diagnostics.hostid").is_some());
    let time = m.header("NServiceBus.TimeOfFailure").unwrap();
    assert!(
        time.ends_with(" Z") && time.len() == "2026-11-22 06:13:21:123456 Z".len(),
        "{time}"
    );
    assert_eq!(
        transport.peek_depth(&q("orders")).await.unwrap(),
        0,
        "the original is gone"
    );
    let metrics = host.handle().metrics_text();
    assert!(
        metrics.contains(
            "throttlehost_messages_processed_total{queue=\"orders\",outcome=\"retry\"} 3"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "throttlehost_messages_processed_total{queue=\"orders\",outcome=\"error\"} 1"
        )
    );
    host.shutdown().await;
}

struct Panics;

#[async_trait]
impl Handler for Panics {
    async fn handle(&self, _ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        panic!("handler bug");
    }
}

struct Hangs;

#[async_trait]
impl Handler for Hangs {
    async fn handle(&self, _ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_a_failure_not_a_crash() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    let transport = &backlog.transport;
    let mut config = backlog.config(ConcurrencyModel::Fixed, 2);
    config.queues[0].immediate_retries = 1;
    let host = backlog.host_with(config, Panics).await;
    host.send("orders", OutgoingMessage::new("boom"))
        .await
        .unwrap();
    let m = error_queue_message(transport).await;
    assert_eq!(
        m.header("NServiceBus.ExceptionInfo.ExceptionType"),
        Some("throttlehost.HandlerPanic")
    );
    assert_eq!(
        m.header("NServiceBus.ExceptionInfo.Message"),
        Some("handler bug")
    );
    // The host still works.
    assert!(host.status().receiving);
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_its_timeout_fails_the_attempt() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    let transport = &backlog.transport;
    let mut config = backlog.config(ConcurrencyModel::Adaptive, 2);
    config.queues[0].immediate_retries = 0;
    config.queues[0].handler_timeout = Some(Duration::from_millis(200));
    let host = backlog.host_with(config, Hangs).await;
    host.send("orders", OutgoingMessage::new("slow"))
        .await
        .unwrap();
    let m = error_queue_message(transport).await;
    assert_eq!(
        m.header("NServiceBus.ExceptionInfo.ExceptionType"),
        Some("throttlehost.HandlerTimeout")
    );
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_reach_the_error_queue_unchanged_and_the_host_goes_on() {
    let schema = PgSchema::new();
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 16).await);
    transport.admin().create_queue(&q("orders")).await.unwrap();
    let client = schema.client().await;
    let id = uuid::Uuid::new_v4();
    client
        .execute(
            &format!("INSERT INTO \"{}\".\"orders\" (Id, Headers, Body) VALUES ($1, '[not, an object]', 'raw')", schema.name),
            &[&id],
        )
        .await
        .unwrap();
    let probe = Probe::new(Duration::ZERO);
    let host = HostBuilder::new(common::pg_config(
        &schema,
        "orders",
        ConcurrencyModel::Monitor,
        2,
    ))
    .transport(transport.clone())
    .handler("orders", ProbeHandler(probe.clone()))
    .start()
    .await
    .unwrap();
    host.send("orders", OutgoingMessage::new("fine"))
        .await
        .unwrap();
    // The poison row and the good message are taken by different receivers,
    // so the good one can be handled before the poison row's move commits.
    wait_until(
        Duration::from_secs(10),
        "the good message handled and the poison row moved",
        || {
            probe.handled() == 1
                && host
                    .handle()
                    .metrics_text()
                    .contains("outcome=\"poison\"} 1")
        },
    )
    .await;
    let row = client
        .query_one(
            &format!(
                "SELECT Headers, Body FROM \"{}\".\"error\" WHERE Id = $1",
                schema.name
            ),
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "[not, an object]");
    assert_eq!(row.get::<_, Vec<u8>>(1), b"raw");
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_messages_are_dropped_and_counted() {
    let schema = PgSchema::new();
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 16).await);
    transport.admin().create_queue(&q("orders")).await.unwrap();
    for _ in 0..3 {
        transport
            .send(
                &q("orders"),
                &OutgoingMessage::new("late").with_time_to_be_received(Duration::from_millis(1)),
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let probe = Probe::new(Duration::ZERO);
    let host = HostBuilder::new(common::pg_config(
        &schema,
        "orders",
        ConcurrencyModel::Monitor,
        2,
    ))
    .transport(transport.clone())
    .handler("orders", ProbeHandler(probe.clone()))
    .start()
    .await
    .unwrap();
    wait_until(Duration::from_secs(10), "expired dropped", || {
        host.handle()
            .metrics_text()
            .contains("outcome=\"expired\"} 3")
    })
    .await;
    assert_eq!(
        probe.calls.load(Ordering::SeqCst),
        0,
        "never handed to the handler"
    );
    assert_eq!(transport.peek_depth(&q("orders")).await.unwrap(), 0);
    host.shutdown().await;
}

/// Forwards with the handler's send, for the transaction-mode tests.
struct ForwardOrFail {
    fail_first: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Handler for ForwardOrFail {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        ctx.send("out", OutgoingMessage::forward_of(ctx.message()))
            .await?;
        if self.fail_first.swap(false, Ordering::SeqCst) {
            return Err("first attempt fails after sending".into());
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_sends_nothing_in_either_transactional_mode() {
    for mode in [
        TransactionMode::ReceiveOnly,
        TransactionMode::SendsAtomicWithReceive,
    ] {
        let schema = PgSchema::new();
        let transport: Arc<dyn Transport> = Arc::new(schema.transport(mode, 16).await);
        transport.admin().create_queue(&q("out")).await.unwrap();
        let mut config = common::pg_config(&schema, "orders", ConcurrencyModel::Monitor, 1);
        config.transport.transaction_mode = mode;
        let host = HostBuilder::new(config)
            .transport(transport.clone())
            .handler(
                "orders",
                ForwardOrFail {
                    fail_first: true.into(),
                },
            )
            .start()
            .await
            .unwrap();
        host.send("orders", OutgoingMessage::new("x"))
            .await
            .unwrap();
        wait_until(Duration::from_secs(10), "forwarded", || {
            host.handle()
                .metrics_text()
                .contains("outcome=\"success\"} 1")
        })
        .await;
        assert_eq!(
            transport.peek_depth(&q("out")).await.unwrap(),
            1,
            "{mode:?}: exactly one copy, from the successful attempt"
        );
        host.shutdown().await;
    }
}
