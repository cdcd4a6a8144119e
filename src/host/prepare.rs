//! Preparing the database before receiving: queue and delayed tables created or checked, and the
//! transport's start-up checks.

use std::sync::Arc;

use crate::config::{ConcurrencyModel, Config, TransportKind};
use crate::receive::QueueRuntime;
use crate::transport::{QueueName, Transport, TransportError};

use super::HostError;
use super::plan::check_abilities;

/// What a failed step of preparing `queue` becomes: a database that is away, or a setting or
/// table layout the transport refused (its error names the queue and what to change), stays
/// a transport error, so the caller may wait for the database; anything else is a `Prepare`
/// error with what to do about it.
pub(super) fn preparing<'q>(
    queue: &'q QueueName,
    what: &'static str,
    remedy: &'static str,
) -> impl FnOnce(TransportError) -> HostError + 'q {
    move |e| match e {
        TransportError::Connection { .. } | TransportError::PoolTimeout { .. } => {
            HostError::Transport(e)
        }
        e if e.is_configuration() => HostError::Transport(e),
        e => HostError::Prepare {
            queue: queue.to_string(),
            what,
            source: e,
            remedy,
        },
    }
}

/// Creates the delayed table of every queue with delayed delivery on, or, when the host is
/// not to create tables, checks that each is there: a missing one would fail every delayed
/// retry and every move, so the start is refused naming the table and the command.
pub(super) async fn prepare_delayed_tables(
    config: &Config,
    transport: &dyn Transport,
) -> Result<(), HostError> {
    let Some(delayed) = transport.delayed_delivery() else {
        return Ok(());
    };
    let names: Vec<QueueName> = config
        .queues
        .iter()
        .filter(|q| q.delayed_delivery.enabled)
        .map(|q| QueueName::new(&q.name))
        .collect::<Result<_, _>>()?;
    // What stands already needs nothing; a failed look-up leaves every table to its own step.
    let in_place = delayed.delayed_in_place(&names).await.unwrap_or_default();
    let names = names
        .into_iter()
        .filter(|q| !in_place.contains(q))
        .collect();
    at_once(names, async |name| {
        if config.host.create_queues {
            delayed.create_delayed(&name).await.map_err(preparing(
                &name,
                "create its delayed table",
                "create it with a privileged account, or set queues.delayed_delivery.enabled = false",
            ))?;
        } else {
            // Whether it is there, not how full: a count would read a large table whole.
            let exists = delayed
                .delayed_table_exists(&name)
                .await
                .map_err(preparing(
                    &name,
                    "look for its delayed table",
                    "check the account's rights on the schema",
                ))?;
            if !exists {
                return Err(HostError::Transport(TransportError::DelayedTableNotFound {
                    queue: name.to_string(),
                    table: delayed.delayed_table(&name),
                }));
            }
        }
        Ok(())
    })
    .await
}

/// How many tables a start prepares at once: a thousand queues' round trips one after
/// another took seconds; the server runs a few side by side without a pool to itself.
const PREPARED_AT_ONCE: usize = 8;

/// Runs `prepare` for every queue, the first alone (it creates the schema, which creators
/// side by side would race for), the rest [`PREPARED_AT_ONCE`] at a time; the first error
/// stops the rest.
async fn at_once(
    mut queues: Vec<QueueName>,
    prepare: impl AsyncFn(QueueName) -> Result<(), HostError>,
) -> Result<(), HostError> {
    use futures_util::{StreamExt, TryStreamExt};
    if queues.is_empty() {
        return Ok(());
    }
    let rest = queues.split_off(1);
    prepare(queues.remove(0)).await?;
    futures_util::stream::iter(rest)
        .map(|queue| prepare(queue))
        .buffer_unordered(PREPARED_AT_ONCE)
        .try_collect::<()>()
        .await
}

/// Creates the queues (when configured), runs the transport's start-up checks, warns about
/// settings that cannot work well, and purges expired messages (when configured).
pub(super) async fn prepare_transport(
    config: &Config,
    transport: &dyn Transport,
    to_create: &[QueueName],
    queues: &[Arc<QueueRuntime>],
) -> Result<(), HostError> {
    let receive_names: Vec<QueueName> = queues.iter().map(|q| q.name().clone()).collect();
    check_abilities(config, transport)?;
    // Before anything is created: a start that is refused leaves no tables behind.
    let server_warnings = transport.admin().server_checks().await?;
    for warning in server_warnings {
        tracing::warn!("{warning}");
    }
    if config.host.create_queues {
        // Only the tables not there as creating leaves them (two catalog reads for all); a
        // failed look-up creates them all, as before.
        let in_place = transport
            .admin()
            .queues_in_place(to_create)
            .await
            .unwrap_or_default();
        let missing = to_create.iter().filter(|q| !in_place.contains(*q));
        at_once(missing.cloned().collect(), async |q| {
            transport.admin().create_queue(&q).await.map_err(preparing(
                &q,
                "create its table",
                "create the queues with a privileged account, then set host.create_queues = false",
            ))
        })
        .await?;
    }
    prepare_ordering(config, transport).await?;
    prepare_subscriptions(config, transport).await?;
    let warnings = transport.admin().startup_checks(&receive_names).await?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    prepare_delayed_tables(config, transport).await?;
    let total_concurrency: u64 = queues.iter().map(|q| q.settings().max as u64).sum();
    if total_concurrency + 1 > config.transport.pool_size as u64 {
        tracing::warn!(
            pool_size = config.transport.pool_size,
            total_concurrency,
            "transport.pool_size is below the queues' total max concurrency + 1: receives will wait for connections"
        );
    }
    if config.transport.kind == TransportKind::Memory {
        tracing::warn!(
            "memory transport: queues live inside this process and are lost when it exits"
        );
    }
    if config.transport.purge_expired_on_startup {
        purge_expired(transport, &receive_names).await;
    }
    Ok(())
}

/// Reads the depths of the queues that peek before they receive (the monitor model) in as
/// few statements as the transport can, for each one's first peek
/// ([`QueueRuntime::seed_first_peek`]); a queue whose read failed peeks by itself.
pub(super) async fn read_first_depths(queues: &[Arc<QueueRuntime>], transport: &dyn Transport) {
    let peekers: Vec<&Arc<QueueRuntime>> = queues
        .iter()
        .filter(|q| q.model() == ConcurrencyModel::Monitor)
        .collect();
    let names: Vec<QueueName> = peekers.iter().map(|q| q.name().clone()).collect();
    let starts: Vec<_> = peekers.iter().map(|q| q.depth().read_started()).collect();
    let depths = transport.peek_depths(&names).await;
    for ((q, start), depth) in peekers.into_iter().zip(starts).zip(depths) {
        if let Ok(depth) = depth {
            q.seed_first_peek(depth, start);
        }
    }
}

/// The subscription table (created with the queues, as NServiceBus's installers create it)
/// and a row for every topic a queue subscribes to: added when missing, pointed at the queue
/// when it points elsewhere; rows of other endpoints are left alone.
async fn prepare_subscriptions(
    config: &Config,
    transport: &dyn Transport,
) -> Result<(), HostError> {
    let Some(store) = transport.subscriptions() else {
        return Ok(()); // check_abilities refused subscribing queues on such a transport
    };
    let table = QueueName::new(&config.transport.subscription_table)?;
    if config.host.create_queues {
        store.create_subscription_table().await.map_err(preparing(
            &table,
            "create the subscription table",
            "create it with a privileged account (`throttlehost queues create`), then set host.create_queues = false",
        ))?;
    }
    for q in config.queues.iter().filter(|q| !q.subscribe.is_empty()) {
        let queue = QueueName::new(&q.name)?;
        let address = transport.address(&queue);
        for topic in &q.subscribe {
            store
                .subscribe(queue.table(), topic, &address)
                .await
                .map_err(preparing(
                    &queue,
                    "subscribe to its events (queues.subscribe)",
                    "the account needs INSERT and UPDATE on the subscription table",
                ))?;
        }
        tracing::info!(queue = %queue, topics = ?q.subscribe, "subscribed");
    }
    Ok(())
}

/// The indexes and tables ordered receives need, for every queue that keeps an order
/// (`check_abilities` refused ordered queues on a transport that keeps none).
async fn prepare_ordering(config: &Config, transport: &dyn Transport) -> Result<(), HostError> {
    let ordered = config.queues.iter().filter(|q| q.ordering.is_ordered());
    for (q, ordering) in ordered.filter_map(|q| Some((q, transport.key_ordering()?))) {
        let name = QueueName::new(&q.name)?;
        ordering
            .order_by_key(&name, &q.ordering)
            .await
            .map_err(preparing(
                &name,
                "prepare ordered receives (queues.ordering)",
                "on PostgreSQL an account that may not create indexes and tables needs sql/postgres/ordering.sql, and with failed_key = \"hold\" sql/postgres/held.sql, run first by one that may",
            ))?;
    }
    Ok(())
}

/// Purges expired messages from the queues received from (`purge_expired_on_startup`); a
/// failure is logged and does not stop the start.
async fn purge_expired(transport: &dyn Transport, queues: &[QueueName]) {
    for q in queues {
        match transport.admin().purge_expired(q).await {
            Ok(n) if n > 0 => {
                tracing::info!(queue = %q, purged = n, "expired messages purged at start-up")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(queue = %q, error = %e, "purging expired messages failed")
            }
        }
    }
}
