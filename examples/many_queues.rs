//! What a host with many queues costs, at several sizes, on PostgreSQL: monitor model, no-op
//! handlers, pool 40, throttling on, as an operator would run it. For each size it prints
//!
//! - **start**: seconds until every queue has a receiver, creating the tables, and again with
//!   every table there;
//! - **idle**: transactions per second at the database while nothing is sent, 20 s after the
//!   start (`pg_stat_database`; every statement the host sends alone is one), CPU of the host
//!   and of PostgreSQL's processes (per cent of one core), and the host's RSS;
//! - **spread drain**: MESSAGES spread evenly over the queues, drained by a host started over
//!   them, against the same MESSAGES in one queue (max 32, same pool): messages per second,
//!   their ratio, and the worst queue's wait for its first message.
//!
//! `cargo run --release --example many_queues -- [SIZES] [IDLE_SECONDS] [MESSAGES]`
//! (SIZES comma-separated, default `10,100,1000`; IDLE_SECONDS 20; MESSAGES 20 000;
//! DATABASE_URL, default the local server's `test` database; QUEUE_METRICS=off runs the
//! queues with `metrics = false`). The idle host runs in a child process, so its RSS is its
//! own; the spread drain also prints the CPU of both processes while it ran. Needs Linux (`/proc`) and a
//! database nobody else is busy with: the transactions are counted database-wide.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use throttlehost::config::{
    ConcurrencyConfig, ConcurrencyModel, Config, ConnectionString, QueueConfig, TransportConfig,
    TransportKind,
};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueAdmin, QueueName, Transport};
use throttlehost::{Context, Handler, HandlerError, Host, HostBuilder};

/// Seconds after a start before the idle window: the start's peeks are over by then.
const SETTLE_SECONDS: u64 = 20;

/// Counts what it handles and notes when each queue's first message came.
#[derive(Default)]
struct Recorder {
    handled: AtomicU64,
    first: Mutex<HashMap<String, Instant>>,
}

#[throttlehost::async_trait]
impl Handler for Recorder {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        self.first
            .lock()
            .unwrap()
            .entry(ctx.queue().to_string())
            .or_insert_with(Instant::now);
        self.handled.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn queue_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("q{i:04}")).collect()
}

fn config(url: &str, schema: &str, queues: &[String], max: u32) -> Config {
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.transport = TransportConfig {
        kind: TransportKind::Postgres,
        connection_string: ConnectionString::new(url.to_string()),
        schema: schema.to_string(),
        pool_size: 40,
        ..TransportConfig::default()
    };
    if std::env::var("THROTTLING").as_deref() == Ok("off") {
        config.throttling.enabled = false;
    }
    config.queues = queues
        .iter()
        .map(|name| QueueConfig {
            name: name.clone(),
            concurrency: ConcurrencyConfig {
                model: ConcurrencyModel::Monitor,
                max,
                ..ConcurrencyConfig::default()
            },
            metrics: std::env::var("QUEUE_METRICS").as_deref() != Ok("off"),
            ..QueueConfig::default()
        })
        .collect();
    config
}

/// Starts a host over `config`'s queues; returns it and the seconds until every queue had a
/// receiver.
async fn start(config: Config, recorder: &Arc<Recorder>) -> (Host, f64) {
    let started = Instant::now();
    let mut builder = HostBuilder::new(config.clone());
    for q in &config.queues {
        builder = builder.shared_handler(&q.name, recorder.clone());
    }
    let host = builder.start().await.expect("the host starts");
    while host.status().queues.iter().any(|q| q.loops == 0) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (host, started.elapsed().as_secs_f64())
}

/// Transactions the database has ended so far.
async fn transactions(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
         WHERE datname = current_database()",
        &[],
    )
    .await
    .expect("pg_stat_database")
    .get(0)
}

/// CPU seconds used so far by the processes `keep` picks by name (`/proc/<pid>/stat`).
fn cpu_seconds(keep: impl Fn(u32, &str) -> bool) -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !keep(pid, &stat[open + 1..close]) {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the name.
        let field = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        total += field(11) + field(12);
    }
    total as f64 / ticks
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Sends `messages` spread evenly over `queues`.
async fn fill(transport: &PostgresTransport, queues: &[String], messages: usize) {
    for (i, name) in queues.iter().enumerate() {
        let count = messages / queues.len() + usize::from(i < messages % queues.len());
        let batch: Vec<OutgoingMessage> = (0..count)
            .map(|k| OutgoingMessage::new(format!("{name} {k}")))
            .collect();
        for chunk in batch.chunks(1000) {
            transport
                .send_batch(&QueueName::new(name).unwrap(), chunk)
                .await
                .expect("filled");
        }
    }
}

/// Starts a host over messages already waiting; returns messages per second, the worst
/// queue's wait for its first message, in seconds from the start, and the CPU of this process
/// and of PostgreSQL while it ran (per cent of one core).
async fn drain(config: Config, messages: usize) -> (f64, f64, (f64, f64)) {
    let recorder = Arc::new(Recorder::default());
    let me = std::process::id();
    // PostgreSQL's CPU is read before the host stops: its backends end with their connections.
    let (host0, pg0) = (
        cpu_seconds(|pid, _| pid == me),
        cpu_seconds(|_, name| name == "postgres"),
    );
    let started = Instant::now();
    let (host, _) = start(config.clone(), &recorder).await;
    while recorder.handled.load(Ordering::Relaxed) < messages as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed().as_secs_f64();
    let worst = recorder
        .first
        .lock()
        .unwrap()
        .values()
        .map(|t| t.duration_since(started).as_secs_f64())
        .fold(0.0, f64::max);
    let cpu = (
        100.0 * (cpu_seconds(|pid, _| pid == me) - host0) / took,
        100.0 * (cpu_seconds(|_, name| name == "postgres") - pg0) / took,
    );
    host.shutdown().await;
    (messages as f64 / took, worst, cpu)
}

/// Drops `schema`, its tables a few hundred per transaction first: one DROP of thousands of
/// tables takes more locks than a default server has room for.
async fn drop_schema(db: &tokio_postgres::Client, schema: &str) {
    let tables: Vec<String> = db
        .query(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables WHERE schemaname = $1",
            &[&schema],
        )
        .await
        .expect("the schema's tables")
        .iter()
        .map(|row| row.get(0))
        .collect();
    for chunk in tables.chunks(200) {
        db.batch_execute(&format!(
            "DROP TABLE IF EXISTS {} CASCADE",
            chunk.join(", ")
        ))
        .await
        .expect("tables dropped");
    }
    db.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await
        .expect("dropped");
}

/// What an idle host of a given size cost.
struct Idle {
    ready: f64,
    transactions: f64,
    host_cpu: f64,
    database_cpu: f64,
    rss: f64,
}

/// Runs an idle host of `n` queues whose tables exist in a child process (this program with
/// `host SCHEMA N SECONDS`), and measures it from here: transactions at the database and CPU
/// over `idle_seconds` after it settled; its ready time and RSS as it says them.
async fn idle_host(
    db: &tokio_postgres::Client,
    schema: &str,
    n: usize,
    idle_seconds: u64,
) -> Result<Idle, Box<dyn std::error::Error>> {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["host", schema, &n.to_string(), &idle_seconds.to_string()])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().expect("the child runs");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    let mut said = async |what: &str| -> Result<f64, Box<dyn std::error::Error>> {
        let line = lines.next_line().await?.ok_or("the host process ended")?;
        let value = line.strip_prefix(what).ok_or(line.clone())?;
        Ok(value.trim().parse()?)
    };
    let ready = said("ready").await?;
    // Settle: a start peeks every queue a few times (before the listener is up, and once
    // when it is) and reads every depth and delayed table; idle is what comes after.
    tokio::time::sleep(Duration::from_secs(SETTLE_SECONDS)).await;
    let (tx0, host0, pg0) = (
        transactions(db).await,
        cpu_seconds(|p, _| p == pid),
        cpu_seconds(|_, name| name == "postgres"),
    );
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_seconds)).await;
    let seconds = window.elapsed().as_secs_f64();
    // The two reads of the count are this program's own.
    let transactions = (transactions(db).await - tx0 - 2) as f64 / seconds;
    let host_cpu = 100.0 * (cpu_seconds(|p, _| p == pid) - host0) / seconds;
    let database_cpu = 100.0 * (cpu_seconds(|_, name| name == "postgres") - pg0) / seconds;
    let rss = said("rss").await?;
    child.wait().await?;
    Ok(Idle {
        ready,
        transactions,
        host_cpu,
        database_cpu,
        rss,
    })
}

/// The child of [`idle_host`]: starts the host, says `ready SECONDS`, stays idle for the
/// settling time and `idle_seconds`, says `rss MIB` and stops.
async fn run_idle_host(url: &str, schema: &str, n: usize, idle_seconds: u64) {
    let recorder = Arc::new(Recorder::default());
    let (host, ready) = start(config(url, schema, &queue_names(n), 8), &recorder).await;
    println!("ready {ready}");
    tokio::time::sleep(Duration::from_secs(SETTLE_SECONDS + idle_seconds)).await;
    println!("rss {}", rss_mib());
    host.shutdown().await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    if let [mode, schema, n, idle] = &args[..]
        && mode == "host"
    {
        run_idle_host(&url, schema, n.parse()?, idle.parse()?).await;
        return Ok(());
    }
    let sizes: Vec<usize> = args
        .first()
        .map_or("10,100,1000", String::as_str)
        .split(',')
        .map(|s| s.parse().expect("SIZES are numbers"))
        .collect();
    let idle_seconds: u64 = args.get(1).map_or(20, |s| s.parse().expect("IDLE_SECONDS"));
    let messages: usize = args.get(2).map_or(20_000, |s| s.parse().expect("MESSAGES"));
    let (db, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let me = std::process::id();
    println!(
        "{:>6} {:>10} {:>9} {:>8} {:>9} {:>8} {:>7} {:>11} {:>11} {:>7} {:>10} spread cpu% host/pg",
        "queues",
        "create s",
        "ready s",
        "idle tx/s",
        "host cpu%",
        "pg cpu%",
        "RSS MiB",
        "spread m/s",
        "one m/s",
        "ratio",
        "worst 1st s",
    );
    for n in sizes {
        let schema = format!("th_many_{me}_{n}");
        drop_schema(&db, &schema).await;
        let queues = queue_names(n);
        let recorder = Arc::new(Recorder::default());
        let (host, create) = start(config(&url, &schema, &queues, 8), &recorder).await;
        host.shutdown().await;
        // The idle host runs in a process of its own, so its RSS is its own (not what this
        // process's allocator kept of the host started above).
        let idle = idle_host(&db, &schema, n, idle_seconds).await?;

        let mut spread_config = config(&url, &schema, &queues, 8);
        spread_config.host.create_queues = false;
        let transport = PostgresTransport::connect(&spread_config.transport).await?;
        fill(&transport, &queues, messages).await;
        let (spread, worst, spread_cpu) = drain(spread_config, messages).await;
        let one = vec!["single".to_string()];
        let one_config = config(&url, &schema, &one, 32);
        transport.create_queue(&QueueName::new("single")?).await?;
        fill(&transport, &one, messages).await;
        let (alone, _, _) = drain(one_config, messages).await;
        drop(transport);
        drop_schema(&db, &schema).await;
        println!(
            "{n:>6} {create:>10.2} {:>9.2} {:>8.1} {:>9.1} {:>8.1} {:>7.1} {spread:>11.0} {alone:>11.0} {:>7.2} {worst:>10.2} {:>4.0}/{:<4.0}",
            idle.ready,
            idle.transactions,
            idle.host_cpu,
            idle.database_cpu,
            idle.rss,
            spread / alone,
            spread_cpu.0,
            spread_cpu.1,
        );
    }
    Ok(())
}
