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

/// One queue may use the whole pool while no other queue needs it: the pool is split into
/// lanes (a queue's statements go to its own lane's few connections first, so a backend
/// touches few tables), and a lane lends what its own queues do not wait for. Eight receives
/// held open at once on a pool of eight (two lanes of four) all get a connection; had the
/// queue been kept to its lane, the fifth would have waited out the pool's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_busy_queue_still_has_the_whole_pool() {
    let schema = PgSchema::new();
    let mut config = schema.transport_config(TransactionMode::ReceiveOnly, 8);
    config.connect_timeout = Duration::from_secs(2);
    let transport = throttlehost::transport::postgres::PostgresTransport::connect(&config)
        .await
        .unwrap();
    let queue = QueueName::new("busy").unwrap();
    transport.admin().create_queue(&queue).await.unwrap();
    let messages: Vec<OutgoingMessage> = (0..8u8).map(|i| OutgoingMessage::new(vec![i])).collect();
    transport.send_batch(&queue, &messages).await.unwrap();
    let mut open = Vec::new();
    for i in 0..8 {
        let received = transport.receive(&queue).await;
        let received = received.unwrap_or_else(|e| panic!("receive {i} of 8 on a pool of 8: {e}"));
        open.push(received.expect("a message"));
    }
    assert_eq!(transport.connections_in_use(), 8);
    for received in open {
        received.rollback().await.unwrap();
    }
}

/// A busy queue cannot keep its lane's connections from the other queues of the lane: while
/// another queue waits, a receive chain (each commit bringing the next receive along on the
/// same connection) gives its connection back after a turn, and the waiting queue gets its
/// message long before the busy queue is empty. Before, a chain kept its connection for as
/// long as its queue had messages: on a host of 1 000 queues the last queue waited 6 s for its
/// first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_queue_takes_turns_with_the_others_of_its_lane() {
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;
    const BUSY: u64 = 20_000;
    let schema = PgSchema::new();
    // Four connections: one lane.
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 4).await);
    let (busy, other) = (
        QueueName::new("busy").unwrap(),
        QueueName::new("other").unwrap(),
    );
    for queue in [&busy, &other] {
        transport.admin().create_queue(queue).await.unwrap();
    }
    for chunk in (0..BUSY).collect::<Vec<_>>().chunks(1000) {
        let batch: Vec<OutgoingMessage> = chunk
            .iter()
            .map(|i| OutgoingMessage::new(i.to_le_bytes().to_vec()))
            .collect();
        transport.send_batch(&busy, &batch).await.unwrap();
    }
    transport
        .send(&other, &OutgoingMessage::new(vec![1]))
        .await
        .unwrap();
    let taken = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let mut chains = Vec::new();
    for _ in 0..4 {
        let (transport, busy, taken, stop) =
            (transport.clone(), busy.clone(), taken.clone(), stop.clone());
        chains.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let mut next = transport.receive(&busy).await.unwrap();
                while let Some(received) = next {
                    taken.fetch_add(1, Ordering::SeqCst);
                    if stop.is_cancelled() {
                        received.commit().await.unwrap();
                        break;
                    }
                    let both = received.commit_and_receive(&busy).await;
                    both.committed.unwrap();
                    next = both.next.transpose().unwrap().flatten();
                }
            }
        }));
    }
    wait_until(
        Duration::from_secs(30),
        "every connection held by a chain",
        || transport.connections_in_use() == 4 && taken.load(Ordering::SeqCst) > 40,
    )
    .await;
    let received = transport.receive(&other).await.unwrap();
    let busy_taken = taken.load(Ordering::SeqCst);
    stop.cancel();
    for chain in chains {
        chain.await.unwrap();
    }
    received
        .expect("the other queue's message")
        .commit()
        .await
        .unwrap();
    eprintln!("the other queue's message came after {busy_taken} of {BUSY} busy messages");
    assert!(
        busy_taken < BUSY,
        "the other queue waited until the busy one was empty"
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
