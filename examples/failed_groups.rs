//! Times grouping an error queue of failed messages on PostgreSQL (the failed-messages tool's
//! `errors list`): fills a schema of its own with N failed messages as the host writes them
//! (fault headers with a stack trace, 20 causes over 4 source queues), groups them ROUNDS
//! times and prints each time, then drops the schema.
//!
//! `cargo run --release --example failed_groups -- [N] [ROUNDS]` (DATABASE_URL, default the
//! local server's `test` database; N 100 000, ROUNDS 3).

use std::sync::Arc;
use std::time::Instant;

use throttlehost::config::{ConnectionString, TransportConfig, TransportKind};
use throttlehost::failed::{FailedMessages, Filter};
use throttlehost::message::{OutgoingMessage, format_wire_time};
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueName, Transport};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N and ROUNDS are numbers"))
        .collect();
    let (n, rounds) = (
        args.first().copied().unwrap_or(100_000),
        args.get(1).copied().unwrap_or(3),
    );
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("th_failed_bench_{}", std::process::id());
    let config = TransportConfig {
        kind: TransportKind::Postgres,
        connection_string: ConnectionString::new(url),
        schema: schema.clone(),
        pool_size: 8,
        ..TransportConfig::default()
    };
    let transport: Arc<dyn Transport> = Arc::new(PostgresTransport::connect(&config).await?);
    let error = QueueName::new("error")?;
    transport.admin().create_queue(&error).await?;
    let trace = "   at Sales.Handlers.PlaceOrderHandler.Handle(PlaceOrder message, IMessageHandlerContext context)\n".repeat(6);
    let filled = Instant::now();
    let mut batch = Vec::with_capacity(1000);
    for i in 0..n {
        let cause = i % 20;
        batch.push(
            OutgoingMessage::new(format!("{{\"order\":{i},\"lines\":[1,2,3]}}"))
                .with_header(
                    "NServiceBus.FailedQ",
                    format!("\"{schema}\".\"Sales{}\"", cause % 4),
                )
                .with_header(
                    "NServiceBus.ExceptionInfo.ExceptionType",
                    format!("Sales.Error{cause}"),
                )
                .with_header(
                    "NServiceBus.ExceptionInfo.Message",
                    format!("order {cause} failed\nsecond line"),
                )
                .with_header("NServiceBus.ExceptionInfo.StackTrace", trace.clone())
                .with_header(
                    "NServiceBus.TimeOfFailure",
                    format_wire_time(chrono::Utc::now()),
                )
                .with_header("NServiceBus.ProcessingEndpoint", "Sales"),
        );
        if batch.len() == 1000 {
            transport.send_batch(&error, &batch).await?;
            batch.clear();
        }
    }
    transport.send_batch(&error, &batch).await?;
    println!(
        "filled {n} failed messages in {:.2}s",
        filled.elapsed().as_secs_f64()
    );
    let tool = FailedMessages::new(transport.clone())?;
    let store = transport
        .failed_store()
        .expect("PostgreSQL browses error queues");
    let started = Instant::now();
    let (mut after, mut read, mut bytes) = (0, 0, 0);
    loop {
        let rows = store.browse(&error, after, 5_000, false).await?;
        let Some(last) = rows.last() else { break };
        after = last.position;
        read += rows.len();
        bytes += rows.iter().map(|r| r.headers.len()).sum::<usize>();
    }
    println!(
        "reading alone: {read} rows, {} MB of headers in {:.3}s",
        bytes / 1_000_000,
        started.elapsed().as_secs_f64()
    );
    for round in 1..=rounds {
        let started = Instant::now();
        let groups = tool.groups(&error, &Filter::default()).await?;
        let total: u64 = groups.iter().map(|g| g.count).sum();
        println!(
            "round {round}: {} groups of {total} messages in {:.3}s",
            groups.len(),
            started.elapsed().as_secs_f64()
        );
    }
    let (client, connection) = tokio_postgres::connect(
        &std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        tokio_postgres::NoTls,
    )
    .await?;
    tokio::spawn(connection);
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await?;
    Ok(())
}
