//! Which queues a host runs and how each is set up: the plan, the handlers, and the sinks the
//! transport reports to.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::{Config, HandlerConfig, QueueConfig, TransactionMode};
use crate::depth::DepthCell;
use crate::handlers::{self, Handler, SimulateHandler};
use crate::metrics::Metrics;
use crate::receive::{QueueRuntime, QueueSettings};
use crate::transport::{ArrivalSink, ConflictSink, QueueName, Transport};

use super::HostError;

/// The receiving queues a configuration asks for, and the tables they need.
pub(super) struct QueuePlan {
    /// One runtime per receiving queue (an instance queue is a queue of its own).
    pub(super) queues: Vec<Arc<QueueRuntime>>,
    /// The handler of each receiving queue (an instance queue shares its queue's).
    pub(super) handlers: HashMap<QueueName, Arc<dyn Handler>>,
    /// Input, instance, error and forward queues, to create at start (each once).
    pub(super) to_create: Vec<QueueName>,
    /// The error queues, whose depth counts as database size only when configured.
    pub(super) error_queues: HashSet<QueueName>,
    /// The receiving queues handled by the built-in simulate handler, with its knobs.
    pub(super) simulated: Vec<(QueueName, Arc<SimulateHandler>)>,
}

/// Builds each queue's runtime with its handler: one registered with the builder, else the
/// configured one.
pub(super) fn plan_queues(
    config: &Config,
    registered: &HashMap<String, Arc<dyn Handler>>,
    metrics: &Metrics,
    instance: &str,
) -> Result<QueuePlan, HostError> {
    let mode = config.transport.transaction_mode;
    let mut queues = Vec::new();
    let mut handlers = HashMap::new();
    let mut simulated = Vec::new();
    let mut to_create: Vec<QueueName> = Vec::new();
    let mut error_queues = HashSet::new();
    let mut error_depths: HashMap<QueueName, Arc<DepthCell>> = HashMap::new();
    for qc in &config.queues {
        let (handler, simulate) = handler_for(qc, registered)?;
        let name = QueueName::new(&qc.name)?;
        let error_queue = QueueName::new(&qc.error_queue)?;
        if let Some(HandlerConfig::Forward(f)) = &qc.handler {
            to_create.push(QueueName::new(&f.to)?);
        }
        to_create.push(error_queue.clone());
        error_queues.insert(error_queue.clone());
        let receivers = receivers_of(qc, &name, instance, mode)?;
        to_create.extend(receivers.iter().map(|(queue, _)| queue.clone()));
        for (queue_name, settings) in receivers {
            let depth = error_depths.entry(error_queue.clone()).or_default().clone();
            let error = (error_queue.clone(), depth);
            let runtime = runtime_of(qc, &name, &queue_name, settings, error, metrics);
            queues.push(Arc::new(runtime));
            handlers.insert(queue_name.clone(), handler.clone());
            if let Some(sim) = &simulate {
                simulated.push((queue_name.clone(), sim.clone()));
            }
        }
    }

    to_create.sort();
    to_create.dedup();
    Ok(QueuePlan {
        queues,
        handlers,
        to_create,
        error_queues,
        simulated,
    })
}

/// The runtime of `queue` (`qc`'s queue `name` itself, or its instance queue) with these
/// settings, its error queue with that queue's shared depth cell, and its metric handles
/// (none exported when `qc` says `metrics = false`).
fn runtime_of(
    qc: &QueueConfig,
    name: &QueueName,
    queue: &QueueName,
    settings: QueueSettings,
    (error_queue, error_depth): (QueueName, Arc<DepthCell>),
    metrics: &Metrics,
) -> QueueRuntime {
    if !qc.metrics {
        metrics.leave_out_queue(queue.as_str());
    }
    let ordered = queue == name && qc.ordering.is_ordered();
    let runtime = QueueRuntime::new(
        queue.clone(),
        error_queue,
        error_depth,
        qc.concurrency.model,
        settings,
        // Order applies to the queue itself; its instance queue carries replies.
        metrics.queue(queue.as_str(), ordered),
    )
    .with_delayed_home(
        qc.delayed_delivery.enabled.then(|| name.clone()),
        qc.delayed_delivery.batch_size,
    );
    match ordered {
        true => runtime.with_ordering(&qc.ordering),
        false => runtime,
    }
}

/// A queue's handler, with the knobs of a simulate handler.
type BuiltHandler = (Arc<dyn Handler>, Option<Arc<SimulateHandler>>);

/// `qc`'s handler: the one registered for it by name, or the one its configuration builds
/// (with a simulate handler's knobs).
fn handler_for(
    qc: &QueueConfig,
    registered: &HashMap<String, Arc<dyn Handler>>,
) -> Result<BuiltHandler, HostError> {
    if let Some(h) = registered.get(&qc.name) {
        return Ok((h.clone(), None));
    }
    let Some(hc) = &qc.handler else {
        return Err(HostError::NoHandler {
            queue: qc.name.clone(),
        });
    };
    let built = handlers::build(hc)?;
    Ok((built.handler, built.simulate))
}

/// The queues `qc` receives from with their settings: the queue itself (`name`) and, when
/// enabled, this instance's own queue.
fn receivers_of(
    qc: &QueueConfig,
    name: &QueueName,
    instance: &str,
    mode: TransactionMode,
) -> Result<Vec<(QueueName, QueueSettings)>, HostError> {
    let shared = QueueSettings::from_config(qc, qc.concurrency.max, mode);
    let mut receivers = vec![(name.clone(), shared)];
    if qc.instance_queue.enabled {
        let instance_queue = QueueName::new(&qc.instance_queue_name(instance))?;
        let own = QueueSettings::from_config(qc, qc.instance_queue.max_concurrency, mode);
        receivers.push((instance_queue, own.local_only()));
    }
    Ok(receivers)
}

/// The lock conflicts the transport handles itself, counted per receiving queue
/// (`throttlehost_lock_conflicts_total`); conflicts on other tables are not this host's.
pub(super) struct ConflictCounters(HashMap<QueueName, (metrics::Counter, metrics::Counter)>);

impl ConflictCounters {
    pub(super) fn of(queues: &[Arc<QueueRuntime>]) -> Self {
        ConflictCounters(
            queues
                .iter()
                .map(|q| {
                    let counters = (
                        q.metrics().lock_timeouts.clone(),
                        q.metrics().deadlocks.clone(),
                    );
                    (q.name().clone(), counters)
                })
                .collect(),
        )
    }
}

impl ConflictSink for ConflictCounters {
    fn lock_timeout(&self, queue: &QueueName) {
        if let Some((lock_timeouts, _)) = self.0.get(queue) {
            lock_timeouts.increment(1);
        }
    }

    fn deadlock(&self, queue: &QueueName) {
        if let Some((_, deadlocks)) = self.0.get(queue) {
            deadlocks.increment(1);
        }
    }
}

/// Wakes a receiving queue's idle receivers when the transport says messages arrived.
pub(super) struct ArrivalWakes(HashMap<QueueName, std::sync::Weak<QueueRuntime>>);

impl ArrivalWakes {
    pub(super) fn of(queues: &[Arc<QueueRuntime>]) -> Self {
        ArrivalWakes(
            queues
                .iter()
                .map(|q| (q.name().clone(), Arc::downgrade(q)))
                .collect(),
        )
    }
}

impl ArrivalSink for ArrivalWakes {
    fn arrived(&self, queue: &QueueName) {
        if let Some(q) = self.0.get(queue).and_then(std::sync::Weak::upgrade) {
            q.arrived();
        }
    }

    fn listening(&self, queue: &QueueName, notified: bool) {
        if let Some(q) = self.0.get(queue).and_then(std::sync::Weak::upgrade) {
            q.set_arrivals_notified(notified);
        }
    }
}

/// Every queue this host receives from, sends errors to or forwards to (what ingest accepts).
/// Their published counters are registered at 0, so a dashboard panel never says "No data"
/// on a fresh host.
pub(super) fn known_queues(
    to_create: Vec<QueueName>,
    queues: &[Arc<QueueRuntime>],
    metrics: &Metrics,
) -> HashSet<QueueName> {
    let mut known: HashSet<QueueName> = to_create.into_iter().collect();
    known.extend(queues.iter().map(|q| q.name().clone()));
    for queue in &known {
        let _registered = metrics.published(queue.as_str());
    }
    known
}

/// Refuses a configuration that needs an ability the transport lacks, naming the setting:
/// key order, batch receive, a fleet-wide limit (shares, and a registry to tell the living
/// from the gone).
pub(super) fn check_abilities(config: &Config, transport: &dyn Transport) -> Result<(), HostError> {
    let shares = transport.fleet_shares().is_some() && transport.instance_registry().is_some();
    for (i, q) in config.queues.iter().enumerate() {
        let missing = if q.ordering.is_ordered() && transport.key_ordering().is_none() {
            Some(("ordering", "cannot keep key order"))
        } else if q.concurrency.receive_batch > 1 && transport.batch_receive().is_none() {
            Some((
                "concurrency.receive_batch",
                "cannot take more than one message in a unit of work",
            ))
        } else if !q.subscribe.is_empty() && transport.subscriptions().is_none() {
            Some(("subscribe", "keeps no subscription table"))
        } else if q.concurrency.fleet_max.is_some() && !shares {
            Some((
                "concurrency.fleet_max",
                "cannot share a limit between instances (it keeps no instance registry or shares table)",
            ))
        } else {
            None
        };
        if let Some((key, why)) = missing {
            return Err(HostError::Setting {
                setting: format!("queues[{i}].{key}"),
                message: format!("the {} transport {why}", transport.describe()),
            });
        }
    }
    Ok(())
}
