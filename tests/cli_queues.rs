//! `throttlehost queues create|list|depth|purge|held|release|subscriptions|unsubscribe` and `throttlehost send` (with `--publish`) against PostgreSQL,
//! and secrets kept out of every output.
// Plain (non-async) tests driving a process: blocking sleeps are what they want.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;

use common::PgSchema;

fn throttlehost(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(args)
        .env("RUST_LOG", "trace")
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn config_file(schema: &PgSchema, connection_string: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("th-cli-{}", schema.name));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("host.toml");
    std::fs::write(
        &path,
        format!(
            "[host]\ninstance_id = \"node1\"\nwait_for_database = false\n[transport]\nkind = \"postgres\"\nconnection_string = \"{connection_string}\"\nschema = \"{}\"\n\
             [[queues]]\nname = \"orders\"\n[queues.instance_queue]\nenabled = true\n[queues.handler]\nkind = \"forward\"\nto = \"shipping\"\n",
            schema.name
        ),
    )
    .unwrap();
    path
}

#[test]
fn queues_and_send_work_from_the_command_line() {
    let schema = PgSchema::new();
    let path = config_file(&schema, &schema.connection_string());
    let p = path.to_str().unwrap();

    let (code, out, err) = throttlehost(&["queues", "create", "-c", p]);
    assert_eq!(code, 0, "{err}");
    for q in ["orders", "error", "orders.node1", "shipping"] {
        assert!(out.contains(&format!("created {q}")), "{q}: {out}");
    }
    let delayed = format!("created \"{}\".\"orders.Delayed\"", schema.name);
    assert!(
        out.contains(&delayed),
        "the input queue's delayed table, as NServiceBus names it: {out}"
    );
    assert!(
        !out.contains("shipping.Delayed") && !out.contains("error.Delayed"),
        "only input queues with delayed delivery get one: {out}"
    );
    let (code, _, _) = throttlehost(&["queues", "create", "-c", p]);
    assert_eq!(code, 0, "idempotent");

    let (code, out, _) = throttlehost(&["queues", "list", "-c", p]);
    assert_eq!(code, 0);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec!["error", "orders", "orders.node1", "shipping"]
    );

    let (code, _, err) = throttlehost(&[
        "send",
        "-c",
        p,
        "--queue",
        "orders",
        "--count",
        "10000",
        "--body",
        "hello",
        "--header",
        "Tenant=a=b",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("sent 10000 message(s) to orders"), "{err}");
    let (code, out, _) = throttlehost(&["queues", "depth", "-c", p, "orders"]);
    assert_eq!(code, 0);
    assert_eq!(out.trim(), "orders\t10000");

    let (code, out, _) = throttlehost(&[
        "send", "-c", p, "--queue", "shipping", "--ttbr", "1ms", "--body", "late",
    ]);
    assert_eq!(code, 0);
    assert_eq!(out.trim().len(), 36, "prints the id of a single message");
    std::thread::sleep(std::time::Duration::from_millis(50));
    let (_, out, _) = throttlehost(&["queues", "purge", "-c", p, "shipping", "--expired"]);
    assert!(out.contains("deleted 1 expired"), "{out}");
    let (code, _, err) = throttlehost(&["queues", "purge", "-c", p, "orders"]);
    assert_eq!(code, 2, "purge says what to delete");
    assert!(err.contains("--all"));
    let (_, out, _) = throttlehost(&["queues", "purge", "-c", p, "orders", "--all"]);
    assert!(out.contains("deleted 10000 messages"), "{out}");

    let (code, _, err) = throttlehost(&["send", "-c", p, "--queue", "bad'name"]);
    assert_eq!(code, 2);
    assert!(err.contains("bad'name"), "{err}");
    let (code, _, err) =
        throttlehost(&["send", "-c", p, "--queue", "orders", "--header", "novalue"]);
    assert_eq!(code, 2);
    assert!(err.contains("NAME=VALUE"), "{err}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn passwords_never_reach_output_or_logs() {
    let schema = PgSchema::new();
    // Unreachable port: the failure path logs the most.
    let path = config_file(
        &schema,
        "postgres://postgres:Sekr1tPassw0rd@127.0.0.1:1/test?connect_timeout=2",
    );
    let p = path.to_str().unwrap();
    for args in [
        vec!["run", "-c", p],
        vec!["queues", "list", "-c", p],
        vec!["config", "check", "-c", p],
    ] {
        let (_, out, err) = throttlehost(&args);
        assert!(
            !out.contains("Sekr1tPassw0rd") && !err.contains("Sekr1tPassw0rd"),
            "{args:?}:\n{out}\n{err}"
        );
    }
    let (code, out, _) = throttlehost(&["config", "check", "-c", p]);
    assert_eq!(code, 0);
    assert!(
        out.contains("postgres://postgres:***@127.0.0.1:1/test"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// `queues held` lists what a failed message holds, with its error; `queues release` asks
/// what to release and lifts the hold.
#[test]
fn held_keys_are_listed_and_released_from_the_command_line() {
    use throttlehost::config::{FailedKey, OrderingConfig, TransactionMode};
    use throttlehost::message::OutgoingMessage;
    use throttlehost::transport::{QueueAdmin, Transport};

    let schema = PgSchema::new();
    let path = config_file(&schema, &schema.connection_string());
    let p = path.to_str().unwrap();
    let (code, _, err) = throttlehost(&["queues", "held", "-c", p]);
    assert_eq!(code, 0, "no holds, no table yet: {err}");

    let message = OutgoingMessage::new(b"a1".to_vec()).with_header("Sales.OrderId", "a");
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let t = schema.transport(TransactionMode::ReceiveOnly, 2).await;
        let queue = common::q("orders");
        t.create_queue(&queue).await.unwrap();
        let ordering = OrderingConfig {
            key_header: "Sales.OrderId".into(),
            failed_key: FailedKey::Hold,
            ..OrderingConfig::default()
        };
        t.key_ordering()
            .unwrap()
            .order_by_key(&queue, &ordering)
            .await
            .unwrap();
        t.send(&queue, &message).await.unwrap();
        let r = t.receive(&queue).await.unwrap().unwrap();
        t.key_ordering()
            .unwrap()
            .hold(&queue, r.payload().id(), "a", "the order service is down")
            .await
            .unwrap();
        r.rollback().await.unwrap();
    });

    let (code, out, err) = throttlehost(&["queues", "held", "-c", p, "orders"]);
    assert_eq!(code, 0, "{err}");
    let line = out.lines().next().unwrap_or_default();
    assert!(
        line.starts_with(&format!("orders\ta\t{}\t", message.id))
            && line.ends_with("\tthe order service is down"),
        "{out}"
    );
    let (code, _, err) = throttlehost(&["queues", "release", "-c", p, "orders"]);
    assert_eq!(code, 2, "release says what to release");
    assert!(err.contains("--key") && err.contains("--all"), "{err}");
    let (code, out, _) = throttlehost(&["queues", "release", "-c", p, "orders", "--key", "b"]);
    assert_eq!(code, 0);
    assert!(out.contains("key `b` was not held"), "{out}");
    let (code, out, _) = throttlehost(&["queues", "release", "-c", p, "orders", "--key", "a"]);
    assert_eq!(code, 0);
    assert!(out.contains("released 1"), "{out}");
    let (_, out, _) = throttlehost(&["queues", "held", "-c", p, "orders"]);
    assert!(out.trim().is_empty(), "{out}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// `send` writes the headers NServiceBus's outgoing pipeline writes on a send: the intent,
/// the type (`--type`), a conversation of its own, the originating endpoint, `DeliverAt` for
/// a delayed send and `ReplyToAddress` when asked.
#[test]
fn send_writes_the_headers_an_nservicebus_endpoint_reads() {
    use throttlehost::config::TransactionMode;
    use throttlehost::message::{
        CONVERSATION_ID_HEADER, CORRELATION_ID_HEADER, DELIVER_AT_HEADER,
        ENCLOSED_MESSAGE_TYPES_HEADER, MESSAGE_ID_HEADER, MESSAGE_INTENT_HEADER,
        ORIGINATING_ENDPOINT_HEADER, REPLY_TO_ADDRESS_HEADER,
    };
    use throttlehost::transport::{Payload, Transport};

    let schema = PgSchema::new();
    let path = config_file(&schema, &schema.connection_string());
    let p = path.to_str().unwrap();
    let (code, _, err) = throttlehost(&["queues", "create", "-c", p]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = throttlehost(&[
        "send",
        "-c",
        p,
        "--queue",
        "orders",
        "--body",
        "{}",
        "--type",
        "Sales.Messages.PlaceOrder, Sales.Messages",
        "--reply-to",
        "Client@[dbo]@[Shop]",
    ]);
    assert_eq!(code, 0, "{err}");
    let id = out.trim().to_string();
    let (code, _, err) = throttlehost(&[
        "send", "-c", p, "--queue", "orders", "--body", "later", "--delay", "1h",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = throttlehost(&["send", "-c", p, "--queue", "orders", "--type", " "]);
    assert_eq!(code, 2, "an empty --type is refused");
    assert!(err.contains("--type"), "{err}");

    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let t = schema.transport(TransactionMode::ReceiveOnly, 2).await;
        let r = t.receive(&common::q("orders")).await.unwrap().unwrap();
        let Payload::Message(m) = r.payload() else {
            panic!("a message")
        };
        assert_eq!(m.header(MESSAGE_ID_HEADER), Some(id.as_str()));
        assert_eq!(m.header(MESSAGE_INTENT_HEADER), Some("Send"));
        assert_eq!(
            m.header(ENCLOSED_MESSAGE_TYPES_HEADER),
            Some("Sales.Messages.PlaceOrder, Sales.Messages")
        );
        assert_eq!(m.header(CORRELATION_ID_HEADER), Some(id.as_str()));
        assert!(
            m.header(CONVERSATION_ID_HEADER)
                .is_some_and(|c| c.len() == 36)
        );
        assert_eq!(m.header(ORIGINATING_ENDPOINT_HEADER), Some("throttlehost"));
        assert_eq!(
            m.header(REPLY_TO_ADDRESS_HEADER),
            Some("Client@[dbo]@[Shop]")
        );
        r.commit().await.unwrap();
        let c = schema.client().await;
        let headers: String = c
            .query_one(
                &format!("SELECT Headers FROM \"{}\".\"orders.Delayed\"", schema.name),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let headers: std::collections::HashMap<String, Option<String>> =
            serde_json::from_str(&headers).unwrap();
        let at = headers[DELIVER_AT_HEADER].clone().unwrap();
        assert!(
            at.ends_with(" Z") && at.len() == "2026-01-01 00:00:00:000000 Z".len(),
            "NServiceBus's wire time: {at}"
        );
    });
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn events_are_published_and_subscriptions_listed_and_removed_from_the_command_line() {
    let schema = PgSchema::new();
    let path = config_file(&schema, &schema.connection_string());
    let p = path.to_str().unwrap();
    let (code, out, err) = throttlehost(&["queues", "create", "-c", p, "shipping", "billing"]);
    assert_eq!(code, 0, "{err}");
    let table = format!("\"{}\".\"SubscriptionRouting\"", schema.name);
    assert!(out.contains(&format!("created {table}")), "{out}");

    // Nobody subscribes yet: published, stored nowhere, said so.
    let types = "Sales.OrderAccepted, Sales;Sales.IOrderEvent, Sales";
    let (code, _, err) = throttlehost(&["send", "-c", p, "--publish", types, "--body", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("nobody subscribes"), "{err}");

    // Two endpoints subscribe as NServiceBus's subscribe statement writes the rows.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = schema.client().await;
        for (endpoint, topic) in [
            ("shipping", "Sales.OrderAccepted"),
            ("billing", "Sales.IOrderEvent"),
        ] {
            c.execute(
                &format!(
                    "INSERT INTO {table} (QueueAddress, Topic, Endpoint) VALUES ($1, $2, $3) \
                     ON CONFLICT (Endpoint, Topic) DO UPDATE SET QueueAddress = $1"
                ),
                &[
                    &format!("\"{}\".\"{endpoint}\"", schema.name),
                    &topic,
                    &endpoint,
                ],
            )
            .await
            .unwrap();
        }
    });
    let (code, out, err) = throttlehost(&["queues", "subscriptions", "-c", p]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Sales.IOrderEvent\tbilling\t"), "{out}");
    assert!(out.contains("Sales.OrderAccepted\tshipping\t"), "{out}");

    let (code, _, err) = throttlehost(&[
        "send",
        "-c",
        p,
        "--publish",
        types,
        "--body",
        "2",
        "--count",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("to 2 subscriber(s)"), "{err}");
    let (_, out, _) = throttlehost(&["queues", "depth", "-c", p, "shipping", "billing"]);
    assert!(
        out.contains("shipping\t3") && out.contains("billing\t3"),
        "{out}"
    );

    let (code, out, err) = throttlehost(&[
        "queues",
        "unsubscribe",
        "-c",
        p,
        "billing",
        "Sales.IOrderEvent",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("billing no longer subscribes to Sales.IOrderEvent"),
        "{out}"
    );
    let (_, out, _) = throttlehost(&[
        "queues",
        "unsubscribe",
        "-c",
        p,
        "billing",
        "Sales.IOrderEvent",
    ]);
    assert!(out.contains("did not subscribe"), "{out}");

    // A bad type is named; --publish with --queue is refused by the parser.
    let (code, _, err) = throttlehost(&["send", "-c", p, "--publish", "Sales.\u{7}X"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--publish: event type"), "{err}");
    let (code, _, _) = throttlehost(&["send", "-c", p, "--publish", types, "--queue", "orders"]);
    assert_ne!(code, 0);
}
