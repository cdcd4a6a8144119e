//! What publishing an event to three subscribers costs against plain sends, through a host's
//! publish path on PostgreSQL: N events published (a copy in each of three subscribers' queues,
//! one transaction per event), N sends to one queue, and 3 x N sends (one per subscriber's
//! copy, each its own transaction), each by CONCURRENCY tasks, in alternating rounds. Prints
//! events (or messages) per second, copies per second, and checks what each queue holds.
//! Throttling is off: this measures the path, not the controller.
//!
//! `cargo run --release --example publish_cost -- [N] [CONCURRENCY] [ROUNDS]`
//! (DATABASE_URL, default the local server's `test` database; N 5 000, CONCURRENCY 8,
//! ROUNDS 3).

use std::sync::Arc;
use std::time::Instant;

use throttlehost::config::{Config, ConnectionString, QueueConfig, TransportConfig, TransportKind};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::{QueueName, Transport};
use throttlehost::{EventTypes, HostBuilder, HostHandle};

const SUBSCRIBERS: [&str; 3] = ["billing", "shipping", "audit"];

/// Runs `n` operations on `concurrency` tasks; returns the seconds they took.
async fn timed<F, Fut>(n: u64, concurrency: u64, op: F) -> f64
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut i = t;
                while i < n {
                    op(i).await;
                    i += concurrency;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a task");
    }
    started.elapsed().as_secs_f64()
}

async fn depth(transport: &Arc<dyn Transport>, queue: &str) -> u64 {
    transport
        .peek_depth(&QueueName::new(queue).unwrap())
        .await
        .unwrap()
}

async fn purge(transport: &Arc<dyn Transport>) {
    for q in SUBSCRIBERS.iter().chain(&["single"]) {
        transport
            .admin()
            .purge(&QueueName::new(q).unwrap())
            .await
            .unwrap();
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N, CONCURRENCY and ROUNDS are numbers"))
        .collect();
    let n = args.first().copied().unwrap_or(5_000);
    let concurrency = args.get(1).copied().unwrap_or(8);
    let rounds = args.get(2).copied().unwrap_or(3);
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.throttling.enabled = false;
    config.transport = TransportConfig {
        kind: TransportKind::Postgres,
        connection_string: ConnectionString::new(url),
        schema: format!("th_publish_cost_{}", std::process::id()),
        pool_size: concurrency as u32 + 4,
        ..TransportConfig::default()
    };
    // The host receives only from an idle queue: the subscribers' tables are filled, not
    // drained, so what each holds can be checked.
    config.queues.push(QueueConfig {
        name: "idle".into(),
        ..QueueConfig::default()
    });
    let host = HostBuilder::new(config)
        .handler("idle", throttlehost::handlers::NoopHandler)
        .start()
        .await?;
    let handle: HostHandle = host.handle();
    let transport = handle.transport().clone();
    let table = transport
        .subscriptions()
        .expect("PostgreSQL keeps subscriptions");
    for (i, queue) in SUBSCRIBERS.iter().enumerate() {
        let name = QueueName::new(queue)?;
        transport.admin().create_queue(&name).await?;
        let topic = [
            "Sales.OrderAccepted",
            "Sales.OrderAccepted",
            "Sales.IOrderEvent",
        ][i];
        table
            .subscribe(queue, topic, &transport.address(&name))
            .await?;
    }
    transport
        .admin()
        .create_queue(&QueueName::new("single")?)
        .await?;
    let types = Arc::new(EventTypes::parse(
        "Sales.OrderAccepted, Sales;Sales.IOrderEvent, Sales",
    )?);

    println!("n {n}, concurrency {concurrency}, 3 subscribers, PostgreSQL");
    for round in 1..=rounds {
        purge(&transport).await;
        let (h, t) = (handle.clone(), types.clone());
        let publish = timed(n, concurrency, move |i| {
            let (h, t) = (h.clone(), t.clone());
            async move {
                let event = OutgoingMessage::new(format!("order {i}"));
                let published = h.publish(&t, event).await.expect("published");
                assert_eq!(published.subscribers.len(), 3);
            }
        })
        .await;
        for q in SUBSCRIBERS {
            assert_eq!(
                depth(&transport, q).await,
                n,
                "{q} holds one copy per event"
            );
        }
        let h = handle.clone();
        let single = timed(n, concurrency, move |i| {
            let h = h.clone();
            async move {
                let m = OutgoingMessage::new(format!("order {i}"));
                h.send("single", m).await.expect("sent");
            }
        })
        .await;
        purge(&transport).await;
        let h = handle.clone();
        let three = timed(3 * n, concurrency, move |i| {
            let h = h.clone();
            async move {
                let m = OutgoingMessage::new(format!("order {i}"));
                h.send(SUBSCRIBERS[(i % 3) as usize], m)
                    .await
                    .expect("sent");
            }
        })
        .await;
        let per_sec = |count: u64, secs: f64| count as f64 / secs;
        println!(
            "round {round}: publish to 3: {:.0} events/s ({:.0} copies/s) | send to 1: {:.0} msg/s | 3 sends per event: {:.0} msg/s = {:.0} events/s",
            per_sec(n, publish),
            per_sec(3 * n, publish),
            per_sec(n, single),
            per_sec(3 * n, three),
            per_sec(n, three),
        );
    }
    host.shutdown().await;
    Ok(())
}
