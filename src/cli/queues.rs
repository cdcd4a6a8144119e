//! `throttlehost queues create|list|depth|purge`.

use std::path::Path;
use std::process::ExitCode;

use throttlehost::config::{Config, TransportKind};
use throttlehost::transport::{self, QueueName, Transport};

/// What to do.
pub enum Action {
    /// Create these queues, or all configured ones.
    Create(Vec<String>),
    /// List tables.
    List,
    /// Depth of these queues, or all configured ones.
    Depth(Vec<String>),
    /// Purge these queues.
    Purge {
        /// Queues.
        names: Vec<String>,
        /// Expired only.
        expired: bool,
        /// Everything.
        all: bool,
    },
}

/// Every queue a configuration implies: inputs, error queues, instance queues, forward targets.
fn configured_queues(config: &Config) -> Vec<String> {
    let instance = config.host.effective_instance_id();
    let mut names: Vec<String> = config
        .queues
        .iter()
        .flat_map(|q| q.tables(&instance))
        .map(|(_, name)| name)
        .collect();
    names.sort();
    names.dedup();
    names
}

fn parse_names(names: &[String]) -> Result<Vec<QueueName>, ExitCode> {
    names
        .iter()
        .map(|n| {
            QueueName::new(n).map_err(|e| {
                eprintln!("error: {e}");
                ExitCode::from(super::INVALID)
            })
        })
        .collect()
}

/// Runs a queues action.
pub async fn queues(path: &Path, action: Action) -> ExitCode {
    let config = match super::read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if config.transport.kind == TransportKind::Memory {
        eprintln!(
            "error: {} uses the memory transport, whose queues live inside a running host; point --config at a postgres or sqlserver configuration",
            path.display()
        );
        return ExitCode::from(super::INVALID);
    }
    let transport = match transport::connect(&config.transport).await {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let or_configured = |names: Vec<String>| {
        if names.is_empty() {
            configured_queues(&config)
        } else {
            names
        }
    };
    let result = match action {
        Action::Create(names) => create(&*transport, or_configured(names)).await,
        Action::List => match transport.list_queues().await {
            Ok(list) => {
                for q in list {
                    println!("{q}");
                }
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        },
        Action::Depth(names) => depth(&*transport, or_configured(names)).await,
        Action::Purge {
            names,
            expired,
            all,
        } => {
            if !expired && !all {
                eprintln!(
                    "error: say what to purge: --expired (expired messages) or --all (every message)"
                );
                return ExitCode::from(super::INVALID);
            }
            purge(&*transport, names, expired).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_empty() => ExitCode::from(super::INVALID),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

async fn create(transport: &dyn Transport, names: Vec<String>) -> Result<(), String> {
    if names.is_empty() {
        return Err("no queues named and none configured".into());
    }
    let names = parse_names(&names).map_err(|_| String::new())?;
    for q in &names {
        transport.create_queue(q).await.map_err(|e| e.to_string())?;
        println!("created {q} (or it existed)");
    }
    Ok(())
}

async fn depth(transport: &dyn Transport, names: Vec<String>) -> Result<(), String> {
    let names = parse_names(&names).map_err(|_| String::new())?;
    for q in &names {
        let d = transport.peek_depth(q).await.map_err(|e| e.to_string())?;
        println!("{q}\t{d}");
    }
    Ok(())
}

async fn purge(transport: &dyn Transport, names: Vec<String>, expired: bool) -> Result<(), String> {
    let names = parse_names(&names).map_err(|_| String::new())?;
    for q in &names {
        let n = if expired {
            transport.purge_expired(q).await
        } else {
            transport.purge(q).await
        }
        .map_err(|e| e.to_string())?;
        println!(
            "{q}: deleted {n} {}",
            if expired {
                "expired messages"
            } else {
                "messages"
            }
        );
    }
    Ok(())
}
