//! Pickup latency on PostgreSQL: from the start of a send to the start of its handler, per
//! concurrency model, with a peek interval of 1 s (the default) so that what is measured is
//! the wake-up by notification, not the polling. Also what the notification costs senders:
//! sends with the insert trigger and without it, side by side.
//!
//! `cargo bench --bench pickup` (env: DATABASE_URL, default the local `test` database;
//! IDLE = messages in the idle run, 200; STEADY_SECONDS = 5). Prints one line per run:
//!
//!   idle monitor: n=200 p50=1.1ms p99=2.4ms max=3.0ms
//!
//! Runs: (a) idle: one message every 100 ms to an idle queue; (b) steady: 1 000 msg/s from
//! one sender for STEADY_SECONDS; (c) bursts: a batch of 1 000 every 100 ms for as long;
//! then the senders' cost: 2 000 single sends and a batch of
//! 20 000, each with the trigger and without, alternating.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use throttlehost::HostBuilder;
use throttlehost::config::{
    ConcurrencyModel, Config, ConnectionString, QueueConfig, TransactionMode, TransportConfig,
    TransportKind,
};
use throttlehost::handlers::{Context, Handler, HandlerError};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueAdmin, QueueName, Transport};

/// When each message was sent, and how long after that its handler started.
#[derive(Default)]
struct Clock {
    sent: Mutex<HashMap<uuid::Uuid, Instant>>,
    latencies: Mutex<Vec<Duration>>,
}

struct Stamp(Arc<Clock>);

#[async_trait]
impl Handler for Stamp {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let now = Instant::now();
        let id = ctx.message().id;
        if let Some(sent) = self.0.sent.lock().unwrap().remove(&id) {
            self.0.latencies.lock().unwrap().push(now - sent);
        }
        Ok(())
    }

    fn name(&self) -> &str {
        "stamp"
    }
}

fn url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn transport_config(schema: &str) -> TransportConfig {
    TransportConfig {
        kind: TransportKind::Postgres,
        connection_string: ConnectionString::new(url()),
        schema: schema.into(),
        pool_size: 16,
        transaction_mode: TransactionMode::ReceiveOnly,
        ..TransportConfig::default()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[at]
}

fn report(what: &str, clock: &Clock, sent: usize) {
    let mut latencies = clock.latencies.lock().unwrap().clone();
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{what}: n={} of {sent} p50={:.1}ms p99={:.1}ms max={:.1}ms",
        latencies.len(),
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or_default()),
    );
}

async fn send_stamped(sender: &PostgresTransport, queue: &QueueName, clock: &Clock) {
    let message = OutgoingMessage::new(Vec::new());
    clock
        .sent
        .lock()
        .unwrap()
        .insert(message.id, Instant::now());
    sender.send(queue, &message).await.expect("send");
}

async fn wait_for(clock: &Clock, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while clock.latencies.lock().unwrap().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One model: the idle run, then the steady run, on a host of its own.
async fn pickup(model: ConcurrencyModel, schema: &str) {
    let queue = QueueName::new("pickup").unwrap();
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.transport = transport_config(schema);
    let mut qc = QueueConfig {
        name: queue.to_string(),
        ..QueueConfig::default()
    };
    qc.concurrency.model = model;
    qc.concurrency.max = 8;
    config.queues.push(qc);
    let clock = Arc::new(Clock::default());
    let host = HostBuilder::new(config)
        .handler("pickup", Stamp(clock.clone()))
        .start()
        .await
        .expect("host starts");
    let sender = PostgresTransport::connect(&transport_config(schema))
        .await
        .expect("sender connects");
    tokio::time::sleep(Duration::from_secs(2)).await;

    let idle = env_number("IDLE", 200) as usize;
    for _ in 0..idle {
        send_stamped(&sender, &queue, &clock).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_for(&clock, idle).await;
    report(&format!("idle {model:?}"), &clock, idle);

    clock.latencies.lock().unwrap().clear();
    let steady = env_number("STEADY_SECONDS", 5) as usize * 1000;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    for _ in 0..steady {
        tick.tick().await;
        send_stamped(&sender, &queue, &clock).await;
    }
    let rate = steady as f64 / started.elapsed().as_secs_f64();
    wait_for(&clock, steady).await;
    report(
        &format!("steady {model:?} ({rate:.0} msg/s sent)"),
        &clock,
        steady,
    );

    // Bursts: a batch of 1 000 every 100 ms (10 000 msg/s), each message stamped when its
    // batch's send starts.
    clock.latencies.lock().unwrap().clear();
    let bursts = env_number("STEADY_SECONDS", 5) as usize * 10;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for _ in 0..bursts {
        tick.tick().await;
        let batch: Vec<OutgoingMessage> = (0..1000)
            .map(|_| OutgoingMessage::new(Vec::new()))
            .collect();
        let now = Instant::now();
        clock
            .sent
            .lock()
            .unwrap()
            .extend(batch.iter().map(|m| (m.id, now)));
        sender.send_batch(&queue, &batch).await.expect("batch");
    }
    wait_for(&clock, bursts * 1000).await;
    report(
        &format!("bursts {model:?} (1 000 every 100 ms)"),
        &clock,
        bursts * 1000,
    );
    host.shutdown().await;
}

/// Sends `n` one by one, then a batch of `batch`; returns (per message, batch) wall time.
async fn send_cost(
    sender: &PostgresTransport,
    queue: &QueueName,
    n: usize,
    batch: usize,
) -> (Duration, Duration) {
    let started = Instant::now();
    for _ in 0..n {
        sender
            .send(queue, &OutgoingMessage::new(Vec::new()))
            .await
            .expect("send");
    }
    let single = started.elapsed();
    let messages: Vec<OutgoingMessage> = (0..batch)
        .map(|_| OutgoingMessage::new(Vec::new()))
        .collect();
    let started = Instant::now();
    sender.send_batch(queue, &messages).await.expect("batch");
    (single, started.elapsed())
}

async fn sender_cost(schema: &str) {
    let (with, without) = (
        QueueName::new("with_trigger").unwrap(),
        QueueName::new("without_trigger").unwrap(),
    );
    let sender = PostgresTransport::connect(&transport_config(schema))
        .await
        .expect("connects");
    for queue in [&with, &without] {
        sender.create_queue(queue).await.expect("create");
    }
    let (client, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .expect("psql");
    tokio::spawn(connection);
    client
        .batch_execute(&format!(
            "DROP TRIGGER throttlehost_notify ON \"{schema}\".\"without_trigger\""
        ))
        .await
        .expect("drop trigger");
    let mut rows = Vec::new();
    for _ in 0..3 {
        for (name, queue) in [("with", &with), ("without", &without)] {
            let (single, batch) = send_cost(&sender, queue, 2000, 20_000).await;
            rows.push((name, single, batch));
        }
    }
    for (name, single, batch) in rows {
        println!(
            "send {name} trigger: 2 000 single {:.0} msg/s, batch of 20 000 {:.3}s",
            2000.0 / single.as_secs_f64(),
            batch.as_secs_f64()
        );
    }
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .ok();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let run = std::process::id();
        for model in [
            ConcurrencyModel::Monitor,
            ConcurrencyModel::Fixed,
            ConcurrencyModel::Adaptive,
        ] {
            let schema = format!("bench_pickup_{run}_{model:?}").to_lowercase();
            pickup(model, &schema).await;
            let (client, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
                .await
                .expect("psql");
            tokio::spawn(connection);
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                .await
                .ok();
        }
        sender_cost(&format!("bench_send_cost_{run}")).await;
    });
}
