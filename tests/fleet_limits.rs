//! Fleet-wide limits on PostgreSQL (`concurrency.fleet_max`): hosts on one queue never have
//! more in flight together than the limit, share it by demand, give it back when idle (and
//! take it again when messages come), and take a dead instance's share once it counts as gone.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{PgSchema, Probe, ProbeHandler, wait_until};
use throttlehost::config::{ConcurrencyModel, Config, TransactionMode};
use throttlehost::host::{Host, HostBuilder};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::{Heartbeat, QueueName, ShareClaim, Transport};

/// A host on `schema` receiving `orders` (at most 4 here, 4 across the fleet), heartbeats
/// every 200 ms, gone after 1 s, a share round every 200 ms.
fn config(schema: &PgSchema, instance: &str, model: ConcurrencyModel) -> Config {
    fleet_limited(common::pg_config(schema, "orders", model, 4), instance)
}

/// `config` with the settings of [`config`]'s fleet.
fn fleet_limited(mut config: Config, instance: &str) -> Config {
    config.host.instance_id = instance.into();
    config.queues[0].concurrency.fleet_max = Some(4);
    config.fleet.heartbeat_interval = Duration::from_millis(200);
    config.fleet.share_interval = Duration::from_millis(200);
    config.fleet.gone_after = Duration::from_secs(1);
    config.fleet.forget_after = Duration::from_secs(60);
    config
}

async fn start(config: Config, probe: &Arc<Probe>) -> Host {
    HostBuilder::new(config)
        .handler("orders", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap()
}

/// This host's share of `orders`' fleet-wide limit, as `/status` shows it.
fn share(host: &Host) -> u32 {
    let status = host.status();
    status.queues[0]
        .fleet
        .expect("orders has a fleet_max")
        .share
}

/// Three hosts (one of each model) on one queue with `fleet_max = 4` and handlers of 50 ms:
/// the calls running at once across all three (one probe counts them) never pass 4, every
/// host takes part, and the shares never add up to more than 4. Once the queue is empty every
/// host gives its share back, and a message sent then is still picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_share_the_fleet_max_and_give_it_back_when_idle() {
    let schema = PgSchema::new();
    share_and_give_back(|name, model| config(&schema, name, model)).await;
}

async fn share_and_give_back(config: impl Fn(&str, ConcurrencyModel) -> Config) {
    // 200 messages of 50 ms at 4 at once: at least 2.5 s, time for every host to get a share.
    let probe = Probe::new(Duration::from_millis(50));
    let mut hosts = Vec::new();
    for (name, model) in [
        ("a", ConcurrencyModel::Fixed),
        ("b", ConcurrencyModel::Adaptive),
        ("c", ConcurrencyModel::Monitor),
    ] {
        hosts.push(start(config(name, model), &probe).await);
    }
    let orders = QueueName::new("orders").unwrap();
    let messages: Vec<OutgoingMessage> = (0..200)
        .map(|i| OutgoingMessage::new(format!("m{i}")))
        .collect();
    hosts[0]
        .handle()
        .transport()
        .send_batch(&orders, &messages)
        .await
        .unwrap();
    // The gates read one after another within microseconds (a status document per host
    // would take long enough for shares to move between two reads).
    let handles: Vec<_> = hosts.iter().map(|h| h.handle()).collect();
    let mut most_shared = 0;
    for _ in 0..600 {
        let shared: u32 = handles
            .iter()
            .map(|h| h.fleet_share("orders").unwrap())
            .sum();
        most_shared = most_shared.max(shared);
        if probe.handled() == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(probe.handled(), 200, "every message handled within 15 s");
    let peak = probe.peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= 4, "{peak} ran at once across the fleet, limit 4");
    assert!(most_shared <= 4, "the shares added up to {most_shared}");
    for host in &hosts {
        let status = host.status();
        let instance = &host.handle().config().host.instance_id;
        assert!(status.queues[0].succeeded_total > 0, "{instance} took part");
    }
    wait_until(Duration::from_secs(5), "every share given back", || {
        hosts.iter().all(|h| share(h) == 0)
    })
    .await;
    hosts[1]
        .send("orders", OutgoingMessage::new("after the quiet"))
        .await
        .unwrap();
    wait_until(Duration::from_secs(5), "the late message handled", || {
        probe.handled() == 201
    })
    .await;
    for host in hosts {
        host.shutdown().await;
    }
}

/// An instance that died holding the whole limit (a registry row and a share row it never
/// writes again): a host started beside it gets nothing while it still counts as alive, and
/// takes the limit once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instances_share_is_taken_once_it_counts_as_gone() {
    let schema = PgSchema::new();
    let transport = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    dead_share_taken(
        std::sync::Arc::new(transport),
        config(&schema, "alive", ConcurrencyModel::Fixed),
        Duration::from_secs(2),
    )
    .await;
}

/// A dead instance's share, gone after `gone_after`: long enough that the check below, a host
/// start and 300 ms after the dead instance's heartbeat, finds it still alive (2 s on
/// PostgreSQL; a host starts on Babelfish in up to 2.1 s). The dead instance writes through
/// `transport`, which is then dropped: a killed process's sessions close with it.
async fn dead_share_taken(
    transport: std::sync::Arc<dyn Transport>,
    mut config: Config,
    gone_after: Duration,
) {
    config.fleet.gone_after = gone_after;
    let registry = transport.instance_registry().unwrap();
    registry.create_registry().await.unwrap();
    let dead = uuid::Uuid::new_v4();
    let beat = Heartbeat {
        process_id: dead,
        host_name: "throttlehost".into(),
        instance_id: "killed".into(),
        version: throttlehost::VERSION.into(),
        admin_address: None,
        summary: "{}".into(),
    };
    let shares = transport.fleet_shares().unwrap();
    shares.create_shares().await.unwrap();
    let orders = QueueName::new("orders").unwrap();
    registry.heartbeat(&beat).await.unwrap();
    let last_beat = tokio::time::Instant::now();
    let claim = ShareClaim {
        wanted: 4,
        granted: 4,
    };
    shares
        .share_round(&orders, dead, Duration::from_secs(2), &mut |_| claim)
        .await
        .unwrap();
    drop(transport);

    let probe = Probe::new(Duration::ZERO);
    let host = start(config, &probe).await;
    host.send("orders", OutgoingMessage::new("waits"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        last_beat.elapsed() < gone_after.mul_f64(0.9),
        "the host took {:?} to start: the check below would prove nothing",
        last_beat.elapsed()
    );
    assert_eq!(share(&host), 0, "the dead instance still counts as alive");
    assert_eq!(probe.handled(), 0);
    wait_until(
        gone_after + Duration::from_secs(3),
        "the message handled",
        || probe.handled() == 1,
    )
    .await;
    assert_eq!(share(&host), 4, "the whole limit, the dead one's included");
    host.shutdown().await;
}

/// SQL Server: three hosts share the limit and give it back; a dead holder's share is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_shares_the_fleet_max() {
    let schema = common::mssql::Schema::new();
    // Babelfish answers slowly under three hosts: a heartbeat every 500 ms, gone after 4 s.
    let config = |name: &str, model| {
        let transport = schema.transport_config(TransactionMode::ReceiveOnly, 8);
        let mut config = fleet_limited(common::host_config(transport, "orders", model, 4), name);
        config.fleet.heartbeat_interval = Duration::from_millis(500);
        config.fleet.gone_after = Duration::from_secs(4);
        config
    };
    share_and_give_back(config).await;
    let other = common::mssql::Schema::new();
    let transport = other.transport(TransactionMode::ReceiveOnly, 2).await;
    let config = fleet_limited(
        common::host_config(
            other.transport_config(TransactionMode::ReceiveOnly, 8),
            "orders",
            ConcurrencyModel::Fixed,
            4,
        ),
        "alive",
    );
    dead_share_taken(transport, config, Duration::from_secs(4)).await;
}

/// The latest write of any share row of `orders` in `schema` (None: no row).
async fn last_share_write(schema: &PgSchema) -> Option<String> {
    let client = schema.client().await;
    let row = client
        .query_one(
            &format!(
                "SELECT max(updated_at)::text FROM \"{}\".throttlehost_shares WHERE queue = 'orders'",
                schema.name
            ),
            &[],
        )
        .await
        .unwrap();
    row.get(0)
}

/// An idle instance holds nothing and writes nothing: its rounds are a peek each, until a
/// message comes; then it takes a share (a write) and handles the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_writes_no_share_rounds() {
    let schema = PgSchema::new();
    let probe = Probe::new(Duration::ZERO);
    let host = start(config(&schema, "idle", ConcurrencyModel::Fixed), &probe).await;
    host.send("orders", OutgoingMessage::new("first"))
        .await
        .unwrap();
    wait_until(Duration::from_secs(5), "the first message handled", || {
        probe.handled() == 1
    })
    .await;
    wait_until(Duration::from_secs(5), "the share given back", || {
        share(&host) == 0
    })
    .await;
    // One more round writes the idle row; after it, three rounds write nothing.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = last_share_write(&schema).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(last_share_write(&schema).await, before, "idle rounds wrote");
    host.send("orders", OutgoingMessage::new("second"))
        .await
        .unwrap();
    wait_until(Duration::from_secs(5), "the second message handled", || {
        probe.handled() == 2
    })
    .await;
    assert_ne!(last_share_write(&schema).await, before, "a share was taken");
    host.shutdown().await;
}

/// A host whose database froze while it held part of the limit (its sessions stay open, as
/// those of a paused process do): the others leave its share alone past `gone_after` (1 s
/// here) while the server still has its sessions, then take it, and when it thaws, the
/// messages that came back with its last commits are given back instead of run past the
/// limit. Before, the share went at `gone_after` and a paused host's handlers resumed beside
/// the others' full share (15 at once for `fleet_max = 12` after SIGSTOP and SIGCONT), and
/// the thaw ran the returned messages (16 at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_thaws_does_not_pass_the_fleet_max() {
    let schema = PgSchema::new();
    let (proxy, through_proxy) =
        common::CommitCutter::for_postgres(&schema, TransactionMode::ReceiveOnly, 8).await;
    let mut frozen_config = config(&schema, "frozen", ConcurrencyModel::Fixed);
    frozen_config.transport = through_proxy;
    let probe = Probe::new(Duration::from_millis(50));
    let frozen = start(frozen_config, &probe).await;
    let other = start(config(&schema, "other", ConcurrencyModel::Fixed), &probe).await;
    let messages: Vec<_> = (0..400)
        .map(|i| OutgoingMessage::new(format!("m{i}")))
        .collect();
    other
        .handle()
        .transport()
        .send_batch(&QueueName::new("orders").unwrap(), &messages)
        .await
        .unwrap();
    wait_until(Duration::from_secs(20), "both hosts handling", || {
        share(&frozen) > 0 && share(&other) > 0 && probe.handled() > 20
    })
    .await;
    proxy.freeze(true);
    let frozen_at = tokio::time::Instant::now();
    // The frozen one, without a round for half of gone_after, closes its own gate: what its
    // receives bring at the thaw must not run.
    wait_until(Duration::from_secs(5), "the frozen gate closed", || {
        share(&frozen) == 0
    })
    .await;
    // Its sessions are open: its share is kept for 5 x gone_after, then the other takes it.
    wait_until(Duration::from_secs(15), "the limit moved over", || {
        share(&other) == 4
    })
    .await;
    assert!(
        frozen_at.elapsed() >= Duration::from_secs(4),
        "the share of a host with open sessions went after {:?}",
        frozen_at.elapsed()
    );
    proxy.freeze(false);
    wait_until(Duration::from_secs(60), "all 400 handled", || {
        probe.handled() == 400
    })
    .await;
    let peak = probe.peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        peak <= 4,
        "{peak} handlers ran at once across the fleet, limit 4"
    );
    frozen.shutdown().await;
    other.shutdown().await;
}
