//! Prints the queue DDL the transports run (used to refresh `sql/`):
//! `cargo run --example print_ddl -- sqlserver dbo Sales`.
use throttlehost::config::Dialect;
use throttlehost::transport::QueueName;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (kind, schema, queue) = match args.as_slice() {
        [k, s, q] => (k.as_str(), s.as_str(), q.as_str()),
        _ => {
            eprintln!("usage: print_ddl sqlserver|postgres|postgres-notify SCHEMA QUEUE");
            std::process::exit(2);
        }
    };
    let queue = QueueName::new(queue).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    match kind {
        "sqlserver" => println!(
            "{}",
            throttlehost::transport::sqlserver::QueueStatements::new(
                schema,
                &queue,
                Dialect::Sqlserver
            )
            .create
        ),
        "postgres" => println!(
            "{};",
            throttlehost::transport::postgres::QueueStatements::new(schema, &queue).create
        ),
        "postgres-notify" => println!(
            "{};",
            throttlehost::transport::postgres::QueueStatements::new(schema, &queue)
                .notify_on_insert
        ),
        other => {
            eprintln!("unknown kind {other}");
            std::process::exit(2);
        }
    }
}
