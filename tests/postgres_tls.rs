//! The PostgreSQL transport's TLS modes: `sslmode=disable` connects in plain text (and builds
//! no TLS connector, which would parse the system's CA bundle at every start); the default
//! (`prefer`) encrypts exactly when the server offers TLS.

mod common;

use throttlehost::config::{ConnectionString, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueAdmin, Transport};

async fn round_trip(url_suffix: &str) -> bool {
    let schema = common::PgSchema::new();
    let mut config = schema.transport_config(TransactionMode::ReceiveOnly, 2);
    let url = format!("{}{url_suffix}", schema.connection_string());
    config.connection_string = ConnectionString::new(url);
    let t = PostgresTransport::connect(&config).await.unwrap();
    let queue = common::q("in");
    t.create_queue(&queue).await.unwrap();
    t.send(&queue, &OutgoingMessage::new("x")).await.unwrap();
    let r = t.receive(&queue).await.unwrap().expect("the message");
    r.commit().await.unwrap();
    // Whether the host's own session is encrypted, as the server sees it.
    let client = schema.client().await;
    let row = client
        .query_one(
            "SELECT bool_or(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a ON a.pid = s.pid \
             WHERE a.application_name = $1",
            &[&schema.name],
        )
        .await
        .unwrap();
    row.get::<_, Option<bool>>(0).unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_disable_connects_in_plain_text() {
    assert!(
        !round_trip("&sslmode=disable").await,
        "no session of the transport is encrypted"
    );
}

/// `prefer`: encrypted exactly when the server offers TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_mode_encrypts_when_the_server_offers_tls() {
    let schema = common::PgSchema::new();
    let server_tls: String = schema
        .client()
        .await
        .query_one("SHOW ssl", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(round_trip("").await, server_tls == "on");
}
