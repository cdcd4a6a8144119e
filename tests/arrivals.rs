//! Pickup on an idle PostgreSQL queue: every insert notifies (the table's statement trigger),
//! the host's listening connection hears it, and idle receivers look at once instead of at
//! their next peek. The peek interval here is 30 s, so a message handled within a few
//! seconds was found by its notification.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use throttlehost::HostBuilder;
use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::{QueueAdmin, Transport};

use common::{PgSchema, Probe, ProbeHandler, pg_config, q, wait_until};

const PEEK_INTERVAL: Duration = Duration::from_secs(30);
/// The bound on pickup after a notification: milliseconds are expected; a second leaves room
/// for a loaded machine and is still far below any wait the receivers would make without it.
const PICKUP_BOUND: Duration = Duration::from_secs(1);

/// Starts a host on `config` (on `transport`, else the configured one) whose first queue a
/// [`Probe`] handles at once.
async fn probed_host(
    config: throttlehost::Config,
    transport: Option<std::sync::Arc<dyn Transport>>,
) -> (throttlehost::Host, std::sync::Arc<Probe>) {
    let probe = Probe::new(Duration::ZERO);
    let queue = config.queues[0].name.clone();
    let mut builder = HostBuilder::new(config);
    if let Some(transport) = transport {
        builder = builder.transport(transport);
    }
    let host = builder
        .handler(&queue, ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    (host, probe)
}

/// Runs `send`, then checks that the probe has handled `handled` messages within
/// [`PICKUP_BOUND`] of its start.
async fn picked_up<E: std::fmt::Debug>(
    probe: &Probe,
    handled: usize,
    send: impl std::future::Future<Output = Result<(), E>>,
) {
    picked_up_within(PICKUP_BOUND, probe, handled, send).await;
}

/// [`picked_up`] with a bound of its own.
async fn picked_up_within<E: std::fmt::Debug>(
    bound: Duration,
    probe: &Probe,
    handled: usize,
    send: impl std::future::Future<Output = Result<(), E>>,
) {
    let sent = Instant::now();
    send.await.unwrap();
    wait_until(PEEK_INTERVAL, "the message handled", || {
        probe.handled() >= handled
    })
    .await;
    assert!(
        sent.elapsed() < bound,
        "handled {:?} after it was sent",
        sent.elapsed()
    );
}

/// Starts a host on an idle queue, lets its receivers settle for `settle`, then sends one
/// message from another connection (as another host or NServiceBus would) and checks it is
/// handled within [`PICKUP_BOUND`]; then a batch, handled too.
async fn an_idle_queue_is_woken_by_an_insert(model: ConcurrencyModel, settle: Duration) {
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "work", model, 4);
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    let (host, probe) = probed_host(config, None).await;
    let sender = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    sender.create_queue(&q("work")).await.unwrap();
    tokio::time::sleep(settle).await;
    eprintln!("{model:?}, after {settle:?} idle");
    picked_up(
        &probe,
        1,
        sender.send(&q("work"), &OutgoingMessage::new(vec![1])),
    )
    .await;
    // A batch send notifies too (one statement, one notification).
    let batch: Vec<OutgoingMessage> = (0..10u8).map(|i| OutgoingMessage::new(vec![i])).collect();
    sender.send_batch(&q("work"), &batch).await.unwrap();
    wait_until(Duration::from_secs(5), "the batch handled", || {
        probe.handled() >= 11
    })
    .await;
    host.shutdown().await;
}

/// The monitor's first idle wait is the whole peek interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_is_woken_by_an_insert() {
    an_idle_queue_is_woken_by_an_insert(ConcurrencyModel::Monitor, Duration::from_millis(500))
        .await;
}

/// Loops back off from 50 ms, doubling: after 13 s idle the poller is in a wait of 12.8 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_and_adaptive_loops_are_woken_by_an_insert() {
    let settle = Duration::from_secs(13);
    tokio::join!(
        an_idle_queue_is_woken_by_an_insert(ConcurrencyModel::Fixed, settle),
        an_idle_queue_is_woken_by_an_insert(ConcurrencyModel::Adaptive, settle)
    );
}

/// A table made before the trigger existed (or by NServiceBus) gets it when a host starts on
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_trigger_gets_it_when_a_host_starts() {
    let schema = PgSchema::new();
    let setup = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    setup.create_queue(&q("old")).await.unwrap();
    let client = schema.client().await;
    client
        .batch_execute(&format!(
            "DROP TRIGGER throttlehost_notify ON \"{}\".\"old\"",
            schema.name
        ))
        .await
        .unwrap();
    let mut config = pg_config(&schema, "old", ConcurrencyModel::Monitor, 2);
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    let (host, probe) = probed_host(config, None).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    picked_up(
        &probe,
        1,
        setup.send(&q("old"), &OutgoingMessage::new(vec![1])),
    )
    .await;
    host.shutdown().await;
}

/// In process no notification is needed: the memory transport wakes a queue's receivers on
/// every message stored ready, sent, rolled back or moved from the delayed table.
#[tokio::test(start_paused = true)]
async fn the_memory_transport_wakes_its_receivers_itself() {
    use std::sync::Arc;
    use throttlehost::transport::memory::MemoryTransport;
    let memory = Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
    let mut config = common::memory_config("work");
    config.host.admin_address = "off".into();
    config.queues[0].concurrency.model = ConcurrencyModel::Monitor;
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    let (host, probe) = probed_host(config, Some(memory.clone())).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    picked_up(
        &probe,
        1,
        memory.send(&q("work"), &OutgoingMessage::new(vec![1])),
    )
    .await;
    // After 13 s idle the peeker is in a wait of 12.8 s. A delayed send through the host
    // tells the mover its due time, so it moves the message a second later: only the move's
    // wake gets it handled before the next peek.
    tokio::time::sleep(Duration::from_secs(13)).await;
    moved_when_due(&probe, 2, host.send("work", delayed())).await;
    host.shutdown().await;
}

/// A memory-transport host over `counting` whose queue `work` (monitor, `max` 2) holds
/// `bodies` at start and is handled by `handler`; depth reads for throttling only hourly, so
/// the receivers' own peeks are what finds messages.
async fn drained_host(
    counting: std::sync::Arc<common::Counting>,
    bodies: &[u8],
    handler: impl throttlehost::Handler + 'static,
) -> throttlehost::Host {
    for &body in bodies {
        counting
            .inner
            .send(&q("work"), &OutgoingMessage::new(vec![body]))
            .await
            .unwrap();
    }
    let mut config = common::memory_config("work");
    config.host.admin_address = "off".into();
    config.throttling.database_size_refresh = Duration::from_secs(3600);
    let queue = &mut config.queues[0];
    queue.concurrency.model = ConcurrencyModel::Monitor;
    queue.concurrency.max = 2;
    queue.concurrency.peek_interval = Duration::from_secs(1);
    queue.delayed_delivery.enabled = false;
    HostBuilder::new(config)
        .transport(counting)
        .handler("work", handler)
        .start()
        .await
        .unwrap()
}

fn memory_transport() -> std::sync::Arc<throttlehost::transport::memory::MemoryTransport> {
    let memory =
        throttlehost::transport::memory::MemoryTransport::new(TransactionMode::ReceiveOnly);
    std::sync::Arc::new(memory)
}

/// A queue whose every arrival is told of, drained until a receive found it empty, peeks
/// once more when its receives have all ended and is idle from there: the quick follow-up
/// peeks after activity (50 ms doubling to a second, six statements) would only find what
/// that receive found. 1 000 queues drained at once made 6 000 of them.
#[tokio::test(start_paused = true)]
async fn a_queue_drained_to_empty_peeks_once_and_rests() {
    let memory = memory_transport();
    memory.admin().create_queue(&q("work")).await.unwrap();
    let counting = common::Counting::announcing_sends_only(memory);
    let probe = Probe::new(Duration::ZERO);
    let bodies: Vec<u8> = (0..20).collect();
    let host = drained_host(counting.clone(), &bodies, ProbeHandler(probe.clone())).await;
    wait_until(Duration::from_secs(5), "the queue drained", || {
        probe.handled() == 20
    })
    .await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let peeks = counting.peeks();
    assert!(
        peeks <= 1,
        "{peeks} peeks in the minute after the queue was drained"
    );
    picked_up(
        &probe,
        21,
        counting.send(&q("work"), &OutgoingMessage::new(vec![21])),
    )
    .await;
    host.shutdown().await;
}

/// Fails the first message's first attempt a second in, after the queue was found empty: its
/// send goes to a queue that does not exist, so the receive rolls back and the message
/// returns to its queue for a retry.
struct FailsFirstSendOnce {
    failed: std::sync::atomic::AtomicBool,
    probe: std::sync::Arc<Probe>,
}

#[throttlehost::async_trait]
impl throttlehost::Handler for FailsFirstSendOnce {
    async fn handle(
        &self,
        ctx: &mut throttlehost::Context<'_>,
    ) -> Result<(), throttlehost::HandlerError> {
        use std::sync::atomic::Ordering;
        if ctx.body() == [1] && !self.failed.swap(true, Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            ctx.send("missing", OutgoingMessage::new(vec![0])).await?;
            return Ok(());
        }
        ProbeHandler(self.probe.clone()).handle(ctx).await
    }
}

/// A message this host gives back after a receive found its queue empty (its send failed:
/// rolled back for a retry) returns without an arrival on PostgreSQL, whose trigger tells of
/// inserts only. The drained queue's one peek waits for its receives to end, so it finds
/// that message at once, not at the next depth read (hourly here) or the safety-net peek
/// five minutes later.
#[tokio::test(start_paused = true)]
async fn a_message_given_back_after_the_queue_was_found_empty_is_found_at_once() {
    let memory = memory_transport();
    memory.admin().create_queue(&q("work")).await.unwrap();
    let counting = common::Counting::announcing_sends_only(memory);
    let probe = Probe::new(Duration::ZERO);
    let handler = FailsFirstSendOnce {
        failed: Default::default(),
        probe: probe.clone(),
    };
    let started = Instant::now();
    let host = drained_host(counting, &[1, 2], handler).await;
    wait_until(
        Duration::from_secs(600),
        "the given-back message handled",
        || probe.handled() == 2,
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the given-back message was handled {:?} after the start",
        started.elapsed()
    );
    host.shutdown().await;
}

/// A fleet-limited queue whose instance holds no share (it gave it back when its receivers
/// found the queue empty) and whose arrivals are told of: a message that comes unannounced
/// (rolled back by a crashed host, its notification lost) is seen by the share round's peek,
/// which takes a share and wakes the receivers sleeping out the safety interval. Before, the
/// round opened the gate and the receivers slept on: the message waited for the next depth
/// read (hourly here) or the safety-net peek five minutes later.
#[tokio::test(start_paused = true)]
async fn a_share_round_that_finds_a_message_wakes_the_idle_receivers() {
    let memory = memory_transport();
    memory.admin().create_queue(&q("work")).await.unwrap();
    let counting = common::Counting::announcing_sends_only(memory);
    let probe = Probe::new(Duration::ZERO);
    let mut config = common::memory_config("work");
    config.host.admin_address = "off".into();
    config.throttling.database_size_refresh = Duration::from_secs(3600);
    config.fleet.share_interval = Duration::from_millis(200);
    let queue = &mut config.queues[0];
    queue.concurrency.model = ConcurrencyModel::Fixed;
    queue.concurrency.max = 4;
    queue.concurrency.fleet_max = Some(4);
    queue.delayed_delivery.enabled = false;
    let host = HostBuilder::new(config)
        .transport(counting.clone())
        .handler("work", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    // A first message, told of: the receivers find the queue empty after it and go idle.
    picked_up(
        &probe,
        1,
        counting.send(&q("work"), &OutgoingMessage::new(vec![0])),
    )
    .await;
    // Long enough for the receivers' follow-up peeks to end in the safety interval.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(host.handle().fleet_share("work"), Some(0), "idle: no share");
    picked_up(
        &probe,
        2,
        counting
            .inner
            .send(&q("work"), &OutgoingMessage::new(vec![1])),
    )
    .await;
    host.shutdown().await;
}

/// A message due in a second, stored in the delayed table by its send.
fn delayed() -> OutgoingMessage {
    OutgoingMessage::new(vec![2]).with_delay(Duration::from_secs(1))
}

/// Runs `send` (of a message due in a second, which the host's mover moves once due: at
/// once when the host sent it, else on its back-off of 0.5 s doubling from start-up) and
/// checks the probe has handled `handled` messages within 8 s: the move woke the receivers,
/// whose next peek is further away.
async fn moved_when_due<E: std::fmt::Debug>(
    probe: &Probe,
    handled: usize,
    send: impl std::future::Future<Output = Result<(), E>>,
) {
    let sent = Instant::now();
    send.await.unwrap();
    wait_until(PEEK_INTERVAL, "the delayed message handled", || {
        probe.handled() >= handled
    })
    .await;
    assert!(
        sent.elapsed() < Duration::from_secs(8),
        "handled {:?} after it was sent, due after 1 s",
        sent.elapsed()
    );
}

/// A delayed message sent by another process is moved into the queue by this host's mover,
/// whose insert notifies like any other: it is handled when due, not at the next peek.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_delayed_message_wakes_the_receivers() {
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "work", ConcurrencyModel::Monitor, 2);
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    let (host, probe) = probed_host(config, None).await;
    let sender = schema.transport(TransactionMode::ReceiveOnly, 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    moved_when_due(&probe, 1, sender.send(&q("work"), &delayed())).await;
    host.shutdown().await;
}

/// SQL Server does not notify, but a send of this process wakes the queue's receivers when it
/// commits: a message sent through the host's own transport (as its handlers' sends, ingest
/// and the forward handler are) does not wait for the next peek.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_a_send_of_this_process_wakes_its_receivers() {
    use std::sync::Arc;
    use throttlehost::transport::sqlserver::SqlServerTransport;
    let schema = common::mssql::Schema::new();
    let transport_config = schema.transport_config(TransactionMode::ReceiveOnly, 8);
    let transport = Arc::new(
        SqlServerTransport::connect(&transport_config)
            .await
            .unwrap(),
    );
    let mut config = common::host_config(transport_config, "work", ConcurrencyModel::Monitor, 2);
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    let (host, probe) = probed_host(config, Some(transport.clone())).await;
    // Babelfish answers slower than PostgreSQL and a receive there looks rows up first: a
    // wider bound than PostgreSQL's, still far below the waits without the wake (the first
    // idle wait is the whole 30 s peek interval, the later one 12.8 s).
    const BOUND: Duration = Duration::from_secs(5);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (work, one) = (q("work"), OutgoingMessage::new(vec![1]));
    picked_up_within(BOUND, &probe, 1, transport.send(&work, &one)).await;
    // After work the idle back-off starts again at 50 ms, doubling: 13 s later the peeker is
    // in a wait of 12.8 s.
    tokio::time::sleep(Duration::from_secs(13)).await;
    let batch: Vec<OutgoingMessage> = (0..3u8).map(|i| OutgoingMessage::new(vec![i])).collect();
    picked_up_within(BOUND, &probe, 4, transport.send_batch(&work, &batch)).await;
    // The same wait again, then a delayed message sent through the host (whose mover then
    // moves it when due, a second later): the move wakes the receivers, whose next peek is
    // 12 s away.
    tokio::time::sleep(Duration::from_secs(13)).await;
    moved_when_due(&probe, 5, host.send("work", delayed())).await;
    host.shutdown().await;
}

/// Without its notification (a table without the trigger, and a host told not to create
/// anything) a message is still received: at the next peek.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_notification_a_message_is_found_by_peeking() {
    let schema = PgSchema::new();
    let setup = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    setup.create_queue(&q("quiet")).await.unwrap();
    setup.create_queue(&q("error")).await.unwrap();
    let delayed = setup.delayed_delivery().unwrap();
    delayed.create_delayed(&q("quiet")).await.unwrap();
    let client = schema.client().await;
    let table = format!("\"{}\".\"quiet\"", schema.name);
    client
        .batch_execute(&format!("DROP TRIGGER throttlehost_notify ON {table}"))
        .await
        .unwrap();
    let mut config = pg_config(&schema, "quiet", ConcurrencyModel::Monitor, 2);
    config.host.create_queues = false;
    config.queues[0].concurrency.peek_interval = Duration::from_millis(300);
    let (host, probe) = probed_host(config, None).await;
    // Found by a peek: the bound is a peek's, not a notification's.
    let (queue, message) = (q("quiet"), OutgoingMessage::new(vec![1]));
    picked_up_within(
        Duration::from_secs(10),
        &probe,
        1,
        setup.send(&queue, &message),
    )
    .await;
    let triggers: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM pg_trigger WHERE tgrelid = '{table}'::regclass AND tgname = 'throttlehost_notify'"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(triggers, 0, "no notification could have woken it");
    host.shutdown().await;
}

/// `notify_on_insert = false`: the tables the host creates get no trigger, nobody listens, and
/// messages are found by peeking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_notify_on_insert_off_nothing_is_added_and_peeks_find_messages() {
    use throttlehost::transport::postgres::QueueStatements;
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "plain", ConcurrencyModel::Monitor, 2);
    config.transport.notify_on_insert = false;
    config.queues[0].concurrency.peek_interval = Duration::from_millis(300);
    let (host, probe) = probed_host(config, None).await;
    let sender = schema.transport(TransactionMode::ReceiveOnly, 1).await;
    let (queue, message) = (q("plain"), OutgoingMessage::new(vec![1]));
    picked_up_within(
        Duration::from_secs(10),
        &probe,
        1,
        sender.send(&queue, &message),
    )
    .await;
    let client = schema.client().await;
    let triggers: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND t.tgname = 'throttlehost_notify'",
            &[&schema.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(triggers, 0, "no table of the schema got the trigger");
    let channel = QueueStatements::new(&schema.name, &q("plain"), "Delayed").notify_channel;
    let listening: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE $1",
            &[&format!("LISTEN \"{channel}\"%")],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(listening, 0, "no listening connection");
    host.shutdown().await;
}

/// The listening connection killed on the server comes back, and wakes receivers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_reconnects_after_its_connection_is_killed() {
    use throttlehost::transport::postgres::QueueStatements;
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "work", ConcurrencyModel::Monitor, 2);
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    let (host, probe) = probed_host(config, None).await;
    let sender = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    let client = schema.client().await;
    let channel = QueueStatements::new(&schema.name, &q("work"), "Delayed").notify_channel;
    let listener = || async {
        client
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE query LIKE $1",
                &[&format!("LISTEN \"{channel}\"%")],
            )
            .await
            .unwrap()
            .map(|row| row.get::<_, i32>(0))
    };
    let mut first = None;
    for _ in 0..100 {
        first = listener().await;
        if first.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first = first.expect("a listening connection");
    client
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .await
        .unwrap();
    let mut second = None;
    for _ in 0..200 {
        second = listener().await.filter(|pid| *pid != first);
        if second.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(second.is_some(), "listening again within 10 s");
    tokio::time::sleep(Duration::from_millis(500)).await;
    picked_up(
        &probe,
        1,
        sender.send(&q("work"), &OutgoingMessage::new(vec![1])),
    )
    .await;
    host.shutdown().await;
}

/// Listening costs an idle queue nothing: everything a host sends its database while its one
/// queue is idle (peeks, the controller's readings, the listening connection) is counted on
/// the wire by a proxy, and stays within one statement per second (peek interval 1 s). The
/// queue has no delayed table here: the host's delayed sweep is counted in
/// tests/many_queues.rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_queue_costs_at_most_one_statement_per_second_with_listening() {
    use common::CommitCutter;
    const WINDOW: Duration = Duration::from_secs(8);
    let schema = PgSchema::new();
    let (proxy, transport) =
        CommitCutter::for_postgres(&schema, TransactionMode::ReceiveOnly, 2).await;
    let mut config = common::host_config(transport, "idle", ConcurrencyModel::Monitor, 2);
    config.queues[0].concurrency.peek_interval = Duration::from_secs(1);
    config.queues[0].delayed_delivery.enabled = false;
    // The heartbeat into the instance registry is the host's, not the queue's: one statement
    // per 5 s whatever the number of queues (tests/fleet.rs).
    config.fleet.enabled = false;
    let (host, probe) = probed_host(config, None).await;
    // Start-up (creating tables, the trigger, LISTEN) is over well within 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = proxy.statements.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(WINDOW).await;
    let idle = proxy.statements.load(std::sync::atomic::Ordering::SeqCst) - before;
    assert!(
        idle <= WINDOW.as_secs() + 1,
        "{idle} statements in {WINDOW:?} on an idle queue"
    );
    // The count is of this host's statements: its receive of a message is seen. (How soon it
    // is received is the other tests' business; here a peek every second may find it first.)
    let sender = schema.transport(TransactionMode::ReceiveOnly, 1).await;
    let (queue, message) = (q("idle"), OutgoingMessage::new(vec![1]));
    picked_up_within(
        Duration::from_secs(10),
        &probe,
        1,
        sender.send(&queue, &message),
    )
    .await;
    assert!(
        proxy.statements.load(std::sync::atomic::Ordering::SeqCst) > before + idle,
        "the receive went through the proxy"
    );
    host.shutdown().await;
}

/// Queues whose every arrival is told of peek only as a safety net: twenty idle queues with a
/// one-second peek interval peek about once each after settling (the listener's wake at
/// start), not once a second each, and a message is still picked up at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notified_queues_stop_peeking_while_idle_and_still_pick_up_at_once() {
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "quiet00", ConcurrencyModel::Monitor, 1);
    config.throttling.database_size_refresh = Duration::from_secs(3600);
    let first = config.queues[0].clone();
    for i in 1..20 {
        let mut qc = first.clone();
        qc.name = format!("quiet{i:02}");
        qc.handler = Some(throttlehost::config::HandlerConfig::Noop);
        config.queues.push(qc);
    }
    for qc in &mut config.queues {
        qc.concurrency.peek_interval = Duration::from_secs(1);
        // A delayed table's mover inserts into the queue on every poll, nothing or not, and
        // the statement trigger notifies for that too: measured here is the receivers alone.
        qc.delayed_delivery.enabled = false;
    }
    let inner: std::sync::Arc<dyn Transport> =
        std::sync::Arc::new(schema.transport(TransactionMode::ReceiveOnly, 24).await);
    let counting = common::Counting::with_abilities(inner);
    let (host, probe) = probed_host(config, Some(counting.clone())).await;
    // Settled: the start's peeks and the listener's wake are over once no queue has peeked
    // for two of its intervals. Unnotified queues peek every second and never settle.
    let mut last = (counting.peeks(), Instant::now());
    wait_until(
        Duration::from_secs(30),
        "the receivers' peeking settled",
        || {
            let now = counting.peeks();
            if now != last.0 {
                last = (now, Instant::now());
            }
            last.1.elapsed() >= Duration::from_secs(2)
        },
    )
    .await;
    // Counted over a window: a busy machine peeks less in it, never more.
    let before = counting.peeks();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_peeks = counting.peeks() - before;
    assert!(
        idle_peeks < 20,
        "{idle_peeks} peeks in 5 s of twenty idle queues (unnotified: about 100)"
    );
    let sender = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    picked_up(
        &probe,
        1,
        sender.send(&q("quiet00"), &OutgoingMessage::new(vec![1])),
    )
    .await;
    host.shutdown().await;
}

/// A row that comes without an insert notification (a crashed host's messages roll back into
/// the table; here a row written with triggers off) is found by the depth reads the host
/// makes for all its queues, not by the rare safety-net peek (every 5 minutes): a queue read
/// holding messages wakes its sleeping receivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_comes_unannounced_is_found_by_the_next_depth_read() {
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "quiet", ConcurrencyModel::Monitor, 1);
    config.throttling.sample_interval = Duration::from_millis(100);
    config.throttling.database_size_refresh = Duration::from_millis(300);
    config.queues[0].concurrency.peek_interval = Duration::from_secs(1);
    config.queues[0].delayed_delivery.enabled = false;
    let inner: std::sync::Arc<dyn Transport> =
        std::sync::Arc::new(schema.transport(TransactionMode::ReceiveOnly, 8).await);
    let counting = common::Counting::with_abilities(inner);
    let (host, probe) = probed_host(config, Some(counting.clone())).await;
    wait_until(Duration::from_secs(10), "the queue peeking rarely", || {
        host.handle()
            .queue_status("quiet")
            .is_some_and(|q| q.loops > 0)
    })
    .await;
    // Settled once a few seconds pass without a receiver's peek.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let client = schema.client().await;
    client
        .batch_execute(&format!(
            "SET session_replication_role = replica;
             INSERT INTO {} (Id, Expires, Headers, Body)
                 VALUES (gen_random_uuid(), NULL, '{{}}', '\\x01'::bytea);
             SET session_replication_role = origin;",
            format_args!("\"{}\".\"quiet\"", schema.name)
        ))
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(5),
        "the unannounced row handled",
        || probe.handled() == 1,
    )
    .await;
    host.shutdown().await;
}

/// A transport that cannot tell of arrivals (here PostgreSQL with `notify_on_insert = false`;
/// SQL Server always): the host reads its idle queues' depths once a second, all of them in
/// one statement, and wakes the queue found holding a message. With a peek interval of 30 s,
/// a message another process sends is still handled within a few seconds, and twenty idle
/// queues are not each peeked every interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_notifications_the_host_reads_its_idle_queues_once_a_second() {
    let schema = PgSchema::new();
    let mut config = pg_config(&schema, "scan00", ConcurrencyModel::Monitor, 2);
    config.transport.notify_on_insert = false;
    config.queues[0].concurrency.peek_interval = PEEK_INTERVAL;
    common::add_noop_queues(&mut config, "scan", 20);
    let transport =
        throttlehost::transport::postgres::PostgresTransport::connect(&config.transport)
            .await
            .unwrap();
    let counting = common::Counting::with_abilities(std::sync::Arc::new(transport));
    let (host, probe) = probed_host(config, Some(counting.clone())).await;
    // The start read every queue's depth for the receivers' first peeks (before `start`
    // returned): each found its queue empty, and its next peek is 30 s away, so only the
    // scan can find the message sent now.
    let sender = schema.transport(TransactionMode::ReceiveOnly, 1).await;
    let (queue, message) = (q("scan00"), OutgoingMessage::new(vec![1]));
    picked_up_within(
        Duration::from_secs(5),
        &probe,
        1,
        sender.send(&queue, &message),
    )
    .await;
    host.shutdown().await;
}
