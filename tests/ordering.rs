//! Order across hosts: three hosts, each with its own connection pool and receivers, drain
//! one ordered queue. Nothing but the database is shared between them, so what holds here
//! holds between processes. Every key's messages must be handled in send order with no
//! overlap, and every stage after the previous one (checked from the recorded start and end
//! times), each message exactly once. Each test runs on PostgreSQL, and on SQL Server when
//! SQLSERVER_URL is set (`cargo test --test ordering -- --ignored`).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use throttlehost::config::{ConcurrencyModel, Config, TransactionMode};
use throttlehost::load::scenario::KeyLayout;
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::Transport;
use throttlehost::{Context, Handler, HandlerError, HostBuilder};

use common::{PgSchema, mssql, q, wait_until};

/// The database a test runs on, in a schema of its own.
enum Db {
    Postgres(PgSchema),
    SqlServer(mssql::Schema),
}

impl Db {
    /// SQL Server at SQLSERVER_URL, in the dialect SQLSERVER_DIALECT names.
    fn sqlserver() -> Option<Db> {
        Some(Db::SqlServer(mssql::Schema::new()))
    }

    async fn transport(&self, pool_size: u32) -> Arc<dyn Transport> {
        match self {
            Db::Postgres(s) => Arc::new(s.transport(TransactionMode::ReceiveOnly, pool_size).await),
            Db::SqlServer(s) => s.transport(TransactionMode::ReceiveOnly, pool_size).await,
        }
    }

    /// One queue's host configuration (fixed loops of `max`) on this database.
    fn config(&self, queue: &str, max: u32) -> Config {
        let transport = match self {
            Db::Postgres(s) => s.transport_config(TransactionMode::ReceiveOnly, max + 8),
            Db::SqlServer(s) => s.transport_config(TransactionMode::ReceiveOnly, max + 8),
        };
        common::host_config(transport, queue, ConcurrencyModel::Fixed, max)
    }

    /// Ends every session of this test's connections; how many it ended.
    async fn kill_connections(&self) -> u64 {
        match self {
            Db::Postgres(s) => s.kill_connections().await,
            Db::SqlServer(s) => s.kill_connections().await,
        }
    }
}

/// The header the queue is ordered by.
const KEY: &str = "Sales.OrderId";

/// One handled message: key, its number within the key, start and end of the handler.
type Handled = (u32, u32, Instant, Instant);

/// Records each call and takes a pseudo-random 0-20 ms.
struct Recorder {
    log: Arc<Mutex<Vec<Handled>>>,
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let start = Instant::now();
        let body = String::from_utf8_lossy(&ctx.message().body).to_string();
        let (key, n) = body.split_once('/').ok_or("body is not key/n")?;
        let (key, n): (u32, u32) = (key.parse()?, n.parse()?);
        // Deterministic per message, spread over 0-20 ms.
        let spread = (key.wrapping_mul(2654435761) ^ n.wrapping_mul(40503)) % 21;
        tokio::time::sleep(Duration::from_millis(u64::from(spread))).await;
        self.log
            .lock()
            .unwrap()
            .push((key, n, start, Instant::now()));
        Ok(())
    }

    fn name(&self) -> &str {
        "recorder"
    }
}

/// `per_key` messages for each of `keys` keys, shuffled across keys, in order within each.
fn keyed_backlog(keys: u32, per_key: u32) -> Vec<OutgoingMessage> {
    let order = KeyLayout::Shuffled.keys(u64::from(keys * per_key), keys);
    let mut next = vec![0u32; keys as usize];
    order
        .into_iter()
        .map(|k| {
            let n = next[k as usize];
            next[k as usize] += 1;
            OutgoingMessage::new(format!("{k}/{n}").into_bytes()).with_header(KEY, k.to_string())
        })
        .collect()
}

/// Checks the log: every message once, each key's in order and never two at once.
fn assert_key_order(log: &[Handled], keys: u32, per_key: u32) {
    assert_eq!(log.len(), (keys * per_key) as usize, "each message once");
    let mut by_key: HashMap<u32, Vec<&Handled>> = HashMap::new();
    for h in log {
        by_key.entry(h.0).or_default().push(h);
    }
    assert_eq!(by_key.len(), keys as usize);
    for (key, mut runs) in by_key {
        runs.sort_by_key(|h| h.2);
        let numbers: Vec<u32> = runs.iter().map(|h| h.1).collect();
        assert_eq!(
            numbers,
            (0..per_key).collect::<Vec<_>>(),
            "key {key} in send order"
        );
        for pair in runs.windows(2) {
            assert!(
                pair[0].3 <= pair[1].2,
                "key {key}: message {} started before {} ended",
                pair[1].1,
                pair[0].1
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_keep_every_keys_order() {
    three_hosts_keep_every_keys_order_on(Db::Postgres(PgSchema::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_three_hosts_keep_every_keys_order() {
    if let Some(db) = Db::sqlserver() {
        three_hosts_keep_every_keys_order_on(db).await;
    }
}

/// 10 000 messages over 500 keys, handlers of 0-20 ms, three hosts of 16 receivers each.
async fn three_hosts_keep_every_keys_order_on(db: Db) {
    const KEYS: u32 = 500;
    const PER_KEY: u32 = 20;
    let queue = "orders";
    let setup = db.transport(4).await;
    setup.admin().create_queue(&q(queue)).await.unwrap();
    for chunk in keyed_backlog(KEYS, PER_KEY).chunks(1000) {
        setup.send_batch(&q(queue), chunk).await.unwrap();
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut config = db.config(queue, 16);
    config.queues[0].ordering.key_header = KEY.into();
    config.queues[0].ordering.lookahead = 128;
    let started = Instant::now();
    let mut hosts = Vec::new();
    for _ in 0..3 {
        let host = HostBuilder::new(config.clone())
            .handler(queue, Recorder { log: log.clone() })
            .start()
            .await
            .unwrap();
        hosts.push(host);
    }
    let total = (KEYS * PER_KEY) as usize;
    wait_until(Duration::from_secs(180), "every keyed message", || {
        log.lock().unwrap().len() >= total
    })
    .await;
    let elapsed = started.elapsed();
    for host in hosts {
        host.shutdown().await;
    }
    eprintln!(
        "{total} messages over {KEYS} keys, three hosts of 16: {:.1} s ({:.0} msg/s)",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    let log = log.lock().unwrap().clone();
    assert_key_order(&log, KEYS, PER_KEY);
    assert!(setup.receive(&q(queue)).await.unwrap().is_none(), "drained");
}

/// The stage example of the seed: stages 100 x4, 200 x2, 300, 400 x2 and 500, each message
/// taking 150 ms, drained by three hosts: each stage starts only after the previous one has
/// ended, and the members of a stage run side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_run_stages_one_after_another() {
    three_hosts_run_stages_one_after_another_on(Db::Postgres(PgSchema::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_three_hosts_run_stages_one_after_another() {
    if let Some(db) = Db::sqlserver() {
        three_hosts_run_stages_one_after_another_on(db).await;
    }
}

async fn three_hosts_run_stages_one_after_another_on(db: Db) {
    use throttlehost::message::{EXECUTION_STAGE_HEADER, PREVIOUS_STAGE_HEADER};
    let plan: [(u32, u32); 5] = [(100, 4), (200, 2), (300, 1), (400, 2), (500, 1)];
    let queue = "stages";
    let setup = db.transport(4).await;
    setup.admin().create_queue(&q(queue)).await.unwrap();
    let mut messages = Vec::new();
    let mut previous: Option<u32> = None;
    for (stage, members) in plan {
        for n in 0..members {
            let mut m = OutgoingMessage::new(format!("{stage}/{n}").into_bytes())
                .with_header(EXECUTION_STAGE_HEADER, stage.to_string());
            if let Some(p) = previous {
                m = m.with_header(PREVIOUS_STAGE_HEADER, p.to_string());
            }
            messages.push(m);
        }
        previous = Some(stage);
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut config = db.config(queue, 4);
    config.queues[0].ordering.stages = true;
    // Idle receivers look again within 100 ms, so that a stage's members start together.
    config.queues[0].concurrency.peek_interval = Duration::from_millis(100);
    let mut hosts = Vec::new();
    for _ in 0..3 {
        let host = HostBuilder::new(config.clone())
            .handler(queue, Sleeper { log: log.clone() })
            .start()
            .await
            .unwrap();
        hosts.push(host);
    }
    // The stages go out once the hosts' receivers are connected: a Babelfish login takes
    // about a second, and members that one early connection took in turn would not overlap.
    if matches!(db, Db::SqlServer(_)) {
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    setup.send_batch(&q(queue), &messages).await.unwrap();
    wait_until(Duration::from_secs(60), "every stage", || {
        log.lock().unwrap().len() >= messages.len()
    })
    .await;
    for host in hosts {
        host.shutdown().await;
    }
    let log = log.lock().unwrap().clone();
    assert_eq!(log.len(), messages.len(), "each message once");
    let span = |stage: u32| {
        let runs: Vec<_> = log.iter().filter(|h| h.0 == stage).collect();
        let first_start = runs.iter().map(|h| h.2).min().unwrap();
        let last_start = runs.iter().map(|h| h.2).max().unwrap();
        let first_end = runs.iter().map(|h| h.3).min().unwrap();
        let last_end = runs.iter().map(|h| h.3).max().unwrap();
        (first_start, last_start, first_end, last_end)
    };
    for pair in plan.windows(2) {
        let (before, after) = (span(pair[0].0), span(pair[1].0));
        assert!(
            before.3 <= after.0,
            "stage {} started before stage {} ended",
            pair[1].0,
            pair[0].0
        );
    }
    for (stage, members) in plan.iter().filter(|(_, m)| *m > 1) {
        let (_, last_start, first_end, _) = span(*stage);
        assert!(
            last_start < first_end,
            "the {members} members of stage {stage} overlap in time: {:?}",
            log.iter()
                .filter(|h| h.0 == *stage)
                .map(|h| (h.2 - log[0].2, h.3 - log[0].2))
                .collect::<Vec<_>>()
        );
    }
}

/// Takes 150 ms per message and records stage, member, start and end.
struct Sleeper {
    log: Arc<Mutex<Vec<Handled>>>,
}

#[async_trait]
impl Handler for Sleeper {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let start = Instant::now();
        let body = String::from_utf8_lossy(&ctx.message().body).to_string();
        let (stage, n) = body.split_once('/').ok_or("body is not stage/n")?;
        let (stage, n): (u32, u32) = (stage.parse()?, n.parse()?);
        tokio::time::sleep(Duration::from_millis(150)).await;
        self.log
            .lock()
            .unwrap()
            .push((stage, n, start, Instant::now()));
        Ok(())
    }

    fn name(&self) -> &str {
        "sleeper"
    }
}

/// A receiver whose connection dies mid-message: the message comes back first, before the
/// next of its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_receiver_keeps_its_keys_order() {
    a_killed_receiver_keeps_its_keys_order_on(Db::Postgres(PgSchema::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_a_killed_receiver_keeps_its_keys_order() {
    if let Some(db) = Db::sqlserver() {
        a_killed_receiver_keeps_its_keys_order_on(db).await;
    }
}

async fn a_killed_receiver_keeps_its_keys_order_on(db: Db) {
    let queue = q("orders");
    let ordering = throttlehost::config::OrderingConfig {
        key_header: KEY.into(),
        ..Default::default()
    };
    let first = db.transport(2).await;
    first.admin().create_queue(&queue).await.unwrap();
    first
        .key_ordering()
        .unwrap()
        .order_by_key(&queue, &ordering)
        .await
        .unwrap();
    let messages: Vec<_> = ["a1", "a2"]
        .iter()
        .map(|b| OutgoingMessage::new(b.as_bytes().to_vec()).with_header(KEY, "a"))
        .collect();
    first.send_batch(&queue, &messages).await.unwrap();
    let held = first.receive(&queue).await.unwrap().expect("a1");
    let second = db.transport(2).await;
    second
        .key_ordering()
        .unwrap()
        .order_by_key(&queue, &ordering)
        .await
        .unwrap();
    assert!(
        second.receive(&queue).await.unwrap().is_none(),
        "a2 waits while a1 is in flight on another host"
    );
    assert!(db.kill_connections().await >= 1);
    // The server ends the killed session's transaction a moment after the kill.
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        // The kill ends this host's pooled sessions too: a receive on one of them fails
        // once and the pool opens a new one.
        if let Ok(Some(r)) = second.receive(&queue).await {
            break r;
        }
        assert!(Instant::now() < deadline, "a1 came back within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let body = match again.payload() {
        throttlehost::transport::Payload::Message(m) => m.body.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(body, b"a1", "the killed receive's message first, not a2");
    drop(held);
    again.commit().await.unwrap();
}

/// Sends a/0, a/1, b/0, b/1 (keys a and b) to `queue`; the messages sent.
async fn send_two_keys(transport: &dyn Transport, queue: &str) -> Vec<OutgoingMessage> {
    let backlog: Vec<_> = [("a", "a/0"), ("a", "a/1"), ("b", "b/0"), ("b", "b/1")]
        .iter()
        .map(|(k, body)| OutgoingMessage::new(body.as_bytes().to_vec()).with_header(KEY, *k))
        .collect();
    transport.send_batch(&q(queue), &backlog).await.unwrap();
    backlog
}

/// The keys of `queue` held now.
async fn held_keys(
    transport: &dyn Transport,
    queue: &str,
) -> Vec<throttlehost::transport::HeldKey> {
    let ordering = transport.key_ordering().unwrap();
    ordering.held_keys(&q(queue)).await.unwrap()
}

/// `failed_key = "hold"` through a host: a keyed message that fails after its retries stays
/// in the queue and holds its key (its later message waits, other keys run, nothing goes to
/// the error queue) until released; then it is handled first, and the rest of its key after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_message_holds_its_key_until_released() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    /// Fails `a/0` while `failing`; records every handled body in order.
    struct FailsFirstOfA {
        failing: AtomicBool,
        attempts: AtomicU32,
        handled: Mutex<Vec<String>>,
    }
    struct Handle(Arc<FailsFirstOfA>);
    #[async_trait]
    impl Handler for Handle {
        async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
            let body = String::from_utf8_lossy(&ctx.message().body).to_string();
            if body == "a/0" {
                self.0.attempts.fetch_add(1, Ordering::SeqCst);
                if self.0.failing.load(Ordering::SeqCst) {
                    return Err("the order service is down".into());
                }
            }
            self.0.handled.lock().unwrap().push(body);
            Ok(())
        }
        fn name(&self) -> &str {
            "fails-first-of-a"
        }
    }

    let db = Db::Postgres(PgSchema::new());
    let queue = "orders";
    let setup = db.transport(4).await;
    setup.admin().create_queue(&q(queue)).await.unwrap();
    let backlog = send_two_keys(setup.as_ref(), queue).await;
    let state = Arc::new(FailsFirstOfA {
        failing: AtomicBool::new(true),
        attempts: AtomicU32::new(0),
        handled: Mutex::new(Vec::new()),
    });
    let mut config = db.config(queue, 4);
    config.queues[0].ordering.key_header = KEY.into();
    config.queues[0].ordering.failed_key = throttlehost::config::FailedKey::Hold;
    config.queues[0].immediate_retries = 1;
    let port = common::free_port();
    config.host.admin_address = format!("127.0.0.1:{port}");
    let host = HostBuilder::new(config)
        .handler(queue, Handle(state.clone()))
        .start()
        .await
        .unwrap();
    wait_until(Duration::from_secs(20), "a/0 held", || {
        state.attempts.load(Ordering::SeqCst) >= 2 && state.handled.lock().unwrap().len() >= 2
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while setup
        .key_ordering()
        .unwrap()
        .held_keys(&q(queue))
        .await
        .unwrap()
        .len()
        != 1
    {
        assert!(Instant::now() < deadline, "the hold recorded within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A second: the held key stays held, however often the queue is polled.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        state.attempts.load(Ordering::SeqCst),
        2,
        "two attempts, no more"
    );
    assert_eq!(
        *state.handled.lock().unwrap(),
        ["b/0", "b/1"],
        "a/1 waits behind a/0"
    );
    let held = held_keys(setup.as_ref(), queue).await;
    assert_eq!(
        (held[0].key.as_str(), held[0].message_id),
        ("a", backlog[0].id)
    );
    assert_eq!(held[0].reason, "the order service is down");
    assert_eq!(
        setup.peek_depth(&q("error")).await.unwrap_or(0),
        0,
        "nothing in the error queue"
    );
    // What an operator alerts on: the held key shows as a gauge.
    let held_gauge = || {
        let (_, metrics, _) =
            common::http("GET", &format!("http://127.0.0.1:{port}/metrics"), b"", &[]);
        metrics
            .lines()
            .find(|l| l.starts_with("throttlehost_ordered_held_keys{queue=\"orders\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while held_gauge() != Some(1.0) {
        assert!(
            Instant::now() < deadline,
            "held keys gauge at 1: {:?}",
            held_gauge()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    state.failing.store(false, Ordering::SeqCst);
    assert_eq!(
        setup
            .key_ordering()
            .unwrap()
            .release_held(&q(queue), Some("a"))
            .await
            .unwrap(),
        1
    );
    wait_until(
        Duration::from_secs(20),
        "a/0 and a/1 after the release",
        || state.handled.lock().unwrap().len() >= 4,
    )
    .await;
    host.shutdown().await;
    assert_eq!(
        *state.handled.lock().unwrap(),
        ["b/0", "b/1", "a/0", "a/1"],
        "released, a/0 first (two full attempts afresh allowed), then a/1"
    );
    assert_eq!(state.attempts.load(Ordering::SeqCst), 3);
}

/// A receive that took a message whose key was held meanwhile (its statement read the store
/// before another receive's hold was committed, and that receive has rolled back since) gives
/// it back untried: the handler never sees it, it stays in the queue, its key stays held, and
/// the other keys run. A CI run once saw a held message tried twice more this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_taken_as_its_key_was_held_goes_back_untried() {
    /// Records every handled body.
    struct Records(Arc<Mutex<Vec<String>>>);
    #[async_trait]
    impl Handler for Records {
        async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
            let body = String::from_utf8_lossy(&ctx.message().body).to_string();
            self.0.lock().unwrap().push(body);
            Ok(())
        }
        fn name(&self) -> &str {
            "records"
        }
    }

    let db = Db::Postgres(PgSchema::new());
    let queue = "orders";
    let transport = common::Counting::with_abilities(db.transport(8).await);
    transport.admin().create_queue(&q(queue)).await.unwrap();
    let backlog = send_two_keys(transport.as_ref(), queue).await;
    *transport.held_once_taken.lock().unwrap() = Some((KEY.to_string(), "a".to_string()));
    let handled = Arc::new(Mutex::new(Vec::new()));
    let mut config = db.config(queue, 4);
    config.queues[0].ordering.key_header = KEY.into();
    config.queues[0].ordering.failed_key = throttlehost::config::FailedKey::Hold;
    let host = HostBuilder::new(config)
        .without_admin()
        .transport(transport.clone())
        .handler(queue, Records(handled.clone()))
        .start()
        .await
        .unwrap();
    wait_until(Duration::from_secs(20), "b/0 and b/1 handled", || {
        handled.lock().unwrap().len() >= 2
    })
    .await;
    // The queue is received from again and again while a/0 and a/1 stay: each receive skips
    // the held key now (or, were a/0 tried, a/0 and a/1 are handled and the queue is empty).
    let receives = transport.receives();
    wait_until(
        Duration::from_secs(20),
        "ten more receives or a handled",
        || transport.receives() >= receives + 10 || handled.lock().unwrap().len() > 2,
    )
    .await;
    host.shutdown().await;
    assert!(
        transport.held_once_taken.lock().unwrap().is_none(),
        "a/0 was taken and its key held"
    );
    assert_eq!(*handled.lock().unwrap(), ["b/0", "b/1"], "a/0 never tried");
    assert_eq!(transport.peek_depth(&q(queue)).await.unwrap(), 2);
    let held = held_keys(transport.as_ref(), queue).await;
    assert_eq!(
        (held.len(), held[0].message_id),
        (1, backlog[0].id),
        "a held by a/0"
    );
}
