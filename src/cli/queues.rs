//! `throttlehost queues create|list|depth|purge|held|release|subscriptions|unsubscribe`.

use std::path::Path;
use std::process::ExitCode;

use throttlehost::config::{Config, TransportKind};
use throttlehost::transport::{self, KeyOrdering, QueueName, Transport};

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
    /// Held keys of these queues, or of all configured ones.
    Held(Vec<String>),
    /// List the subscription table's rows: topic, endpoint, queue address.
    Subscriptions,
    /// Remove an endpoint's subscription to a topic.
    Unsubscribe {
        /// The subscribing endpoint (a host queue subscribes under its table name).
        endpoint: String,
        /// The topic.
        topic: String,
    },
    /// Lift the holds of one queue: of one key, or all.
    Release {
        /// The queue.
        name: String,
        /// The key.
        key: Option<String>,
        /// Every key.
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
    let result = run_action(&config, &*transport, action).await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_empty() => ExitCode::from(super::INVALID),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs `action` on the transport's tables. Err("") when the command line was wrong (said
/// already), else why it failed.
async fn run_action(
    config: &Config,
    transport: &dyn Transport,
    action: Action,
) -> Result<(), String> {
    let or_configured = |names: Vec<String>| {
        if names.is_empty() {
            configured_queues(config)
        } else {
            names
        }
    };
    match action {
        Action::Create(names) => {
            let delayed = delayed_queues(config);
            create(transport, or_configured(names), &delayed).await
        }
        Action::List => match transport.admin().list_queues().await {
            Ok(list) => {
                for q in list {
                    println!("{q}");
                }
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        },
        Action::Depth(names) => depth(transport, or_configured(names)).await,
        Action::Purge {
            names,
            expired,
            all,
        } => {
            if !expired && !all {
                eprintln!(
                    "error: say what to purge: --expired (expired messages) or --all (every message)"
                );
                return Err(String::new());
            }
            purge(transport, names, expired).await
        }
        Action::Held(names) => held(transport, or_configured(names)).await,
        Action::Subscriptions => super::subscriptions::list(transport).await,
        Action::Unsubscribe { endpoint, topic } => {
            super::subscriptions::unsubscribe(transport, &endpoint, &topic).await
        }
        Action::Release { name, key, all } => {
            if key.is_none() && !all {
                eprintln!(
                    "error: say what to release: --key KEY (one key) or --all (every held key)"
                );
                return Err(String::new());
            }
            release(transport, &name, key.as_deref()).await
        }
    }
}

/// The transport's key order, or why there is none.
fn key_ordering(transport: &dyn Transport) -> Result<&dyn KeyOrdering, String> {
    transport.key_ordering().ok_or_else(|| {
        format!(
            "the {} transport keeps no key order, so it holds no keys",
            transport.describe()
        )
    })
}

/// Prints each held key: queue, key, message id, since when, why.
async fn held(transport: &dyn Transport, names: Vec<String>) -> Result<(), String> {
    let queues = parse_names(&names).map_err(|_| String::new())?;
    let ordering = key_ordering(transport)?;
    for queue in queues {
        let held = ordering
            .held_keys(&queue)
            .await
            .map_err(|e| e.to_string())?;
        for h in held {
            println!(
                "{queue}\t{}\t{}\t{}\t{}",
                h.key, h.message_id, h.held_at, h.reason
            );
        }
    }
    Ok(())
}

/// Lifts the holds of `name` (of `key`, or all) and says how many.
async fn release(transport: &dyn Transport, name: &str, key: Option<&str>) -> Result<(), String> {
    let queue = parse_names(&[name.to_string()]).map_err(|_| String::new())?;
    let released = key_ordering(transport)?
        .release_held(&queue[0], key)
        .await
        .map_err(|e| e.to_string())?;
    match key {
        Some(key) if released == 0 => println!("{name}: key `{key}` was not held"),
        _ => println!("{name}: released {released} held key(s)"),
    }
    Ok(())
}

/// The configured input queues with delayed delivery on: each has a delayed table beside it.
fn delayed_queues(config: &Config) -> Vec<String> {
    config
        .queues
        .iter()
        .filter(|q| q.delayed_delivery.enabled)
        .map(|q| q.name.clone())
        .collect()
}

/// Creates the queues `names`, and the delayed table of each that `delayed` lists (the
/// host's start makes the same tables, and refuses to start without them when it may not).
async fn create(
    transport: &dyn Transport,
    names: Vec<String>,
    delayed: &[String],
) -> Result<(), String> {
    if names.is_empty() {
        return Err("no queues named and none configured".into());
    }
    let names = parse_names(&names).map_err(|_| String::new())?;
    for q in &names {
        transport
            .admin()
            .create_queue(q)
            .await
            .map_err(|e| e.to_string())?;
        println!("created {q} (or it existed)");
        if let Some(d) = transport.delayed_delivery()
            && delayed.iter().any(|name| name == q.as_str())
        {
            d.create_delayed(q).await.map_err(|e| e.to_string())?;
            println!("created {} (or it existed)", d.delayed_table(q));
        }
    }
    // The subscription table, as NServiceBus's installers create it with the queues.
    if let Some(s) = transport.subscriptions() {
        s.create_subscription_table()
            .await
            .map_err(|e| e.to_string())?;
        println!("created {} (or it existed)", s.subscription_table());
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
            transport.admin().purge_expired(q).await
        } else {
            transport.admin().purge(q).await
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
