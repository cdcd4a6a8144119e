//! Shared test helpers: PostgreSQL schemas isolated per test, a transport decorator that
//! counts statements, polling helpers.
#![allow(dead_code)]

pub mod load;
pub mod mssql;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use throttlehost::config::{ConnectionString, TransactionMode, TransportConfig, TransportKind};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::postgres::PostgresTransport;
use throttlehost::transport::{QueueAdmin, QueueName, Received, Transport, TransportError};

/// The PostgreSQL the tests use (DATABASE_URL, else the local server).
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A schema (and application name) of its own for one test; dropped at the end.
pub struct PgSchema {
    pub name: String,
}

impl PgSchema {
    pub fn new() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        PgSchema {
            name: format!("th_{}", &id[..16]),
        }
    }

    /// Connection string whose connections are tagged with this schema's name.
    pub fn connection_string(&self) -> String {
        let url = database_url();
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}application_name={}", self.name)
    }

    pub fn transport_config(&self, mode: TransactionMode, pool_size: u32) -> TransportConfig {
        TransportConfig {
            kind: TransportKind::Postgres,
            connection_string: ConnectionString::new(self.connection_string()),
            schema: self.name.clone(),
            pool_size,
            transaction_mode: mode,
            connect_timeout: Duration::from_secs(10),
            ..TransportConfig::default()
        }
    }

    pub async fn transport(&self, mode: TransactionMode, pool_size: u32) -> PostgresTransport {
        PostgresTransport::connect(&self.transport_config(mode, pool_size))
            .await
            .expect("PostgreSQL at DATABASE_URL (default 127.0.0.1:5432, database test) must be running")
    }

    /// A plain client for assertions and sabotage.
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL must be running");
        tokio::spawn(connection);
        client
    }

    /// Terminates this test's pooled connections (pg_terminate_backend); returns how many.
    pub async fn kill_connections(&self) -> u64 {
        let client = self.client().await;
        let rows = client
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
                &[&self.name],
            )
            .await
            .unwrap();
        rows.len() as u64
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside async context guarantees; use a thread with its own runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let Ok((client, connection)) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await else {
                    return;
                };
                tokio::spawn(connection);
                let _ = client
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                        &[&name],
                    )
                    .await;
                let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE")).await;
            });
        })
        .join();
    }
}

pub fn q(name: &str) -> QueueName {
    QueueName::new(name).unwrap()
}

/// Sends signal `name` (HUP, TERM, KILL, ...) to a child process with kill(1).
pub fn signal(child: &std::process::Child, name: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{name}");
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until `f` is true, polling every 20 ms; panics with `what` after `timeout`.
pub async fn wait_until(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !f() {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `n` messages in batches of 500 (one statement each on PostgreSQL), 8 batches at a
/// time (a transport that sends a batch one by one still has 8 writers); returns their
/// logical ids.
pub async fn fill(transport: &Arc<dyn Transport>, queue: &QueueName, n: usize) -> Vec<String> {
    const BATCH: usize = 500;
    let messages: Arc<Vec<OutgoingMessage>> = Arc::new(
        (0..n)
            .map(|i| OutgoingMessage::new(format!("message {i}")))
            .collect(),
    );
    let mut writers = Vec::new();
    for w in 0..8 {
        let (t, queue, messages) = (transport.clone(), queue.clone(), messages.clone());
        writers.push(tokio::spawn(async move {
            for batch in messages.chunks(BATCH).skip(w).step_by(8) {
                t.send_batch(&queue, batch).await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    messages.iter().map(|m| m.logical_id()).collect()
}

/// Counts the statements a host sends to its transport.
pub struct Counting {
    pub inner: Arc<dyn Transport>,
    pub receives: AtomicU64,
    pub peeks: AtomicU64,
    /// Reads of many queues' depths at once (a statement per 200 queues on SQL databases).
    pub depth_reads: AtomicU64,
    pub sends: AtomicU64,
    /// Messages taken by each batch receive that found any.
    pub batches: std::sync::Mutex<Vec<usize>>,
    /// Batch receives asked of the inner transport that have not returned.
    batches_out: AtomicU64,
    /// Hands out the inner transport's abilities (delayed delivery, the instance registry,
    /// fleet shares); without, the host runs as on a transport that has none.
    pub abilities: bool,
    /// Hides batch receive and key order too: a transport with the message path only.
    pub bare: bool,
    /// A header and a key: the first message received with that key has its key held in the
    /// store before the receive returns it. What a receive sees whose statement began before
    /// another receive's hold was committed: it took a message that is now held.
    pub held_once_taken: std::sync::Mutex<Option<(String, String)>>,
    /// Tells the host of arrivals its sends make only, and that it tells of all of them, as
    /// PostgreSQL's insert notification does: a message rolled back into its queue comes
    /// unannounced.
    pub sends_announced_only: bool,
    /// Sends under way (arrivals told of meanwhile are theirs).
    sending: Arc<AtomicU64>,
    /// While true, a receive that found a message holds it before returning it, as a frozen
    /// server holds its answer ([`Counting::stall_receives`]).
    stall: tokio::sync::watch::Sender<bool>,
    /// Receives holding a message until the stall ends.
    stalled: AtomicU64,
}

impl Counting {
    pub fn new(inner: Arc<dyn Transport>) -> Arc<Self> {
        Arc::new(Counting {
            inner,
            receives: AtomicU64::new(0),
            peeks: AtomicU64::new(0),
            depth_reads: AtomicU64::new(0),
            sends: AtomicU64::new(0),
            batches: Default::default(),
            batches_out: AtomicU64::new(0),
            abilities: false,
            bare: false,
            held_once_taken: Default::default(),
            sends_announced_only: false,
            sending: Default::default(),
            stall: tokio::sync::watch::Sender::new(false),
            stalled: AtomicU64::new(0),
        })
    }

    /// Hands out the abilities of `inner` (which must tell of arrivals), and tells of the
    /// arrivals of sends only ([`Counting::sends_announced_only`]).
    pub fn announcing_sends_only(inner: Arc<dyn Transport>) -> Arc<Self> {
        let mut counting = Arc::into_inner(Counting::with_abilities(inner)).unwrap();
        counting.sends_announced_only = true;
        Arc::new(counting)
    }

    /// A transport with the message path of `inner` and no ability at all.
    pub fn bare(inner: Arc<dyn Transport>) -> Arc<Self> {
        let mut counting = Arc::into_inner(Counting::new(inner)).unwrap();
        counting.bare = true;
        Arc::new(counting)
    }

    /// Counts the message path of `inner` and hands out its abilities.
    pub fn with_abilities(inner: Arc<dyn Transport>) -> Arc<Self> {
        let mut counting = Arc::into_inner(Counting::new(inner)).unwrap();
        counting.abilities = true;
        Arc::new(counting)
    }

    /// Batch receives under way: asked of the inner transport, not returned yet.
    pub fn batches_out(&self) -> u64 {
        self.batches_out.load(Ordering::SeqCst)
    }

    /// Receives that find a message hold it until `false` is set: they answer late, as those
    /// of a frozen server do, with what they took before.
    pub fn stall_receives(&self, stall: bool) {
        self.stall.send_replace(stall);
    }

    /// Receives holding a message until the stall ends.
    pub fn stalled(&self) -> u64 {
        self.stalled.load(Ordering::SeqCst)
    }

    /// Waits, when a receive `found` messages, until the stall ends.
    async fn held_while_stalled(&self, found: bool) {
        if found && *self.stall.borrow() {
            self.stalled.fetch_add(1, Ordering::SeqCst);
            let mut stall = self.stall.subscribe();
            let _ = stall.wait_for(|stalled| !stalled).await;
            self.stalled.fetch_sub(1, Ordering::SeqCst);
        }
    }

    pub fn receives(&self) -> u64 {
        self.receives.load(Ordering::Relaxed)
    }

    pub fn peeks(&self) -> u64 {
        self.peeks.load(Ordering::Relaxed)
    }

    /// Looks at depths: single peeks and reads of many queues' depths at once.
    pub fn depth_looks(&self) -> u64 {
        self.peeks() + self.depth_reads.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl Transport for Counting {
    fn admin(&self) -> &dyn QueueAdmin {
        self
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.sends.fetch_add(1, Ordering::Relaxed);
        self.sending.fetch_add(1, Ordering::SeqCst);
        let sent = self.inner.send(queue, message).await;
        self.sending.fetch_sub(1, Ordering::SeqCst);
        sent
    }
    async fn receive(
        &self,
        queue: &QueueName,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        self.receives.fetch_add(1, Ordering::Relaxed);
        let received = self.inner.receive(queue).await?;
        self.held_while_stalled(received.is_some()).await;
        if let Some(throttlehost::transport::Payload::Message(m)) =
            received.as_ref().map(|r| r.payload())
        {
            let to_hold = {
                let mut once = self.held_once_taken.lock().unwrap();
                let matches = once.as_ref().is_some_and(|(h, k)| m.header(h) == Some(k));
                if matches { once.take() } else { None }
            };
            if let Some((_, key)) = to_hold {
                let ordering = self.inner.key_ordering().unwrap();
                ordering
                    .hold(queue, m.id, &key, "held by another receive")
                    .await?;
            }
        }
        Ok(received)
    }
    async fn peek_depth(&self, queue: &QueueName) -> Result<u64, TransportError> {
        self.peeks.fetch_add(1, Ordering::Relaxed);
        self.inner.peek_depth(queue).await
    }
    async fn peek_depths(&self, queues: &[QueueName]) -> Vec<Result<u64, TransportError>> {
        self.depth_reads.fetch_add(1, Ordering::Relaxed);
        self.inner.peek_depths(queues).await
    }
    fn connections_in_use(&self) -> u64 {
        self.inner.connections_in_use()
    }
    async fn ping(&self) -> Result<(), TransportError> {
        self.inner.ping().await
    }
    fn delayed_delivery(&self) -> Option<&dyn throttlehost::transport::DelayedDelivery> {
        self.inner.delayed_delivery().filter(|_| self.abilities)
    }
    fn instance_registry(&self) -> Option<&dyn throttlehost::transport::InstanceRegistry> {
        self.inner.instance_registry().filter(|_| self.abilities)
    }
    fn fleet_shares(&self) -> Option<&dyn throttlehost::transport::FleetShares> {
        self.inner.fleet_shares().filter(|_| self.abilities)
    }
    fn batch_receive(&self) -> Option<&dyn throttlehost::transport::BatchReceive> {
        self.inner
            .batch_receive()
            .filter(|_| !self.bare)
            .map(|_| self as _)
    }
    fn key_ordering(&self) -> Option<&dyn throttlehost::transport::KeyOrdering> {
        self.inner.key_ordering().filter(|_| !self.bare)
    }
    fn host_hooks(&self) -> Option<&dyn throttlehost::transport::HostHooks> {
        match self.sends_announced_only {
            true => Some(self as _),
            false => self.inner.host_hooks().filter(|_| self.abilities),
        }
    }
}

/// The inner transport's hooks, with arrivals told of only while a send is under way.
impl throttlehost::transport::HostHooks for Counting {
    fn silent_for(&self) -> Option<Duration> {
        self.inner.host_hooks()?.silent_for()
    }

    fn report_conflicts_to(&self, sink: Arc<dyn throttlehost::transport::ConflictSink>) {
        if let Some(hooks) = self.inner.host_hooks() {
            hooks.report_conflicts_to(sink);
        }
    }

    fn wake_on_arrival(
        &self,
        queues: &[QueueName],
        sink: Arc<dyn throttlehost::transport::ArrivalSink>,
    ) -> bool {
        let sends_only = Arc::new(SendsOnly {
            sink: sink.clone(),
            sending: self.sending.clone(),
        });
        let told = self
            .inner
            .host_hooks()
            .is_some_and(|hooks| hooks.wake_on_arrival(queues, sends_only));
        // As PostgreSQL's listening connection says once it listens: from now on every
        // insert is told of.
        for queue in queues.iter().filter(|_| told) {
            sink.listening(queue, true);
        }
        told
    }
}

/// Passes on the arrivals told of while a send is under way.
struct SendsOnly {
    sink: Arc<dyn throttlehost::transport::ArrivalSink>,
    sending: Arc<AtomicU64>,
}

impl throttlehost::transport::ArrivalSink for SendsOnly {
    fn arrived(&self, queue: &QueueName) {
        if self.sending.load(Ordering::SeqCst) > 0 {
            self.sink.arrived(queue);
        }
    }

    fn listening(&self, queue: &QueueName, notified: bool) {
        self.sink.listening(queue, notified);
    }
}

#[async_trait]
impl QueueAdmin for Counting {
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        self.inner.admin().create_queue(queue).await
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        self.inner.admin().purge_expired(queue).await
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        self.inner.admin().purge(queue).await
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        self.inner.admin().list_queues().await
    }
}

/// Counts batch receives too (the inner transport takes them).
#[async_trait]
impl throttlehost::transport::BatchReceive for Counting {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        self.receives.fetch_add(1, Ordering::Relaxed);
        self.batches_out.fetch_add(1, Ordering::SeqCst);
        let batch = self
            .inner
            .batch_receive()
            .expect("handed out only when the inner transport has it")
            .receive_batch(queue, max)
            .await;
        self.batches_out.fetch_sub(1, Ordering::SeqCst);
        let batch = batch?;
        if !batch.is_empty() {
            self.batches.lock().unwrap().push(batch.len());
        }
        self.held_while_stalled(!batch.is_empty()).await;
        Ok(batch)
    }
}

use throttlehost::config::{ConcurrencyModel, Config, QueueConfig};
use throttlehost::{Context, Handler, HandlerError};

/// A host configuration for tests on PostgreSQL: one queue, no admin endpoint.
pub fn pg_config(schema: &PgSchema, queue: &str, model: ConcurrencyModel, max: u32) -> Config {
    let transport = schema.transport_config(TransactionMode::ReceiveOnly, max + 8);
    host_config(transport, queue, model, max)
}

/// Adds copies of `config`'s first queue, with no-op handlers, until it has `count` queues
/// named `<prefix>00` (the first, named so by the caller) to `<prefix>NN`.
pub fn add_noop_queues(config: &mut Config, prefix: &str, count: usize) {
    let first = config.queues[0].clone();
    for i in 1..count {
        let mut queue = first.clone();
        queue.name = format!("{prefix}{i:02}");
        queue.handler = Some(throttlehost::config::HandlerConfig::Noop);
        config.queues.push(queue);
    }
}

/// A host configuration for tests on any database: one queue, no admin endpoint.
pub fn host_config(
    transport: TransportConfig,
    queue: &str,
    model: ConcurrencyModel,
    max: u32,
) -> Config {
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.host.shutdown_timeout = Duration::from_secs(10);
    config.transport = transport;
    let mut qc = QueueConfig {
        name: queue.into(),
        ..QueueConfig::default()
    };
    qc.concurrency.model = model;
    qc.concurrency.max = max;
    // These hosts test the immediate path: a failed message reaches the error queue after its
    // immediate retries. tests/recoverability.rs covers delayed retries.
    qc.recoverability.delayed_retries = Some(0);
    config.queues.push(qc);
    config
}

/// A handler that records what it saw: ids, concurrency, attempts; optionally slow or failing.
#[derive(Default)]
pub struct Probe {
    pub latency: Duration,
    pub fail: bool,
    pub current: AtomicU64,
    pub peak: AtomicU64,
    pub calls: AtomicU64,
    pub ids: std::sync::Mutex<Vec<String>>,
    /// Concurrency seen by each call when it started: (call number, concurrent).
    pub starts: std::sync::Mutex<Vec<u64>>,
}

impl Probe {
    pub fn new(latency: Duration) -> Arc<Self> {
        Arc::new(Probe {
            latency,
            ..Probe::default()
        })
    }

    pub fn failing() -> Arc<Self> {
        Arc::new(Probe {
            fail: true,
            ..Probe::default()
        })
    }

    pub fn handled(&self) -> usize {
        self.ids.lock().unwrap().len()
    }
}

/// Lets tests register an `Arc<Probe>` and keep a handle.
pub struct ProbeHandler(pub Arc<Probe>);

#[async_trait]
impl Handler for ProbeHandler {
    async fn handle(&self, ctx: &mut Context<'_>) -> Result<(), HandlerError> {
        let p = &self.0;
        p.calls.fetch_add(1, Ordering::Relaxed);
        let now = p.current.fetch_add(1, Ordering::SeqCst) + 1;
        p.peak.fetch_max(now, Ordering::SeqCst);
        p.starts.lock().unwrap().push(now);
        if !p.latency.is_zero() {
            tokio::time::sleep(p.latency).await;
        }
        p.current.fetch_sub(1, Ordering::SeqCst);
        if p.fail {
            return Err("probe told to fail".into());
        }
        p.ids.lock().unwrap().push(ctx.message().logical_id());
        Ok(())
    }

    fn name(&self) -> &str {
        "probe"
    }
}

/// A memory-transport host configuration with the admin endpoint on a free port.
pub fn memory_config(queue: &str) -> Config {
    let mut config = Config::default();
    config.host.admin_address = "127.0.0.1:0".into();
    config.host.shutdown_timeout = Duration::from_secs(5);
    config.throttling.sample_interval = Duration::from_millis(200);
    let mut qc = QueueConfig {
        name: queue.into(),
        ..QueueConfig::default()
    };
    qc.concurrency.peek_interval = Duration::from_millis(200);
    qc.recoverability.delayed_retries = Some(0);
    config.queues.push(qc);
    config
}

/// GET returning (status, body); status 0 when unreachable.
pub fn http(
    method: &str,
    url: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> (u16, String, Option<String>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let result = match method {
        "GET" => {
            let mut r = agent.get(url);
            for (k, v) in headers {
                r = r.header(*k, *v);
            }
            r.call()
        }
        "DELETE" => agent.delete(url).call(),
        m => {
            let mut r = if m == "POST" {
                agent.post(url)
            } else {
                agent.put(url)
            };
            for (k, v) in headers {
                r = r.header(*k, *v);
            }
            r.send(body)
        }
    };
    match result {
        Ok(mut response) => {
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(String::from);
            (
                status,
                response.body_mut().read_to_string().unwrap_or_default(),
                retry_after,
            )
        }
        Err(_) => (0, String::new(), None),
    }
}

/// A PostgreSQL schema with one queue holding a backlog: the start of most receiver tests.
pub struct PgBacklog {
    pub schema: PgSchema,
    pub transport: Arc<dyn Transport>,
    pub queue: QueueName,
    /// Logical ids of the backlog.
    pub sent: std::collections::HashSet<String>,
}

impl PgBacklog {
    /// Creates `queue` in a fresh schema and sends `n` messages to it.
    pub async fn new(queue: &str, n: usize, pool_size: u32) -> Self {
        let schema = PgSchema::new();
        let transport: Arc<dyn Transport> = Arc::new(
            schema
                .transport(TransactionMode::ReceiveOnly, pool_size)
                .await,
        );
        let queue = q(queue);
        transport.admin().create_queue(&queue).await.unwrap();
        let sent = fill(&transport, &queue, n).await.into_iter().collect();
        PgBacklog {
            schema,
            transport,
            queue,
            sent,
        }
    }

    /// The test host configuration for this queue (see [`pg_config`]).
    pub fn config(&self, model: ConcurrencyModel, max: u32) -> Config {
        pg_config(&self.schema, self.queue.as_str(), model, max)
    }

    /// Starts a host on this schema with `probe` handling the queue.
    pub async fn host(&self, config: Config, probe: &Arc<Probe>) -> throttlehost::Host {
        self.host_with(config, ProbeHandler(probe.clone())).await
    }

    /// Starts a host on this schema with `handler` handling the queue.
    pub async fn host_with(&self, config: Config, handler: impl Handler) -> throttlehost::Host {
        throttlehost::HostBuilder::new(config)
            .transport(self.transport.clone())
            .handler(self.queue.as_str(), handler)
            .start()
            .await
            .unwrap()
    }
}

/// Where a [`CommitCutter`] cuts a connection that sends a COMMIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Pass everything.
    Never,
    /// Drop the COMMIT and close: the server rolls the transaction back.
    BeforeCommit,
    /// Pass the COMMIT, give the server a moment to run it, close before its answer comes
    /// back: the commit took effect and the client never hears it.
    AfterCommit,
}

/// A TCP proxy in front of a database server that cuts the next connection to send a
/// COMMIT, where [`Cut`] says (once per arming). New connections pass untouched.
pub struct CommitCutter {
    pub port: u16,
    armed: Arc<std::sync::Mutex<Cut>>,
    /// While set, nothing is relayed either way: a frozen server, as SIGSTOP makes one.
    frozen: Arc<std::sync::atomic::AtomicBool>,
    /// Connections cut so far.
    pub cut: Arc<AtomicU64>,
    /// PostgreSQL statements the clients sent through so far (simple queries and executes of
    /// the extended protocol, read from the message frames; meaningless for TDS).
    pub statements: Arc<AtomicU64>,
}

/// Counts the statements in a PostgreSQL client's byte stream: each simple `Query` ('Q') and
/// each `Execute` ('E') is one. The stream opens with untyped frames (an SSL or GSS request,
/// answered with one byte, then the startup message); every later frame is a type byte and a
/// length that counts itself.
#[derive(Default)]
struct StatementFrames {
    started: bool,
    pending: Vec<u8>,
}

impl StatementFrames {
    const SSL_REQUEST: u32 = 80_877_103;
    const GSS_REQUEST: u32 = 80_877_104;

    /// Takes the next chunk; returns the statements it completed.
    fn read(&mut self, chunk: &[u8]) -> u64 {
        self.pending.extend_from_slice(chunk);
        let mut statements = 0;
        loop {
            let at = usize::from(self.started);
            let Some(length) = self.pending.get(at..at + 4) else {
                return statements;
            };
            let length = u32::from_be_bytes(length.try_into().unwrap()) as usize;
            let frame = at + length;
            if self.pending.len() < frame {
                return statements;
            }
            if self.started {
                statements += u64::from(matches!(self.pending[0], b'Q' | b'E'));
            } else {
                let code = self
                    .pending
                    .get(4..8)
                    .map(|c| u32::from_be_bytes(c.try_into().unwrap()));
                self.started = !matches!(code, Some(Self::SSL_REQUEST | Self::GSS_REQUEST));
            }
            self.pending.drain(..frame);
        }
    }
}

impl CommitCutter {
    /// A proxy on a free loopback port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(std::sync::Mutex::new(Cut::Never));
        let cut = Arc::new(AtomicU64::new(0));
        let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let statements = Arc::new(AtomicU64::new(0));
        let (a, c, f, s) = (
            armed.clone(),
            cut.clone(),
            frozen.clone(),
            statements.clone(),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let ends = (client, server);
                tokio::spawn(Self::relay(
                    ends,
                    a.clone(),
                    c.clone(),
                    f.clone(),
                    s.clone(),
                ));
            }
        });
        CommitCutter {
            port,
            armed,
            cut,
            frozen,
            statements,
        }
    }

    /// Stops (true) or resumes (false) relaying on every connection.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::SeqCst);
    }

    /// A proxy in front of the tests' PostgreSQL, and `schema`'s transport settings pointed
    /// through it, without TLS (the proxy reads the statements).
    pub async fn for_postgres(
        schema: &PgSchema,
        mode: TransactionMode,
        pool_size: u32,
    ) -> (Self, TransportConfig) {
        let url = database_url();
        let upstream = url
            .split('@')
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .expect("DATABASE_URL names host:port after '@'")
            .to_string();
        let proxy = Self::start(upstream.clone()).await;
        let mut config = schema.transport_config(mode, pool_size);
        config.connection_string = ConnectionString::new(
            schema
                .connection_string()
                .replace(&upstream, &format!("127.0.0.1:{}", proxy.port))
                + "&sslmode=disable",
        );
        (proxy, config)
    }

    /// Cuts the next connection that sends a COMMIT, as `cut` says.
    pub fn arm(&self, cut: Cut) {
        *self.armed.lock().unwrap() = cut;
    }

    async fn relay(
        (client, server): (tokio::net::TcpStream, tokio::net::TcpStream),
        armed: Arc<std::sync::Mutex<Cut>>,
        cut: Arc<AtomicU64>,
        frozen: Arc<std::sync::atomic::AtomicBool>,
        statements: Arc<AtomicU64>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut frames = StatementFrames::default();
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        let thaw = |frozen: Arc<std::sync::atomic::AtomicBool>| async move {
            while frozen.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let answers_frozen = frozen.clone();
        let answers = tokio::spawn(async move {
            let mut buffer = vec![0u8; 64 * 1024];
            loop {
                let n = match server_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                thaw(answers_frozen.clone()).await;
                if client_write.write_all(&buffer[..n]).await.is_err() {
                    break;
                }
            }
        });
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            thaw(frozen.clone()).await;
            let chunk = &buffer[..n];
            statements.fetch_add(frames.read(chunk), Ordering::SeqCst);
            // PostgreSQL sends statements as UTF-8, TDS as UTF-16LE.
            const WIDE: &[u8] = b"C\0O\0M\0M\0I\0T\0";
            let commits = chunk.windows(6).any(|w| w.eq_ignore_ascii_case(b"COMMIT"))
                || chunk
                    .windows(WIDE.len())
                    .any(|w| w.eq_ignore_ascii_case(WIDE));
            let action = match commits {
                true => std::mem::replace(&mut *armed.lock().unwrap(), Cut::Never),
                false => Cut::Never,
            };
            match action {
                Cut::Never => {
                    if server_write.write_all(chunk).await.is_err() {
                        break;
                    }
                }
                Cut::BeforeCommit => {
                    cut.fetch_add(1, Ordering::SeqCst);
                    break;
                }
                Cut::AfterCommit => {
                    // The answer must not reach the client: stop relaying answers first.
                    answers.abort();
                    cut.fetch_add(1, Ordering::SeqCst);
                    let _ = server_write.write_all(chunk).await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    break;
                }
            }
        }
        answers.abort();
    }
}
