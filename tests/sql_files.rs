//! The DDL shipped in `sql/` is the DDL the transports run, statement for statement.

use throttlehost::config::Dialect;
use throttlehost::transport::QueueName;

fn normalize(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn sqlserver_queue_sql_is_what_create_queue_runs() {
    let file = std::fs::read_to_string("sql/sqlserver/queue.sql").unwrap();
    let code = throttlehost::transport::sqlserver::QueueStatements::new(
        "dbo",
        &QueueName::new("Sales").unwrap(),
        Dialect::Sqlserver,
        "Delayed",
    )
    .create;
    assert_eq!(normalize(&file), normalize(&code));
}

#[test]
fn postgres_queue_sql_is_what_create_queue_runs() {
    let file = std::fs::read_to_string("sql/postgres/queue.sql").unwrap();
    let code = throttlehost::transport::postgres::QueueStatements::new(
        "public",
        &QueueName::new("Sales").unwrap(),
        "Delayed",
    )
    .create;
    assert_eq!(
        normalize(&file),
        normalize(&format!("CREATE SCHEMA IF NOT EXISTS \"public\";\n{code};"))
    );
}

#[test]
fn postgres_delayed_sql_is_what_create_delayed_runs() {
    let file = std::fs::read_to_string("sql/postgres/delayed.sql").unwrap();
    let code = throttlehost::transport::postgres::QueueStatements::new(
        "public",
        &QueueName::new("Sales").unwrap(),
        "Delayed",
    )
    .delayed
    .create();
    assert!(code.contains("\"public\".\"Sales.Delayed\""), "{code}");
    assert!(code.contains("\"Sales.Delayed_Due\""), "{code}");
    assert_eq!(
        normalize(&file),
        normalize(&format!("CREATE SCHEMA IF NOT EXISTS \"public\";\n{code};"))
    );
}

#[test]
fn sqlserver_delayed_sql_is_what_create_delayed_runs() {
    let file = std::fs::read_to_string("sql/sqlserver/delayed.sql").unwrap();
    let code = throttlehost::transport::sqlserver::QueueStatements::new(
        "dbo",
        &QueueName::new("Sales").unwrap(),
        Dialect::Sqlserver,
        "Delayed",
    )
    .delayed
    .create;
    assert!(code.contains("[dbo].[Sales.Delayed]"), "{code}");
    assert_eq!(normalize(&file), normalize(&code));
}

#[test]
fn postgres_ordering_sql_is_what_an_ordered_queue_creates() {
    let file = std::fs::read_to_string("sql/postgres/ordering.sql").unwrap();
    let ordering = throttlehost::config::OrderingConfig {
        key_header: "NServiceBus.ConversationId".into(),
        stages: true,
        ..Default::default()
    };
    let code = throttlehost::transport::postgres::QueueStatements::new(
        "public",
        &QueueName::new("Sales").unwrap(),
        "Delayed",
    )
    .with_ordering(&ordering)
    .ordering_indexes
    .iter()
    .map(|index| index.create.clone())
    .collect::<Vec<_>>()
    .join(";\n");
    assert_eq!(normalize(&file), normalize(&format!("{code};")));
}

#[test]
fn held_keys_sql_is_what_a_holding_queue_creates() {
    let file = std::fs::read_to_string("sql/postgres/held.sql").unwrap();
    let code = throttlehost::transport::postgres::held_statements("\"public\"").create;
    assert_eq!(normalize(&file), normalize(&format!("{code};")));
    let file = std::fs::read_to_string("sql/sqlserver/held.sql").unwrap();
    let code = throttlehost::transport::sqlserver::held_statements("[dbo]").create;
    assert_eq!(normalize(&file), normalize(&code));
}

#[test]
fn postgres_notify_sql_is_what_create_queue_runs() {
    let file = std::fs::read_to_string("sql/postgres/notify.sql").unwrap();
    let code = throttlehost::transport::postgres::QueueStatements::new(
        "public",
        &QueueName::new("Sales").unwrap(),
        "Delayed",
    )
    .notify_on_insert();
    assert_eq!(normalize(&file), normalize(&format!("{code};")));
}

#[test]
fn postgres_instances_sql_is_what_the_registry_creates() {
    let file = std::fs::read_to_string("sql/postgres/instances.sql").unwrap();
    let code = throttlehost::transport::postgres::fleet::registry_statements("public").create;
    assert_eq!(normalize(&file), normalize(&code));
}

#[test]
fn sqlserver_instances_sql_is_what_the_registry_creates() {
    let file = std::fs::read_to_string("sql/sqlserver/instances.sql").unwrap();
    let code = throttlehost::transport::sqlserver::fleet::registry_statements("dbo").create;
    assert_eq!(normalize(&file), normalize(&code));
}

#[test]
fn shares_sql_is_what_a_fleet_wide_limit_creates() {
    let file = std::fs::read_to_string("sql/postgres/shares.sql").unwrap();
    let code = throttlehost::transport::postgres::fleet::share_statements("public").create;
    assert_eq!(normalize(&file), normalize(&code));
    let file = std::fs::read_to_string("sql/sqlserver/shares.sql").unwrap();
    let code = throttlehost::transport::sqlserver::fleet::share_statements("dbo").create;
    assert_eq!(normalize(&file), normalize(&code));
}
