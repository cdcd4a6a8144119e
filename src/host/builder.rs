//! Building a host: what a builder may be given, and the start that assembles it in order.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use crate::config::{Config, TransactionMode};
use crate::dispatch::{DispatchObserver, HostIdentity};
use crate::handlers::Handler;
use crate::metrics::Metrics;
use crate::receive::QueueRuntime;
use crate::throttling::sensors::{ResourceSensor, SystemSensor};
use crate::throttling::service::{ServiceParts, ThrottleControl};
use crate::throttling::{Clock, Throttle, TokioClock};
use crate::transport::{self, QueueName, Transport};

use super::plan::{ArrivalWakes, ConflictCounters, known_queues, plan_queues};
use super::prepare::{prepare_transport, read_first_depths};
use super::probe;
use super::tasks::{
    AdminServer, RunningController, message_path, serve_admin, start_census, start_controller,
    start_heartbeat, start_receiving,
};
use super::{Host, HostError, HostInner};

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
        let plan = plan_queues(&config, &self.handlers, &metrics, &instance)?;
        let queues = plan.queues;
        let (throttle, publisher, dispatcher) = message_path(
            &config,
            &transport,
            &metrics,
            identity,
            plan.handlers,
            self.observer,
        );

        prepare_transport(&config, transport.as_ref(), &plan.to_create, &queues).await?;
        let arrivals_told = hook_into(transport.as_ref(), &queues);
        read_first_depths(&queues, transport.as_ref()).await;

        let adapter = Arc::new(probe::HostAdapter::new(
            &config,
            &queues,
            &dispatcher,
            &transport,
            &publisher,
            plan.error_queues,
        ));
        let (control, controller) = start_throttling(
            &config,
            self.sensor,
            self.clock,
            &throttle,
            adapter,
            &metrics,
        )?;

        let receive_ctx = start_receiving(&queues, &transport, &dispatcher, &throttle, &publisher);
        let known_queues = known_queues(plan.to_create, &queues, &metrics);
        let inner = Arc::new(HostInner {
            config: ArcSwap::from_pointee(config),
            config_path: self.config_path,
            instance,
            transport,
            queues,
            simulated: plan.simulated,
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

        if !arrivals_told {
            scan_for_arrivals(&inner);
        }
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

/// Gives the transport's host hooks what they report to: each queue's conflict counter and
/// its arrival wake. True when the transport wakes queues on arrival itself.
fn hook_into(transport: &dyn Transport, queues: &[Arc<QueueRuntime>]) -> bool {
    let Some(hooks) = transport.host_hooks() else {
        return false;
    };
    hooks.report_conflicts_to(Arc::new(ConflictCounters::of(queues)));
    let names: Vec<QueueName> = queues.iter().map(|q| q.name().clone()).collect();
    hooks.wake_on_arrival(&names, Arc::new(ArrivalWakes::of(queues)))
}

/// Watches idle queues for arrivals the transport does not announce.
fn scan_for_arrivals(inner: &HostInner) {
    inner.receive_ctx.tasks.spawn(super::arrival_scan::run(
        inner.queues.clone(),
        inner.transport.clone(),
        inner.receive_ctx.stop.clone(),
    ));
}

/// The throttling controller, reading the host through `adapter`, started on the sensor and
/// clock the builder was given (the machine's and tokio's when none).
fn start_throttling(
    config: &Config,
    sensor: Option<Box<dyn ResourceSensor>>,
    clock: Option<Arc<dyn Clock>>,
    throttle: &Arc<Throttle>,
    adapter: Arc<probe::HostAdapter>,
    metrics: &Metrics,
) -> Result<(Arc<ThrottleControl>, RunningController), HostError> {
    let mut sensor = sensor.unwrap_or_else(|| Box::new(SystemSensor::new()));
    check_memory_threshold(config, sensor.as_mut())?;
    let control = Arc::new(ThrottleControl::new(
        config.throttling.clone(),
        sensor.machine(),
    ));
    // A transaction holds its pooled session from the receive to the commit: no more
    // receives can be out, or messages in process, than the pool has sessions.
    if config.transport.transaction_mode != TransactionMode::None {
        control.bound_at_once(Some(u64::from(config.transport.pool_size)));
    }
    let controller = start_controller(ServiceParts {
        control: control.clone(),
        sensor,
        clock: clock.unwrap_or_else(|| Arc::new(TokioClock::new())),
        throttle: throttle.clone(),
        probe: adapter.clone(),
        limits: adapter,
        metrics: metrics.clone(),
    });
    Ok((control, controller))
}

/// Makes a started host known: its admin endpoint (when asked for), its heartbeat in the
/// fleet, and a log line.
pub(super) fn announce(
    inner: &Arc<HostInner>,
    serve: bool,
) -> Result<Option<AdminServer>, HostError> {
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
pub(super) fn check_memory_threshold(
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

impl Host {
    /// Starts a host from configuration with everything built from it.
    pub async fn start(config: Config) -> Result<Host, HostError> {
        HostBuilder::new(config).start().await
    }
}
