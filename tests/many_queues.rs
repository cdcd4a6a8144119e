//! Many queues on PostgreSQL: what idle queues cost the database. The delayed tables are read
//! by one sweep per host (a few statements for all of them every 5 s), not polled each by
//! its mover, and a message another process stores in one is still moved when due.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{CommitCutter, PgSchema, Probe, ProbeHandler, wait_until};
use throttlehost::HostBuilder;
use throttlehost::config::{ConcurrencyModel, HandlerConfig, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::{QueueName, Transport};

/// Twenty idle queues with delayed tables, counted on the wire: once started, the host sends
/// a handful of statements in 5 s (a sweep of every delayed table, the depth reads, the
/// heartbeat), not one per table. Before, each mover polled its own table on a back-off from
/// 0.5 s (about 20-40 statements in this window, and each empty move fired the queue's insert
/// trigger). A message another process stores in a delayed table is moved when due, found by
/// the next sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_delayed_tables_cost_one_sweep_not_a_poll_each() {
    const WINDOW: Duration = Duration::from_secs(5);
    let schema = PgSchema::new();
    let (proxy, transport) =
        CommitCutter::for_postgres(&schema, TransactionMode::ReceiveOnly, 8).await;
    let mut config = common::host_config(transport, "idle00", ConcurrencyModel::Monitor, 1);
    common::add_noop_queues(&mut config, "idle", 20);
    let probe = Probe::new(Duration::ZERO);
    let host = HostBuilder::new(config)
        .handler("idle00", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    // Start-up (tables, triggers, LISTEN, the first sweep) is over well within 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = proxy.statements.load(Ordering::SeqCst);
    tokio::time::sleep(WINDOW).await;
    let idle = proxy.statements.load(Ordering::SeqCst) - before;
    eprintln!("{idle} statements in {WINDOW:?}");
    assert!(
        idle <= 12,
        "{idle} statements in {WINDOW:?} from twenty idle queues with delayed tables"
    );
    let sender = schema.transport(TransactionMode::ReceiveOnly, 1).await;
    let stored = Instant::now();
    sender
        .send(
            &QueueName::new("idle00").unwrap(),
            &OutgoingMessage::new(vec![1]).with_delay(Duration::from_millis(500)),
        )
        .await
        .unwrap();
    // Found by the next sweep (every 5 s), moved when due.
    wait_until(
        Duration::from_secs(15),
        "the delayed message handled",
        || probe.handled() == 1,
    )
    .await;
    eprintln!(
        "a delayed message stored elsewhere handled after {:?}",
        stored.elapsed()
    );
    host.shutdown().await;
}

/// A start over tables that stand already creates none of them: it looks them up in a few
/// reads of the catalogs. Creating a queue runs about eight statements (a transaction, a
/// lock, the table, the trigger, its layout) and its delayed table five, so a start that
/// created twenty queues again sent some 260; this one sends the look-ups, the checks and the
/// receivers' first peeks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_over_existing_tables_looks_them_up_and_creates_none() {
    let schema = PgSchema::new();
    let (proxy, transport) =
        CommitCutter::for_postgres(&schema, TransactionMode::ReceiveOnly, 8).await;
    let mut config = common::host_config(transport, "stand00", ConcurrencyModel::Monitor, 1);
    config.queues[0].handler = Some(HandlerConfig::Noop);
    common::add_noop_queues(&mut config, "stand", 20);
    let created_by = proxy.statements.load(Ordering::SeqCst);
    let host = HostBuilder::new(config.clone()).start().await.unwrap();
    let creating = proxy.statements.load(Ordering::SeqCst) - created_by;
    host.shutdown().await;
    let before = proxy.statements.load(Ordering::SeqCst);
    let host = HostBuilder::new(config).start().await.unwrap();
    let again = proxy.statements.load(Ordering::SeqCst) - before;
    host.shutdown().await;
    eprintln!("a start creating 20 queues: {creating} statements; over them: {again}");
    assert!(
        creating >= 200,
        "{creating} statements creating 20 queues: this test no longer measures a creation"
    );
    assert!(
        again <= 40,
        "{again} statements to start over 20 queues whose tables stand"
    );
}

/// SQL Server tells of no arrival: twenty idle queues are read together once a second, and
/// their receivers peek by themselves only as the safety net (before, each peeked every
/// second: some 100 peeks in this window); a message another process sends is found by the
/// next read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_idle_queues_are_read_together_not_peeked_each() {
    use std::sync::Arc;
    use throttlehost::transport::sqlserver::SqlServerTransport;
    const WINDOW: Duration = Duration::from_secs(5);
    let schema = common::mssql::Schema::new();
    let transport_config = schema.transport_config(TransactionMode::ReceiveOnly, 8);
    let inner: Arc<dyn Transport> = Arc::new(
        SqlServerTransport::connect(&transport_config)
            .await
            .unwrap(),
    );
    let counting = common::Counting::with_abilities(inner);
    let mut config = common::host_config(
        transport_config.clone(),
        "idle00",
        ConcurrencyModel::Monitor,
        2,
    );
    config.queues[0].delayed_delivery.enabled = false;
    common::add_noop_queues(&mut config, "idle", 20);
    let probe = Probe::new(Duration::ZERO);
    let host = HostBuilder::new(config)
        .transport(counting.clone())
        .handler("idle00", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    // Settled once three seconds pass without a peek: the first peeks and the follow-ups
    // after them (1 s, 1 s, 2 s apart before the long safety interval) are over.
    let mut last = counting.peeks.load(Ordering::SeqCst);
    let mut quiet = 0;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = counting.peeks.load(Ordering::SeqCst);
        quiet = if now == last { quiet + 1 } else { 0 };
        last = now;
        if quiet == 3 {
            break;
        }
    }
    let (peeks, reads) = (
        counting.peeks.load(Ordering::SeqCst),
        counting.depth_reads.load(Ordering::SeqCst),
    );
    tokio::time::sleep(WINDOW).await;
    let peeks = counting.peeks.load(Ordering::SeqCst) - peeks;
    let reads = counting.depth_reads.load(Ordering::SeqCst) - reads;
    eprintln!("in {WINDOW:?}: {peeks} peeks, {reads} reads of many depths");
    assert!(
        peeks <= 4,
        "{peeks} peeks of twenty idle queues in {WINDOW:?}"
    );
    assert!(
        (3..=12).contains(&reads),
        "{reads} reads of the idle queues' depths in {WINDOW:?}"
    );
    let sender = SqlServerTransport::connect(&transport_config)
        .await
        .unwrap();
    let (queue, message) = (
        QueueName::new("idle00").unwrap(),
        OutgoingMessage::new(vec![1]),
    );
    let sent = Instant::now();
    sender.send(&queue, &message).await.unwrap();
    wait_until(Duration::from_secs(5), "the message handled", || {
        probe.handled() == 1
    })
    .await;
    eprintln!("handled {:?} after it was sent", sent.elapsed());
    host.shutdown().await;
}
