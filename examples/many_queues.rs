//! What a host with many queues costs, at several sizes, on PostgreSQL: monitor model, no-op
//! handlers, pool 40, throttling on, as an operator would run it. For each size it prints
//!
//! - **start**: seconds until every queue has a receiver, creating the tables, and again with
//!   every table there;
//! - **idle**: transactions per second at the database while nothing is sent, 20 s after the
//!   start (`pg_stat_database`; every statement the host sends alone is one), CPU of the host
//!   and of PostgreSQL's processes (per cent of one core), the host's RSS, and what one
//!   render of `/metrics` takes (milliseconds, KiB);
//! - **spread drain**: MESSAGES spread evenly over the queues, drained by a host started over
//!   them, against the same MESSAGES in one queue (max 32, same pool), in turn ROUNDS times
//!   (default 3): the medians of messages per second, of their ratio, of the median and the
//!   worst queue's wait for its first message (seconds from the start of the host), of the
//!   transactions per message at the database and of the CPU of both processes;
//! - **wave**: after each drain, as many messages again, spread the same way and inserted in
//!   one transaction, to the host that drained the first (its backends have touched every
//!   table, as on a host that has run a while): the same figures from the commit, and each
//!   round's ratio. Before each drain and wave, a table whose share is over a hundred
//!   messages is vacuumed, so that neither side steps over the last round's dead rows.
//!
//! `cargo run --release --example many_queues -- [SIZES] [IDLE_SECONDS] [MESSAGES]`
//! (SIZES comma-separated, default `10,100,1000`; IDLE_SECONDS 20; MESSAGES 20 000;
//! DATABASE_URL, default the local server's `test` database; QUEUE_METRICS=off runs the
//! queues with `metrics = false`; THROTTLING=off turns throttling off). The idle host runs in
//! a child process, so its RSS is its own. Needs Linux (`/proc`) and a database nobody else is
//! busy with: the transactions are counted database-wide.

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

/// CPU ticks used so far by each process `keep` picks by pid and name (`/proc/<pid>/stat`).
fn cpu_ticks(keep: impl Fn(u32, &str) -> bool) -> HashMap<u32, u64> {
    let mut ticks = HashMap::new();
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
        ticks.insert(pid, field(11) + field(12));
    }
    ticks
}

/// Per cent of one core the processes `keep` picks used between `before` (their ticks then)
/// and now, over `seconds`. A process that ended meanwhile is not counted (its last ticks are
/// gone with it); one that started is counted whole.
fn cpu_percent(before: &HashMap<u32, u64>, seconds: f64, keep: impl Fn(u32, &str) -> bool) -> f64 {
    const TICKS_PER_SECOND: f64 = 100.0; // USER_HZ on Linux
    let used: u64 = cpu_ticks(keep)
        .iter()
        .map(|(pid, now)| now.saturating_sub(before.get(pid).copied().unwrap_or(0)))
        .sum();
    100.0 * used as f64 / TICKS_PER_SECOND / seconds
}

fn is_postgres(_: u32, name: &str) -> bool {
    name == "postgres"
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

/// What one drain of waiting messages measured.
struct Drain {
    /// Messages per second, from the start of the host to the last message handled.
    rate: f64,
    /// Seconds from the start until a queue's first message was handled: the median queue's
    /// and the worst queue's.
    first_wait: (f64, f64),
    /// Transactions at the database per message handled.
    transactions: f64,
    /// Per cent of one core: this process, PostgreSQL's processes.
    cpu: (f64, f64),
}

/// What a wave of messages sent to a running host measured. Its backends have touched every
/// table by then, as on a host that has run a while: a cold start pays about half a
/// millisecond of PostgreSQL's CPU for each table each backend touches first.
struct Wave {
    /// Messages per second, from the commit of their insert to the last message handled.
    rate: f64,
    /// Seconds from the commit until a queue's first message was handled: the median
    /// queue's and the worst queue's.
    first_wait: (f64, f64),
    /// Per cent of one core: this process, PostgreSQL's processes.
    cpu: (f64, f64),
}

/// Seconds from `started` until each queue's first message, the median queue's and the
/// worst's.
fn first_waits(recorder: &Recorder, started: Instant) -> (f64, f64) {
    let mut firsts: Vec<f64> = recorder
        .first
        .lock()
        .unwrap()
        .values()
        .map(|t| t.duration_since(started).as_secs_f64())
        .collect();
    firsts.sort_by(f64::total_cmp);
    (firsts[firsts.len() / 2], firsts[firsts.len() - 1])
}

/// Waits until `recorder` has handled `count` messages in all.
async fn handled(recorder: &Recorder, count: u64) {
    while recorder.handled.load(Ordering::Relaxed) < count {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Starts a host over `messages` already waiting in `queues` of `schema` and measures it
/// until all are handled (the drain); then sends it as many again, spread the same way, in
/// one transaction and measures that wave too.
async fn drain(
    db: &tokio_postgres::Client,
    config: Config,
    (schema, queues): (&str, &[String]),
    messages: usize,
) -> (Drain, Wave) {
    let recorder = Arc::new(Recorder::default());
    let me = std::process::id();
    let host_process = move |pid: u32, _: &str| pid == me;
    let tx0 = transactions(db).await;
    let (host0, pg0) = (cpu_ticks(host_process), cpu_ticks(is_postgres));
    let started = Instant::now();
    let (host, _) = start(config.clone(), &recorder).await;
    handled(&recorder, messages as u64).await;
    let took = started.elapsed().as_secs_f64();
    let cpu = (
        cpu_percent(&host0, took, host_process),
        cpu_percent(&pg0, took, is_postgres),
    );
    // A backend reports its transactions at most once a second, and an idle one, when the
    // lock it reports under is busy (40 backends went idle at once), 10 s later
    // (PGSTAT_IDLE_INTERVAL): read after 2 s, a drain counted 0.78 transactions a message.
    // The idle host's own statements in the meantime are a few dozen.
    tokio::time::sleep(Duration::from_secs(11)).await;
    // The two reads of the count are this program's own.
    let transactions = (transactions(db).await - tx0 - 2) as f64 / messages as f64;
    let drain = Drain {
        rate: messages as f64 / took,
        first_wait: first_waits(&recorder, started),
        transactions,
        cpu,
    };
    let wave = wave(db, (schema, queues), messages, &recorder).await;
    host.shutdown().await;
    (drain, wave)
}

/// Inserts `messages` spread over `queues` in one transaction while the host that `recorder`
/// counts for runs, and measures from the commit until they are handled.
async fn wave(
    db: &tokio_postgres::Client,
    (schema, queues): (&str, &[String]),
    messages: usize,
    recorder: &Recorder,
) -> Wave {
    use std::fmt::Write;
    vacuum_crowded(db, (schema, queues), messages).await;
    let mut insert = String::from("BEGIN;");
    for (i, name) in queues.iter().enumerate() {
        let count = messages / queues.len() + usize::from(i < messages % queues.len());
        write!(
            insert,
            "INSERT INTO \"{schema}\".\"{name}\" (Id, Expires, Headers, Body) \
             SELECT gen_random_uuid(), NULL, '{{}}', '\\x01'::bytea FROM generate_series(1, {count});"
        )
        .unwrap();
    }
    db.batch_execute(&insert).await.expect("the wave inserted");
    recorder.first.lock().unwrap().clear();
    let before = recorder.handled.load(Ordering::Relaxed);
    let me = std::process::id();
    let host_process = move |pid: u32, _: &str| pid == me;
    let (host0, pg0) = (cpu_ticks(host_process), cpu_ticks(is_postgres));
    let started = Instant::now();
    db.batch_execute("COMMIT")
        .await
        .expect("the wave committed");
    handled(recorder, before + messages as u64).await;
    let took = started.elapsed().as_secs_f64();
    Wave {
        rate: messages as f64 / took,
        first_wait: first_waits(recorder, started),
        cpu: (
            cpu_percent(&host0, took, host_process),
            cpu_percent(&pg0, took, is_postgres),
        ),
    }
}

/// Vacuums each of `queues` if a share of `messages` left over a hundred dead rows in it: a
/// receive steps over the dead rows at the head of its table's index until autovacuum comes,
/// which would slow one queue (and the 10 or 100 of a small spread) against 1 000 tables of
/// 20 each. A VACUUM drops every backend's cached entries for its table, the very warmth a
/// wave measures, so tables with a few dead rows are left as they are.
async fn vacuum_crowded(
    db: &tokio_postgres::Client,
    (schema, queues): (&str, &[String]),
    messages: usize,
) {
    if messages / queues.len() <= 100 {
        return;
    }
    for name in queues {
        db.batch_execute(&format!("VACUUM \"{schema}\".\"{name}\""))
            .await
            .expect("vacuumed");
    }
}

/// The median of `values` by `key`.
fn median<T>(values: &[T], key: impl Fn(&T) -> f64) -> f64 {
    let mut keys: Vec<f64> = values.iter().map(key).collect();
    keys.sort_by(f64::total_cmp);
    keys[keys.len() / 2]
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
    /// Milliseconds to render `/metrics` once, and its size in KiB.
    scrape: (f64, f64),
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
    let host_process = move |p: u32, _: &str| p == pid;
    let (tx0, host0, pg0) = (
        transactions(db).await,
        cpu_ticks(host_process),
        cpu_ticks(is_postgres),
    );
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_seconds)).await;
    let seconds = window.elapsed().as_secs_f64();
    // The two reads of the count are this program's own.
    let transactions = (transactions(db).await - tx0 - 2) as f64 / seconds;
    let host_cpu = cpu_percent(&host0, seconds, host_process);
    let database_cpu = cpu_percent(&pg0, seconds, is_postgres);
    let rss = said("rss").await?;
    let scrape = (said("scrape ms").await?, said("scrape KiB").await?);
    child.wait().await?;
    Ok(Idle {
        ready,
        transactions,
        host_cpu,
        database_cpu,
        rss,
        scrape,
    })
}

/// The child of [`idle_host`]: starts the host, says `ready SECONDS`, stays idle for the
/// settling time and `idle_seconds`, says `rss MIB`, then renders `/metrics` once and says
/// `scrape ms MILLISECONDS` and `scrape KiB SIZE` (after the RSS: the text is a few MiB) and stops.
async fn run_idle_host(url: &str, schema: &str, n: usize, idle_seconds: u64) {
    let recorder = Arc::new(Recorder::default());
    let (host, ready) = start(config(url, schema, &queue_names(n), 8), &recorder).await;
    println!("ready {ready}");
    tokio::time::sleep(Duration::from_secs(SETTLE_SECONDS + idle_seconds)).await;
    println!("rss {}", rss_mib());
    let rendering = Instant::now();
    let text = host.handle().metrics_text();
    println!("scrape ms {}", rendering.elapsed().as_secs_f64() * 1000.0);
    println!("scrape KiB {}", text.len() as f64 / 1024.0);
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
    let rounds: usize = std::env::var("ROUNDS").map_or(3, |r| r.parse().expect("ROUNDS"));
    println!(
        "{:>6} {:>8} {:>7} {:>9} {:>9} {:>7} {:>7} {:>15} {:>10} {:>9} {:>6} {:>13} {:>11} {:>12} {:>12}",
        "queues",
        "create s",
        "ready s",
        "idle tx/s",
        "host cpu%",
        "pg cpu%",
        "RSS MiB",
        "scrape ms/KiB",
        "spread m/s",
        "one m/s",
        "ratio",
        "1st wait p50/max",
        "tx/msg s/1",
        "spread cpu% host/pg",
        "one cpu% host/pg",
    );
    let mut waves = Vec::new();
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
        // Spread and one queue in turn, `rounds` times: a machine's noise falls on both.
        let (mut spread, mut alone) = (Vec::new(), Vec::new());
        let (mut spread_waves, mut alone_waves) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            vacuum_crowded(&db, (&schema, &queues), messages).await;
            fill(&transport, &queues, messages).await;
            let (cold, warm) =
                drain(&db, spread_config.clone(), (&schema, &queues), messages).await;
            spread.push(cold);
            spread_waves.push(warm);
            // A new table each round, so the last round's dead rows are not in its way.
            let one = vec![format!("single{round}")];
            transport.create_queue(&QueueName::new(&one[0])?).await?;
            fill(&transport, &one, messages).await;
            let one_config = config(&url, &schema, &one, 32);
            let (cold, warm) = drain(&db, one_config, (&schema, &one), messages).await;
            alone.push(cold);
            alone_waves.push(warm);
        }
        drop(transport);
        drop_schema(&db, &schema).await;
        let ratios: Vec<f64> = spread
            .iter()
            .zip(&alone)
            .map(|(s, a)| s.rate / a.rate)
            .collect();
        println!(
            "{n:>6} {create:>8.2} {:>7.2} {:>9.1} {:>9.1} {:>7.1} {:>7.1} {:>6.1} / {:<6.0} {:>10.0} {:>9.0} {:>6.2} {:>6.2} / {:<6.2} {:>5.2} / {:<4.2} {:>5.0} / {:<5.0} {:>5.0} / {:<5.0}",
            idle.ready,
            idle.transactions,
            idle.host_cpu,
            idle.database_cpu,
            idle.rss,
            idle.scrape.0,
            idle.scrape.1,
            median(&spread, |d| d.rate),
            median(&alone, |d| d.rate),
            median(&ratios, |r| *r),
            median(&spread, |d| d.first_wait.0),
            median(&spread, |d| d.first_wait.1),
            median(&spread, |d| d.transactions),
            median(&alone, |d| d.transactions),
            median(&spread, |d| d.cpu.0),
            median(&spread, |d| d.cpu.1),
            median(&alone, |d| d.cpu.0),
            median(&alone, |d| d.cpu.1),
        );
        let wave_ratios: Vec<f64> = spread_waves
            .iter()
            .zip(&alone_waves)
            .map(|(s, a)| s.rate / a.rate)
            .collect();
        let rounds = |ratios: &[f64]| {
            let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
            each.join(" ")
        };
        waves.push(format!(
            "{n:>6} {:>10.0} {:>9.0} {:>6.2} {:>6.2} / {:<6.2} {:>5.0} / {:<5.0} {:>5.0} / {:<5.0}   {} | {}",
            median(&spread_waves, |w| w.rate),
            median(&alone_waves, |w| w.rate),
            median(&wave_ratios, |r| *r),
            median(&spread_waves, |w| w.first_wait.0),
            median(&spread_waves, |w| w.first_wait.1),
            median(&spread_waves, |w| w.cpu.0),
            median(&spread_waves, |w| w.cpu.1),
            median(&alone_waves, |w| w.cpu.0),
            median(&alone_waves, |w| w.cpu.1),
            rounds(&wave_ratios),
            rounds(&ratios),
        ));
    }
    // The same messages again, sent in one transaction to the host that drained the first
    // ones: what a host that has run a while does.
    println!();
    println!("a wave of as many messages to the running host (warm backends):");
    println!(
        "{:>6} {:>10} {:>9} {:>6} {:>15} {:>13} {:>13}   ratio per round: wave | drain",
        "queues", "spread m/s", "one m/s", "ratio", "1st wait p50/max", "spread cpu%", "one cpu%",
    );
    for line in waves {
        println!("{line}");
    }
    Ok(())
}
