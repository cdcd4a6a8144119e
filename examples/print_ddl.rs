//! Prints the queue DDL the transports run (used to refresh `sql/`):
//! `cargo run --example print_ddl -- sqlserver dbo Sales`.
use throttlehost::config::{DEFAULT_DELAYED_TABLE_SUFFIX, Dialect};
use throttlehost::transport::QueueName;
use throttlehost::transport::{postgres, sqlserver};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (kind, schema, queue) = match args.as_slice() {
        [k, s, q] => (k.as_str(), s.as_str(), q.as_str()),
        _ => {
            eprintln!(
                "usage: print_ddl sqlserver|sqlserver-delayed|postgres|postgres-delayed|postgres-notify SCHEMA QUEUE"
            );
            std::process::exit(2);
        }
    };
    let queue = QueueName::new(queue).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let suffix = DEFAULT_DELAYED_TABLE_SUFFIX;
    let sqlserver = || sqlserver::QueueStatements::new(schema, &queue, Dialect::Sqlserver, suffix);
    let postgres = || postgres::QueueStatements::new(schema, &queue, suffix);
    match kind {
        "sqlserver" => println!("{}", sqlserver().create),
        "sqlserver-delayed" => println!("{}", sqlserver().delayed.create),
        "postgres" => println!("{};", postgres().create),
        "postgres-delayed" => println!("{};", postgres().delayed.create()),
        "postgres-notify" => println!("{};", postgres().notify_on_insert()),
        other => {
            eprintln!("unknown kind {other}");
            std::process::exit(2);
        }
    }
}
