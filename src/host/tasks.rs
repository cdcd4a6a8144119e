//! The host's running tasks: receivers, delayed movers, the throttling controller, the admin
//! endpoint, the fleet heartbeat and the failed-message census.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::dispatch::{DispatchObserver, Dispatcher, HostIdentity};
use crate::handlers::Handler;
use crate::metrics::Metrics;
use crate::publish::Publisher;
use crate::receive::{self, QueueRuntime, ReceiveContext};
use crate::throttling::Throttle;
use crate::throttling::service::{self, ServiceParts};
use crate::transport::{QueueName, Transport};

use super::status;
use super::{HostError, HostInner};

/// The path a message takes, shared by every queue: the throttle both directions wait on,
/// the publisher every send goes through, and the dispatcher that runs handlers.
pub(super) fn message_path(
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
    let publisher = Arc::new(
        Publisher::new(transport.clone(), throttle.clone(), metrics.clone())
            .with_subscription_cache(config.transport.subscription_cache)
            .with_pool(
                config.transport.pool_size,
                config.queues.iter().map(|q| q.concurrency.max).sum(),
            ),
    );
    let dispatcher = Arc::new(Dispatcher::new(
        publisher.clone(),
        throttle.clone(),
        config.transport.transaction_mode,
        identity,
        handlers,
        transport.clone(),
        observer,
    ));
    (throttle, publisher, dispatcher)
}

/// Starts every queue's receiver; returns what they share (and what stops them).
pub(super) fn start_receiving(
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
    let mut swept = Vec::new();
    for q in queues {
        // The publisher counts this host's sends into the queue's depth between reads.
        publisher.track_depth(q.name(), q.depth().clone());
        receive::start(q.clone(), receive_ctx.clone());
        let moves = moves_delayed(q, transport.as_ref());
        // Alone until the fleet's heartbeats tell otherwise.
        q.set_delayed_unmoved(owns_delayed_table(q) && !moves);
        if moves {
            let wake = publisher.schedule().wake(q.name());
            wake.count_into(q.delayed_waiting().clone());
            swept.push(crate::delayed::sweep::SweptTable {
                queue: q.name().clone(),
                wake,
                leads: q.lead_flag().clone(),
                waiting: q.delayed_waiting().clone(),
                metrics: q.metrics().clone(),
                health: q.delayed_health().clone(),
            });
            let of = crate::delayed::MoverOf {
                queue: q.name().clone(),
                batch: q.delayed_batch(),
                metrics: q.metrics().clone(),
                waiting: q.delayed_waiting().clone(),
                polls: q.lead_flag().clone(),
                health: q.delayed_health().clone(),
                swept: true,
            };
            receive_ctx.tasks.spawn(crate::delayed::run_mover(
                transport.clone(),
                of,
                publisher.schedule().wake(q.name()),
                receive_ctx.stop.clone(),
            ));
        }
    }
    if !swept.is_empty() {
        receive_ctx.tasks.spawn(crate::delayed::sweep::run_sweeper(
            transport.clone(),
            swept,
            receive_ctx.stop.clone(),
        ));
    }
    receive_ctx
}

/// Whether `q` keeps its delayed messages in a table of its own (an instance queue keeps them
/// in its endpoint queue's); with delayed delivery off, the table it would have.
pub(super) fn owns_delayed_table(q: &QueueRuntime) -> bool {
    q.delayed_home().is_none_or(|home| home == q.name())
}

/// Whether a host runs a mover for `q`'s delayed table: its own table (not an instance
/// queue's), with delayed delivery on and a transport that has it.
pub(super) fn moves_delayed(q: &QueueRuntime, transport: &dyn Transport) -> bool {
    q.delayed_home() == Some(q.name()) && transport.delayed_delivery().is_some()
}

/// The throttling service of a running host.
pub(super) struct RunningController {
    /// Stops the service.
    pub(super) stop: CancellationToken,
    pub(super) task: JoinHandle<()>,
    /// Cancelled when the service's loop ends for any reason, a panic included.
    pub(super) ended: CancellationToken,
}

/// Starts the throttling service on a thread of its own.
pub(super) fn start_controller(parts: ServiceParts) -> RunningController {
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
pub(super) fn serve_admin(inner: &Arc<HostInner>) -> Result<Option<AdminServer>, HostError> {
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

pub(super) struct AdminServer {
    pub(super) address: SocketAddr,
    pub(super) stop: CancellationToken,
    pub(super) task: JoinHandle<()>,
}

/// Starts this host's heartbeat into the instance registry, when `fleet.enabled` and the
/// transport keeps one; it stops with the receivers and removes its row.
pub(super) fn start_heartbeat(inner: &Arc<HostInner>, admin: Option<SocketAddr>) {
    let config = inner.config();
    if !config.fleet.enabled || inner.transport.instance_registry().is_none() {
        return;
    }
    let me = crate::transport::Heartbeat {
        process_id: inner.process_id,
        host_name: config.host.name.clone(),
        instance_id: inner.instance.clone(),
        version: crate::version::VERSION.to_string(),
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
pub(super) fn start_census(inner: &Arc<HostInner>) {
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
