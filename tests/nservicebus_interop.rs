//! An NServiceBus endpoint and this host on one database: the delayed tables, the addresses
//! and the headers each writes, read by the other. The statements marked "as NServiceBus"
//! are written here from the NServiceBus SQL transports' SQL texts (9.1 line) and run
//! against the tables the host made, so a change of name or form on the host's side fails
//! here. PostgreSQL runs in the suite; SQL Server behind SQLSERVER_URL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{PgBacklog, PgSchema, Probe, q, wait_until};
use throttlehost::config::{ConcurrencyModel, TransactionMode};
use throttlehost::message::{
    CONVERSATION_ID_HEADER, CORRELATION_ID_HEADER, FORWARD_DESTINATION_HEADER, MESSAGE_ID_HEADER,
    MESSAGE_INTENT_HEADER, ORIGINATING_ENDPOINT_HEADER, RELATED_TO_HEADER, REPLY_TO_ADDRESS_HEADER,
};
use throttlehost::transport::{Payload, QueueAdmin, Transport, TransportError};
use throttlehost::{Context, Handler, HandlerError, OutgoingMessage};

/// Receives one message from `queue`, waiting up to 10 s; commits it.
async fn receive_one(t: &dyn Transport, queue: &str) -> throttlehost::Message {
    for _ in 0..200 {
        if let Some(r) = t.receive(&q(queue)).await.unwrap() {
            let Payload::Message(m) = r.payload().clone() else {
                panic!("a message")
            };
            r.commit().await.unwrap();
            return m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing arrived on {queue}");
}

// ---- PostgreSQL ---------------------------------------------------------------------------

/// The delayed table this host made before it followed NServiceBus's name,
/// `"<queue>.delayed"`, is adopted once at start: renamed when the new table is missing, its
/// rows moved over (none lost, a taken id renewed) when both exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_lowercase_delayed_table_is_adopted_with_its_rows() {
    let schema = PgSchema::new();
    let t = schema.transport(TransactionMode::ReceiveOnly, 4).await;
    let c = schema.client().await;
    let s = &schema.name;
    let old_ddl = |queue: &str| {
        format!(
            "CREATE SCHEMA IF NOT EXISTS \"{s}\";
             CREATE TABLE \"{s}\".\"{queue}.delayed\" (Id uuid NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
               Headers text NOT NULL, Body bytea, Due timestamptz NOT NULL);
             CREATE INDEX \"{queue}.delayed_Due\" ON \"{s}\".\"{queue}.delayed\" (Due);
             INSERT INTO \"{s}\".\"{queue}.delayed\" (Id, Headers, Body, Due) VALUES
               ('00000000-0000-0000-0000-000000000001', '{{}}', 'a', now() + interval '1 hour'),
               ('00000000-0000-0000-0000-000000000002', '{{}}', 'b', now() + interval '1 hour');"
        )
    };
    let count = |table: String| {
        let c = &c;
        async move {
            c.query_one(&format!("SELECT count(*) FROM {table}"), &[])
                .await
                .map(|r| r.get::<_, i64>(0))
        }
    };
    let exists = |table: String| {
        let c = &c;
        async move {
            c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    let d = t.delayed_delivery().unwrap();

    // Only the old table: renamed.
    c.batch_execute(&old_ddl("renamed")).await.unwrap();
    d.create_delayed(&q("renamed")).await.unwrap();
    assert_eq!(
        count(format!("\"{s}\".\"renamed.Delayed\"")).await.unwrap(),
        2
    );
    assert!(!exists(format!("\"{s}\".\"renamed.delayed\"")).await);
    assert!(exists(format!("\"{s}\".\"renamed.Delayed_Due\"")).await);

    // Both tables (an NServiceBus endpoint made the new one): rows moved, one id renewed.
    c.batch_execute(&old_ddl("merged")).await.unwrap();
    c.batch_execute(&format!(
        "CREATE TABLE \"{s}\".\"merged.Delayed\" (Id uuid NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
           Headers text NOT NULL, Body bytea, Due timestamptz NOT NULL);
         INSERT INTO \"{s}\".\"merged.Delayed\" (Id, Headers, Body, Due)
           VALUES ('00000000-0000-0000-0000-000000000001', '{{}}', 'theirs', now() + interval '1 hour');"
    ))
    .await
    .unwrap();
    d.create_delayed(&q("merged")).await.unwrap();
    assert_eq!(
        count(format!("\"{s}\".\"merged.Delayed\"")).await.unwrap(),
        3
    );
    assert!(!exists(format!("\"{s}\".\"merged.delayed\"")).await);
    // Again: nothing left to adopt, nothing changes.
    d.create_delayed(&q("merged")).await.unwrap();
    assert_eq!(d.delayed_count(&q("merged")).await.unwrap(), 3);
}

/// A message an NServiceBus endpoint delayed for the host's queue (stored in
/// `"<queue>.Delayed"` with its forward destination, as NServiceBus stores it) is moved by the
/// host's mover and handled here, not sent on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_an_endpoint_delayed_is_moved_and_handled_here() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    let probe = Probe::new(Duration::ZERO);
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.queues[0].delayed_delivery.batch_size = 10;
    let host = backlog.host(config, &probe).await;
    let s = &backlog.schema.name;
    let headers = format!(
        r#"{{"NServiceBus.MessageId":"nsb-1","{FORWARD_DESTINATION_HEADER}":"\"{s}\".\"orders\""}}"#
    );
    // As NServiceBus's StoreDelayedMessageText: Headers, Body, Due from the server's clock.
    backlog
        .schema
        .client()
        .await
        .execute(
            &format!(
                "INSERT INTO \"{s}\".\"orders.Delayed\" (Headers, Body, Due) \
                 SELECT $1, $2, timestamptz (now() AT TIME ZONE 'UTC') + interval '100 ms'"
            ),
            &[&headers, &b"from nsb".to_vec()],
        )
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(15),
        "the delayed message handled",
        || probe.handled() == 1,
    )
    .await;
    assert_eq!(probe.ids.lock().unwrap()[0], "nsb-1");
    host.shutdown().await;
    assert_eq!(
        backlog.transport.peek_depth(&q("error")).await.unwrap_or(0),
        0
    );
}

/// A message the host delays is stored where NServiceBus's mover takes it from, and arrives
/// with a forward destination equal to NServiceBus's canonical address of the queue
/// (`"schema"."table"`), so an endpoint on that queue handles it instead of sending it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_host_delays_is_moved_by_an_endpoint_and_handled_there() {
    let schema = PgSchema::new();
    let t = schema.transport(TransactionMode::ReceiveOnly, 4).await;
    t.create_queue(&q("Sales")).await.unwrap();
    t.delayed_delivery()
        .unwrap()
        .create_delayed(&q("Sales"))
        .await
        .unwrap();
    t.send(
        &q("Sales"),
        &OutgoingMessage::new("later").with_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    let s = &schema.name;
    // As NServiceBus's move of due messages: delete the due rows, insert them into the queue.
    // Due "now" by the server's clock, so it is due once that clock has moved on: the move
    // runs until it takes it.
    let move_due = format!(
        "WITH message AS (DELETE FROM \"{s}\".\"Sales.Delayed\" WHERE Id IN \
         (SELECT Id FROM \"{s}\".\"Sales.Delayed\" WHERE Due < now() AT TIME ZONE 'UTC' LIMIT 100) \
         RETURNING Id, Headers, Body) \
         INSERT INTO \"{s}\".\"Sales\" (Id, Expires, Headers, Body) SELECT Id, NULL, Headers, Body FROM message"
    );
    let client = schema.client().await;
    let mut moved = 0;
    for _ in 0..500 {
        moved = client.execute(&move_due, &[]).await.unwrap();
        if moved > 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(moved, 1);
    let m = receive_one(&t, "Sales").await;
    let canonical = format!("\"{s}\".\"Sales\"");
    assert_eq!(
        m.header(FORWARD_DESTINATION_HEADER),
        Some(canonical.as_str())
    );
    assert_eq!(t.address(&q("Sales")), canonical);
}

/// With `create_queues = false` a missing delayed table stops the start, naming the table and
/// the command that creates it; after `create_delayed` (what `queues create` runs) it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_may_not_create_tables_refuses_to_start_without_its_delayed_table() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    backlog
        .transport
        .admin()
        .create_queue(&q("error"))
        .await
        .unwrap();
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.host.create_queues = false;
    let start = throttlehost::HostBuilder::new(config.clone())
        .transport(backlog.transport.clone())
        .handler("orders", common::ProbeHandler(Probe::new(Duration::ZERO)))
        .start()
        .await;
    let Err(e) = start else {
        panic!("started without its delayed table")
    };
    let text = e.to_string();
    assert!(
        text.contains(&format!("\"{}\".\"orders.Delayed\"", backlog.schema.name)),
        "{text}"
    );
    assert!(text.contains("throttlehost queues create"), "{text}");
    backlog
        .transport
        .delayed_delivery()
        .unwrap()
        .create_delayed(&q("orders"))
        .await
        .unwrap();
    let probe = Probe::new(Duration::ZERO);
    let host = backlog.host(config, &probe).await;
    host.shutdown().await;
}

/// Sends a reply-like message to `invoices` for each message handled.
struct Invoicing;

#[async_trait]
impl Handler for Invoicing {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        ctx.send("invoices", OutgoingMessage::new("invoice"))
            .await?;
        Ok(())
    }
}

/// A handler's send joins the conversation of the message it handles, as NServiceBus's
/// outgoing pipeline writes it, so ServicePulse draws both in one conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_send_carries_the_conversation_headers() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    backlog
        .transport
        .admin()
        .create_queue(&q("invoices"))
        .await
        .unwrap();
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.host.name = "Billing".into();
    let host = backlog.host_with(config, Invoicing).await;
    let order = OutgoingMessage::new("order")
        .with_header(MESSAGE_ID_HEADER, "order-1")
        .with_header(CONVERSATION_ID_HEADER, "conversation-9");
    backlog.transport.send(&q("orders"), &order).await.unwrap();
    let m = receive_one(backlog.transport.as_ref(), "invoices").await;
    host.shutdown().await;
    let reply_to = format!("\"{}\".\"orders\"", backlog.schema.name);
    for (header, expected) in [
        (CONVERSATION_ID_HEADER, "conversation-9"),
        (RELATED_TO_HEADER, "order-1"),
        (CORRELATION_ID_HEADER, "order-1"),
        (REPLY_TO_ADDRESS_HEADER, reply_to.as_str()),
        (ORIGINATING_ENDPOINT_HEADER, "Billing"),
        (MESSAGE_INTENT_HEADER, "Send"),
    ] {
        assert_eq!(m.header(header), Some(expected), "{header}");
    }
    assert_ne!(m.logical_id(), "order-1");
}

/// A message sent through the host's API starts a conversation of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_send_starts_a_conversation() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    backlog
        .transport
        .admin()
        .create_queue(&q("other"))
        .await
        .unwrap();
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.host.name = "Shop".into();
    let host = backlog.host(config, &Probe::new(Duration::ZERO)).await;
    host.send("other", OutgoingMessage::new("x")).await.unwrap();
    let m = receive_one(backlog.transport.as_ref(), "other").await;
    host.shutdown().await;
    assert_eq!(m.header(MESSAGE_INTENT_HEADER), Some("Send"));
    assert_eq!(m.header(ORIGINATING_ENDPOINT_HEADER), Some("Shop"));
    assert_eq!(
        m.header(CORRELATION_ID_HEADER),
        Some(m.logical_id().as_str())
    );
    assert!(m.header(CONVERSATION_ID_HEADER).is_some());
    assert_eq!(m.header(RELATED_TO_HEADER), None);
}

/// Sends each message on to a queue named by its address.
struct SendTo(String);

#[async_trait]
impl Handler for SendTo {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        if ctx.body() == b"fail" {
            return Err("told to fail".into());
        }
        ctx.send(&self.0, OutgoingMessage::new("sent on")).await?;
        Ok(())
    }
}

/// The error queue and a handler's sends may name another schema, as NServiceBus addresses
/// it (`"schema"."table"`); the host creates the error queue there and writes FailedQ as the
/// failed queue's own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_error_queue_and_sends_may_be_in_another_schema() {
    let backlog = PgBacklog::new("orders", 0, 16).await;
    let other = PgSchema::new();
    let (errors, invoices) = (
        format!("\"{}\".\"errors\"", other.name),
        format!("\"{}\".\"invoices\"", other.name),
    );
    backlog
        .transport
        .admin()
        .create_queue(&q(&invoices))
        .await
        .unwrap();
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.queues[0].error_queue = errors.clone();
    config.queues[0].immediate_retries = 0;
    let host = backlog.host_with(config, SendTo(invoices.clone())).await;
    for body in ["ok", "fail"] {
        backlog
            .transport
            .send(&q("orders"), &OutgoingMessage::new(body))
            .await
            .unwrap();
    }
    let sent = receive_one(backlog.transport.as_ref(), &invoices).await;
    let failed = receive_one(backlog.transport.as_ref(), &errors).await;
    host.shutdown().await;
    assert_eq!(sent.body, b"sent on");
    assert_eq!(failed.body, b"fail");
    assert_eq!(
        failed.header("NServiceBus.FailedQ"),
        Some(format!("\"{}\".\"orders\"", backlog.schema.name).as_str())
    );
    let c = other.client().await;
    let tables: i64 = c
        .query_one(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1",
            &[&other.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 2, "errors and invoices, in the other schema");
}

/// Publish/subscribe with NServiceBus endpoints on PostgreSQL: a row an endpoint wrote with
/// NServiceBus's subscribe statement routes the host's events to it, and the host's own
/// subscription is found by NServiceBus's subscribers query, at the address NServiceBus
/// sends to, in the table NServiceBus creates (`"schema"."SubscriptionRouting"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_cross_between_an_endpoint_and_the_host_through_the_subscription_table() {
    let backlog = PgBacklog::new("Billing", 0, 16).await;
    let probe = Probe::new(Duration::ZERO);
    let mut config = backlog.config(ConcurrencyModel::Monitor, 2);
    config.queues[0].subscribe = vec!["Sales.OrderAccepted".into()];
    let host = backlog.host(config, &probe).await;
    let s = &backlog.schema.name;
    let table = format!("\"{s}\".\"SubscriptionRouting\"");
    let client = backlog.schema.client().await;
    // As NServiceBus's GetSubscribersText, for the event and its interface.
    let found: Vec<String> = client
        .query(
            &format!("SELECT DISTINCT QueueAddress FROM {table} WHERE Topic IN ($1, $2)"),
            &[&"Sales.OrderAccepted", &"Sales.IOrderEvent"],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(found, [format!("\"{s}\".\"Billing\"")]);
    // As NServiceBus's SubscribeText: an endpoint subscribes to the event's interface.
    backlog
        .transport
        .admin()
        .create_queue(&q("Shipping"))
        .await
        .unwrap();
    client
        .execute(
            &format!(
                "INSERT INTO {table} (QueueAddress, Topic, Endpoint) VALUES ($1, $2, $3) \
                 ON CONFLICT (Endpoint, Topic) DO UPDATE SET QueueAddress = $1"
            ),
            &[
                &format!("\"{s}\".\"Shipping\""),
                &"Sales.IOrderEvent",
                &"Shipping",
            ],
        )
        .await
        .unwrap();
    let types = throttlehost::EventTypes::parse(
        "Sales.OrderAccepted, Sales.Messages;Sales.IOrderEvent, Sales.Messages",
    )
    .unwrap();
    let published = host
        .publish(&types, OutgoingMessage::new("accepted"))
        .await
        .unwrap();
    assert_eq!(
        published.subscribers.len(),
        2,
        "{:?}",
        published.subscribers
    );
    wait_until(Duration::from_secs(15), "the host's copy handled", || {
        probe.handled() == 1
    })
    .await;
    let m = receive_one(backlog.transport.as_ref(), "Shipping").await;
    assert_eq!(m.header(MESSAGE_INTENT_HEADER), Some("Publish"));
    assert_eq!(
        m.header("NServiceBus.EnclosedMessageTypes"),
        Some("Sales.OrderAccepted, Sales.Messages;Sales.IOrderEvent, Sales.Messages")
    );
    host.shutdown().await;
}

// ---- SQL Server ---------------------------------------------------------------------------

/// The catalog the tests' connection string names (`Database=`), as NServiceBus reads it.
fn catalog() -> String {
    common::mssql::url()
        .split(';')
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| {
            let k = k.trim().to_ascii_lowercase();
            k == "database" || k == "initial catalog"
        })
        .map(|(_, v)| v.trim().to_string())
        .expect("SQLSERVER_URL names its database (NServiceBus requires it too)")
}

/// SQL Server: the address is `table@[schema]@[catalog]`; a message an endpoint delayed in
/// `[<queue>.Delayed]` (stored as NServiceBus stores it) is moved by the host, and its
/// forward destination resolves to the queue; what the host delays carries the full address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_delayed_tables_and_addresses_are_nservicebus_s() {
    let schema = common::mssql::Schema::new();
    let t = schema.transport(TransactionMode::ReceiveOnly, 4).await;
    t.admin().create_queue(&q("Sales")).await.unwrap();
    let d = t.delayed_delivery().unwrap();
    d.create_delayed(&q("Sales")).await.unwrap();
    let address = format!("Sales@[{}]@[{}]", schema.name, catalog());
    assert_eq!(t.address(&q("Sales")), address);
    assert_eq!(d.delayed_table(&q("Sales")), schema.table("Sales.Delayed"));
    assert_eq!(t.resolve_address(&address), Some(q("Sales")));

    // As NServiceBus's StoreDelayedMessageText, due a second ago.
    let headers = format!(
        r#"{{"NServiceBus.MessageId":"nsb-2","{FORWARD_DESTINATION_HEADER}":"{address}"}}"#
    );
    let mut c = common::mssql::client().await;
    c.execute(
        format!(
            "INSERT INTO {} (Headers, Body, Due) VALUES (@P1, @P2, DATEADD(ms, -1000, GETUTCDATE()))",
            schema.table("Sales.Delayed")
        ),
        &[&headers.as_str(), &b"from nsb".as_slice()],
    )
    .await
    .unwrap();
    let moved = d.move_due(&q("Sales"), 10).await.unwrap();
    assert_eq!(moved.moved, 1);
    let m = receive_one(t.as_ref(), "Sales").await;
    assert_eq!(m.logical_id(), "nsb-2");
    assert_eq!(
        t.resolve_address(m.header(FORWARD_DESTINATION_HEADER).unwrap()),
        Some(q("Sales"))
    );

    t.send(
        &q("Sales"),
        &OutgoingMessage::new("later").with_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    // Due "now" by the server's clock: moved once that clock has moved on.
    for _ in 0..50 {
        if d.move_due(&q("Sales"), 10).await.unwrap().moved > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let m = receive_one(t.as_ref(), "Sales").await;
    assert_eq!(
        m.header(FORWARD_DESTINATION_HEADER),
        Some(address.as_str()),
        "with the catalog, as NServiceBus compares it with its own address"
    );
    let missing = d.delayed_count(&q("Nobody")).await.unwrap_err();
    assert!(
        matches!(missing, TransportError::DelayedTableNotFound { .. }),
        "{missing}"
    );
}

/// SQL Server: a failed message's `NServiceBus.FailedQ` is the queue's full address, so a
/// ServicePulse retry lands in this schema's table; the error queue may be in another schema
/// (`errors@[schema]@[catalog]`), created there by the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_failed_q_is_the_transport_address() {
    let schema = common::mssql::Schema::new();
    let other = common::mssql::Schema::new();
    let errors = format!("errors@[{}]@[{}]", other.name, catalog());
    let t: Arc<dyn Transport> = schema.transport(TransactionMode::ReceiveOnly, 8).await;
    let mut config = common::host_config(
        schema.transport_config(TransactionMode::ReceiveOnly, 8),
        "orders",
        ConcurrencyModel::Monitor,
        1,
    );
    config.queues[0].immediate_retries = 0;
    config.queues[0].error_queue = errors.clone();
    let host = throttlehost::HostBuilder::new(config)
        .transport(t.clone())
        .handler("orders", common::ProbeHandler(Probe::failing()))
        .start()
        .await
        .unwrap();
    host.send("orders", OutgoingMessage::new("bad"))
        .await
        .unwrap();
    let m = receive_one(t.as_ref(), &errors).await;
    host.shutdown().await;
    let elsewhere = t
        .admin()
        .create_queue(&q(&format!("x@[{}]@[NoSuchCatalog]", other.name)))
        .await
        .unwrap_err();
    assert!(
        elsewhere.to_string().contains("NoSuchCatalog"),
        "tables are created in the host's own database only: {elsewhere}"
    );
    assert_eq!(
        m.header("NServiceBus.FailedQ"),
        Some(format!("orders@[{}]@[{}]", schema.name, catalog()).as_str())
    );
}

/// SQL Server: the host's subscription is a row NServiceBus's subscribers query finds at the
/// queue's full address, and a row written with NServiceBus's MERGE routes the host's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs SQLSERVER_URL"]
async fn sqlserver_subscriptions_are_nservicebus_s() {
    let schema = common::mssql::Schema::new();
    let t = schema.transport(TransactionMode::ReceiveOnly, 4).await;
    for name in ["Billing", "Shipping"] {
        t.admin().create_queue(&q(name)).await.unwrap();
    }
    let subscriptions = t.subscriptions().unwrap();
    subscriptions.create_subscription_table().await.unwrap();
    let billing = t.address(&q("Billing"));
    subscriptions
        .subscribe("Billing", "Sales.OrderAccepted", &billing)
        .await
        .unwrap();
    let table = schema.table("SubscriptionRouting");
    let mut c = common::mssql::client().await;
    // As NServiceBus's GetSubscribersText.
    let found: Vec<String> = c
        .query(
            format!("SELECT DISTINCT QueueAddress FROM {table} WHERE Topic IN (@P1, @P2)"),
            &[&"Sales.OrderAccepted", &"Sales.IOrderEvent"],
        )
        .await
        .unwrap()
        .into_first_result()
        .await
        .unwrap()
        .iter()
        .filter_map(|r| r.get::<&str, _>(0).map(str::to_string))
        .collect();
    assert_eq!(
        found,
        [format!("Billing@[{}]@[{}]", schema.name, catalog())]
    );
    // An endpoint subscribes as NServiceBus does (its upsert; Babelfish takes no MERGE, so
    // there the row goes in as the MERGE would insert it).
    let shipping = format!("Shipping@[{}]@[{}]", schema.name, catalog());
    let subscribe = match common::mssql::dialect() {
        throttlehost::config::Dialect::Sqlserver => format!(
            "MERGE {table} WITH (HOLDLOCK, TABLOCK) AS target \
             USING (SELECT @P3 AS Endpoint, @P1 AS QueueAddress, @P2 AS Topic) AS source \
             ON target.Endpoint = source.Endpoint AND target.Topic = source.Topic \
             WHEN MATCHED AND target.QueueAddress <> source.QueueAddress THEN UPDATE SET QueueAddress = @P1 \
             WHEN NOT MATCHED THEN INSERT (QueueAddress, Topic, Endpoint) VALUES (@P1, @P2, @P3);"
        ),
        _ => format!("INSERT INTO {table} (QueueAddress, Topic, Endpoint) VALUES (@P1, @P2, @P3)"),
    };
    c.execute(
        subscribe,
        &[&shipping.as_str(), &"Sales.IOrderEvent", &"Shipping"],
    )
    .await
    .unwrap();
    let mut addresses = subscriptions
        .subscribers(&["Sales.OrderAccepted".into(), "Sales.IOrderEvent".into()])
        .await
        .unwrap();
    addresses.sort();
    assert_eq!(addresses, [billing.clone(), shipping.clone()]);
    let copies: Vec<_> = addresses
        .iter()
        .map(|a| {
            (
                t.resolve_address(a).unwrap(),
                OutgoingMessage::new("accepted"),
            )
        })
        .collect();
    subscriptions.deliver(&copies).await.unwrap();
    for name in ["Billing", "Shipping"] {
        assert_eq!(receive_one(t.as_ref(), name).await.body, b"accepted");
    }
}
