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
use throttlehost::transport::{
    BatchReceive, DelayedReading, KeyOrdering, Payload, QueueName, Received, Subscriptions,
    TABLES_PER_SWEEP, Transport, TransportError,
};
use uuid::Uuid;

use common::q;

/// The transport's key order: every transport under test keeps it.
fn keys(t: &Arc<dyn Transport>) -> &dyn KeyOrdering {
    t.key_ordering()
        .expect("every transport under test keeps key order")
}

/// The transport's batch receive: every transport under test has it.
fn batches(t: &Arc<dyn Transport>) -> &dyn BatchReceive {
    t.batch_receive()
        .expect("every transport under test receives batches")
}

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
    /// Stores a row in `queue`'s delayed table whose due time no client type reads as a time
    /// (PostgreSQL `infinity`; SQL Server its last `datetime`); false if unsupported.
    async fn insert_never_due(&self, _queue: &str) -> bool {
        false
    }
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
        t.admin().create_queue(&q(name)).await.unwrap();
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
    assert_eq!(t.admin().purge_expired(&q("in")).await.unwrap(), 3);
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
    t.admin().create_queue(&q("in")).await.unwrap();
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
    t.admin().create_queue(&q("in")).await.unwrap();
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
            t.admin().create_queue(&q("Sales.Node-1")).await
        }));
    }
    for c in creators {
        c.await.unwrap().unwrap();
    }
    t.admin().create_queue(&q("Sales.Node-1")).await.unwrap();
    assert!(
        t.admin()
            .list_queues()
            .await
            .unwrap()
            .contains(&"Sales.Node-1".to_string())
    );
    t.send(&q("Sales.Node-1"), &OutgoingMessage::new("x"))
        .await
        .unwrap();
    assert_eq!(t.admin().purge(&q("Sales.Node-1")).await.unwrap(), 1);
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
    assert!(
        batches(&t)
            .receive_batch(&q("in"), 8)
            .await
            .unwrap()
            .is_empty()
    );
    send_numbered(t.as_ref(), "in", 10).await;
    let first = batches(&t).receive_batch(&q("in"), 4).await.unwrap();
    let bodies: Vec<_> = first.iter().map(|r| body_of(r.as_ref())).collect();
    assert_eq!(bodies, vec![vec![0], vec![1], vec![2], vec![3]]);
    // The first batch's rows are locked: the next batch takes the rest, in order.
    let rest = batches(&t).receive_batch(&q("in"), 100).await.unwrap();
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
    let mut batch = batches(&t).receive_batch(&q("in"), 5).await.unwrap();
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
    let mut batch = batches(&t).receive_batch(&q("in"), 3).await.unwrap();
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

/// A batch's sends (its outbox) are written when it commits, sends to one queue joined into
/// multi-row inserts: every send arrives once, and each message's sends to a queue keep
/// their order, even when its sends to other queues come in between.
pub async fn a_batch_outbox_keeps_the_order_of_each_message_sends(h: &dyn Harness) {
    let t = setup(h, &["in", "out", "audit"]).await;
    send_numbered(t.as_ref(), "in", 8).await;
    let mut batch = batches(&t).receive_batch(&q("in"), 8).await.unwrap();
    assert_eq!(batch.len(), 8);
    for received in batch.iter_mut() {
        let i = body_of(received.as_ref())[0];
        for (queue, body) in [("out", vec![i, 0]), ("audit", vec![i]), ("out", vec![i, 1])] {
            received
                .send(&q(queue), &OutgoingMessage::new(body))
                .await
                .unwrap();
        }
    }
    for result in end_batch(batch, |_| true).await {
        result.unwrap();
    }
    let mut out = Vec::new();
    while let Some(r) = t.receive(&q("out")).await.unwrap() {
        out.push(body_of(r.as_ref()));
        r.commit().await.unwrap();
    }
    assert_eq!(out.len(), 16, "two sends per message: {out:?}");
    for i in 0..8u8 {
        let first = out.iter().position(|b| *b == vec![i, 0]);
        let second = out.iter().position(|b| *b == vec![i, 1]);
        assert!(
            first.is_some() && first < second,
            "message {i}'s sends in order: {out:?}"
        );
    }
    let mut audit = 0;
    while let Some(r) = t.receive(&q("audit")).await.unwrap() {
        audit += 1;
        r.commit().await.unwrap();
    }
    assert_eq!(audit, 8);
}

/// A bulk send larger than one SQL Server statement holds (500 rows) is stored whole and
/// in order.
pub async fn a_large_batch_is_stored_whole_in_order(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    let batch: Vec<OutgoingMessage> = (0..600u32)
        .map(|i| OutgoingMessage::new(i.to_be_bytes().to_vec()))
        .collect();
    t.send_batch(&q("in"), &batch).await.unwrap();
    assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 600);
    for i in 0..600u32 {
        let r = t.receive(&q("in")).await.unwrap().expect("a message");
        assert_eq!(body_of(r.as_ref()), i.to_be_bytes().to_vec(), "in order");
        r.commit().await.unwrap();
    }
}

pub async fn a_batch_dropped_mid_way_returns_every_message(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    send_numbered(t.as_ref(), "in", 4).await;
    let mut batch = batches(&t).receive_batch(&q("in"), 4).await.unwrap();
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

// ---- key order ---------------------------------------------------------------------------

/// The ordering key header of the ordered tests (a dot, as real header names have).
const KEY: &str = "Sales.OrderId";

/// A fresh transport with queue `in` ordered by [`KEY`] (and `error`, unordered).
async fn ordered(h: &dyn Harness, lookahead: u32) -> Arc<dyn Transport> {
    let t = setup(h, &["in", "error"]).await;
    let ordering = throttlehost::config::OrderingConfig {
        key_header: KEY.into(),
        stages: false,
        lookahead,
        ..Default::default()
    };
    keys(&t).order_by_key(&q("in"), &ordering).await.unwrap();
    t
}

/// Checks the count of messages of `in` waiting for their key or stage.
async fn assert_waiting(t: &Arc<dyn Transport>, expected: u64) {
    let waiting = keys(t).waiting_in_order(&q("in")).await.unwrap();
    assert_eq!(waiting, Some(expected), "messages waiting for their order");
}

/// A message of `key` (None: no key header) whose body names it.
fn keyed(key: Option<&str>, body: &str) -> OutgoingMessage {
    let m = OutgoingMessage::new(body.as_bytes().to_vec());
    match key {
        Some(k) => m.with_header(KEY, k),
        None => m,
    }
}

fn text_of(r: &dyn Received) -> String {
    String::from_utf8(body_of(r)).unwrap()
}

/// A key whose message is in flight gives nothing more until that message ends; other keys
/// and unkeyed messages pass it; a rolled-back message is its key's first again.
pub async fn a_busy_key_waits_while_other_keys_pass(h: &dyn Harness) {
    let t = ordered(h, 64).await;
    let sends = [
        (Some("a"), "a1"),
        (Some("a"), "a2"),
        (Some("b"), "b1"),
        (None, "u1"),
        (Some("a"), "a3"),
        (Some("b"), "b2"),
    ];
    let messages: Vec<_> = sends.iter().map(|(k, b)| keyed(*k, b)).collect();
    t.send_batch(&q("in"), &messages).await.unwrap();
    let a1 = t.receive(&q("in")).await.unwrap().expect("a1");
    assert_eq!(text_of(a1.as_ref()), "a1");
    let b1 = t.receive(&q("in")).await.unwrap().expect("b1");
    assert_eq!(text_of(b1.as_ref()), "b1", "a2 waits for a1");
    let u1 = t.receive(&q("in")).await.unwrap().expect("u1");
    assert_eq!(text_of(u1.as_ref()), "u1");
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "a2, a3 and b2 all wait for a message in flight"
    );
    assert_waiting(&t, 3).await;
    b1.commit().await.unwrap();
    let b2 = t
        .receive(&q("in"))
        .await
        .unwrap()
        .expect("b2 once b1 is done");
    assert_eq!(text_of(b2.as_ref()), "b2");
    a1.rollback().await.unwrap();
    let again = t.receive(&q("in")).await.unwrap().expect("a1 again");
    assert_eq!(text_of(again.as_ref()), "a1", "back first, not a2");
    for r in [again, b2, u1] {
        r.commit().await.unwrap();
    }
    for expected in ["a2", "a3"] {
        let r = t.receive(&q("in")).await.unwrap().expect(expected);
        assert_eq!(text_of(r.as_ref()), expected);
        assert!(
            t.receive(&q("in")).await.unwrap().is_none(),
            "one of a at a time"
        );
        r.commit().await.unwrap();
    }
    assert!(t.receive(&q("in")).await.unwrap().is_none());
}

/// Eight receivers on 40 keys of 15 messages each, handlers of random length: every key's
/// messages are handled in send order and never two at once, nothing is lost or repeated.
pub async fn concurrent_receivers_keep_each_keys_order(h: &dyn Harness) {
    use std::sync::Mutex;
    use std::time::Instant;
    const KEYS: usize = 40;
    const PER_KEY: usize = 15;
    let t = ordered(h, 64).await;
    let mut messages = Vec::new();
    for n in 0..PER_KEY {
        for k in 0..KEYS {
            messages.push(keyed(Some(&format!("key-{k}")), &format!("{k}/{n}")));
        }
    }
    // Shuffled keys, in order within each key: a key's messages are not adjacent.
    let mut rng = 0x2545_f491_u64;
    for i in (1..messages.len()).rev() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let j = (rng % (i as u64 + 1)) as usize;
        messages.swap(i, j);
    }
    let mut next = vec![0usize; KEYS];
    for m in &mut messages {
        let k: usize = String::from_utf8_lossy(&m.body)
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        m.body = format!("{k}/{}", next[k]).into_bytes();
        next[k] += 1;
    }
    t.send_batch(&q("in"), &messages).await.unwrap();
    let log = Arc::new(Mutex::new(Vec::<(usize, usize, Instant, Instant)>::new()));
    let receivers: Vec<_> = (0..8u64)
        .map(|r| {
            let (t, log) = (t.clone(), log.clone());
            tokio::spawn(async move {
                let mut empty = 0;
                let mut seed = r * 7919 + 1;
                while empty < 50 {
                    let Some(received) = t.receive(&q("in")).await.unwrap() else {
                        empty += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    };
                    empty = 0;
                    let text = text_of(received.as_ref());
                    let (k, n) = text.split_once('/').unwrap();
                    let start = Instant::now();
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    tokio::time::sleep(Duration::from_micros((seed >> 33) % 3000)).await;
                    let end = Instant::now();
                    log.lock()
                        .unwrap()
                        .push((k.parse().unwrap(), n.parse().unwrap(), start, end));
                    received.commit().await.unwrap();
                }
            })
        })
        .collect();
    for r in receivers {
        r.await.unwrap();
    }
    let mut log = log.lock().unwrap().clone();
    assert_eq!(
        log.len(),
        KEYS * PER_KEY,
        "each message handled exactly once"
    );
    log.sort_by_key(|(k, _, start, _)| (*k, *start));
    for pair in log.windows(2) {
        let ((k1, n1, _, end1), (k2, n2, start2, _)) = (pair[0], pair[1]);
        if k1 == k2 {
            assert_eq!(n2, n1 + 1, "key {k1}: {n2} ran right after {n1}");
            assert!(end1 <= start2, "key {k1}: {n1} and {n2} overlapped");
        }
    }
}

/// The key is the header's value, wherever it stands and whatever it holds: not the same
/// name met as another header's value, quotes inside kept; a null header has no key.
pub async fn the_key_is_read_from_its_header_alone(h: &dyn Harness) {
    let t = ordered(h, 64).await;
    let tricky = "x\"y, \"Sales.OrderId\": \"z";
    let first = keyed(Some(tricky), "first").with_header("A.Before", KEY);
    let second = keyed(Some(tricky), "second");
    let mut unkeyed = keyed(None, "null key");
    unkeyed.headers.insert(KEY.into(), None);
    let other = keyed(Some("z"), "other");
    t.send_batch(&q("in"), &[first, second, unkeyed, other])
        .await
        .unwrap();
    let r1 = t.receive(&q("in")).await.unwrap().expect("first");
    assert_eq!(text_of(r1.as_ref()), "first");
    let r2 = t.receive(&q("in")).await.unwrap().expect("the null key");
    assert_eq!(text_of(r2.as_ref()), "null key", "second waits for first");
    let r3 = t.receive(&q("in")).await.unwrap().expect("other");
    assert_eq!(text_of(r3.as_ref()), "other", "a different key");
    assert!(t.receive(&q("in")).await.unwrap().is_none());
    r1.commit().await.unwrap();
    let r4 = t.receive(&q("in")).await.unwrap().expect("second");
    assert_eq!(text_of(r4.as_ref()), "second");
    for r in [r2, r3, r4] {
        r.commit().await.unwrap();
    }
}

/// A message of stage `stage` that waits for stage `previous`.
fn staged(stage: &str, previous: Option<&str>, body: &str) -> OutgoingMessage {
    use throttlehost::message::{EXECUTION_STAGE_HEADER, PREVIOUS_STAGE_HEADER};
    let m =
        OutgoingMessage::new(body.as_bytes().to_vec()).with_header(EXECUTION_STAGE_HEADER, stage);
    match previous {
        Some(p) => m.with_header(PREVIOUS_STAGE_HEADER, p),
        None => m,
    }
}

/// Ordered stages: the members of a stage run side by side; the next stage starts only
/// when every message of the previous one has ended, and a rolled-back member holds it back.
pub async fn a_stage_waits_for_every_message_of_the_previous_one(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    let ordering = throttlehost::config::OrderingConfig {
        stages: true,
        ..Default::default()
    };
    keys(&t).order_by_key(&q("in"), &ordering).await.unwrap();
    let messages = [
        staged("100", None, "a"),
        staged("100", None, "b"),
        staged("200", Some("100"), "c"),
        staged("200", Some("100"), "d"),
        staged("300", Some("200"), "e"),
    ];
    t.send_batch(&q("in"), &messages).await.unwrap();
    let a = t.receive(&q("in")).await.unwrap().expect("a");
    let b = t.receive(&q("in")).await.unwrap().expect("b");
    assert_eq!(
        (text_of(a.as_ref()), text_of(b.as_ref())),
        ("a".into(), "b".into())
    );
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "200 waits for 100"
    );
    assert_waiting(&t, 3).await;
    a.commit().await.unwrap();
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "b is still in flight"
    );
    b.rollback().await.unwrap();
    let b = t.receive(&q("in")).await.unwrap().expect("b again");
    assert_eq!(text_of(b.as_ref()), "b");
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "b is back in flight"
    );
    b.commit().await.unwrap();
    let c = t.receive(&q("in")).await.unwrap().expect("c");
    let d = t.receive(&q("in")).await.unwrap().expect("d, beside c");
    assert_eq!(
        (text_of(c.as_ref()), text_of(d.as_ref())),
        ("c".into(), "d".into())
    );
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "300 waits for 200"
    );
    assert_waiting(&t, 1).await;
    c.commit().await.unwrap();
    d.commit().await.unwrap();
    let e = t.receive(&q("in")).await.unwrap().expect("e");
    assert_eq!(text_of(e.as_ref()), "e");
    e.commit().await.unwrap();
}

/// `failed_key = "hold"`: a held message stays in place and holds its key on every receive
/// (its later messages wait behind it, other keys pass), until released; then it is the
/// key's next message again, before the rest.
pub async fn a_held_key_waits_until_released(h: &dyn Harness) {
    let t = setup(h, &["in", "error"]).await;
    let ordering = throttlehost::config::OrderingConfig {
        key_header: KEY.into(),
        failed_key: throttlehost::config::FailedKey::Hold,
        ..Default::default()
    };
    keys(&t).order_by_key(&q("in"), &ordering).await.unwrap();
    assert!(keys(&t).held_keys(&q("in")).await.unwrap().is_empty());
    let messages = [
        keyed(Some("a"), "a1"),
        keyed(Some("a"), "a2"),
        keyed(Some("b"), "b1"),
    ];
    t.send_batch(&q("in"), &messages).await.unwrap();
    let a1 = t.receive(&q("in")).await.unwrap().expect("a1");
    assert_eq!(text_of(a1.as_ref()), "a1");
    let a1_id = a1.payload().id();
    keys(&t)
        .hold(&q("in"), a1_id, "a", "boom: the handler failed")
        .await
        .unwrap();
    a1.rollback().await.unwrap();
    let b1 = t
        .receive(&q("in"))
        .await
        .unwrap()
        .expect("b1 passes the held key");
    assert_eq!(text_of(b1.as_ref()), "b1");
    b1.commit().await.unwrap();
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "a1 is held and a2 waits behind it"
    );
    let held = keys(&t).held_keys(&q("in")).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0].key, "a");
    assert_eq!(held[0].message_id, messages[0].id);
    assert!(keys(&t).is_held(&q("in"), "a").await.unwrap());
    assert!(!keys(&t).is_held(&q("in"), "b").await.unwrap());
    assert_eq!(held[0].reason, "boom: the handler failed");
    assert!(!held[0].held_at.is_empty());
    assert_eq!(
        t.peek_depth(&q("in")).await.unwrap(),
        2,
        "both still stored"
    );
    assert_eq!(keys(&t).release_held(&q("in"), Some("b")).await.unwrap(), 0);
    assert_eq!(keys(&t).release_held(&q("in"), Some("a")).await.unwrap(), 1);
    assert!(keys(&t).held_keys(&q("in")).await.unwrap().is_empty());
    assert!(!keys(&t).is_held(&q("in"), "a").await.unwrap());
    let again = t
        .receive(&q("in"))
        .await
        .unwrap()
        .expect("a1 after the release");
    assert_eq!(text_of(again.as_ref()), "a1", "the held message first");
    again.commit().await.unwrap();
    let a2 = t.receive(&q("in")).await.unwrap().expect("a2");
    assert_eq!(text_of(a2.as_ref()), "a2");
    a2.commit().await.unwrap();
    // Holding twice is one hold; `None` releases every key.
    t.send(&q("in"), &keyed(Some("c"), "c1")).await.unwrap();
    let c1 = t.receive(&q("in")).await.unwrap().expect("c1");
    let c1_id = c1.payload().id();
    keys(&t).hold(&q("in"), c1_id, "c", "first").await.unwrap();
    keys(&t).hold(&q("in"), c1_id, "c", "second").await.unwrap();
    c1.rollback().await.unwrap();
    assert_eq!(keys(&t).held_keys(&q("in")).await.unwrap().len(), 1);
    assert_eq!(keys(&t).release_held(&q("in"), None).await.unwrap(), 1);
    assert!(t.receive(&q("in")).await.unwrap().is_some(), "c1 released");
}

/// Headers that are not JSON do not stop an ordered queue: the row comes out as poison.
pub async fn a_poison_row_does_not_stop_an_ordered_queue(h: &dyn Harness) {
    let t = ordered(h, 64).await;
    let id = Uuid::new_v4();
    assert!(
        h.insert_poison("in", id, "{\"Sales.OrderId\": [broken", b"x")
            .await
    );
    t.send(&q("in"), &keyed(Some("a"), "a1")).await.unwrap();
    let r = t.receive(&q("in")).await.unwrap().expect("the poison row");
    assert!(
        matches!(r.payload(), Payload::Poison { id: p, .. } if *p == id),
        "{:?}",
        r.payload()
    );
    let a1 = t.receive(&q("in")).await.unwrap().expect("a1 passes it");
    assert_eq!(text_of(a1.as_ref()), "a1");
    a1.commit().await.unwrap();
    r.commit().await.unwrap();
}

/// An ordered queue refuses batch receives (a batch would take a key's messages together)
/// and transaction mode `none` (it deletes before the handler runs).
pub async fn an_ordered_queue_refuses_batches_and_mode_none(h: &dyn Harness) {
    let t = ordered(h, 64).await;
    t.send(&q("in"), &keyed(Some("a"), "a1")).await.unwrap();
    let refused = batches(&t).receive_batch(&q("in"), 8).await;
    assert!(
        matches!(&refused, Err(TransportError::Queue { message, .. }) if message.contains("receive_batch = 1")),
        "{:?}",
        refused.map(|v| v.len())
    );
    let none = h.transport(TransactionMode::None, 4).await;
    none.admin().create_queue(&q("in")).await.unwrap();
    let ordering = throttlehost::config::OrderingConfig {
        key_header: KEY.into(),
        ..Default::default()
    };
    let refused = keys(&none).order_by_key(&q("in"), &ordering).await;
    assert!(
        matches!(&refused, Err(TransportError::Queue { message, .. }) if message.contains("transaction_mode")),
        "{refused:?}"
    );
}

// ---- delayed delivery -------------------------------------------------------------------

use throttlehost::message::FORWARD_DESTINATION_HEADER;

async fn with_delayed(h: &dyn Harness, queues: &[&str]) -> Arc<dyn Transport> {
    let t = setup(h, queues).await;
    let d = t
        .delayed_delivery()
        .expect("every transport stores delayed messages");
    for name in queues {
        d.create_delayed(&q(name)).await.unwrap();
        d.create_delayed(&q(name)).await.unwrap();
    }
    t
}

/// Movers of several hosts at once, round after round: each due message moves once, and a
/// mover that finds the table taken says busy. Before, Babelfish's server process aborted at
/// the fifth refused application lock of a session (`ERRORDATA_STACK_SIZE exceeded`), which
/// contending movers reached within a few rounds.
pub async fn movers_at_once_move_each_message_once(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    let mut sent = std::collections::HashSet::new();
    for round in 0..8 {
        let batch: Vec<_> = (0..40)
            .map(|i| {
                sent.insert(format!("{round}/{i}"));
                OutgoingMessage::new(format!("{round}/{i}")).with_delay(Duration::from_millis(1))
            })
            .collect();
        t.send_batch(&q("in"), &batch).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let movers: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                tokio::spawn(async move {
                    let d = t.delayed_delivery().unwrap();
                    let mut moved = 0;
                    for _ in 0..200 {
                        let m = d.move_due(&q("in"), 10).await.unwrap();
                        moved += m.moved;
                        if !m.busy && m.moved == 0 && m.waiting == 0 {
                            break;
                        }
                        if m.moved == 0 {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                    moved
                })
            })
            .collect();
        let mut moved = 0;
        for mover in movers {
            moved += mover.await.unwrap();
        }
        assert_eq!(moved, 40, "round {round}: every due message moved once");
    }
    let mut received = std::collections::HashSet::new();
    while let Some(r) = t.receive(&q("in")).await.unwrap() {
        assert!(received.insert(text_of(r.as_ref())), "received twice");
        r.commit().await.unwrap();
    }
    assert_eq!(received, sent);
}

/// Moves until something moved or `within` passed; returns the last report.
async fn move_until_moved(
    t: &dyn Transport,
    queue: &str,
    within: Duration,
) -> throttlehost::transport::Moved {
    let d = t.delayed_delivery().unwrap();
    let until = std::time::Instant::now() + within;
    loop {
        let moved = d.move_due(&q(queue), 100).await.unwrap();
        if moved.moved > 0 || std::time::Instant::now() > until {
            return moved;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A message delayed far ahead (400 days): its next due time is told as it is, not cut to
/// the 49.7 days a u32 of milliseconds holds (a next-due gauge read 4 294 967 s).
pub async fn a_far_delayed_message_is_due_when_it_says(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    let d = t.delayed_delivery().unwrap();
    let days = |n: u64| Duration::from_secs(n * 86_400);
    t.send(
        &q("in"),
        &OutgoingMessage::new("next year").with_delay(days(400)),
    )
    .await
    .unwrap();
    let next = d
        .move_due(&q("in"), 100)
        .await
        .unwrap()
        .next_due_in
        .expect("the next due time");
    assert!(
        next > days(399) && next <= days(401),
        "due in 400 days, told {next:?}"
    );
}

/// A sweep reads many delayed tables together, in order: each one's messages and how long
/// until its earliest is due (zero once due, none when empty); more tables than one statement
/// holds are read in several; a missing table fails the sweep.
pub async fn a_sweep_reads_every_delayed_table_in_order(h: &dyn Harness) {
    let t = with_delayed(h, &["sw0", "sw1", "sw2"]).await;
    let d = t.delayed_delivery().unwrap();
    for (queue, body, delay) in [
        ("sw1", "soon", Duration::from_secs(60)),
        ("sw1", "later", Duration::from_secs(3600)),
        ("sw2", "now", Duration::from_millis(1)),
    ] {
        t.send(&q(queue), &OutgoingMessage::new(body).with_delay(delay))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // More reads than one statement holds: the empty table 200 times, then the other two.
    let mut queues = vec![q("sw0"); TABLES_PER_SWEEP];
    queues.extend([q("sw1"), q("sw2")]);
    let readings = d.sweep(&queues).await.unwrap();
    assert_eq!(readings.len(), TABLES_PER_SWEEP + 2);
    assert!(
        readings[..TABLES_PER_SWEEP]
            .iter()
            .all(|r| *r == DelayedReading::default()),
        "an empty table: {:?}",
        readings[0]
    );
    let sw1 = readings[TABLES_PER_SWEEP];
    assert_eq!(sw1.waiting, 2);
    let soon = sw1.next_due_in.expect("the earliest due time");
    assert!(
        soon > Duration::from_secs(55) && soon <= Duration::from_secs(61),
        "due in 60 s, told {soon:?}"
    );
    let sw2 = readings[TABLES_PER_SWEEP + 1];
    assert_eq!(sw2.waiting, 1, "read by the second statement");
    assert!(
        sw2.next_due_in
            .is_some_and(|due| due < Duration::from_secs(1)),
        "{sw2:?}"
    );
    assert!(
        d.sweep(&[q("sw0"), q("nowhere")]).await.is_err(),
        "a missing table fails the sweep"
    );
}

pub async fn a_delayed_message_waits_in_its_table_until_due(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    let d = t.delayed_delivery().unwrap();
    t.send(
        &q("in"),
        &OutgoingMessage::new("later").with_delay(Duration::from_millis(1500)),
    )
    .await
    .unwrap();
    t.send(&q("in"), &OutgoingMessage::new("now"))
        .await
        .unwrap();
    let r = t
        .receive(&q("in"))
        .await
        .unwrap()
        .expect("the undelayed message");
    assert_eq!(body_of(r.as_ref()), b"now");
    r.commit().await.unwrap();
    assert!(
        t.receive(&q("in")).await.unwrap().is_none(),
        "the delayed one is not in the queue"
    );
    let early = d.move_due(&q("in"), 100).await.unwrap();
    assert_eq!((early.moved, early.waiting, early.busy), (0, 1, false));
    let next = early.next_due_in.expect("the next due time");
    assert!(
        next > Duration::from_millis(500) && next <= Duration::from_millis(1600),
        "due in about 1.5 s by the server's clock, got {next:?}"
    );
    let moved = move_until_moved(t.as_ref(), "in", Duration::from_secs(5)).await;
    assert_eq!(
        (moved.moved, moved.waiting, moved.next_due_in),
        (1, 0, None)
    );
    let r = t
        .receive(&q("in"))
        .await
        .unwrap()
        .expect("moved in when due");
    let Payload::Message(m) = r.payload() else {
        panic!("a message")
    };
    assert_eq!(m.body, b"later");
    let destination = m
        .header(FORWARD_DESTINATION_HEADER)
        .expect("the forward destination");
    assert_eq!(
        t.resolve_address(destination),
        Some(q("in")),
        "it names its queue: {destination}"
    );
    assert_eq!(
        destination,
        t.address(&q("in")),
        "written whole, as NServiceBus compares it with its own address"
    );
    r.commit().await.unwrap();
}

pub async fn due_messages_move_in_batches_oldest_due_first(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    let d = t.delayed_delivery().unwrap();
    // Stored in reverse order of due time: the move follows Due, not the order stored.
    for i in 0..5u8 {
        let delay = Duration::from_millis(u64::from(50 * (5 - i)));
        t.send(&q("in"), &OutgoingMessage::new(vec![i]).with_delay(delay))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut moved = Vec::new();
    for _ in 0..3 {
        moved.push(d.move_due(&q("in"), 2).await.unwrap().moved);
    }
    assert_eq!(moved, vec![2, 2, 1]);
    let mut bodies = Vec::new();
    while let Some(r) = t.receive(&q("in")).await.unwrap() {
        bodies.push(body_of(r.as_ref())[0]);
        r.commit().await.unwrap();
    }
    assert_eq!(bodies, vec![4, 3, 2, 1, 0]);
}

pub async fn a_delayed_send_inside_a_receive_commits_with_it(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    let d = t.delayed_delivery().unwrap();
    t.send(&q("in"), &OutgoingMessage::new("first"))
        .await
        .unwrap();
    let retry = OutgoingMessage::new("retry").with_delay(Duration::ZERO);
    let mut r = t.receive(&q("in")).await.unwrap().unwrap();
    r.send(&q("in"), &retry).await.unwrap();
    r.rollback().await.unwrap();
    assert_eq!(
        d.move_due(&q("in"), 100).await.unwrap().waiting,
        0,
        "rolled back with the receive"
    );
    let mut r = t.receive(&q("in")).await.unwrap().unwrap();
    r.send(&q("in"), &retry).await.unwrap();
    r.commit().await.unwrap();
    let moved = move_until_moved(t.as_ref(), "in", Duration::from_secs(5)).await;
    assert_eq!(moved.moved, 1);
    let r = t.receive(&q("in")).await.unwrap().unwrap();
    assert_eq!(body_of(r.as_ref()), b"retry");
    r.commit().await.unwrap();
}

pub async fn a_forward_destination_set_by_the_sender_is_kept(h: &dyn Harness) {
    let t = with_delayed(h, &["in", "other"]).await;
    let to_other = OutgoingMessage::new("for other")
        .with_header(FORWARD_DESTINATION_HEADER, t.address(&q("other")))
        .with_delay(Duration::ZERO);
    t.send(&q("in"), &to_other).await.unwrap();
    assert_eq!(
        move_until_moved(t.as_ref(), "in", Duration::from_secs(5))
            .await
            .moved,
        1
    );
    let r = t
        .receive(&q("in"))
        .await
        .unwrap()
        .expect("moved into the table's own queue");
    let Payload::Message(m) = r.payload() else {
        panic!("a message")
    };
    assert_eq!(
        t.resolve_address(m.header(FORWARD_DESTINATION_HEADER).unwrap()),
        Some(q("other"))
    );
    r.commit().await.unwrap();
}

pub async fn a_row_that_is_never_due_does_not_stall_the_mover(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    assert!(
        h.insert_never_due("in").await,
        "database transports store it"
    );
    t.send(
        &q("in"),
        &OutgoingMessage::new("due").with_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    let moved = move_until_moved(t.as_ref(), "in", Duration::from_secs(5)).await;
    assert_eq!((moved.moved, moved.waiting), (1, 1), "{moved:?}");
    let r = t.receive(&q("in")).await.unwrap().expect("the due one");
    assert_eq!(body_of(r.as_ref()), b"due");
    r.commit().await.unwrap();
    let again = t
        .delayed_delivery()
        .unwrap()
        .move_due(&q("in"), 100)
        .await
        .unwrap();
    assert_eq!((again.moved, again.waiting), (0, 1), "{again:?}");
}

/// `<queue>.Delayed`, with NServiceBus's capital D on both engines (quoted on PostgreSQL, so
/// the case stays), and a delayed send lands in the table of that name.
pub async fn the_delayed_table_is_named_as_nservicebus_names_it(h: &dyn Harness) {
    let t = with_delayed(h, &["in"]).await;
    let d = t.delayed_delivery().unwrap();
    assert!(d.delayed_table_exists(&q("in")).await.unwrap());
    assert!(
        !d.delayed_table_exists(&q("nowhere")).await.unwrap(),
        "a queue without a delayed table"
    );
    let table = d.delayed_table(&q("in"));
    assert!(
        ["\"in.Delayed\"", "[in.Delayed]", "in.Delayed"]
            .iter()
            .any(|name| table.ends_with(name)),
        "{table}"
    );
    t.send(
        &q("in"),
        &OutgoingMessage::new("x").with_delay(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    assert_eq!(d.delayed_count(&q("in")).await.unwrap(), 1);
    if h.insert_never_due("in").await {
        assert_eq!(d.delayed_count(&q("in")).await.unwrap(), 2, "{table}");
    }
}

pub async fn a_delayed_send_is_refused_without_a_table_or_with_an_expiry(h: &dyn Harness) {
    let t = setup(h, &["in"]).await;
    let e = t
        .send(
            &q("in"),
            &OutgoingMessage::new("x").with_delay(Duration::from_secs(1)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, TransportError::DelayedTableNotFound { .. }),
        "a missing delayed table is said as such: {e}"
    );
    assert!(e.to_string().contains("in.Delayed"), "names the table: {e}");
    assert!(
        e.to_string().contains("throttlehost queues create"),
        "names the command that creates it: {e}"
    );
    let d = t.delayed_delivery().unwrap();
    let e = d.delayed_count(&q("in")).await.unwrap_err();
    assert!(
        matches!(e, TransportError::DelayedTableNotFound { .. }),
        "counting a missing delayed table says it is missing: {e}"
    );
    let both = OutgoingMessage::new("x")
        .with_time_to_be_received(Duration::from_secs(5))
        .with_delay(Duration::from_secs(1));
    let e = t.send(&q("in"), &both).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidMessage(_)), "{e}");
}

pub async fn depths_of_many_queues_are_read_together_in_order(h: &dyn Harness) {
    let names: Vec<String> = (0..250).map(|i| format!("many{i:03}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let t = setup(h, &refs).await;
    for (i, name) in names.iter().enumerate().filter(|(i, _)| i % 50 == 7) {
        let batch: Vec<OutgoingMessage> = (0..=i % 5).map(|_| OutgoingMessage::new("x")).collect();
        t.send_batch(&q(name), &batch).await.unwrap();
    }
    // More than one statement's worth, with a queue that does not exist in the middle.
    let mut queues: Vec<QueueName> = names.iter().map(|n| q(n)).collect();
    queues.insert(120, q("nowhere"));
    let depths = t.peek_depths(&queues).await;
    assert_eq!(depths.len(), queues.len());
    for (queue, depth) in queues.iter().zip(&depths) {
        match queue.as_str() {
            "nowhere" => assert!(
                matches!(depth, Err(TransportError::QueueNotFound(_))),
                "{depth:?}"
            ),
            name => {
                let i: usize = name[4..].parse().unwrap();
                let expected = if i % 50 == 7 { (i % 5 + 1) as u64 } else { 0 };
                assert_eq!(*depth.as_ref().unwrap(), expected, "{name}");
            }
        }
    }
}

/// The transport's subscription table: every transport under test keeps one.
fn subs(t: &Arc<dyn Transport>) -> &dyn Subscriptions {
    t.subscriptions()
        .expect("every transport under test keeps subscriptions")
}

pub async fn subscribe_is_an_upsert_per_endpoint_and_topic(h: &dyn Harness) {
    let t = setup(h, &[]).await;
    let s = subs(&t);
    s.create_subscription_table().await.unwrap();
    s.create_subscription_table().await.unwrap(); // created once, then left alone
    s.subscribe("Billing", "Sales.OrderAccepted", "billing-old")
        .await
        .unwrap();
    s.subscribe("Billing", "Sales.OrderAccepted", "billing")
        .await
        .unwrap();
    s.subscribe("Shipping", "Sales.OrderAccepted", "shipping")
        .await
        .unwrap();
    s.subscribe("Shipping", "Sales.IOrderEvent", "shipping")
        .await
        .unwrap();
    let rows = s.all_subscriptions().await.unwrap();
    let seen: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|r| {
            (
                r.topic.as_str(),
                r.endpoint.as_str(),
                r.queue_address.as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("Sales.IOrderEvent", "Shipping", "shipping"),
            ("Sales.OrderAccepted", "Billing", "billing"),
            ("Sales.OrderAccepted", "Shipping", "shipping"),
        ]
    );
}

pub async fn subscribers_of_an_event_and_its_base_types_are_distinct(h: &dyn Harness) {
    let t = setup(h, &[]).await;
    let s = subs(&t);
    s.create_subscription_table().await.unwrap();
    s.subscribe("Billing", "Sales.OrderAccepted", "billing")
        .await
        .unwrap();
    s.subscribe("Shipping", "Sales.IOrderEvent", "shipping")
        .await
        .unwrap();
    s.subscribe("Audit", "Sales.IOrderEvent", "billing")
        .await
        .unwrap();
    let topics = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let mut found = s
        .subscribers(&topics(&["Sales.OrderAccepted", "Sales.IOrderEvent"]))
        .await
        .unwrap();
    found.sort();
    assert_eq!(found, ["billing", "shipping"]);
    assert!(
        s.subscribers(&topics(&["Sales.Other"]))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(s.subscribers(&[]).await.unwrap().is_empty());
}

pub async fn unsubscribe_removes_only_its_key(h: &dyn Harness) {
    let t = setup(h, &[]).await;
    let s = subs(&t);
    s.create_subscription_table().await.unwrap();
    s.subscribe("Billing", "Sales.OrderAccepted", "billing")
        .await
        .unwrap();
    s.subscribe("Shipping", "Sales.OrderAccepted", "shipping")
        .await
        .unwrap();
    assert!(
        s.unsubscribe("Billing", "Sales.OrderAccepted")
            .await
            .unwrap()
    );
    assert!(
        !s.unsubscribe("Billing", "Sales.OrderAccepted")
            .await
            .unwrap()
    );
    let found = s
        .subscribers(&["Sales.OrderAccepted".to_string()])
        .await
        .unwrap();
    assert_eq!(found, ["shipping"]);
}

pub async fn an_event_is_stored_for_every_subscriber_or_for_none(h: &dyn Harness) {
    let t = setup(h, &["billing", "shipping", "audit"]).await;
    let event = OutgoingMessage::new(b"accepted".to_vec()).with_header("Topic", "x");
    let copies: Vec<(QueueName, OutgoingMessage)> = ["billing", "shipping", "audit"]
        .iter()
        .map(|n| (q(n), event.clone()))
        .collect();
    subs(&t).deliver(&copies).await.unwrap();
    for name in ["billing", "shipping", "audit"] {
        assert_eq!(t.peek_depth(&q(name)).await.unwrap(), 1, "{name}");
        let r = t.receive(&q(name)).await.unwrap().expect("a copy");
        assert_eq!(body_of(r.as_ref()), b"accepted");
        r.commit().await.unwrap();
    }
    // A copy for a queue that does not exist: nothing is stored anywhere.
    let mut broken = copies.clone();
    broken.insert(1, (q("gone"), event.clone()));
    let e = subs(&t).deliver(&broken).await.unwrap_err();
    assert!(matches!(e, TransportError::QueueNotFound(_)), "{e}");
    for name in ["billing", "shipping", "audit"] {
        assert_eq!(t.peek_depth(&q(name)).await.unwrap(), 0, "{name}");
    }
}

pub async fn a_missing_subscription_table_is_named(h: &dyn Harness) {
    let t = setup(h, &[]).await;
    let s = subs(&t);
    let e = s
        .subscribe("Billing", "Sales.OrderAccepted", "billing")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("subscription table"), "{e}");
    let e = s
        .subscribers(&["Sales.OrderAccepted".into()])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("subscription table"), "{e}");
}

macro_rules! conformance {
    ($module:ident, $harness:expr, { $(#[$attr:meta])* }, database) => {
        mod $module {
            use super::*;
            conformance!(@tests $harness, { $(#[$attr])* };
                a_killed_connection_fails_cleanly_and_the_next_receive_works,
                poison_rows_are_dead_lettered_unchanged,
                a_poison_row_does_not_stop_an_ordered_queue,
                a_row_that_is_never_due_does_not_stall_the_mover
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
                a_batch_outbox_keeps_the_order_of_each_message_sends,
                a_large_batch_is_stored_whole_in_order,
                a_batch_dropped_mid_way_returns_every_message,
                a_busy_key_waits_while_other_keys_pass,
                the_key_is_read_from_its_header_alone,
                a_stage_waits_for_every_message_of_the_previous_one,
                concurrent_receivers_keep_each_keys_order,
                an_ordered_queue_refuses_batches_and_mode_none,
                a_held_key_waits_until_released,
                a_delayed_message_waits_in_its_table_until_due,
                a_far_delayed_message_is_due_when_it_says,
                a_sweep_reads_every_delayed_table_in_order,
                movers_at_once_move_each_message_once,
                due_messages_move_in_batches_oldest_due_first,
                a_delayed_send_inside_a_receive_commits_with_it,
                a_forward_destination_set_by_the_sender_is_kept,
                a_delayed_send_is_refused_without_a_table_or_with_an_expiry,
                the_delayed_table_is_named_as_nservicebus_names_it,
                depths_of_many_queues_are_read_together_in_order,
                subscribe_is_an_upsert_per_endpoint_and_topic,
                subscribers_of_an_event_and_its_base_types_are_distinct,
                unsubscribe_removes_only_its_key,
                an_event_is_stored_for_every_subscriber_or_for_none,
                a_missing_subscription_table_is_named
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
    async fn insert_never_due(&self, queue: &str) -> bool {
        let c = self.schema.client().await;
        c.execute(
            &format!(
                "INSERT INTO {} (Headers, Body, Due) VALUES ('{{}}', NULL, 'infinity')",
                self.table(&format!("{queue}.Delayed"))
            ),
            &[],
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

use common::mssql;

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
            "a_batch_receive_takes_the_oldest_unlocked_in_order" => Some(
                "Babelfish ignores READPAST: a second batch waits on the rows the first batch holds instead of taking the next ones",
            ),
            _ => None,
        }
    }
    async fn kill_connections(&self) -> Option<u64> {
        Some(self.schema.kill_connections().await)
    }
    async fn insert_never_due(&self, queue: &str) -> bool {
        let mut c = mssql::client().await;
        c.execute(
            format!(
                "INSERT INTO {} (Headers, Body, Due) VALUES (N'{{}}', NULL, '9999-12-31T23:59:59')",
                self.schema.table(&format!("{queue}.Delayed"))
            ),
            &[],
        )
        .await
        .unwrap();
        true
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
    t.admin().create_queue(&q("modern")).await.unwrap();
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
    let warnings = t
        .admin()
        .startup_checks(&[q("modern"), q("old")])
        .await
        .unwrap();
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
    // So does a bulk load (more than one multi-row insert holds), into both old layouts.
    let many: Vec<_> = (0..600u32)
        .map(|i| OutgoingMessage::new(i.to_be_bytes().to_vec()))
        .collect();
    for table in ["bare", "old"] {
        t.send_batch(&q(table), &many).await.unwrap();
        let first = t.receive(&q(table)).await.unwrap().expect("a message");
        if table == "old" {
            assert_eq!(body_of(first.as_ref()), 0u32.to_be_bytes().to_vec());
        }
        first.rollback().await.unwrap();
    }
    assert_eq!(t.peek_depth(&q("bare")).await.unwrap(), 601);
}
