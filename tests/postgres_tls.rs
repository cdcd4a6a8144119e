//! The PostgreSQL transport's TLS modes: `sslmode=disable` connects in plain text; the default
//! (`prefer`) encrypts exactly when the server offers TLS; `verify-full` checks the chain
//! against `sslrootcert` and then the host name.

mod common;

use throttlehost::config::{ConnectionString, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueAdmin, Transport};

async fn round_trip(url_suffix: &str) -> bool {
    round_trip_on(&common::PgSchema::new(), url_suffix).await
}

/// Sends and receives one message through a transport whose connection string is the test
/// schema's plus `url_suffix`; whether its session was encrypted.
async fn round_trip_on(schema: &common::PgSchema, url_suffix: &str) -> bool {
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

/// The server's certificate file when it offers TLS and this process may read the file.
async fn server_certificate(schema: &common::PgSchema) -> Option<String> {
    let client = schema.client().await;
    let ssl: String = client.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    if ssl != "on" {
        eprintln!("the server offers no TLS: nothing to verify");
        return None;
    }
    let file: String = client
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .unwrap()
        .get(0);
    let file = if file.starts_with('/') {
        file
    } else {
        let dir: String = client
            .query_one("SHOW data_directory", &[])
            .await
            .unwrap()
            .get(0);
        format!("{dir}/{file}")
    };
    match std::fs::metadata(&file) {
        Ok(_) => Some(file),
        Err(e) => {
            eprintln!("cannot read the server's certificate {file}: {e}");
            None
        }
    }
}

/// Connects with `suffix` added to the test schema's connection string; the error, if any.
async fn connect_error(schema: &common::PgSchema, suffix: &str) -> Option<String> {
    let mut config = schema.transport_config(TransactionMode::ReceiveOnly, 1);
    config.connection_string =
        ConnectionString::new(format!("{}{suffix}", schema.connection_string()));
    PostgresTransport::connect(&config)
        .await
        .err()
        .map(|e| format!("{e:#}"))
}

/// With the system's bundle of public CAs as `sslrootcert`, `mode` refuses the server's
/// self-signed certificate for its issuer (checked where the bundle is installed).
async fn assert_refused_by_the_public_cas(schema: &common::PgSchema, mode: &str) {
    let public_cas = "/etc/ssl/certs/ca-certificates.crt";
    if !std::path::Path::new(public_cas).exists() {
        eprintln!("no {public_cas}: the issuer check is not shown");
        return;
    }
    let e = connect_error(schema, &format!("&sslmode={mode}&sslrootcert={public_cas}"))
        .await
        .expect("a self-signed certificate is refused");
    assert!(e.contains("UnknownIssuer"), "{mode}: {e}");
}

/// `verify-full` checks the chain against `sslrootcert`, then the host name. With the public
/// CAs of the system's bundle as roots, a server with a self-signed certificate (Debian's
/// snakeoil one) is refused for its issuer; with its own certificate as the root it is
/// trusted, and refused for the name instead: 127.0.0.1 is not a name such a certificate is
/// issued for. A root file that does not exist is an error naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_the_chain_against_sslrootcert_then_the_host_name() {
    let schema = common::PgSchema::new();
    let Some(cert) = server_certificate(&schema).await else {
        return;
    };
    assert_refused_by_the_public_cas(&schema, "verify-full").await;
    let e = connect_error(&schema, &format!("&sslmode=verify-full&sslrootcert={cert}"))
        .await
        .expect("refused for its name");
    assert!(e.contains("not valid for name"), "{e}");
    assert!(!e.contains("UnknownIssuer"), "{e}");
    let e = connect_error(&schema, "&sslmode=verify-full&sslrootcert=/nonexistent.pem")
        .await
        .expect("a missing file is an error");
    assert!(e.contains("sslrootcert `/nonexistent.pem`"), "{e}");
}

/// `verify-ca` checks the chain and not the name: with the server's own certificate as the
/// root, a connection to 127.0.0.1 is made, encrypted, where `verify-full` refuses it; with
/// the public CAs as roots it is refused for the issuer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_checks_the_chain_and_not_the_host_name() {
    let schema = common::PgSchema::new();
    let Some(cert) = server_certificate(&schema).await else {
        return;
    };
    assert!(
        round_trip_on(&schema, &format!("&sslmode=verify-ca&sslrootcert={cert}")).await,
        "the session is encrypted"
    );
    assert_refused_by_the_public_cas(&schema, "verify-ca").await;
}
