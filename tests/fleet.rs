//! The instance registry on PostgreSQL: hosts on one schema see each other through their
//! heartbeats, a stopping host leaves, a silent one shows as gone and is forgotten, a host
//! whose heartbeat fails keeps receiving and says so, and `throttlehost status --fleet` shows
//! every instance, and an override given for the fleet reaches every instance within one
//! heartbeat.

mod common;

use std::time::Duration;

use common::{PgSchema, Probe, ProbeHandler, wait_until};
use throttlehost::FleetView;
use throttlehost::config::{ConcurrencyModel, Config, OverrideMode, Secret, TransactionMode};
use throttlehost::host::OverrideScope;
use throttlehost::host::{Host, HostBuilder};
use throttlehost::message::OutgoingMessage;
use throttlehost::throttling::Direction;
use throttlehost::transport::{Heartbeat, Transport};

const FLEET_TOKEN: &str = "the-fleet-token-for-tests";

/// A host on `schema` whose heartbeat comes every 200 ms and that calls an instance gone
/// after 1 s.
fn config(schema: &PgSchema, instance: &str) -> Config {
    let mut config = common::pg_config(schema, "orders", ConcurrencyModel::Monitor, 2);
    config.host.instance_id = instance.into();
    // The fleet's token: each instance obeys only orders sealed with its own.
    config.admin.token = Secret::new(FLEET_TOKEN);
    config.fleet.heartbeat_interval = Duration::from_millis(200);
    config.fleet.gone_after = Duration::from_secs(1);
    config.fleet.forget_after = Duration::from_secs(2);
    config
}

/// [`config`] with an admin endpoint on a free loopback port.
fn config_with_admin(schema: &PgSchema, instance: &str) -> Config {
    let mut config = config(schema, instance);
    config.host.admin_address = "127.0.0.1:0".into();
    config
}

async fn start(config: Config) -> (Host, std::sync::Arc<Probe>) {
    let probe = Probe::new(Duration::ZERO);
    let host = HostBuilder::new(config)
        .handler("orders", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    (host, probe)
}

async fn view(host: &Host) -> FleetView {
    host.handle().fleet().await.unwrap()
}

/// `host`'s view once `done` holds for it (looked at every 100 ms for up to 10 s; a registry
/// its first heartbeat has not created yet reads as not yet).
async fn view_when(host: &Host, what: &str, done: impl Fn(&FleetView) -> bool) -> FleetView {
    for _ in 0..100 {
        if let Ok(v) = host.handle().fleet().await
            && done(&v)
        {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("not {what} within 10 s: {:?}", view(host).await)
}

/// The live instances' ids in a view, sorted.
fn live(view: &FleetView) -> Vec<String> {
    let mut ids: Vec<String> = view
        .instances
        .iter()
        .filter(|m| !m.gone)
        .map(|m| m.instance_id.clone())
        .collect();
    ids.sort();
    ids
}

/// Three hosts on one schema: each sees all three, itself marked, with the summary its
/// heartbeat wrote; one that stops removes its row at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_on_one_schema_see_each_other_and_a_stopping_one_leaves() {
    let schema = PgSchema::new();
    let mut hosts = Vec::new();
    for name in ["a", "b", "c"] {
        hosts.push(start(config(&schema, name)).await.0);
    }
    view_when(&hosts[0], "three seen", |v| live(v) == ["a", "b", "c"]).await;
    for host in &hosts {
        let v = view(host).await;
        let me: Vec<&str> = v
            .instances
            .iter()
            .filter(|m| m.this)
            .map(|m| m.instance_id.as_str())
            .collect();
        assert_eq!(me, [host.handle().config().host.instance_id.as_str()]);
        assert!(v.heartbeat_error.is_none());
        for m in &v.instances {
            assert_eq!(m.version, throttlehost::VERSION);
            assert_eq!(m.summary["receiving"], true, "{:?}", m.summary);
            assert!(m.seen_seconds_ago < 1.0, "{m:?}");
        }
    }
    let c = hosts.pop().unwrap();
    c.shutdown().await;
    let v = view(&hosts[0]).await;
    assert_eq!(
        v.instances.len(),
        2,
        "the stopped host's row is gone: {v:?}"
    );
    for host in hosts {
        host.shutdown().await;
    }
}

/// An instance that stops beating without leaving (killed) shows as gone after
/// `gone_after`, and a live instance deletes its row once `forget_after` has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_instance_shows_as_gone_and_is_then_forgotten() {
    let schema = PgSchema::new();
    let (host, _) = start(config(&schema, "alive")).await;
    let transport = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    let registry = transport.instance_registry().unwrap();
    registry.create_registry().await.unwrap();
    let killed = Heartbeat {
        process_id: uuid::Uuid::new_v4(),
        host_name: "sales".into(),
        instance_id: "killed".into(),
        version: "0.0.1".into(),
        admin_address: Some("http://10.0.0.9:9464".into()),
        summary: "{}".into(),
    };
    registry.heartbeat(&killed).await.unwrap();
    let state_of_killed = async || {
        view(&host)
            .await
            .instances
            .into_iter()
            .find(|m| m.instance_id == "killed")
            .map(|m| m.gone)
    };
    assert_eq!(state_of_killed().await, Some(false), "seen a moment ago");
    let mut states = Vec::new();
    for _ in 0..80 {
        let state = state_of_killed().await;
        if states.last() != Some(&state) {
            states.push(state);
        }
        if state.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        states,
        [Some(false), Some(true), None],
        "live, then gone, then forgotten"
    );
    assert_eq!(live(&view(&host).await), ["alive"]);
    host.shutdown().await;
}

/// A heartbeat the database refuses: the host goes on receiving, and its view says why its
/// own row is stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_heartbeat_fails_keeps_receiving_and_says_so() {
    let schema = PgSchema::new();
    let (host, probe) = start(config(&schema, "refused")).await;
    let client = schema.client().await;
    // Every heartbeat from now on breaks a rule of the table.
    let mut refused = false;
    for _ in 0..50 {
        let done = client
            .batch_execute(&format!(
                "ALTER TABLE \"{}\".throttlehost_instances ADD CONSTRAINT no_beats CHECK (host_name = '') NOT VALID",
                schema.name
            ))
            .await;
        if done.is_ok() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refused, "the registry table was created");
    let error = view_when(&host, "the heartbeat said to fail", |v| {
        v.heartbeat_error.is_some()
    })
    .await
    .heartbeat_error
    .unwrap();
    assert!(error.contains("no_beats"), "{error}");
    host.send("orders", OutgoingMessage::new("still here"))
        .await
        .unwrap();
    wait_until(Duration::from_secs(10), "the message handled", || {
        probe.handled() == 1
    })
    .await;
    client
        .batch_execute(&format!(
            "ALTER TABLE \"{}\".throttlehost_instances DROP CONSTRAINT no_beats",
            schema.name
        ))
        .await
        .unwrap();
    view_when(&host, "the heartbeat written again", |v| {
        v.heartbeat_error.is_none()
    })
    .await;
    host.shutdown().await;
}

/// `throttlehost status --fleet` against one host's admin endpoint lists every instance on
/// the schema, marks the one it asked, and exits 0 while none throttles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_fleet_lists_every_instance() {
    let schema = PgSchema::new();
    let asked = start(config_with_admin(&schema, "asked")).await.0;
    let others = [
        start(config(&schema, "second")).await.0,
        start(config(&schema, "third")).await.0,
    ];
    view_when(&asked, "three seen", |v| live(v).len() == 3).await;
    let url = format!("http://{}", asked.admin_address().unwrap());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_throttlehost"))
            .args(["status", "--fleet", "--url", &url])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("instance"), "{text}");
    assert_eq!(lines.len(), 4, "a header and three instances: {text}");
    for name in ["asked *", "second", "third"] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("throttlehost/{name}"))),
            "{name}: {text}"
        );
    }
    assert!(lines[1..].iter().all(|l| l.contains("ago")), "{text}");
    for host in others {
        host.shutdown().await;
    }
    asked.shutdown().await;
}

/// `host`'s delivery override in force and where it came from (as `/status` shows them from
/// the next tick on).
fn delivery_override(host: &Host) -> (OverrideMode, OverrideScope) {
    host.handle().override_in_force(Direction::Delivery)
}

/// Waits (10 s at most) until `host` has `expected` as its delivery override.
async fn override_becomes(host: &Host, expected: (OverrideMode, OverrideScope)) {
    wait_until(Duration::from_secs(10), "the override applied", || {
        delivery_override(host) == expected
    })
    .await;
}

/// A fleet-wide override given on one instance is applied by every instance at its next
/// heartbeat and shown as the fleet's; a local override on one instance holds there until the
/// next fleet order; a host that starts later applies the order in force; `/fleet` lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_override_reaches_every_instance_and_a_local_one_holds_until_the_next() {
    let schema = PgSchema::new();
    let a = start(config(&schema, "a")).await.0;
    let b = start(config(&schema, "b")).await.0;
    view_when(&a, "both seen", |v| live(v) == ["a", "b"]).await;
    let fleet_throttle = (OverrideMode::Throttle, OverrideScope::Fleet);
    a.handle()
        .set_fleet_override(Direction::Delivery, OverrideMode::Throttle)
        .await
        .unwrap();
    assert_eq!(delivery_override(&a), fleet_throttle, "at once where given");
    override_becomes(&b, fleet_throttle).await;
    let orders = view(&b).await.orders;
    assert_eq!(orders.len(), 1, "{orders:?}");
    assert_eq!(orders[0].set_by, "a");
    assert_eq!(
        live(&view(&a).await),
        ["a", "b"],
        "orders are not listed as instances"
    );

    // A local override on b holds over the order b has applied...
    b.handle()
        .set_override(Direction::Delivery, OverrideMode::None);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        delivery_override(&b),
        (OverrideMode::None, OverrideScope::Local)
    );
    assert_eq!(delivery_override(&a), fleet_throttle);
    // ... and a host that starts now applies the order in force.
    let c = start(config(&schema, "c")).await.0;
    override_becomes(&c, fleet_throttle).await;

    // The next order reaches all three, b included.
    a.handle()
        .set_fleet_override(Direction::Delivery, OverrideMode::None)
        .await
        .unwrap();
    for host in [&a, &b, &c] {
        override_becomes(host, (OverrideMode::None, OverrideScope::Fleet)).await;
    }
    for host in [c, b, a] {
        host.shutdown().await;
    }
}

/// Over HTTP: `?scope=fleet` answers the scope, an unknown scope is refused naming it, and a
/// host without the registry refuses a fleet order, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_override_route_takes_a_fleet_scope_and_refuses_what_it_cannot_do() {
    let schema = PgSchema::new();
    let a = start(config_with_admin(&schema, "a")).await.0;
    let url = format!(
        "http://{}/throttling/delivery/override",
        a.admin_address().unwrap()
    );
    let put = |query: &str| {
        let url = format!("{url}{query}");
        let auth = format!("Bearer {FLEET_TOKEN}");
        tokio::task::spawn_blocking(move || {
            common::http("PUT", &url, b"throttle", &[("Authorization", &auth)])
        })
    };
    let (status, body, _) = put("?scope=fleet").await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"scope\":\"fleet\""), "{body}");
    // /status shows it, and where it came from, from the next tick on.
    wait_until(
        Duration::from_secs(10),
        "/status shows the fleet's override",
        || {
            a.handle().status().throttling.is_some_and(|t| {
                t.delivery.override_mode == OverrideMode::Throttle
                    && t.delivery.override_scope == OverrideScope::Fleet
            })
        },
    )
    .await;
    let (status, body, _) = put("?scope=everywhere").await.unwrap();
    assert_eq!(status, 400);
    assert!(
        body.contains("everywhere") && body.contains("fleet"),
        "{body}"
    );
    a.shutdown().await;

    let mut off = config_with_admin(&schema, "off");
    off.fleet.enabled = false;
    let off = start(off).await.0;
    let url = format!(
        "http://{}/throttling/delivery/override?scope=fleet",
        off.admin_address().unwrap()
    );
    let auth = format!("Bearer {FLEET_TOKEN}");
    let (status, body, _) = tokio::task::spawn_blocking(move || {
        common::http("PUT", &url, b"throttle", &[("Authorization", &auth)])
    })
    .await
    .unwrap();
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("fleet.enabled = false"), "{body}");
    off.shutdown().await;
}

/// The registry's statements on SQL Server: created once (a second creation is harmless), a
/// first heartbeat inserts and the next one updates, the server's clock measures ages, a
/// forget removes only what is older, a leave removes the row; two hosts see each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_keeps_the_instance_registry() {
    let schema = common::mssql::Schema::new();
    let transport = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    let registry = transport.instance_registry().unwrap();
    registry.create_registry().await.unwrap();
    registry.create_registry().await.unwrap();
    let mut beat = Heartbeat {
        process_id: uuid::Uuid::new_v4(),
        host_name: "sales".into(),
        instance_id: "node-1".into(),
        version: "0.1.0".into(),
        admin_address: None,
        summary: r#"{"in_process":1}"#.into(),
    };
    registry.heartbeat(&beat).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    beat.summary = r#"{"in_process":2}"#.into();
    beat.admin_address = Some("http://127.0.0.1:9464".into());
    registry.heartbeat(&beat).await.unwrap();
    let all = registry.instances().await.unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(
        all[0].heartbeat, beat,
        "the second heartbeat updated the row"
    );
    assert!(all[0].up_seconds >= 1.0, "{:?}", all[0]);
    assert!(all[0].seen_seconds_ago < 1.0, "{:?}", all[0]);
    assert_eq!(registry.forget(Duration::from_secs(60)).await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(registry.forget(Duration::from_secs(1)).await.unwrap(), 1);
    registry.heartbeat(&beat).await.unwrap();
    registry.leave(beat.process_id).await.unwrap();
    assert!(registry.instances().await.unwrap().is_empty());
    // Two hosts on the schema see each other.
    let host_config = |instance: &str| {
        let mut config = common::host_config(
            schema.transport_config(TransactionMode::ReceiveOnly, 6),
            "orders",
            ConcurrencyModel::Monitor,
            2,
        );
        config.host.instance_id = instance.into();
        config.admin.token = Secret::new(FLEET_TOKEN);
        config.fleet.heartbeat_interval = Duration::from_millis(200);
        config.fleet.gone_after = Duration::from_secs(2);
        config
    };
    let a = start(host_config("a")).await.0;
    let b = start(host_config("b")).await.0;
    view_when(&a, "both seen", |v| live(v) == ["a", "b"]).await;
    // A fleet order given on a reaches b at its next heartbeat, and is no instance.
    a.handle()
        .set_fleet_override(Direction::Delivery, OverrideMode::Throttle)
        .await
        .unwrap();
    override_becomes(&b, (OverrideMode::Throttle, OverrideScope::Fleet)).await;
    assert_eq!(live(&view(&b).await), ["a", "b"]);
    assert_eq!(view(&b).await.orders.len(), 1);
    b.shutdown().await;
    a.shutdown().await;
}

/// The instances that lead `orders` (poll its delayed mover, read its depth), as each says.
fn leaders(hosts: &[(Host, std::sync::Arc<common::Counting>)]) -> Vec<String> {
    hosts
        .iter()
        .filter(|(h, _)| h.handle().queue_status("orders").unwrap().leads)
        .map(|(h, _)| h.handle().config().host.instance_id.clone())
        .collect()
}

/// Three hosts on one queue: after a heartbeat exactly one leads it (it reads the depth every
/// 100 ms tick; the others read none of their own and take the leader's), a delayed message sent through a follower still comes
/// when due (its own mover moves it), and when the leader stops another takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_per_queue_reads_its_depth_and_polls_its_delayed_table() {
    let schema = PgSchema::new();
    let probe = Probe::new(Duration::ZERO);
    let mut hosts = Vec::new();
    for name in ["a", "b", "c"] {
        let mut config = config(&schema, name);
        // The monitor peeks an idle queue this rarely (inserts wake it): the peeks counted
        // below are the database size's readings, one per tick at most.
        config.queues[0].concurrency.peek_interval = Duration::from_secs(30);
        config.throttling.sample_interval = Duration::from_millis(100);
        config.throttling.database_size_refresh = Duration::from_millis(100);
        let transport = schema.transport(TransactionMode::ReceiveOnly, 6).await;
        let counting = common::Counting::with_abilities(std::sync::Arc::new(transport));
        let host = HostBuilder::new(config)
            .transport(counting.clone())
            .handler("orders", ProbeHandler(probe.clone()))
            .start()
            .await
            .unwrap();
        hosts.push((host, counting));
    }
    // Every host has seen all three once two more heartbeats have passed.
    view_when(&hosts[0].0, "three seen", |v| live(v).len() == 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let leader = match leaders(&hosts).as_slice() {
        [one] => one.clone(),
        other => panic!("one leader, not {other:?}"),
    };
    let peeks: Vec<u64> = hosts.iter().map(|(_, c)| c.depth_looks()).collect();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    for ((host, counting), before) in hosts.iter().zip(peeks) {
        let name = host.handle().config().host.instance_id.clone();
        let peeked = counting.depth_looks() - before;
        match name == leader {
            true => assert!(
                peeked >= 4,
                "the leader {name} read the depth {peeked} times"
            ),
            // At most the monitor's own peek after its listener connected.
            false => assert!(
                peeked <= 1,
                "{name} follows {leader} but peeked {peeked} times"
            ),
        }
    }
    let follower = hosts
        .iter()
        .position(|(h, _)| h.handle().config().host.instance_id != leader)
        .unwrap();
    let mut delayed = OutgoingMessage::new("later");
    delayed.deliver_after = Some(Duration::from_millis(300));
    hosts[follower].0.send("orders", delayed).await.unwrap();
    wait_until(
        Duration::from_secs(5),
        "the delayed message handled",
        || probe.handled() == 1,
    )
    .await;
    let at = hosts
        .iter()
        .position(|(h, _)| h.handle().config().host.instance_id == leader)
        .unwrap();
    hosts.remove(at).0.shutdown().await;
    wait_until(Duration::from_secs(10), "a new leader", || {
        leaders(&hosts).len() == 1
    })
    .await;
    assert_ne!(leaders(&hosts)[0], leader);
    for (host, _) in hosts {
        host.shutdown().await;
    }
}

/// A fleet-wide override binds only the instances that hold the token it was sealed with: an
/// instance with another token (or none) refuses it and keeps its own; an instance without a
/// token cannot give one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_order_binds_only_instances_with_the_token_it_was_sealed_with() {
    let schema = PgSchema::new();
    let a = start(config(&schema, "a")).await.0;
    let mut other = config(&schema, "other");
    other.admin.token = Secret::new("another-token");
    let other = start(other).await.0;
    let mut none = config(&schema, "none");
    none.admin.token = Secret::default();
    let none = start(none).await.0;
    view_when(&a, "all three seen", |v| live(v) == ["a", "none", "other"]).await;
    let refused = none
        .handle()
        .set_fleet_override(Direction::Delivery, OverrideMode::Throttle)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("admin.token"), "{refused}");

    a.handle()
        .set_fleet_override(Direction::Delivery, OverrideMode::Throttle)
        .await
        .unwrap();
    // A third instance with the fleet's token obeys at its next heartbeat...
    let b = start(config(&schema, "b")).await.0;
    override_becomes(&b, (OverrideMode::Throttle, OverrideScope::Fleet)).await;
    // ...while the others have read the order at as many heartbeats and refused it.
    for host in [&other, &none] {
        assert_eq!(
            delivery_override(host),
            (OverrideMode::None, OverrideScope::Configured)
        );
    }
    for host in [a, b, other, none] {
        host.shutdown().await;
    }
}

/// Rows of the registry anyone can write: a `last_seen` PostgreSQL cannot subtract
/// ('infinity') failed every host's heartbeat and `/fleet`; one far ahead kept a row alive for
/// ever. Both are skipped at once and deleted by the next forget; the host goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_rows_with_impossible_times_are_skipped_and_forgotten() {
    let schema = PgSchema::new();
    let a = start(config(&schema, "a")).await.0;
    view_when(&a, "a seen", |v| live(v) == ["a"]).await;
    let client = schema.client().await;
    let table = format!("\"{}\".throttlehost_instances", schema.name);
    for (id, seen) in [("infinity", "'infinity'"), ("future", "'3000-01-01'")] {
        client
            .execute(
                &format!(
                    "INSERT INTO {table} (process_id, host_name, instance_id, version, summary, last_seen)
                     VALUES (gen_random_uuid(), 'forged', '{id}', '0', '{{}}', {seen})"
                ),
                &[],
            )
            .await
            .unwrap();
    }
    let count = async || {
        client
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE host_name = 'forged'"),
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    assert_eq!(count().await, 2);
    // The view reads (the listing and the heartbeat's read-back) go on without them...
    view_when(&a, "a still seen, the forged rows not", |v| {
        live(v) == ["a"]
    })
    .await;
    // ...and the forget (forget_after 2 s here) deletes them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while count().await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the forged rows stay"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(a.handle().fleet().await.is_ok());
    a.shutdown().await;
}

/// A leader killed outright closes its database sessions: the others take its leads at their
/// next heartbeat, though its registry row is still within `gone_after` (20 s here). The
/// leader is a row written through a connection of the test's, which is then closed, as a
/// process killed with SIGKILL closes its own. Before, its queues' delayed tables went
/// unpolled until the row counted as gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_sessions_closed_hands_its_leads_over_at_once() {
    let schema = PgSchema::new();
    let mut config = config(&schema, "a");
    config.fleet.gone_after = Duration::from_secs(20);
    config.fleet.forget_after = Duration::from_secs(60);
    let a = start(config).await.0;
    let me = view_when(&a, "a seen", |v| live(v) == ["a"])
        .await
        .instances
        .iter()
        .find(|m| m.this)
        .unwrap()
        .process_id;
    let leads = || a.handle().queue_status("orders").unwrap().leads;
    // A process id that wins the queue's rendezvous hash over a's (fleet::lead).
    let weight = |id: uuid::Uuid| uuid::Uuid::new_v5(&id, b"orders").as_u128();
    let crashed = std::iter::repeat_with(uuid::Uuid::new_v4)
        .find(|id| weight(*id) > weight(me))
        .unwrap();
    let session = schema.client().await;
    session
        .execute(
            &format!(
                "INSERT INTO \"{}\".throttlehost_instances
                     (process_id, host_name, instance_id, version, summary, backend)
                 VALUES ($1, 'elsewhere', 'b', '0', $2, pg_backend_pid())",
                schema.name
            ),
            &[
                &crashed,
                &r#"{"instance":"b","queues":{"orders":0},"moves_delayed":["orders"]}"#,
            ],
        )
        .await
        .unwrap();
    wait_until(Duration::from_secs(5), "b leading orders", || !leads()).await;
    drop(session);
    wait_until(
        Duration::from_secs(10),
        "a leading orders again, long before b's row is gone",
        leads,
    )
    .await;
    assert!(
        live(&view(&a).await).contains(&"b".to_string()),
        "b is not gone yet"
    );
    a.shutdown().await;
}

/// A queue whose delayed table no instance alive moves is told so: alone with delayed
/// delivery off, the host says `nobody`; beside an instance that moves it, `moving`; when that
/// one stops, `nobody` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_table_nobody_moves_is_told() {
    use throttlehost::DelayedMoves;
    let schema = PgSchema::new();
    let mut config = config(&schema, "a");
    config.queues[0].delayed_delivery.enabled = false;
    config.queues[0].recoverability.delayed_retries = Some(0);
    let a = start(config).await.0;
    let moves = || a.handle().queue_status("orders").unwrap().delayed_moves;
    assert_eq!(moves(), DelayedMoves::Nobody);
    let b = start(self::config(&schema, "b")).await.0;
    wait_until(Duration::from_secs(5), "b seen moving orders", || {
        moves() == DelayedMoves::Moving
    })
    .await;
    assert_eq!(
        b.handle().queue_status("orders").unwrap().delayed_moves,
        DelayedMoves::Moving
    );
    b.shutdown().await;
    wait_until(Duration::from_secs(5), "nobody moving orders again", || {
        moves() == DelayedMoves::Nobody
    })
    .await;
    a.shutdown().await;
}
