//! One conformance suite for every transport: memory and PostgreSQL always, SQL Server when
//! SQLSERVER_URL is set (`SQLSERVER_URL=... cargo test -- --ignored`), in the dialect
//! SQLSERVER_DIALECT names (`sqlserver`, the default, or `babelfish`). A behaviour a dialect
//! cannot show is declared by its harness with the reason, which the test prints; it is
//! neither skipped silently nor failed.
//!
//! Each behaviour is a function over a [`Harness`]; the `conformance!` macro stamps one test
//! per behaviour per transport. Behaviours only a database can show (a killed connection, a
//! row whose headers cannot be parsed) are stamped for the database transports only, so no
//! test passes without testing anything.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use throttlehost::config::TransactionMode;
use throttlehost::message::{Headers, OutgoingMessage};
use throttlehost::transport::{Payload, QueueName, Received, Transport, TransportError};
use uuid::Uuid;

use common::q;

/// What a transport under test offers the suite.
#[async_trait]
pub trait Harness: Send + Sync {
    /// A fresh transport (own schema or instance) in this mode with this pool size.
    async fn transport(&self, mode: TransactionMode, pool_size: u32) -> Arc<dyn Transport>;
    /// Kills the transport's database connections; None if it has none.
    async fn kill_connections(&self) -> Option<u64>;
    /// Writes a row with unparseable headers straight into a queue table; false if unsupported.
    async fn insert_poison(&self, queue: &str, id: Uuid, raw_headers: &str, body: &[u8]) -> bool;
    /// Reads a row's raw headers and body and whether Expires is NULL.
    async fn read_raw(&self, queue: &str, id: Uuid) -> Option<(String, Vec<u8>, bool)>;
    /// Why this transport cannot show `behaviour` (a test function's name), if it cannot.
    fn not_applicable(&self, _behaviour: &str) -> Option<&'static str> {
        None
    }
}

fn body_of(r: &dyn Received) -> Vec<u8> {
    match r.payload() {
        Payload::Message(m) => m.body.clone(),
        other => panic!("expected a message, got {other:?}"),
    }
}

async fn setup(h: &dyn Harness, queues: &[&str]) -> Arc<dyn Transport> {
    let t = h.transport(TransactionMode::ReceiveOnly, 20).await;
    for name in queues {
        t.create_queue(&q(name)).await.unwrap();
    }
    t
}

pub async fn fifo_order(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    for i in 0..20u8 {
        t.send(&q("in"), &OutgoingMessage::new(vec![i]))
            .await
            .unwrap();
    }
    for i in 0..20u8 {
        let r = t.receive(&q("in")).await.unwrap().expect("a message");
        assert_eq!(body_of(r.as_ref()), vec![i]);
        r.commit().await.unwrap();
    }
    assert!(t.receive(&q("in")).await.unwrap().is_none());
}

pub async fn a_batch_is_stored_in_order_with_each_expiry(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    t.send_batch(&q("in"), &[]).await.unwrap();
    let batch: Vec<OutgoingMessage> = (0..50u8)
        .map(|i| {
            let m = OutgoingMessage::new(vec![i]);
            if i == 10 {
                m.with_time_to_be_received(Duration::from_millis(1))
            } else {
                m.with_time_to_be_received(Duration::from_secs(3600))
            }
        })
        .collect();
    t.send_batch(&q("in"), &batch).await.unwrap();
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 50);
    tokio::time::sleep(Duration::from_millis(50)).await;
    for i in 0..50u8 {
        let r = t.receive(&q("in")).await.unwrap().expect("a message");
        match r.payload() {
            Payload::Expired { id } => {
                assert_eq!(i, 10, "only the 1 ms message expired");
                assert_eq!(*id, batch[10].id);
            }
            Payload::Message(m) => {
                assert_eq!(m.body, vec![i], "stored in the order given");
                assert_eq!(m.logical_id(), batch[i as usize].logical_id());
            }
            other => panic!("{other:?}"),
        }
        r.commit().await.unwrap();
    }
    assert!(t.receive(&q("in")).await.unwrap().is_none());
}

pub async fn rollback_returns_the_message_to_the_head(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    for i in 0..3u8 {
        t.send(&q("in"), &OutgoingMessage::new(vec![i]))
            .await
            .unwrap();
    }
    let first = t.receive(&q("in")).await.unwrap().unwrap();
    assert_eq!(body_of(first.as_ref()), vec![0]);
    first.rollback().await.unwrap();
    for i in 0..3u8 {
        let r = t.receive(&q("in")).await.unwrap().unwrap();
        assert_eq!(
            body_of(r.as_ref()),
            vec![i],
            "rolled-back message comes first again"
        );
        r.commit().await.unwrap();
    }
}

pub async fn dropping_a_receive_rolls_it_back(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    drop(r);
    // The database notices the closed connection asynchronously.
    let mut again = None;
    for _ in 0..100 {
        if let Some(r) = t.receive(&q("in")).await.unwrap() {
            again = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = again.expect("the message came back");
    assert_eq!(body_of(r.as_ref()), b"x");
    r.commit().await.unwrap();
}

pub async fn eight_receivers_drain_ten_thousand_exactly_once(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    let sent: HashSet<String> = common::fill(&t, &q("in"), 10_000)
        .await
        .into_iter()
        .collect();
    assert_eq!(sent.len(), 10_000);
    let mut receivers = Vec::new();
    for _ in 0..8 {
        let t = t.clone();
        receivers.push(tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(r) = t.receive(&q("in")).await.unwrap() {
                if let Payload::Message(m) = r.payload() {
                    got.push(m.logical_id());
                }
                r.commit().await.unwrap();
            }
            got
        }));
    }
    let mut all = Vec::new();
    for r in receivers {
        all.extend(r.await.unwrap());
    }
    let unique: HashSet<String> = all.iter().cloned().collect();
    assert_eq!(all.len(), 10_000, "no duplicates");
    assert_eq!(unique, sent, "every id exactly once");
}

pub async fn expired_messages_are_flagged_and_purged(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    let old = OutgoingMessage::new("old").with_time_to_be_received(Duration::from_millis(1));
    t.send(&q("in"), &old).await.unwrap();
    t.send(
        &q("in"),
        &OutgoingMessage::new("live").with_time_to_be_received(Duration::from_secs(600)),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    assert!(
        matches!(r.payload(), Payload::Expired { id } if *id == old.id),
        "{:?}",
        r.payload()
    );
    r.commit().await.unwrap();
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    match r.payload() {
        Payload::Message(m) => {
            assert_eq!(m.body, b"live");
            assert!(m.expires.is_some(), "expiry is reported");
        }
        other => panic!("{other:?}"),
    }
    r.rollback().await.unwrap();
    for _ in 0..3 {
        t.send(
            &q("in"),
            &OutgoingMessage::new("gone").with_time_to_be_received(Duration::from_millis(1)),
        )
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(t.purge_expired(&q("in")).await.unwrap(), 3);
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 1);
}

pub async fn peek_ignores_rows_locked_by_in_flight_receives(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 0);
    for i in 0..3u8 {
        t.send(&q("in"), &OutgoingMessage::new(vec![i]))
            .await
            .unwrap();
    }
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 3);
    let held = t.receive(&q("in")).await.unwrap().unwrap();
    assert_eq!(
        t.peek_depth(&q("in")).await.unwrap(),
        2,
        "the locked head is not counted"
    );
    held.rollback().await.unwrap();
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 3);
}

pub async fn unicode_headers_and_a_ten_mib_body_round_trip(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    let mut body = vec![0u8; 10 << 20];
    let mut x: u32 = 0x1234_5678;
    for b in body.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
    let mut m = OutgoingMessage::new(body.clone())
        .with_header(
            "Ünïcödé/Key",
            "rocket \u{1F680}, 中文, \"quoted\", back\\slash, tab\t",
        )
        .with_header("empty", "");
    m.headers.insert("NullValue".into(), None);
    let sent_headers: Headers = m.headers.clone();
    t.send(&q("in"), &m).await.unwrap();
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    match r.payload() {
        Payload::Message(got) => {
            assert_eq!(got.headers, sent_headers);
            assert!(got.body == body, "10 MiB body byte for byte");
            assert_eq!(got.id, m.id);
        }
        other => panic!("{other:?}"),
    }
    r.commit().await.unwrap();
}

pub async fn names_that_could_inject_sql_are_rejected(_h: &dyn Harness) {
    for bad in [
        "a'b",
        "a]b",
        "a[b",
        "a;DROP TABLE x",
        "a\"b",
        "a b",
        "a--b/*",
    ] {
        let err = QueueName::new(bad).err().map(TransportError::from);
        assert!(
            matches!(err, Some(TransportError::InvalidName(_))),
            "{bad} must be rejected"
        );
    }
}

pub async fn a_killed_connection_fails_cleanly_and_the_next_receive_works(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    t.send(&q("in"), &OutgoingMessage::new("survivor"))
        .await
        .unwrap();
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    let killed = h
        .kill_connections()
        .await
        .expect("stamped for database transports only");
    assert!(killed >= 1, "killed {killed}");
    let err = r
        .commit()
        .await
        .expect_err("commit on a killed connection fails");
    assert!(
        matches!(
            err,
            TransportError::Connection { .. } | TransportError::Database { .. }
        ),
        "{err}"
    );
    // The pool may hand out other dead connections once; the message must come back.
    let mut body = None;
    for _ in 0..10 {
        match t.receive(&q("in")).await {
            Ok(Some(r)) => {
                body = Some(body_of(r.as_ref()));
                r.commit().await.unwrap();
                break;
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(_) => continue,
        }
    }
    assert_eq!(
        body.as_deref(),
        Some(&b"survivor"[..]),
        "rolled back by the server, received again"
    );
}

pub async fn an_exhausted_pool_waits_instead_of_failing(h: &dyn Harness) {
    let t = h.transport(TransactionMode::ReceiveOnly, 2).await;
    t.create_queue(&q("in")).await.unwrap();
    for _ in 0..3 {
        t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
    }
    let a = t.receive(&q("in")).await.unwrap().unwrap();
    let b = t.receive(&q("in")).await.unwrap().unwrap();
    assert_eq!(t.connections_in_use(), 2);
    let third = {
        let t = t.clone();
        tokio::spawn(async move { t.receive(&q("in")).await.map(|r| r.is_some()) })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!third.is_finished(), "waits for a connection");
    a.commit().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .unwrap()
        .unwrap();
    assert!(
        got.unwrap(),
        "got the third message once a connection was free"
    );
    b.commit().await.unwrap();
}

pub async fn poison_rows_are_dead_lettered_unchanged(h: &dyn Harness) {
    let t = setup(h, &["in", "error"]).await;
    let id = Uuid::new_v4();
    let raw = "{this is not json";
    assert!(
        h.insert_poison("in", id, raw, b"body bytes").await,
        "stamped for database transports only"
    );
    let mut r = t.receive(&q("in")).await.unwrap().unwrap();
    assert!(
        matches!(r.payload(), Payload::Poison { id: p, .. } if *p == id),
        "{:?}",
        r.payload()
    );
    r.dead_letter(&q("error")).await.unwrap();
    r.commit().await.unwrap();
    let (headers, body, expires_null) = h
        .read_raw("error", id)
        .await
        .expect("row in the error queue, same id");
    assert_eq!(headers, raw);
    assert_eq!(body, b"body bytes");
    assert!(expires_null);
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 0);
}

pub async fn sends_inside_a_receive_commit_with_it(h: &dyn Harness) {
    let t = setup(h, &["in", "out"]).await;
    t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
    let mut r = t.receive(&q("in")).await.unwrap().unwrap();
    r.send(&q("out"), &OutgoingMessage::new("y")).await.unwrap();
    r.rollback().await.unwrap();
    assert_eq!(
        t.peek_depth(&q("out")).await.unwrap(),
        0,
        "rolled back with the receive"
    );
    let mut r = t.receive(&q("in")).await.unwrap().unwrap();
    r.send(&q("out"), &OutgoingMessage::new("y")).await.unwrap();
    r.commit().await.unwrap();
    assert_eq!(t.peek_depth(&q("out")).await.unwrap(), 1);
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 0);
}

pub async fn a_failed_send_inside_a_receive_fails_its_commit(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
    let mut r = t.receive(&q("in")).await.unwrap().unwrap();
    let err = r
        .send(&q("missing"), &OutgoingMessage::new("y"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::QueueNotFound(ref n) if n == "missing"),
        "{err}"
    );
    let _ = r.commit().await;
    let back = t.receive(&q("in")).await.unwrap();
    assert!(
        back.is_some(),
        "the message was not deleted by a half-failed unit of work"
    );
}

pub async fn mode_none_deletes_before_the_handler(h: &dyn Harness) {
    let t = h.transport(TransactionMode::None, 5).await;
    t.create_queue(&q("in")).await.unwrap();
    t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 0);
    r.rollback().await.unwrap();
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "at-most-once: gone after rollback"
    );
}

pub async fn a_missing_queue_is_named_in_the_error(h: &dyn Harness) {
    let t = setup(h, &[]).await;
    let err = t
        .send(&q("nowhere"), &OutgoingMessage::new("x"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TransportError::QueueNotFound(n) if n == "nowhere"),
        "{err}"
    );
    assert!(t.receive(&q("nowhere")).await.is_err());
}

pub async fn concurrent_creation_is_safe_and_listed(h: &dyn Harness) {
    let t = setup(h, &[]).await;
    let mut creators = Vec::new();
    for _ in 0..6 {
        let t = t.clone();
        creators.push(tokio::spawn(async move {
            t.create_queue(&q("Sales.Node-1")).await
        }));
    }
    for c in creators {
        c.await.unwrap().unwrap();
    }
    t.create_queue(&q("Sales.Node-1")).await.unwrap();
    assert!(
        t.list_queues()
            .await
            .unwrap()
            .contains(&"Sales.Node-1".to_string())
    );
    t.send(&q("Sales.Node-1"), &OutgoingMessage::new("x"))
        .await
        .unwrap();
    assert_eq!(t.purge(&q("Sales.Node-1")).await.unwrap(), 1);
}

/// Ends every message of a batch at once (a batch ends when all its messages have): `how`
/// picks commit (true) or rollback (false) per position; returns each result.
async fn end_batch(
    batch: Vec<Box<dyn Received>>,
    how: impl Fn(usize) -> bool,
) -> Vec<Result<(), TransportError>> {
    let ends: Vec<_> = batch
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let commit = how(i);
            tokio::spawn(async move {
                match commit {
                    true => r.commit().await,
                    false => r.rollback().await,
                }
            })
        })
        .collect();
    let mut results = Vec::new();
    for end in ends {
        results.push(
            tokio::time::timeout(Duration::from_secs(30), end)
                .await
                .expect("a batch ends once all its messages have")
                .unwrap(),
        );
    }
    results
}

async fn send_numbered(t: &dyn Transport, queue: &str, n: u8) {
    for i in 0..n {
        t.send(&q(queue), &OutgoingMessage::new(vec![i]))
            .await
            .unwrap();
    }
}

pub async fn a_batch_receive_takes_the_oldest_unlocked_in_order(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    assert!(t.receive_batch(&q("in"), 8).await.unwrap().is_empty());
    send_numbered(t.as_ref(), "in", 10).await;
    let first = t.receive_batch(&q("in"), 4).await.unwrap();
    let bodies: Vec<_> = first.iter().map(|r| body_of(r.as_ref())).collect();
    assert_eq!(bodies, vec![vec![0], vec![1], vec![2], vec![3]]);
    // The first batch's rows are locked: the next batch takes the rest, in order.
    let rest = t.receive_batch(&q("in"), 100).await.unwrap();
    let bodies: Vec<_> = rest.iter().map(|r| body_of(r.as_ref())).collect();
    assert_eq!(bodies, (4..10u8).map(|i| vec![i]).collect::<Vec<_>>());
    for result in end_batch(first, |_| true).await {
        result.unwrap();
    }
    for result in end_batch(rest, |_| true).await {
        result.unwrap();
    }
    assert!(t.receive(&q("in")).await.unwrap().is_none());
}

pub async fn one_rollback_returns_the_whole_batch_to_its_place(h: &dyn Harness) {
    let t = setup(h, &["in", "out"]).await;
    send_numbered(t.as_ref(), "in", 5).await;
    let mut batch = t.receive_batch(&q("in"), 5).await.unwrap();
    assert_eq!(batch.len(), 5);
    batch[0]
        .send(&q("out"), &OutgoingMessage::new("from a batch"))
        .await
        .unwrap();
    let results = end_batch(batch, |i| i != 2).await;
    assert!(results[2].is_ok(), "the rollback itself worked");
    for (i, result) in results.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert!(
            result.is_err(),
            "message {i} reports that its commit did not happen"
        );
    }
    assert!(
        t.receive(&q("out")).await.unwrap().is_none(),
        "sends vanish"
    );
    for i in 0..5u8 {
        let r = t
            .receive(&q("in"))
            .await
            .unwrap()
            .expect("back in the queue");
        assert_eq!(body_of(r.as_ref()), vec![i], "at its place");
        r.commit().await.unwrap();
    }
}

pub async fn a_failing_message_of_a_batch_goes_to_the_error_queue_while_the_rest_commit(
    h: &dyn Harness,
) {
    let t = setup(h, &["in", "out", "error"]).await;
    send_numbered(t.as_ref(), "in", 3).await;
    let mut batch = t.receive_batch(&q("in"), 3).await.unwrap();
    batch[0]
        .send(&q("out"), &OutgoingMessage::new("handled"))
        .await
        .unwrap();
    let failed = OutgoingMessage::new(body_of(batch[1].as_ref()));
    batch[1].send(&q("error"), &failed).await.unwrap();
    for result in end_batch(batch, |_| true).await {
        result.unwrap();
    }
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "all three left"
    );
    let moved = t
        .receive(&q("error"))
        .await
        .unwrap()
        .expect("the failed one");
    assert_eq!(body_of(moved.as_ref()), vec![1]);
    moved.commit().await.unwrap();
    let sent = t
        .receive(&q("out"))
        .await
        .unwrap()
        .expect("the handled one's send");
    assert_eq!(body_of(sent.as_ref()), b"handled".to_vec());
    sent.commit().await.unwrap();
}

pub async fn a_batch_dropped_mid_way_returns_every_message(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    send_numbered(t.as_ref(), "in", 4).await;
    let mut batch = t.receive_batch(&q("in"), 4).await.unwrap();
    // Two messages commit (they wait for the batch), then the process "dies": the rest drop.
    let tail = batch.split_off(2);
    let waiting = tokio::spawn(end_batch(batch, |_| true));
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(tail);
    for result in waiting.await.unwrap() {
        assert!(result.is_err(), "a dropped message takes its batch back");
    }
    for i in 0..4u8 {
        let r = t.receive(&q("in")).await.unwrap().expect("returned");
        assert_eq!(body_of(r.as_ref()), vec![i]);
        r.commit().await.unwrap();
    }
}

macro_rules! conformance {
    ($module:ident, $harness:expr, { $(#[$attr:meta])* }, database) => {
        mod $module {
            use super::*;
            conformance!(@tests $harness, { $(#[$attr])* };
                a_killed_connection_fails_cleanly_and_the_next_receive_works,
                poison_rows_are_dead_lettered_unchanged
            );
            conformance!(@common $harness, { $(#[$attr])* });
        }
    };
    ($module:ident, $harness:expr, { $(#[$attr:meta])* }) => {
        mod $module {
            use super::*;
            conformance!(@common $harness, { $(#[$attr])* });
        }
    };
    (@common $harness:expr, { $(#[$attr:meta])* }) => {
            conformance!(@tests $harness, { $(#[$attr])* };
                fifo_order,
                a_batch_is_stored_in_order_with_each_expiry,
                rollback_returns_the_message_to_the_head,
                dropping_a_receive_rolls_it_back,
                eight_receivers_drain_ten_thousand_exactly_once,
                expired_messages_are_flagged_and_purged,
                peek_ignores_rows_locked_by_in_flight_receives,
                unicode_headers_and_a_ten_mib_body_round_trip,
                names_that_could_inject_sql_are_rejected,
                an_exhausted_pool_waits_instead_of_failing,
                sends_inside_a_receive_commit_with_it,
                a_failed_send_inside_a_receive_fails_its_commit,
                mode_none_deletes_before_the_handler,
                a_missing_queue_is_named_in_the_error,
                concurrent_creation_is_safe_and_listed,
                a_batch_receive_takes_the_oldest_unlocked_in_order,
                one_rollback_returns_the_whole_batch_to_its_place,
                a_failing_message_of_a_batch_goes_to_the_error_queue_while_the_rest_commit,
                a_batch_dropped_mid_way_returns_every_message
            );
    };
    (@tests $harness:expr, $attrs:tt; $($name:ident),*) => {
        $( conformance!(@one $harness, $attrs, $name); )*
    };
    (@one $harness:expr, { $(#[$attr:meta])* }, $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let h = $harness;
            if let Some(reason) = h.not_applicable(stringify!($name)) {
                eprintln!("{}: not applicable here: {reason}", stringify!($name));
                return;
            }
            super::$name(&h).await;
        }
    };
}

// ---- memory ---------------------------------------------------------------------------

struct MemoryHarness;

#[async_trait]
impl Harness for MemoryHarness {
    async fn transport(&self, mode: TransactionMode, pool_size: u32) -> Arc<dyn Transport> {
        Arc::new(
            throttlehost::transport::memory::MemoryTransport::simulating(
                mode,
                pool_size,
                Duration::from_secs(10),
                Duration::ZERO,
            ),
        )
    }
    async fn kill_connections(&self) -> Option<u64> {
        None
    }
    async fn insert_poison(&self, _: &str, _: Uuid, _: &str, _: &[u8]) -> bool {
        false
    }
    async fn read_raw(&self, _: &str, _: Uuid) -> Option<(String, Vec<u8>, bool)> {
        None
    }
}

conformance!(memory, MemoryHarness, {});

// ---- PostgreSQL ------------------------------------------------------------------------

struct PostgresHarness {
    schema: common::PgSchema,
}

impl PostgresHarness {
    fn new() -> Self {
        PostgresHarness {
            schema: common::PgSchema::new(),
        }
    }

    fn table(&self, queue: &str) -> String {
        format!("\"{}\".\"{}\"", self.schema.name, queue)
    }
}

#[async_trait]
impl Harness for PostgresHarness {
    async fn transport(&self, mode: TransactionMode, pool_size: u32) -> Arc<dyn Transport> {
        Arc::new(self.schema.transport(mode, pool_size).await)
    }
    async fn kill_connections(&self) -> Option<u64> {
        Some(self.schema.kill_connections().await)
    }
    async fn insert_poison(&self, queue: &str, id: Uuid, raw: &str, body: &[u8]) -> bool {
        let c = self.schema.client().await;
        c.execute(
            &format!(
                "INSERT INTO {} (Id, Headers, Body) VALUES ($1, $2, $3)",
                self.table(queue)
            ),
            &[&id, &raw, &body],
        )
        .await
        .unwrap();
        true
    }
    async fn read_raw(&self, queue: &str, id: Uuid) -> Option<(String, Vec<u8>, bool)> {
        let c = self.schema.client().await;
        let row = c
            .query_opt(
                &format!(
                    "SELECT Headers, Body, Expires IS NULL FROM {} WHERE Id = $1",
                    self.table(queue)
                ),
                &[&id],
            )
            .await
            .unwrap()?;
        Some((row.get(0), row.get(1), row.get(2)))
    }
}

conformance!(postgres, PostgresHarness::new(), {}, database);

// ---- SQL Server (needs SQLSERVER_URL: an ADO.NET connection string) ---------------------

mod mssql {
    use std::sync::Arc;
    use std::time::Duration;

    use throttlehost::config::{
        ConnectionString, Dialect, TransactionMode, TransportConfig, TransportKind,
    };
    use throttlehost::transport::Transport;
    use throttlehost::transport::sqlserver::{SqlServerTransport, int_at, parse_connection_string};
    use tokio::net::TcpStream;
    use tokio_util::compat::TokioAsyncWriteCompatExt;

    pub fn url() -> String {
        std::env::var("SQLSERVER_URL").expect(
            "SQLSERVER_URL must hold an ADO.NET connection string, e.g. \
             Server=tcp:127.0.0.1,1433;User Id=sa;Password=...;TrustServerCertificate=true",
        )
    }

    /// The dialect under test: SQLSERVER_DIALECT, `sqlserver` when unset.
    pub fn dialect() -> Dialect {
        match std::env::var("SQLSERVER_DIALECT").as_deref() {
            Err(_) | Ok("") | Ok("sqlserver") => Dialect::Sqlserver,
            Ok("babelfish") => Dialect::Babelfish,
            Ok(other) => panic!("SQLSERVER_DIALECT must be sqlserver or babelfish, not {other:?}"),
        }
    }

    pub type Client = tiberius::Client<tokio_util::compat::Compat<TcpStream>>;

    /// A plain client for assertions and sabotage.
    pub async fn client() -> Client {
        let config = parse_connection_string(&url()).unwrap();
        let tcp = TcpStream::connect(config.get_addr()).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        tiberius::Client::connect(config, tcp.compat_write())
            .await
            .unwrap()
    }

    /// A schema and application name of its own for one test.
    pub struct Schema {
        pub name: String,
    }

    impl Schema {
        pub fn new() -> Self {
            let id = uuid::Uuid::new_v4().simple().to_string();
            Schema {
                name: format!("th_{}", &id[..16]),
            }
        }

        pub async fn transport(&self, mode: TransactionMode, pool_size: u32) -> Arc<dyn Transport> {
            let config = TransportConfig {
                kind: TransportKind::Sqlserver,
                connection_string: ConnectionString::new(format!(
                    "{};Application Name={}",
                    url().trim_end_matches(';'),
                    self.name
                )),
                schema: self.name.clone(),
                pool_size,
                transaction_mode: mode,
                connect_timeout: Duration::from_secs(10),
                dialect: dialect(),
                ..TransportConfig::default()
            };
            Arc::new(
                SqlServerTransport::connect(&config)
                    .await
                    .expect("SQL Server at SQLSERVER_URL"),
            )
        }

        pub async fn kill_connections(&self) -> u64 {
            let mut c = client().await;
            let rows = c
                .query("SELECT session_id FROM sys.dm_exec_sessions WHERE program_name = @P1 AND session_id <> @@SPID", &[&self.name.as_str()])
                .await
                .unwrap()
                .into_first_result()
                .await
                .unwrap();
            // smallint on SQL Server, int on Babelfish.
            let ids: Vec<i64> = rows.iter().filter_map(|r| int_at(r, 0)).collect();
            for id in &ids {
                c.simple_query(format!("KILL {id}"))
                    .await
                    .unwrap()
                    .into_results()
                    .await
                    .unwrap();
            }
            ids.len() as u64
        }

        pub fn table(&self, queue: &str) -> String {
            format!("[{}].[{}]", self.name, queue)
        }
    }

    impl Drop for Schema {
        fn drop(&mut self) {
            let name = self.name.clone();
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let mut c = client().await;
                    // One statement per table: `SELECT @sql += ...` over many rows keeps only
                    // one of them on Babelfish, which left test schemas behind.
                    let tables: Vec<String> = match c
                        .query(
                            "SELECT TABLE_NAME FROM INFORMATION_SCHEMA.TABLES WHERE TABLE_SCHEMA = @P1",
                            &[&name.as_str()],
                        )
                        .await
                    {
                        Ok(stream) => stream
                            .into_first_result()
                            .await
                            .unwrap_or_default()
                            .iter()
                            .filter_map(|r| r.get::<&str, _>(0).map(str::to_string))
                            .collect(),
                        Err(_) => Vec::new(),
                    };
                    for table in tables {
                        let drop = format!("DROP TABLE [{name}].[{}]", table.replace(']', "]]"));
                        if let Ok(stream) = c.simple_query(drop).await {
                            let _ = stream.into_results().await;
                        }
                    }
                    let drop_schema = format!("IF SCHEMA_ID(N'{name}') IS NOT NULL EXEC(N'DROP SCHEMA [{name}]');");
                    if let Ok(stream) = c.simple_query(drop_schema).await {
                        let _ = stream.into_results().await;
                    }
                });
            })
            .join();
        }
    }
}

struct SqlServerHarness {
    schema: mssql::Schema,
}

#[async_trait]
impl Harness for SqlServerHarness {
    async fn transport(&self, mode: TransactionMode, pool_size: u32) -> Arc<dyn Transport> {
        self.schema.transport(mode, pool_size).await
    }
    fn not_applicable(&self, behaviour: &str) -> Option<&'static str> {
        if mssql::dialect() != throttlehost::config::Dialect::Babelfish {
            return None;
        }
        match behaviour {
            "peek_ignores_rows_locked_by_in_flight_receives" => Some(
                "Babelfish parses READPAST and ignores it, so the peek counts the rows receivers hold",
            ),
            "an_exhausted_pool_waits_instead_of_failing" => Some(
                "Babelfish ignores READPAST: once the third receive has a connection it waits on the second receive's locked row until the command timeout, so the pool wait this test measures cannot be shown",
            ),
            "a_batch_receive_takes_the_oldest_unlocked_in_order" => Some(
                "Babelfish ignores READPAST: a second batch waits on the rows the first batch holds instead of taking the next ones",
            ),
            _ => None,
        }
    }
    async fn kill_connections(&self) -> Option<u64> {
        Some(self.schema.kill_connections().await)
    }
    async fn insert_poison(&self, queue: &str, id: Uuid, raw: &str, body: &[u8]) -> bool {
        let mut c = mssql::client().await;
        c.execute(
            format!(
                "INSERT INTO {} (Id, Recoverable, Headers, Body) VALUES (@P1, 1, @P2, @P3)",
                self.schema.table(queue)
            ),
            &[&id, &raw, &body],
        )
        .await
        .unwrap();
        true
    }
    async fn read_raw(&self, queue: &str, id: Uuid) -> Option<(String, Vec<u8>, bool)> {
        let mut c = mssql::client().await;
        let row = c
            .query(
                format!("SELECT Headers, Body, CASE WHEN Expires IS NULL THEN 1 ELSE 0 END FROM {} WHERE Id = @P1", self.schema.table(queue)),
                &[&id],
            )
            .await
            .unwrap()
            .into_row()
            .await
            .unwrap()?;
        Some((
            row.get::<&str, _>(0).unwrap().to_string(),
            row.get::<&[u8], _>(1).unwrap().to_vec(),
            row.get::<i32, _>(2).unwrap() == 1,
        ))
    }
}

conformance!(sqlserver, SqlServerHarness { schema: mssql::Schema::new() }, { #[ignore = "needs SQLSERVER_URL"] }, database);

/// SQL Server only: the start-up checks find a clustered RowVersion index and varchar
/// headers, the old layouts NServiceBus warns about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_startup_checks_warn_about_old_layouts() {
    let schema = mssql::Schema::new();
    let t = schema.transport(TransactionMode::ReceiveOnly, 5).await;
    t.create_queue(&q("modern")).await.unwrap();
    let mut c = mssql::client().await;
    let old = schema.table("old");
    c.simple_query(format!(
        "CREATE TABLE {old} (Id uniqueidentifier NOT NULL, CorrelationId varchar(255), ReplyToAddress varchar(255), \
         Recoverable bit NOT NULL, Expires datetime, Headers varchar(max) NOT NULL, Body varbinary(max), \
         RowVersion bigint IDENTITY(1,1) NOT NULL); CREATE CLUSTERED INDEX Index_RowVersion ON {old} (RowVersion);"
    ))
    .await
    .unwrap()
    .into_results()
    .await
    .unwrap();
    let warnings = t.startup_checks(&[q("modern"), q("old")]).await.unwrap();
    assert!(
        !warnings.iter().any(|w| w.contains("`modern`")),
        "{warnings:?}"
    );
    if mssql::dialect() == throttlehost::config::Dialect::Babelfish {
        eprintln!(
            "the clustered-index warning is not applicable on Babelfish: it creates no clustered index, so the old layout cannot be made there"
        );
    } else {
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("`old`") && w.contains("clustered")),
            "{warnings:?}"
        );
    }
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("`old`") && w.contains("varchar")),
        "{warnings:?}"
    );
    // A table without Recoverable takes the other insert form.
    let bare = schema.table("bare");
    c.simple_query(format!(
        "CREATE TABLE {bare} (Id uniqueidentifier NOT NULL, CorrelationId varchar(255), ReplyToAddress varchar(255), \
         Expires datetime, Headers nvarchar(max) NOT NULL, Body varbinary(max), RowVersion bigint IDENTITY(1,1) NOT NULL);"
    ))
    .await
    .unwrap()
    .into_results()
    .await
    .unwrap();
    t.send(&q("bare"), &OutgoingMessage::new("x"))
        .await
        .unwrap();
    assert_eq!(t.peek_depth(&q("bare")).await.unwrap(), 1);
}
