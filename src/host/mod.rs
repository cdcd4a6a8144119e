//! The host: assembles transport, queues, receivers, dispatcher, publisher, throttling and the
//! admin endpoint from a [`Config`], runs them, reloads settings, and shuts down without
//! losing messages.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use throttlehost::{Config, HostBuilder};
//! let config = throttlehost::config::load_file("config/host.toml".as_ref())?;
//! let host = HostBuilder::new(config).start().await?;
//! // ... until a signal arrives:
//! host.shutdown().await;
//! # Ok(()) }
//! ```

mod admin_state;
mod handle;
mod overrides;
mod probe;
mod status;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Limits of the admin endpoint (`host.admin_address`) against clients that hold connections.
pub use crate::admin::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS};
pub use crate::status::{
    DirectionStatus, FleetShareStatus, HostStatus, OverrideScope, QueueStatus, ResourceStatus,
    ThrottlingStatus,
};
pub use handle::HostHandle;

use crate::config::{Config, HandlerConfig, TransportKind};
use crate::depth::DepthCell;
use crate::dispatch::{DispatchObserver, Dispatcher, HostIdentity};
use crate::handlers::{self, Handler, SimulateHandler};
use crate::message::OutgoingMessage;
use crate::metrics::Metrics;
use crate::publish::Publisher;
use crate::receive::{self, QueueRuntime, QueueSettings, ReceiveContext};
use crate::throttling::sensors::{ResourceSensor, SystemSensor};
use crate::throttling::service::{self, ServiceParts, ThrottleControl};
use crate::throttling::{Clock, Direction, Throttle, TokioClock};
use crate::transport::{self, ArrivalSink, ConflictSink, QueueName, Transport, TransportError};

/// Why a host could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A setting cannot be run as it is; names it.
    #[error("{setting}: {message}")]
    Setting {
        /// The setting, as written in the configuration file (`queues[0].concurrency.receive_batch`).
        setting: String,
        /// What is wrong with it and what to do instead.
        message: String,
    },
    /// A configured queue has no handler.
    #[error(
        "queue `{queue}` has no handler: set [queues.handler] in the configuration or register one with HostBuilder::handler"
    )]
    NoHandler {
        /// The queue.
        queue: String,
    },
    /// A table the host creates or prepares for a queue could not be made ready.
    #[error("queue `{queue}`: cannot {what}: {source} ({remedy})")]
    Prepare {
        /// The queue.
        queue: String,
        /// What the host tried.
        what: &'static str,
        /// Why it failed.
        source: TransportError,
        /// What an operator can do about it.
        remedy: &'static str,
    },
    /// A configured queue name is not a valid name.
    #[error(transparent)]
    QueueName(#[from] crate::names::InvalidName),
    /// The admin endpoint could not listen.
    #[error("cannot listen on admin address {address}: {source}")]
    Admin {
        /// The address.
        address: String,
        /// Why.
        source: std::io::Error,
    },
}

impl HostError {
    /// The database could not be reached (as opposed to a configuration it rejected): worth
    /// trying again once it answers.
    pub fn is_unreachable_database(&self) -> bool {
        matches!(
            self,
            HostError::Transport(
                TransportError::Connection { .. } | TransportError::PoolTimeout { .. }
            )
        )
    }
}

/// Builds and starts a [`Host`].
pub struct HostBuilder {
    config: Config,
    config_path: Option<PathBuf>,
    transport: Option<Arc<dyn Transport>>,
    handlers: HashMap<String, Arc<dyn Handler>>,
    sensor: Option<Box<dyn ResourceSensor>>,
    clock: Option<Arc<dyn Clock>>,
    observer: Option<Arc<dyn DispatchObserver>>,
    serve_admin: bool,
}

impl HostBuilder {
    /// A host for this configuration.
    pub fn new(config: Config) -> Self {
        HostBuilder {
            config,
            config_path: None,
            transport: None,
            handlers: HashMap::new(),
            sensor: None,
            clock: None,
            observer: None,
            serve_admin: true,
        }
    }

    /// Reports every message that leaves a queue for good (success, error, expired, poison).
    pub fn observer(mut self, observer: Arc<dyn DispatchObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Remembers the file the configuration came from (reloads re-read it).
    pub fn config_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.config_path = Some(path.into());
        self
    }

    /// Uses this transport instead of connecting the configured one.
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.transport = Some(transport);
        self
    }

    /// Handles `queue` (and its instance queue) with `handler`, whatever the TOML says.
    pub fn handler(mut self, queue: &str, handler: impl Handler) -> Self {
        self.handlers.insert(queue.to_string(), Arc::new(handler));
        self
    }

    /// Handles `queue` with a shared handler.
    pub fn shared_handler(mut self, queue: &str, handler: Arc<dyn Handler>) -> Self {
        self.handlers.insert(queue.to_string(), handler);
        self
    }

    /// Replaces the process and system sensor (tests, simulations).
    pub fn resource_sensor(mut self, sensor: impl ResourceSensor) -> Self {
        self.sensor = Some(Box::new(sensor));
        self
    }

    /// Replaces the controller's clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Skips the admin HTTP endpoint even if an address is configured.
    pub fn without_admin(mut self) -> Self {
        self.serve_admin = false;
        self
    }

    /// Connects, creates queues if configured, and starts receiving.
    pub async fn start(self) -> Result<Host, HostError> {
        let config = self.config;
        let metrics = Metrics::new();
        let transport = match self.transport {
            Some(t) => t,
            None => transport::connect(&config.transport).await?,
        };
        let instance = config.host.effective_instance_id();
        metrics.host_info(&config.host.name, &instance, &transport.describe());
        let identity = HostIdentity::new(&config.host.name, &instance);
        let QueuePlan {
            queues,
            handlers,
            to_create,
            error_queues,
            simulated,
        } = plan_queues(&config, &self.handlers, &metrics, &instance)?;
        let (throttle, publisher, dispatcher) = message_path(
            &config,
            &transport,
            &metrics,
            identity,
            handlers,
            self.observer,
        );

        prepare_transport(&config, transport.as_ref(), &to_create, &queues).await?;
        transport.report_conflicts_to(Arc::new(ConflictCounters::of(&queues)));
        let names: Vec<QueueName> = queues.iter().map(|q| q.name().clone()).collect();
        transport.wake_on_arrival(&names, Arc::new(ArrivalWakes::of(&queues)));

        let mut sensor = self.sensor.unwrap_or_else(|| Box::new(SystemSensor::new()));
        check_memory_threshold(&config, sensor.as_mut())?;
        let control = Arc::new(ThrottleControl::new(
            config.throttling.clone(),
            sensor.machine(),
        ));
        let adapter = Arc::new(probe::HostAdapter {
            queues: queues.clone(),
            dispatcher: dispatcher.clone(),
            transport: transport.clone(),
            publisher: publisher.clone(),
            error_queues,
            include_error_queues: config.throttling.database_size_includes_error_queue,
            runtime: tokio::runtime::Handle::current(),
            refreshing: Arc::default(),
            held_read_at: Default::default(),
        });
        let controller = start_controller(ServiceParts {
            control: control.clone(),
            sensor,
            clock: self.clock.unwrap_or_else(|| Arc::new(TokioClock::new())),
            throttle: throttle.clone(),
            probe: adapter.clone(),
            limits: adapter,
            metrics: metrics.clone(),
        });

        let receive_ctx = start_receiving(&queues, &transport, &dispatcher, &throttle, &publisher);
        let known_queues = known_queues(to_create, &queues, &metrics);
        let inner = Arc::new(HostInner {
            config: ArcSwap::from_pointee(config),
            config_path: self.config_path,
            instance,
            transport,
            queues,
            simulated,
            known_queues,
            dispatcher,
            publisher,
            throttle,
            control,
            metrics,
            receive_ctx,
            runtime: tokio::runtime::Handle::current(),
            started: Instant::now(),
            process_id: uuid::Uuid::new_v4(),
            fleet_health: Arc::default(),
            overrides: Default::default(),
        });

        let admin = announce(&inner, self.serve_admin)?;
        Ok(Host {
            inner,
            service_stop: controller.stop,
            service_task: controller.task,
            controller_ended: controller.ended,
            admin,
        })
    }
}

/// Makes a started host known: its admin endpoint (when asked for), its heartbeat in the
/// fleet, and a log line.
fn announce(inner: &Arc<HostInner>, serve: bool) -> Result<Option<AdminServer>, HostError> {
    let admin = if serve { serve_admin(inner)? } else { None };
    start_heartbeat(inner, admin.as_ref().map(|a| a.address));
    start_census(inner);
    tracing::info!(
        host = %inner.config.load().host.name,
        instance = %inner.instance,
        transport = %inner.transport.describe(),
        queues = inner.queues.len(),
        "host started"
    );
    Ok(admin)
}

/// Refuses a process memory threshold the process is over before it handles anything: its
/// delivery would never start.
fn check_memory_threshold(
    config: &Config,
    sensor: &mut dyn crate::throttling::sensors::ResourceSensor,
) -> Result<(), HostError> {
    let thresholds =
        crate::throttling::controller::Thresholds::resolve(&config.throttling, sensor.machine());
    let rss = sensor.read().process_memory;
    match thresholds.process_memory {
        Some(limit) if config.throttling.enabled && limit <= rss => Err(HostError::Setting {
            setting: "throttling.process_memory".into(),
            message: format!(
                "{} is at or below this process's own memory before it handles anything ({}): delivery would never start; set it well above that, or \"off\"",
                crate::config::ByteSize(limit),
                crate::config::ByteSize(rss)
            ),
        }),
        _ => Ok(()),
    }
}

/// The receiving queues a configuration asks for, and the tables they need.
struct QueuePlan {
    /// One runtime per receiving queue (an instance queue is a queue of its own).
    queues: Vec<Arc<QueueRuntime>>,
    /// The handler of each receiving queue (an instance queue shares its queue's).
    handlers: HashMap<QueueName, Arc<dyn Handler>>,
    /// Input, instance, error and forward queues, to create at start (each once).
    to_create: Vec<QueueName>,
    /// The error queues, whose depth counts as database size only when configured.
    error_queues: HashSet<QueueName>,
    /// The receiving queues handled by the built-in simulate handler, with its knobs.
    simulated: Vec<(QueueName, Arc<SimulateHandler>)>,
}

/// Builds each queue's runtime with its handler: one registered with the builder, else the
/// configured one.
fn plan_queues(
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
        let (handler, simulate) = match registered.get(&qc.name) {
            Some(h) => (h.clone(), None),
            None => match &qc.handler {
                Some(hc) => {
                    let built = handlers::build(hc)?;
                    (built.handler, built.simulate)
                }
                None => {
                    return Err(HostError::NoHandler {
                        queue: qc.name.clone(),
                    });
                }
            },
        };
        let name = QueueName::new(&qc.name)?;
        let error_queue = QueueName::new(&qc.error_queue)?;
        if let Some(HandlerConfig::Forward(f)) = &qc.handler {
            to_create.push(QueueName::new(&f.to)?);
        }
        to_create.push(name.clone());
        to_create.push(error_queue.clone());
        error_queues.insert(error_queue.clone());
        let shared = QueueSettings::from_config(qc, qc.concurrency.max, mode);
        let mut receivers = vec![(name.clone(), shared)];
        if qc.instance_queue.enabled {
            let instance_queue = QueueName::new(&qc.instance_queue_name(instance))?;
            to_create.push(instance_queue.clone());
            let own = QueueSettings::from_config(qc, qc.instance_queue.max_concurrency, mode);
            receivers.push((instance_queue, own.local_only()));
        }
        for (queue_name, settings) in receivers {
            let runtime = QueueRuntime::new(
                queue_name.clone(),
                error_queue.clone(),
                error_depths.entry(error_queue.clone()).or_default().clone(),
                qc.concurrency.model,
                settings,
                metrics.queue(queue_name.as_str()),
            )
            .with_delayed_home(
                qc.delayed_delivery.enabled.then(|| name.clone()),
                qc.delayed_delivery.batch_size,
            );
            // Order applies to the queue itself; its instance queue carries replies.
            let runtime = match queue_name.as_str() == qc.name {
                true => runtime.with_ordering(&qc.ordering),
                false => runtime,
            };
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

/// The lock conflicts the transport handles itself, counted per receiving queue
/// (`throttlehost_lock_conflicts_total`); conflicts on other tables are not this host's.
struct ConflictCounters(HashMap<QueueName, (metrics::Counter, metrics::Counter)>);

impl ConflictCounters {
    fn of(queues: &[Arc<QueueRuntime>]) -> Self {
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
struct ArrivalWakes(HashMap<QueueName, std::sync::Weak<QueueRuntime>>);

impl ArrivalWakes {
    fn of(queues: &[Arc<QueueRuntime>]) -> Self {
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
}

/// Every queue this host receives from, sends errors to or forwards to (what ingest accepts).
/// Their published counters are registered at 0, so a dashboard panel never says "No data"
/// on a fresh host.
fn known_queues(
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
fn check_abilities(config: &Config, transport: &dyn Transport) -> Result<(), HostError> {
    let shares = transport.fleet_shares().is_some() && transport.instance_registry().is_some();
    for (i, q) in config.queues.iter().enumerate() {
        let missing = if q.ordering.is_ordered() && transport.key_ordering().is_none() {
            Some(("ordering", "cannot keep key order"))
        } else if q.concurrency.receive_batch > 1 && transport.batch_receive().is_none() {
            Some((
                "concurrency.receive_batch",
                "cannot take more than one message in a unit of work",
            ))
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

/// What a failed step of preparing `queue` becomes: a database that is away, or a setting or
/// table layout the transport refused (its error names the queue and what to change), stays
/// a transport error, so the caller may wait for the database; anything else is a `Prepare`
/// error with what to do about it.
fn preparing<'q>(
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
async fn prepare_delayed_tables(
    config: &Config,
    transport: &dyn Transport,
) -> Result<(), HostError> {
    let Some(delayed) = transport.delayed_delivery() else {
        return Ok(());
    };
    for qc in config.queues.iter().filter(|q| q.delayed_delivery.enabled) {
        let name = QueueName::new(&qc.name)?;
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
    }
    Ok(())
}

/// Creates the queues (when configured), runs the transport's start-up checks, warns about
/// settings that cannot work well, and purges expired messages (when configured).
async fn prepare_transport(
    config: &Config,
    transport: &dyn Transport,
    to_create: &[QueueName],
    queues: &[Arc<QueueRuntime>],
) -> Result<(), HostError> {
    let receive_names: Vec<QueueName> = queues.iter().map(|q| q.name().clone()).collect();
    check_abilities(config, transport)?;
    // Before anything is created: a start that is refused leaves no tables behind.
    let server_warnings = transport.server_checks().await?;
    for warning in server_warnings {
        tracing::warn!("{warning}");
    }
    if config.host.create_queues {
        for q in to_create {
            transport.create_queue(q).await.map_err(preparing(
                q,
                "create its table",
                "create the queues with a privileged account, then set host.create_queues = false",
            ))?;
        }
    }
    let ordered = config.queues.iter().filter(|q| q.ordering.is_ordered());
    // check_abilities refused ordered queues on a transport that keeps no order.
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
    let warnings = transport.startup_checks(&receive_names).await?;
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
        for q in &receive_names {
            match transport.purge_expired(q).await {
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

    Ok(())
}

/// The path a message takes, shared by every queue: the throttle both directions wait on,
/// the publisher every send goes through, and the dispatcher that runs handlers.
fn message_path(
    config: &Config,
    transport: &Arc<dyn Transport>,
    metrics: &Metrics,
    identity: HostIdentity,
    handlers: HashMap<QueueName, Arc<dyn Handler>>,
    observer: Option<Arc<dyn DispatchObserver>>,
) -> (Arc<Throttle>, Arc<Publisher>, Arc<Dispatcher>) {
    let host_metrics = metrics.host();
    let throttle = Arc::new(Throttle::new(
        host_metrics.delivery.wait.clone(),
        host_metrics.publishing.wait.clone(),
    ));
    let publisher = Arc::new(Publisher::new(
        transport.clone(),
        throttle.clone(),
        metrics.clone(),
    ));
    let dispatcher = Arc::new(Dispatcher::new(
        publisher.clone(),
        throttle.clone(),
        config.transport.transaction_mode,
        identity,
        handlers,
        observer,
    ));
    (throttle, publisher, dispatcher)
}

/// Starts every queue's receiver; returns what they share (and what stops them).
fn start_receiving(
    queues: &[Arc<QueueRuntime>],
    transport: &Arc<dyn Transport>,
    dispatcher: &Arc<Dispatcher>,
    throttle: &Arc<Throttle>,
    publisher: &Publisher,
) -> Arc<ReceiveContext> {
    let receive_ctx = Arc::new(ReceiveContext {
        transport: transport.clone(),
        dispatcher: dispatcher.clone(),
        throttle: throttle.clone(),
        stop: CancellationToken::new(),
        abort: CancellationToken::new(),
        tasks: TaskTracker::new(),
    });
    for q in queues {
        // The publisher counts this host's sends into the queue's depth between reads.
        publisher.track_depth(q.name(), q.depth().clone());
        receive::start(q.clone(), receive_ctx.clone());
        if moves_delayed(q, transport.as_ref()) {
            let of = crate::delayed::MoverOf {
                queue: q.name().clone(),
                batch: q.delayed_batch(),
                metrics: q.metrics().clone(),
                waiting: q.delayed_waiting().clone(),
                polls: q.lead_flag().clone(),
            };
            receive_ctx.tasks.spawn(crate::delayed::run_mover(
                transport.clone(),
                of,
                publisher.schedule().wake(q.name()),
                receive_ctx.stop.clone(),
            ));
        }
    }
    receive_ctx
}

/// Whether a host runs a mover for `q`'s delayed table: its own table (not an instance
/// queue's), with delayed delivery on and a transport that has it.
fn moves_delayed(q: &QueueRuntime, transport: &dyn Transport) -> bool {
    q.delayed_home() == Some(q.name()) && transport.delayed_delivery().is_some()
}

/// The throttling service of a running host.
struct RunningController {
    /// Stops the service.
    stop: CancellationToken,
    task: JoinHandle<()>,
    /// Cancelled when the service's loop ends for any reason, a panic included.
    ended: CancellationToken,
}

/// Starts the throttling service on a thread of its own.
fn start_controller(parts: ServiceParts) -> RunningController {
    let stop = CancellationToken::new();
    // Cancelled when the controller's loop ends for any reason, a panic included (the guard
    // drops while unwinding): a host must not run on without its controller.
    let ended = CancellationToken::new();
    let guard = ended.clone().drop_guard();
    let run = service::run(parts, stop.clone());
    let task = crate::isolate::spawn_isolated("throttling", async move {
        let _ended = guard;
        run.await;
    });
    RunningController { stop, task, ended }
}

/// Binds the admin endpoint (a taken port fails the start) and serves it on a thread of its
/// own, so /status and /metrics answer while handlers saturate the workers. None when
/// `host.admin_address` is "off".
fn serve_admin(inner: &Arc<HostInner>) -> Result<Option<AdminServer>, HostError> {
    let address = inner.config.load().host.admin_address.clone();
    if address.trim().eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let addr: SocketAddr = address.parse().map_err(|_| HostError::Setting {
        setting: "host.admin_address".into(),
        message: format!("`{address}` is not an address"),
    })?;
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|source| HostError::Admin {
            address: address.clone(),
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| HostError::Admin { address, source })?;
    let stop = CancellationToken::new();
    let task = crate::isolate::spawn_isolated(
        "throttlehost-admin",
        crate::admin::serve(
            listener,
            inner.clone() as Arc<dyn crate::admin::AdminState>,
            stop.clone(),
        ),
    );
    tracing::info!(address = %local, "admin endpoint listening (/metrics /status /healthz /readyz)");
    Ok(Some(AdminServer {
        address: local,
        stop,
        task,
    }))
}

struct AdminServer {
    address: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// Starts this host's heartbeat into the instance registry, when `fleet.enabled` and the
/// transport keeps one; it stops with the receivers and removes its row.
fn start_heartbeat(inner: &Arc<HostInner>, admin: Option<SocketAddr>) {
    let config = inner.config();
    if !config.fleet.enabled || inner.transport.instance_registry().is_none() {
        return;
    }
    let me = crate::transport::Heartbeat {
        process_id: inner.process_id,
        host_name: config.host.name.clone(),
        instance_id: inner.instance.clone(),
        version: crate::VERSION.to_string(),
        admin_address: admin.map(|a| format!("http://{a}")),
        summary: String::new(),
    };
    let (for_summary, for_settings, for_heard) = (inner.clone(), inner.clone(), inner.clone());
    let (written, shares_released) = (CancellationToken::new(), CancellationToken::new());
    let hooks = crate::fleet::HeartbeatHooks {
        summary: move || status::fleet_summary(&for_summary).to_string(),
        settings: move || for_settings.config().fleet.clone(),
        heard: move |heard| for_heard.heard_from_fleet(heard),
        written: written.clone(),
        shares_released: shares_released.clone(),
    };
    let for_shares = inner.clone();
    inner
        .receive_ctx
        .tasks
        .spawn(crate::fleet::share::run_shares(
            inner.transport.clone(),
            inner.queues.clone(),
            inner.process_id,
            move || for_shares.config().fleet.clone(),
            written,
            inner.receive_ctx.stop.clone(),
            shares_released,
        ));
    inner.receive_ctx.tasks.spawn(crate::fleet::run_heartbeat(
        inner.transport.clone(),
        me,
        hooks,
        inner.fleet_health.clone(),
        inner.receive_ctx.stop.clone(),
    ));
}

/// Starts counting this host's error queues for the failed-messages gauges, when the
/// transport can browse them; it stops with the receivers.
fn start_census(inner: &Arc<HostInner>) {
    let Ok(failed) = crate::failed::FailedMessages::new(inner.transport.clone()) else {
        return;
    };
    let mut plan = crate::failed::CensusPlan {
        error_queues: Default::default(),
    };
    for q in &inner.queues {
        plan.error_queues
            .entry(q.error_queue().clone())
            .or_default()
            .push(q.name().clone());
    }
    for queue in plan.error_queues.keys() {
        // At 0 before an operator's first retry or delete, so rate() has a series.
        for action in ["retried", "deleted"] {
            inner.metrics.failed_handled(queue.as_str(), action, 0);
        }
    }
    let for_interval = inner.clone();
    inner.receive_ctx.tasks.spawn(crate::failed::run_census(
        failed,
        plan,
        inner.metrics.clone(),
        move || for_interval.config().failed_messages.count_interval,
        inner.receive_ctx.stop.clone(),
    ));
}

/// The parts of a running host that the admin endpoint and the host handle share.
pub(crate) struct HostInner {
    config: ArcSwap<Config>,
    config_path: Option<PathBuf>,
    instance: String,
    transport: Arc<dyn Transport>,
    queues: Vec<Arc<QueueRuntime>>,
    /// The simulate handlers' knobs by receiving queue (load tests and reloads turn them).
    simulated: Vec<(QueueName, Arc<SimulateHandler>)>,
    known_queues: HashSet<QueueName>,
    dispatcher: Arc<Dispatcher>,
    publisher: Arc<Publisher>,
    throttle: Arc<Throttle>,
    control: Arc<ThrottleControl>,
    metrics: Metrics,
    receive_ctx: Arc<ReceiveContext>,
    /// The host's runtime: transport work from the admin thread runs here.
    runtime: tokio::runtime::Handle,
    started: Instant,
    /// This process in the instance registry.
    process_id: uuid::Uuid,
    /// Whether its heartbeat is written.
    fleet_health: Arc<crate::fleet::HeartbeatHealth>,
    /// Where each direction's override came from; the fleet's orders.
    overrides: overrides::Overrides,
}

impl HostInner {
    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// The runtime the host's receivers and transport connections run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// The throttled publisher.
    pub fn publisher(&self) -> &Arc<Publisher> {
        &self.publisher
    }

    /// Who this host is in the headers it writes (`Originating*`, `Processing*`).
    pub(crate) fn origin(&self) -> &crate::message::Origin {
        self.dispatcher.origin()
    }

    /// Throttling settings, overrides and the latest snapshot.
    pub fn control(&self) -> &Arc<ThrottleControl> {
        &self.control
    }

    /// The admissions and rate counters.
    pub fn throttle(&self) -> &Arc<Throttle> {
        &self.throttle
    }

    /// The metric registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Receiving queues (input and instance queues).
    pub fn queues(&self) -> &[Arc<QueueRuntime>] {
        &self.queues
    }

    /// The built-in simulate handlers by receiving queue: the knobs load tests turn.
    pub fn simulated(&self) -> impl Iterator<Item = &Arc<SimulateHandler>> {
        self.simulated.iter().map(|(_, sim)| sim)
    }

    /// A receiving queue by name.
    pub fn queue(&self, name: &str) -> Option<&Arc<QueueRuntime>> {
        self.queues.iter().find(|q| q.name().as_str() == name)
    }

    /// Queues this host receives from, sends errors to or forwards to: what ingest accepts.
    pub fn is_known_queue(&self, name: &QueueName) -> bool {
        self.known_queues.contains(name)
    }

    /// Messages handed to handlers and not done.
    pub fn in_process(&self) -> u64 {
        self.dispatcher.in_process()
    }

    /// True until shutdown begins.
    pub fn is_receiving(&self) -> bool {
        !self.receive_ctx.stop.is_cancelled()
    }

    /// The status document served at `/status`.
    pub fn status(&self) -> HostStatus {
        status::build(self)
    }

    /// Every instance on this host's database, as `/fleet` shows it. Err: the registry is off
    /// (`fleet.enabled = false`), the transport keeps none, or it cannot be read.
    pub async fn fleet(&self) -> Result<crate::fleet::FleetView, String> {
        let config = self.config();
        if !config.fleet.enabled {
            return Err("the instance registry is off (fleet.enabled = false)".into());
        }
        let Some(registry) = self.transport.instance_registry() else {
            return Err(format!(
                "the {} transport keeps no instance registry",
                self.transport.describe()
            ));
        };
        let records = registry
            .instances()
            .await
            .map_err(|e| format!("cannot read the instance registry: {e}"))?;
        Ok(crate::fleet::FleetView::of(
            records,
            self.process_id,
            &config.fleet,
            self.fleet_health.failing(),
            self.overrides.orders(),
        ))
    }

    /// Sets a direction's override on this instance until the next reload or fleet order.
    pub fn set_override(&self, direction: Direction, mode: crate::config::OverrideMode) {
        tracing::info!(%direction, mode = ?mode, "throttling override set");
        self.control.set_override(direction, mode);
        self.overrides.set_locally(direction);
    }

    /// Where `direction`'s override in force came from.
    pub fn override_scope(&self, direction: Direction) -> crate::status::OverrideScope {
        self.overrides.scope(direction)
    }

    /// Orders every instance on the database to override `direction` (this one at once, the
    /// others at their next heartbeat): the order is written into the instance registry.
    pub async fn set_fleet_override(
        &self,
        direction: Direction,
        mode: crate::config::OverrideMode,
    ) -> Result<crate::fleet::FleetOrder, crate::fleet::FleetOrderError> {
        use crate::fleet::FleetOrderError;
        let config = self.config();
        if !config.fleet.enabled {
            return Err(FleetOrderError::NoRegistry(
                "a fleet-wide override goes through the instance registry, which is off (fleet.enabled = false)"
                    .into(),
            ));
        }
        let Some(registry) = self.transport.instance_registry() else {
            return Err(FleetOrderError::NoRegistry(format!(
                "the {} transport keeps no instance registry to send a fleet-wide override through",
                self.transport.describe()
            )));
        };
        let token = config.admin.token.expose();
        if token.is_empty() {
            return Err(FleetOrderError::NoToken);
        }
        let order = crate::fleet::FleetOrder::sealed(direction, mode, &self.instance, token);
        let write = async {
            registry.create_registry().await?;
            registry
                .heartbeat(&order.as_heartbeat(&config.host.name))
                .await
        };
        write
            .await
            .map_err(|e| FleetOrderError::NotWritten(e.to_string()))?;
        let mut orders: Vec<_> = self
            .overrides
            .orders()
            .into_iter()
            .filter(|o| o.direction != direction)
            .collect();
        orders.push(order.clone());
        self.apply_fleet_orders(orders);
        Ok(order)
    }

    /// What a heartbeat brought: the fleet's orders to apply, and who leads each queue's
    /// background reading (`fleet::lead`); None (the heartbeat failed): this host leads all
    /// its queues, as it would alone.
    fn heard_from_fleet(
        &self,
        heard: Option<(
            Vec<crate::fleet::FleetOrder>,
            Vec<crate::transport::BeatRow>,
        )>,
    ) {
        let Some((orders, rows)) = heard else {
            for q in &self.queues {
                q.set_leads(true);
            }
            return;
        };
        self.apply_fleet_orders(orders);
        let mine: Vec<crate::fleet::lead::Mine<'_>> = self
            .queues
            .iter()
            .map(|q| crate::fleet::lead::Mine {
                queue: q.name().as_str(),
                moves_delayed: self.moves_delayed(q),
            })
            .collect();
        let gone_after = self.config().fleet.gone_after.as_secs_f64();
        let leads =
            crate::fleet::lead::leads(self.process_id, &self.instance, &mine, &rows, gone_after);
        for (q, lead) in self.queues.iter().zip(leads) {
            match lead {
                crate::fleet::lead::Lead::Here => q.set_leads(true),
                crate::fleet::lead::Lead::Elsewhere { depth } => {
                    q.set_leads(false);
                    if let Some(depth) = depth {
                        q.depth().set(depth);
                    }
                }
            }
        }
    }

    /// Whether this host runs a mover for `q`'s delayed table.
    pub(crate) fn moves_delayed(&self, q: &QueueRuntime) -> bool {
        moves_delayed(q, self.transport.as_ref())
    }

    /// Applies the fleet's orders this instance has not applied yet, among those sealed with
    /// its own `admin.token`; an order sealed otherwise (another token, none, a row written by
    /// hand) is refused and said once.
    fn apply_fleet_orders(&self, orders: Vec<crate::fleet::FleetOrder>) {
        let config = self.config();
        let token = config.admin.token.expose();
        let (sealed, refused): (Vec<_>, Vec<_>) =
            orders.into_iter().partition(|o| o.is_sealed_with(token));
        for order in self.overrides.newly_refused(&refused) {
            tracing::warn!(direction = %order.direction, mode = ?order.mode,
                set_by = %order.set_by.escape_debug(),
                "a fleet-wide override not sealed with this instance's admin.token is refused (the fleet's instances need the same token)");
        }
        for order in self.overrides.to_apply(sealed) {
            tracing::info!(direction = %order.direction, mode = ?order.mode, set_by = %order.set_by,
                "fleet-wide throttling override applied");
            self.control.set_override(order.direction, order.mode);
        }
    }

    /// Applies a new configuration without restarting: throttling settings, queue
    /// concurrency, retries, peek intervals and simulate knobs. Returns the changes that need a
    /// restart (they are left as they are).
    pub fn apply_config(&self, new: Config) -> Vec<String> {
        let old = self.config.load_full();
        let mut needs_restart = Vec::new();
        if old.transport != new.transport {
            needs_restart.push("[transport]".to_string());
        }
        if old.host != new.host {
            needs_restart.push("[host]".to_string());
        }
        if old.fleet.enabled != new.fleet.enabled {
            needs_restart.push("fleet.enabled".to_string());
        }
        let old_names: Vec<&str> = old.queues.iter().map(|q| q.name.as_str()).collect();
        let new_names: Vec<&str> = new.queues.iter().map(|q| q.name.as_str()).collect();
        if old_names != new_names {
            needs_restart.push("the list of queues".to_string());
        }
        for qc in &new.queues {
            let Some(before) = old.queues.iter().find(|q| q.name == qc.name) else {
                continue;
            };
            if before.concurrency.model != qc.concurrency.model
                || before.error_queue != qc.error_queue
                || before.instance_queue.enabled != qc.instance_queue.enabled
            {
                needs_restart.push(format!(
                    "queue `{}` model, error queue or instance queue",
                    qc.name
                ));
            }
            let instance_queue = format!("{}.{}", qc.name, self.instance);
            let mode = new.transport.transaction_mode;
            for q in self.queues.iter() {
                let settings = if q.name().as_str() == qc.name {
                    QueueSettings::from_config(qc, qc.concurrency.max, mode)
                } else if qc.instance_queue.enabled && q.name().as_str() == instance_queue {
                    QueueSettings::from_config(qc, qc.instance_queue.max_concurrency, mode)
                        .local_only()
                } else {
                    continue;
                };
                q.reconfigure(settings);
                let sim = self.simulated.iter().find(|(name, _)| name == q.name());
                match (&qc.handler, sim.map(|(_, sim)| sim)) {
                    (Some(HandlerConfig::Simulate(knobs)), Some(sim)) => {
                        sim.set_knobs(knobs.clone())
                    }
                    (h, _) if *h != before.handler => {
                        needs_restart.push(format!("queue `{}` handler", qc.name));
                    }
                    _ => {}
                }
            }
        }
        self.control.reconfigure(new.throttling.clone());
        self.overrides.reloaded();
        self.config.store(Arc::new(new));
        needs_restart.sort();
        needs_restart.dedup();
        needs_restart
    }

    /// Re-reads the configuration file; an invalid file keeps the running settings.
    pub fn reload(&self) -> Result<Vec<String>, String> {
        let Some(path) = &self.config_path else {
            return Err("the host was not started from a configuration file".into());
        };
        self.reload_from(path)
    }

    /// Reads `path` and applies it (see [`HostInner::apply_config`]).
    pub fn reload_from(&self, path: &Path) -> Result<Vec<String>, String> {
        match crate::config::load_file(path) {
            Ok(config) => {
                let restart = self.apply_config(config);
                self.metrics.config_reload(true);
                if restart.is_empty() {
                    tracing::info!(path = %path.display(), "configuration reloaded");
                } else {
                    tracing::warn!(path = %path.display(), needs_restart = ?restart,
                        "configuration reloaded; some changes take effect only after a restart");
                }
                Ok(restart)
            }
            Err(e) => {
                self.metrics.config_reload(false);
                tracing::error!(path = %path.display(), error = %e, "configuration reload failed; the running settings stay");
                Err(e.to_string())
            }
        }
    }
}

/// How long shutdown waits for in-flight work after telling it to roll back.
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// A running host.
pub struct Host {
    inner: Arc<HostInner>,
    service_stop: CancellationToken,
    service_task: JoinHandle<()>,
    controller_ended: CancellationToken,
    admin: Option<AdminServer>,
}

/// What shutdown did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// In-flight work finished within the timeout.
    pub drained: bool,
    /// Messages rolled back because the timeout passed (they return to their queues).
    pub rolled_back: u64,
}

impl Host {
    /// Starts a host from configuration with everything built from it.
    pub async fn start(config: Config) -> Result<Host, HostError> {
        HostBuilder::new(config).start().await
    }

    /// The shared parts, for the crate's own tools (the load runner, `run`).
    pub(crate) fn inner(&self) -> &Arc<HostInner> {
        &self.inner
    }

    /// A handle to this host that tasks and threads can keep: send, reload, override, and
    /// read its status, throttling and metrics.
    pub fn handle(&self) -> HostHandle {
        HostHandle::new(self.inner.clone())
    }

    /// The admin endpoint's address, if it listens.
    pub fn admin_address(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(|a| a.address)
    }

    /// Sends a message through the throttled publish path.
    pub async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), TransportError> {
        handle::send_from(&self.inner, queue, message).await
    }

    /// Resolves if the throttling controller stops while the host runs (it panicked): the
    /// host can no longer throttle or apply an override, so the caller should shut it down
    /// and exit with an error. Never resolves during a normal run.
    pub async fn controller_failed(&self) {
        self.controller_ended.cancelled().await;
        if self.service_stop.is_cancelled() {
            std::future::pending::<()>().await;
        }
    }

    /// The status document.
    pub fn status(&self) -> HostStatus {
        self.inner.status()
    }

    /// Stops receiving, lets in-flight messages finish for up to `host.shutdown_timeout`,
    /// rolls back what is still running (it returns to its queue), and stops.
    pub async fn shutdown(self) -> ShutdownReport {
        let timeout = self.inner.config().host.shutdown_timeout;
        self.shutdown_within(timeout).await
    }

    /// [`Host::shutdown`] with an explicit timeout.
    pub async fn shutdown_within(self, timeout: Duration) -> ShutdownReport {
        let ctx = &self.inner.receive_ctx;
        tracing::info!(
            in_process = self.inner.in_process(),
            "shutting down: receiving stopped, waiting for in-flight messages"
        );
        ctx.stop.cancel();
        ctx.tasks.close();
        let drained = tokio::time::timeout(timeout, ctx.tasks.wait())
            .await
            .is_ok();
        let mut rolled_back = 0;
        if !drained {
            rolled_back = self.inner.in_process();
            tracing::warn!(
                rolled_back,
                "shutdown timeout passed: rolling back in-flight messages"
            );
            ctx.abort.cancel();
            // Rolling back is dropping: a task stuck in a statement (a lock wait, a frozen
            // server) is not waited for past a short grace, so the timeout stays a limit.
            // Its connection goes with the runtime, and the server rolls its work back.
            if tokio::time::timeout(ABORT_GRACE, ctx.tasks.wait())
                .await
                .is_err()
            {
                tracing::warn!(
                    "in-flight work did not stop within {}s of the rollback; leaving it to the server",
                    ABORT_GRACE.as_secs()
                );
            }
        }
        self.service_stop.cancel();
        let _ = self.service_task.await;
        if let Some(admin) = self.admin {
            admin.stop.cancel();
            let _ = admin.task.await;
        }
        tracing::info!(drained, rolled_back, "host stopped");
        ShutdownReport {
            drained,
            rolled_back,
        }
    }
}
