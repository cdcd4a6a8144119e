//! The PostgreSQL per-message receive: `[COMMIT;] BEGIN; EXECUTE <receive>` as one simple
//! query, its row read as text. What the conformance suite cannot show on every transport:
//! that the text decoding holds whatever the server's settings, and that a chain of
//! commit-and-receive keeps every message whole.

mod common;

use std::sync::Arc;

use throttlehost::config::{ConnectionString, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{Payload, Received, Transport};

use common::q;

/// Every byte value, rotated by `n` so each message differs.
fn every_byte(n: u8) -> Vec<u8> {
    (0..=255u8).map(|b| b.wrapping_add(n)).collect()
}

fn body_of(r: &dyn Received) -> Vec<u8> {
    match r.payload() {
        Payload::Message(m) => m.body.clone(),
        other => panic!("expected a message, got {other:?}"),
    }
}

/// A transport on the test schema whose sessions start with the server settings `options`
/// (URL-encoded `-c name=value` pairs).
async fn with_session_options(schema: &common::PgSchema, options: &str) -> PostgresTransport {
    let mut config = schema.transport_config(TransactionMode::ReceiveOnly, 2);
    config.connection_string =
        ConnectionString::new(format!("{}&options={options}", schema.connection_string()));
    PostgresTransport::connect(&config).await.unwrap()
}

/// Sends five bodies of every byte value, receives the first on its own and the rest as
/// follow-ons of each commit, and checks each body byte for byte.
async fn chain_keeps_bodies_whole(transport: Arc<dyn Transport>) {
    let queue = q("in");
    transport.admin().create_queue(&queue).await.unwrap();
    for n in 0..5u8 {
        transport
            .send(&queue, &OutgoingMessage::new(every_byte(n)))
            .await
            .unwrap();
    }
    // An empty body and an absent one read as empty.
    transport
        .send(&queue, &OutgoingMessage::new(Vec::new()))
        .await
        .unwrap();
    let mut current = transport.receive(&queue).await.unwrap().expect("a message");
    for n in 0..5u8 {
        assert_eq!(body_of(current.as_ref()), every_byte(n), "message {n}");
        let next = current.commit_and_receive(&queue).await;
        next.committed.expect("the commit");
        current = next
            .next
            .expect("a follow-on receive")
            .expect("no receive error")
            .expect("a message");
    }
    assert_eq!(body_of(current.as_ref()), Vec::<u8>::new());
    let last = current.commit_and_receive(&queue).await;
    last.committed.expect("the commit");
    assert!(
        last.next.expect("a follow-on receive").unwrap().is_none(),
        "the queue is empty"
    );
    assert_eq!(transport.peek_depth(&queue).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_read_whole_with_the_default_hex_output() {
    let schema = common::PgSchema::new();
    let transport = schema.transport(TransactionMode::ReceiveOnly, 2).await;
    chain_keeps_bodies_whole(Arc::new(transport)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_read_whole_when_the_server_prints_bytea_escaped() {
    let schema = common::PgSchema::new();
    // `bytea_output = escape` for this test's sessions, as a server or role may set it.
    let transport = with_session_options(&schema, "-c%20bytea_output%3Descape").await;
    chain_keeps_bodies_whole(Arc::new(transport)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_prepares_the_receive_again_and_the_order_holds() {
    let schema = common::PgSchema::new();
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 1).await);
    let queue = q("in");
    transport.admin().create_queue(&queue).await.unwrap();
    for n in 0..3u8 {
        transport
            .send(&queue, &OutgoingMessage::new(every_byte(n)))
            .await
            .unwrap();
    }
    let first = transport.receive(&queue).await.unwrap().expect("a message");
    assert_eq!(body_of(first.as_ref()), every_byte(0));
    // The connection, and the receive prepared on it, are gone (a restart, a killed
    // session): the commit fails and no follow-on receive runs.
    let client = schema.client().await;
    client
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
            &[&schema.name],
        )
        .await
        .unwrap();
    let next = first.commit_and_receive(&queue).await;
    assert!(next.committed.is_err(), "the connection was killed");
    // The first message's transaction rolled back with its connection; a new connection
    // prepares the receive again and the order holds.
    let mut bodies = Vec::new();
    while let Some(r) = transport.receive(&queue).await.unwrap() {
        bodies.push(body_of(r.as_ref()));
        r.commit().await.unwrap();
    }
    assert_eq!(bodies, vec![every_byte(0), every_byte(1), every_byte(2)]);
}

/// The expiry a received message reports, by the per-message and the batch receive, is the
/// one it was sent with whatever the session's `DateStyle` and `TimeZone`: the server prints
/// `Expires` in one fixed form for the host (a German day-first `DateStyle` read as ISO would
/// lose it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_reads_the_same_under_any_date_style_and_time_zone() {
    let schema = common::PgSchema::new();
    let transport: Arc<dyn Transport> = Arc::new(
        with_session_options(
            &schema,
            "-c%20DateStyle%3DGerman%2CDMY%20-c%20TimeZone%3DAmerica%2FNew_York",
        )
        .await,
    );
    let queue = q("in");
    transport.admin().create_queue(&queue).await.unwrap();
    let ttl = std::time::Duration::from_secs(600);
    for n in 0..3u8 {
        transport
            .send(
                &queue,
                &OutgoingMessage::new(vec![n]).with_time_to_be_received(ttl),
            )
            .await
            .unwrap();
    }
    let sent_at = chrono::Utc::now();
    let expect_near = |r: &dyn Received, how: &str| match r.payload() {
        Payload::Message(m) => {
            let expires = m.expires.unwrap_or_else(|| panic!("{how}: no expiry read"));
            let off = (expires - sent_at).num_seconds();
            assert!(
                (590..=610).contains(&off),
                "{how}: expires {expires}, {off} s after sending instead of about 600"
            );
        }
        other => panic!("{how}: expected a message, got {other:?}"),
    };
    let single = transport.receive(&queue).await.unwrap().expect("a message");
    expect_near(single.as_ref(), "single receive");
    single.commit().await.unwrap();
    let batch = transport
        .batch_receive()
        .unwrap()
        .receive_batch(&queue, 2)
        .await
        .unwrap();
    assert_eq!(batch.len(), 2);
    for r in &batch {
        expect_near(r.as_ref(), "batch receive");
    }
    futures_util::future::join_all(batch.into_iter().map(|r| r.commit())).await;
}
