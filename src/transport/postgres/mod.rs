//! PostgreSQL transport: the NServiceBus PostgreSQL transport's table layout and statements on
//! tokio-postgres with a deadpool pool.
//!
//! A receive takes a pooled connection, runs `BEGIN; EXECUTE <receive>` as one query (one
//! round trip, see `pipeline`), and keeps connection and transaction open until the caller
//! commits or rolls back. A receive dropped without either discards its connection, which makes the
//! server roll the transaction back: the message returns to the queue.
//!
//! This file is the face: the transport, its shared state and the message path's core. The
//! rooms: `connection` (libpq settings, errors), `store` (sends and the unit of work),
//! `receive` (rows a receive returns, batches), `pipeline` (the one-query receive), `ordering`
//! (held keys), `lanes` (the pool in lanes, shared fairly by many queues), `found_empty`
//! (receives that need not run: their queue was found empty while they waited), `admin` (tables,
//! layout, purge), `delayed` (the delayed table), `listen`
//! (notifications), `tls`, `failed` (the failed-messages store), [`fleet`] (instances and
//! shares).

mod admin;
mod connection;
mod delayed;
mod failed;
pub mod fleet;
mod found_empty;
mod lanes;
mod listen;
mod ordering;
mod pipeline;
mod receive;
mod statements;
mod store;
mod subscriptions;
mod tls;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{
    Manager, ManagerConfig, Object, ObjectId, Pool, PoolError, QueueMode, RecyclingMethod, Runtime,
};
use tokio_postgres::error::SqlState;

pub use statements::{QueueStatements, held_statements, quote_ident};

use super::delayed::DelayedDelivery;
use super::{QueueName, Received, Transport, TransportError};
use crate::config::{TransactionMode, TransportConfig};
use crate::message::OutgoingMessage;
use crate::names::{validate_delayed_table_suffix, validate_schema_name};

use self::connection::{check_url_userinfo, libpq_environment, map_error};
use self::lanes::{Lane, Lanes, Lent};
use self::receive::decode_row;

/// Connections [`Inner::prepared_receives`] remembers before it starts over: closed
/// connections leave their entries behind, and forgetting a live one costs one `PREPARE`
/// that finds the name taken.
const PREPARED_REMEMBERED: usize = 1024;

/// Rows deleted per statement by [`Transport::purge_expired`].
const PURGE_BATCH: i64 = 10_000;

/// The PostgreSQL transport.
#[derive(Clone)]
pub struct PostgresTransport {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Lanes,
    schema: String,
    /// Delayed tables are `<queue>.<delayed_suffix>` (`transport.delayed_table_suffix`).
    delayed_suffix: String,
    /// The subscription table's schema, quoted (`transport.subscription_schema`).
    subscription_schema: String,
    /// The subscription table, quoted: `"schema"."SubscriptionRouting"` by default.
    subscription_table: String,
    mode: TransactionMode,
    pool_size: u32,
    wait_timeout: Duration,
    /// How long the client waits for an answer before it gives the connection up (see
    /// [`Inner::answered`]).
    answer_deadline: Duration,
    /// Statements waiting for an answer, to tell a database that stopped answering.
    silence: Arc<super::silence::Silence>,
    statements: RwLock<HashMap<QueueName, Arc<QueueStatements>>>,
    /// Which pooled connections have which receive statements prepared under their SQL
    /// names (see `pipeline`).
    prepared_receives: Mutex<HashMap<(Lane, ObjectId), Vec<String>>>,
    /// When each queue was last found empty, so receives that waited meanwhile need not run.
    found_empty: found_empty::FoundEmpty,
    /// How the listening connection connects (see `listen`): the pool's settings.
    listen_with: (
        tokio_postgres::Config,
        Option<tokio_postgres_rustls::MakeRustlsConnect>,
    ),
    /// Whether tables get the insert trigger and the host listens (`notify_on_insert`).
    notify_on_insert: bool,
    /// Ends the listening connection with the transport.
    stop_listening: tokio_util::sync::CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop_listening.cancel();
    }
}

impl PostgresTransport {
    /// Opens a pool from the configuration and checks that the server answers.
    pub async fn connect(config: &TransportConfig) -> Result<Self, TransportError> {
        let transport = Self::new(config)?;
        transport.ping().await?;
        Ok(transport)
    }

    /// Builds the pool without connecting (connections open on first use).
    pub fn new(config: &TransportConfig) -> Result<Self, TransportError> {
        let schema = config.effective_schema().to_string();
        validate_schema_name(&schema).map_err(TransportError::InvalidName)?;
        validate_delayed_table_suffix(&config.delayed_table_suffix).map_err(|message| {
            TransportError::Setting {
                setting: "transport.delayed_table_suffix",
                message,
            }
        })?;
        let (pg, tls_connector) = client_config(config)?;
        let pool = pool_of(config, &pg, tls_connector.as_ref())?;
        let listen_with = (pg, tls_connector);
        Ok(PostgresTransport {
            inner: Arc::new(Inner {
                pool,
                schema,
                delayed_suffix: config.delayed_table_suffix.clone(),
                subscription_schema: quote_ident(config.effective_subscription_schema()),
                subscription_table: format!(
                    "{}.{}",
                    quote_ident(config.effective_subscription_schema()),
                    quote_ident(&config.subscription_table)
                ),
                mode: config.transaction_mode,
                pool_size: config.pool_size,
                wait_timeout: config.connect_timeout,
                answer_deadline: config.command_timeout + ANSWER_GRACE,
                silence: Arc::default(),
                statements: RwLock::new(HashMap::new()),
                prepared_receives: Mutex::new(HashMap::new()),
                found_empty: Default::default(),
                listen_with,
                notify_on_insert: config.notify_on_insert,
                stop_listening: tokio_util::sync::CancellationToken::new(),
            }),
        })
    }

    /// The schema the queue tables live in.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }
}

/// The client settings from `transport.connection_string` (libpq's environment filled in,
/// the connect and statement timeouts, the application name) and the TLS connector its
/// `sslmode` asks for.
fn client_config(
    config: &TransportConfig,
) -> Result<
    (
        tokio_postgres::Config,
        Option<tokio_postgres_rustls::MakeRustlsConnect>,
    ),
    TransportError,
> {
    check_url_userinfo(config.connection_string.expose())?;
    let tls = tls::TlsSettings::read(config.connection_string.expose());
    let mut pg = tokio_postgres::Config::from_str(&tls.connection_string).map_err(|e| {
        TransportError::Setting {
            setting: "transport.connection_string",
            message: format!(
                "not a PostgreSQL connection string ({e}); got {}",
                config.connection_string
            ),
        }
    })?;
    libpq_environment(&mut pg);
    pg.connect_timeout(config.connect_timeout);
    if pg.get_application_name().is_none() {
        pg.application_name("throttlehost");
    }
    let statement_timeout = format!(
        "-c statement_timeout={}",
        config.command_timeout.as_millis()
    );
    let options = match pg.get_options() {
        Some(existing) => format!("{existing} {statement_timeout}"),
        None => statement_timeout,
    };
    pg.options(&options);
    let tls_connector = match pg.get_ssl_mode() {
        tokio_postgres::config::SslMode::Disable => None,
        // libpq semantics (see `tls`): prefer/require encrypt without checking the
        // certificate; verify-ca/verify-full check it.
        _ => Some(tls.connector().map_err(|e| TransportError::Setting {
            setting: "transport.connection_string",
            message: e.to_string(),
        })?),
    };
    Ok((pg, tls_connector))
}

/// The pool of `transport.pool_size` connections, in lanes.
fn pool_of(
    config: &TransportConfig,
    pg: &tokio_postgres::Config,
    tls_connector: Option<&tokio_postgres_rustls::MakeRustlsConnect>,
) -> Result<Lanes, TransportError> {
    Lanes::split(config.pool_size as usize, |size| {
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match tls_connector {
            None => Manager::from_config(pg.clone(), tokio_postgres::NoTls, manager_config),
            Some(tls) => Manager::from_config(pg.clone(), tls.clone(), manager_config),
        };
        Pool::builder(manager)
            .max_size(size)
            // The connection returned last is lent first: an idle host's few statements
            // (depth reads and sweeps of many tables, safety-net peeks) go to one or two
            // backends, which plan them and load those tables' catalog entries once. Lent
            // in turn, every backend of the pool did that work again: with 1 000 queues,
            // about 30 % of a core of PostgreSQL for a host doing nothing.
            .queue_mode(QueueMode::Lifo)
            .wait_timeout(Some(config.connect_timeout))
            .create_timeout(Some(config.connect_timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| TransportError::Setting {
                setting: "transport.pool_size",
                message: format!("cannot build the connection pool: {e}"),
            })
    })
}

/// How much longer than `command_timeout` the client waits for an answer: the server's own
/// `statement_timeout` error should come first whenever the server is alive.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

impl Inner {
    /// Runs `work` on `client`, waiting at most the answer deadline, and hands the client
    /// back with what the work returned. The server enforces `command_timeout` itself
    /// (`statement_timeout`), but a frozen server or a network that drops packets never
    /// answers, and the kernel keeps acknowledging a stopped server's socket, so without this
    /// a receive waited forever and nothing was logged. On timeout the connection is closed
    /// (its state is unknown; the server rolls back what it had).
    async fn answered<T>(
        &self,
        what: &'static str,
        client: Lent,
        work: impl AsyncFnOnce(&Object) -> T,
    ) -> Result<(Lent, T), TransportError> {
        self.answered_mut(what, client, async |c: &mut Object| work(c).await)
            .await
    }

    /// [`Inner::answered`] for work that needs the connection mutably (a transaction).
    async fn answered_mut<T>(
        &self,
        what: &'static str,
        mut client: Lent,
        work: impl AsyncFnOnce(&mut Object) -> T,
    ) -> Result<(Lent, T), TransportError> {
        let ticket = self.silence.ask();
        match tokio::time::timeout(self.answer_deadline, work(&mut *client)).await {
            Ok(answer) => {
                ticket.answered();
                Ok((client, answer))
            }
            Err(_) => {
                ticket.unanswered();
                discard(client);
                Err(TransportError::Unanswered {
                    what,
                    after: self.answer_deadline,
                })
            }
        }
    }

    /// How long statements wait unanswered before the database counts as not answering.
    fn silent_after(&self) -> Duration {
        super::silence::SILENT_AFTER.min(self.answer_deadline)
    }

    /// The schema `queue`'s table is in: the one its address names, else the transport's.
    fn schema_of<'q>(&'q self, queue: &'q QueueName) -> &'q str {
        queue.parts().schema.unwrap_or(&self.schema)
    }

    fn statements(&self, queue: &QueueName) -> Result<Arc<QueueStatements>, TransportError> {
        if let Some(s) = self
            .statements
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(s.clone());
        }
        let parts = queue.parts();
        if parts.catalog.is_some() {
            return Err(TransportError::queue(
                queue,
                "names a catalog: a PostgreSQL address is \"schema\".\"table\" (the database is the connection's)",
            ));
        }
        crate::names::validate_postgres_table_name(parts.table)
            .map_err(TransportError::InvalidName)?;
        let built = Arc::new(QueueStatements::new(
            &self.schema,
            queue,
            &self.delayed_suffix,
        ));
        self.statements
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.clone(), built.clone());
        Ok(built)
    }

    /// Whether `client` (of `lane`) has the receive of `st` prepared under its SQL name.
    fn receive_prepared(&self, (lane, client): (Lane, &Object), st: &QueueStatements) -> bool {
        self.prepared_receives
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(lane, Object::id(client)))
            .is_some_and(|names| names.contains(&st.receive_name))
    }

    /// Prepares the receive of `st` on `client` under its SQL name, once per connection
    /// (outside a transaction: a name found taken is an error that would abort one).
    async fn prepare_receive(
        &self,
        (lane, client): (Lane, &Object),
        st: &QueueStatements,
    ) -> Result<(), tokio_postgres::Error> {
        if self.receive_prepared((lane, client), st) {
            return Ok(());
        }
        let prepare = format!("PREPARE {} AS {}", st.receive_name, st.receive);
        match client.batch_execute(&prepare).await {
            Ok(()) => {}
            // Prepared before this set was started over.
            Err(e) if e.code() == Some(&SqlState::DUPLICATE_PSTATEMENT) => {}
            Err(e) => return Err(e),
        }
        let mut prepared = self
            .prepared_receives
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if prepared.len() >= PREPARED_REMEMBERED {
            prepared.clear();
        }
        prepared
            .entry((lane, Object::id(client)))
            .or_default()
            .push(st.receive_name.clone());
        Ok(())
    }

    /// A connection for statements that serve no one queue (see [`Lanes::SHARED`]).
    async fn client(&self) -> Result<Lent, TransportError> {
        let lent = self.pool.get(Lanes::SHARED).await;
        lent.map_err(|e| self.pool_error(e))
    }

    /// A connection for `queue`'s statements, from its home lane when one is free there.
    async fn client_for(&self, queue: &QueueName) -> Result<Lent, TransportError> {
        let lent = self.pool.get_for(queue).await;
        lent.map_err(|e| self.pool_error(e))
    }

    fn pool_error(&self, e: PoolError) -> TransportError {
        match e {
            // Every connection waits on a database that says nothing: that, not the pool's
            // size, is the news.
            PoolError::Timeout(_) => match self.silence.silent_for(self.silent_after()) {
                Some(silent) => TransportError::connection(format!(
                    "the database is not answering: statements have waited {:.0} s with no answer",
                    silent.as_secs_f64()
                )),
                None => TransportError::PoolTimeout {
                    waited: self.wait_timeout,
                    pool_size: self.pool_size,
                },
            },
            PoolError::Backend(e) => map_error(e, None),
            other => TransportError::connection(other.to_string()),
        }
    }
}

/// Drops a pooled connection instead of returning it: used whenever its state is unknown
/// (an error mid-transaction, a cancelled receive). Closing it makes the server roll back.
fn discard(client: Lent) {
    client.close();
}

#[async_trait]
impl Transport for PostgresTransport {
    fn admin(&self) -> &dyn crate::transport::QueueAdmin {
        self
    }

    fn key_ordering(&self) -> Option<&dyn crate::transport::KeyOrdering> {
        Some(self)
    }

    fn batch_receive(&self) -> Option<&dyn crate::transport::BatchReceive> {
        Some(self)
    }

    fn describe(&self) -> String {
        format!(
            "postgres (schema \"{}\", pool {})",
            self.inner.schema, self.inner.pool_size
        )
    }

    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let client = self.inner.client_for(queue).await?;
        let (_, sent) = self
            .inner
            .answered("a send", client, async |c| {
                self.inner.send_on(c, queue, message).await
            })
            .await?;
        sent
    }

    async fn send_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        if messages.is_empty() {
            return Ok(());
        }
        let client = self.inner.client_for(queue).await?;
        let (_, sent) = self
            .inner
            .answered("a batch send", client, async |c| {
                self.inner.send_many_on(c, queue, messages).await
            })
            .await?;
        sent
    }

    async fn receive(
        &self,
        queue: &QueueName,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let st = self.inner.statements(queue)?;
        let asked = tokio::time::Instant::now();
        let client = self.inner.client_for(queue).await?;
        if self.inner.found_empty.since(queue, asked) {
            return Ok(None);
        }
        let sent = tokio::time::Instant::now();
        let lane = client.lane();
        let transactional = self.inner.mode != TransactionMode::None;
        let (client, row) = self
            .inner
            .answered("a receive", client, async |c| {
                if transactional {
                    if let Err(e) = self.inner.prepare_receive((lane, c), &st).await {
                        return Err(map_error(e, Some(queue)));
                    }
                    // `BEGIN; EXECUTE`: one query, one answer (see `pipeline`).
                    let (_, row) = pipeline::begin_and_receive(c, false, &st.receive_name)
                        .await
                        .outcome(queue);
                    row.unwrap_or_else(|| {
                        Err(TransportError::database(format!(
                            "the receive from queue `{queue}` did not begin"
                        )))
                    })
                } else {
                    let stmt = match c.prepare_cached(&st.receive).await {
                        Ok(stmt) => stmt,
                        Err(e) => return Err(map_error(e, Some(queue))),
                    };
                    match c.query_opt(&stmt, &[]).await {
                        Ok(Some(row)) => decode_row(queue, &row).map(Some),
                        Ok(None) => Ok(None),
                        Err(e) => Err(map_error(e, Some(queue))),
                    }
                }
            })
            .await?;
        self.inner
            .clone()
            .received(queue, (client, sent), transactional, row)
            .await
    }

    async fn peek_depth(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let st = self.inner.statements(queue)?;
        self.inner.count(queue, "a peek", &st.peek).await
    }

    async fn peek_depths(&self, queues: &[QueueName]) -> Vec<Result<u64, TransportError>> {
        let mut depths = Vec::with_capacity(queues.len());
        for chunk in queues.chunks(super::DEPTHS_PER_STATEMENT) {
            depths.extend(self.inner.peek_chunk(chunk).await);
        }
        depths
    }

    fn connections_in_use(&self) -> u64 {
        self.inner.pool.in_use() as u64
    }

    fn delayed_delivery(&self) -> Option<&dyn DelayedDelivery> {
        Some(self)
    }

    fn instance_registry(&self) -> Option<&dyn crate::transport::InstanceRegistry> {
        Some(self)
    }

    fn failed_store(&self) -> Option<&dyn crate::transport::failed::FailedStore> {
        Some(self)
    }

    fn subscriptions(&self) -> Option<&dyn crate::transport::Subscriptions> {
        Some(self)
    }

    fn fleet_shares(&self) -> Option<&dyn crate::transport::FleetShares> {
        Some(self)
    }

    async fn ping(&self) -> Result<(), TransportError> {
        let client = self.inner.client().await?;
        let (_, answer) = self
            .inner
            .answered("a ping", client, async |c| c.simple_query("SELECT 1").await)
            .await?;
        answer.map(|_| ()).map_err(|e| map_error(e, None))
    }

    /// NServiceBus's canonical PostgreSQL address, `"schema"."table"`.
    fn address(&self, queue: &QueueName) -> String {
        format!(
            "{}.{}",
            quote_ident(self.inner.schema_of(queue)),
            quote_ident(queue.table())
        )
    }

    fn resolve_address(&self, address: &str) -> Option<QueueName> {
        super::address::parse(address, &self.inner.schema, None)
    }

    fn host_hooks(&self) -> Option<&dyn super::HostHooks> {
        Some(self)
    }
}

impl super::HostHooks for PostgresTransport {
    fn silent_for(&self) -> Option<Duration> {
        self.inner.silence.silent_for(self.inner.silent_after())
    }

    /// One listening connection for all of `queues` (outside the pool), woken by the
    /// tables' insert trigger (see `listen`).
    fn wake_on_arrival(&self, queues: &[QueueName], sink: Arc<dyn super::ArrivalSink>) -> bool {
        if !self.inner.notify_on_insert {
            return false;
        }
        let channels: HashMap<String, QueueName> = queues
            .iter()
            .filter_map(|queue| {
                let st = self.inner.statements(queue).ok()?;
                Some((st.notify_channel.clone(), queue.clone()))
            })
            .collect();
        if channels.is_empty() {
            return false;
        }
        let (config, tls) = self.inner.listen_with.clone();
        let listener = listen::Listener {
            config,
            tls,
            channels,
            sink,
            stop: self.inner.stop_listening.clone(),
            schema: self.inner.schema.clone(),
        };
        tokio::spawn(listener.run());
        // The listener marks each queue as told of while it listens (`ArrivalSink::listening`).
        true
    }
}
