//! Retries a whole error queue through a running host on PostgreSQL and shows that the retry
//! is paced by the host's publishing throttling: fills a schema of its own with N failed
//! messages of queue `Sales`, starts a host whose handler takes HANDLER_MS per message and
//! whose database-size threshold is THRESHOLD, asks the host to retry every failed message
//! (`POST /errors/retry`, as `throttlehost errors retry --all` does), and prints twice a
//! second what the retry moved, the queue's depth, the publishing state and the rates. At the
//! end it checks that every message was handled exactly once and nothing is left.
//!
//! `cargo run --release --example failed_retry -- [N] [THRESHOLD] [HANDLER_MS]`
//! (DATABASE_URL, default the local server's `test` database; N 50 000, THRESHOLD 5 000,
//! HANDLER_MS 2).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use throttlehost::config::{Config, ConnectionString, QueueConfig, TransportConfig, TransportKind};
use throttlehost::message::{OutgoingMessage, format_wire_time};
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueName, Transport};
use throttlehost::{Context, Handler, HandlerError, HostBuilder};

/// Counts each body it handles, after a pause that stands for the work.
struct Counting {
    seen: Arc<Mutex<HashMap<Vec<u8>, u32>>>,
    work: Duration,
}

#[throttlehost::async_trait]
impl Handler for Counting {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        tokio::time::sleep(self.work).await;
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        *seen.entry(ctx.body().to_vec()).or_default() += 1;
        Ok(())
    }
}

fn http(method: &str, url: &str, body: &str) -> serde_json::Value {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut answer = match method {
        "POST" => agent
            .post(url)
            .header("Content-Type", "application/json")
            .send(body),
        _ => agent.get(url).call(),
    }
    .expect("the host answers");
    let text = answer.body_mut().read_to_string().expect("a text answer");
    serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N, THRESHOLD and HANDLER_MS are numbers"))
        .collect();
    let n = args.first().copied().unwrap_or(50_000);
    let threshold = args.get(1).copied().unwrap_or(5_000);
    let handler_ms = args.get(2).copied().unwrap_or(2);
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("th_failed_retry_{}", std::process::id());
    let transport_config = TransportConfig {
        kind: TransportKind::Postgres,
        connection_string: ConnectionString::new(url.clone()),
        schema: schema.clone(),
        pool_size: 24,
        ..TransportConfig::default()
    };

    // The error queue as a host leaves it after `Sales` failed N messages.
    let filler: Arc<dyn Transport> = Arc::new(PostgresTransport::connect(&transport_config).await?);
    let error = QueueName::new("error")?;
    filler.admin().create_queue(&error).await?;
    let mut batch = Vec::with_capacity(1000);
    for i in 0..n {
        batch.push(
            OutgoingMessage::new(format!("order {i}"))
                .with_header("NServiceBus.FailedQ", "Sales")
                .with_header("NServiceBus.ExceptionInfo.ExceptionType", "Sales.Timeout")
                .with_header(
                    "NServiceBus.ExceptionInfo.Message",
                    "the warehouse did not answer",
                )
                .with_header(
                    "NServiceBus.TimeOfFailure",
                    format_wire_time(chrono::Utc::now()),
                ),
        );
        if batch.len() == 1000 {
            filler.send_batch(&error, &batch).await?;
            batch.clear();
        }
    }
    filler.send_batch(&error, &batch).await?;

    let mut config = Config::default();
    config.host.admin_address = "127.0.0.1:0".into();
    config.transport = transport_config;
    config.throttling.database_size = threshold;
    let mut sales = QueueConfig {
        name: "Sales".into(),
        ..QueueConfig::default()
    };
    sales.concurrency.max = 8;
    config.queues.push(sales);
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let host = HostBuilder::new(config)
        .handler(
            "Sales",
            Counting {
                seen: seen.clone(),
                work: Duration::from_millis(handler_ms),
            },
        )
        .start()
        .await?;
    let base = format!("http://{}", host.admin_address().expect("an admin address"));
    println!(
        "{n} failed messages of Sales; database_size threshold {threshold}; handler {handler_ms} ms, concurrency 8"
    );

    let started = Instant::now();
    let b = base.clone();
    let job = tokio::task::spawn_blocking(move || {
        http("POST", &format!("{b}/errors/retry"), r#"{"all":true}"#)
    })
    .await?;
    println!("retry started: {job}");
    println!("     t  moved  depth  handled  pub.state  pub.in/s  pub.out/s  pub.delay  db.size");
    let (mut peak_depth, mut states) = (0u64, std::collections::BTreeMap::new());
    let mut moved = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let b = base.clone();
        let progress =
            tokio::task::spawn_blocking(move || http("GET", &format!("{b}/errors/retry"), ""))
                .await?;
        let status = host.status();
        let queue = &status.queues[0];
        let handled = queue.succeeded_total;
        moved = progress["job"]["moved"].as_u64().unwrap_or(moved);
        peak_depth = peak_depth.max(queue.depth);
        let (state, incoming, outgoing, delay, size) = match &status.throttling {
            Some(t) => (
                t.publishing.state,
                t.publishing.incoming_per_second,
                t.publishing.outgoing_per_second,
                t.publishing.delay_seconds,
                t.resources
                    .iter()
                    .find(|r| r.condition == throttlehost::throttling::Condition::DatabaseSize)
                    .map_or(0.0, |r| r.value),
            ),
            None => (0, 0.0, 0.0, 0.0, 0.0),
        };
        *states.entry(state).or_insert(0u32) += 1;
        println!(
            "{:6.1} {moved:6} {:6} {handled:8} {state:10} {incoming:9.0} {outgoing:10.0} {delay:10.3} {size:8.0}",
            started.elapsed().as_secs_f64(),
            queue.depth,
        );
        if handled >= n && progress["running"] == false {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            println!("gave up after 10 minutes");
            break;
        }
    }
    let took = started.elapsed().as_secs_f64();
    host.shutdown().await;
    let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let twice = seen.values().filter(|c| **c > 1).count();
    let left = filler.peek_depth(&error).await?;
    println!(
        "retried {n} in {took:.1}s ({:.0}/s): handled {} distinct, {twice} more than once, {left} left in the error queue; peak depth {peak_depth} (threshold {threshold}); samples by publishing state {states:?}",
        n as f64 / took,
        seen.len()
    );
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await?;
    Ok(())
}
