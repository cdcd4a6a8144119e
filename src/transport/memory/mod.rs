//! In-process queues for `demo`, unit tests and simulations.
//!
//! It behaves like the database transports where it matters to the layers above: FIFO by a
//! sequence number, a received message is invisible to other receivers until its receive
//! ends, rollback (or dropping the receive) puts it back at its original position, expiry is
//! checked on receive. Everything lives in this process: **messages are lost when it exits**.
//!
//! "Connections in use" counts open receives, since each would hold a connection on a real
//! database. Built from a configuration ([`MemoryTransport::simulating`]), it goes further and
//! behaves like a pooled database: at most `pool_size` sessions (an open receive holds one
//! until it ends, a send or peek briefly), a wait of up to `connect_timeout` for a free one,
//! and `simulated_latency` per statement. Load tests use that to drive the publishing-rate
//! and database-sessions conditions without a database.

mod failed;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use super::delayed::{DelayedDelivery, Moved, delayed_headers};
use super::fleet::{
    BeatRow, FLEET_ORDER_ROWS, FleetShares, Heartbeat, InstanceRecord, InstanceRegistry,
    ShareClaim, ShareRow,
};
use super::{
    ArrivalSink, HeldKey, Payload, QueueAdmin, QueueName, Received, Transport, TransportError,
};
use crate::config::{DEFAULT_DELAYED_TABLE_SUFFIX, OrderingConfig, TransactionMode};
use crate::message::{
    EXECUTION_STAGE_HEADER, Headers, Message, OutgoingMessage, PREVIOUS_STAGE_HEADER,
};

#[derive(Debug, Clone)]
struct StoredMessage {
    id: Uuid,
    headers: Headers,
    body: Vec<u8>,
    expires: Option<SystemTime>,
    /// Deliver no sooner than this: stored in the queue's delayed table until then.
    due: Option<SystemTime>,
}

#[derive(Default)]
struct QueueState {
    ready: BTreeMap<u64, StoredMessage>,
    next_seq: u64,
    /// How receives keep order; None = plain FIFO (shared so a receive need not copy it).
    ordering: Option<Arc<OrderingConfig>>,
    /// Keys with a message in flight: none of their messages may be taken until it ends.
    busy_keys: HashSet<String>,
    /// Stages with messages in flight, and how many.
    busy_stages: HashMap<String, usize>,
    /// Keys held by a failed message (`failed_key = "hold"`), oldest first.
    held: Vec<HeldKey>,
}

/// What an ordered message holds while it is in flight: its key and its stage.
#[derive(Debug, Default)]
struct Holds {
    key: Option<String>,
    stage: Option<String>,
}

fn header_of(m: &StoredMessage, name: &str) -> Option<String> {
    m.headers.get(name).cloned().flatten()
}

impl QueueState {
    /// The stages with a message left, ready or in flight (empty unless stages are ordered).
    fn unfinished_stages(&self, ordering: &OrderingConfig) -> HashSet<String> {
        if !ordering.stages {
            return HashSet::new();
        }
        self.ready
            .values()
            .filter_map(|m| header_of(m, EXECUTION_STAGE_HEADER))
            .chain(self.busy_stages.keys().cloned())
            .collect()
    }

    /// Whether `m` may run now: its key has nothing in flight and its previous stage has no
    /// message left. The oldest ready message of a free key is found first by an ordered
    /// scan, so the key's order holds.
    fn may_run(
        &self,
        ordering: &OrderingConfig,
        unfinished: &HashSet<String>,
        m: &StoredMessage,
    ) -> bool {
        let key = ordering.key_header().and_then(|h| header_of(m, h));
        key.is_none_or(|k| !self.busy_keys.contains(&k))
            && !self.held.iter().any(|h| h.message_id == m.id)
            && (!ordering.stages
                || header_of(m, PREVIOUS_STAGE_HEADER).is_none_or(|p| !unfinished.contains(&p)))
    }

    /// Takes the oldest message that may run now (any message on an unordered queue) and
    /// marks its key and stage busy.
    fn take_next(&mut self) -> Option<(u64, StoredMessage, Holds)> {
        let Some(ordering) = self.ordering.clone() else {
            return self
                .ready
                .pop_first()
                .map(|(seq, m)| (seq, m, Holds::default()));
        };
        let unfinished = self.unfinished_stages(&ordering);
        // Of each key only the oldest ready message may run (a held one holds the rest).
        let mut seen_keys = HashSet::new();
        let seq = self
            .ready
            .iter()
            .find(|(_, m)| {
                ordering
                    .key_header()
                    .and_then(|h| header_of(m, h))
                    .is_none_or(|k| seen_keys.insert(k))
                    && self.may_run(&ordering, &unfinished, m)
            })
            .map(|(seq, _)| *seq)?;
        let message = self.ready.remove(&seq)?;
        let holds = Holds {
            key: ordering.key_header().and_then(|h| header_of(&message, h)),
            stage: ordering
                .stages
                .then(|| header_of(&message, EXECUTION_STAGE_HEADER))
                .flatten(),
        };
        if let Some(k) = &holds.key {
            self.busy_keys.insert(k.clone());
        }
        if let Some(stage) = &holds.stage {
            *self.busy_stages.entry(stage.clone()).or_default() += 1;
        }
        Some((seq, message, holds))
    }

    /// Ready messages that may not run now; None on an unordered queue.
    fn waiting(&self) -> Option<u64> {
        let ordering = self.ordering.as_ref()?;
        let unfinished = self.unfinished_stages(ordering);
        // Of a free key only the oldest may run: the rest wait for it.
        let mut seen_keys = HashSet::new();
        let waiting = self
            .ready
            .values()
            .filter(|m| {
                let first_of_key = ordering
                    .key_header()
                    .and_then(|h| header_of(m, h))
                    .is_none_or(|k| seen_keys.insert(k));
                !(first_of_key && self.may_run(ordering, &unfinished, m))
            })
            .count();
        Some(waiting as u64)
    }

    /// Frees what an ended receive held.
    fn release(&mut self, holds: &Holds) {
        if let Some(key) = &holds.key {
            self.busy_keys.remove(key);
        }
        if let Some(stage) = &holds.stage
            && let Some(n) = self.busy_stages.get_mut(stage)
        {
            *n -= 1;
            if *n == 0 {
                self.busy_stages.remove(stage);
            }
        }
    }
}

/// A queue's delayed table: messages by due time, then by arrival. A move happens under its
/// lock, so movers never overlap.
#[derive(Default)]
struct DelayedTable {
    rows: BTreeMap<(SystemTime, u64), StoredMessage>,
    next: u64,
}

#[derive(Default)]
struct Shared {
    queues: Mutex<HashMap<QueueName, Arc<Mutex<QueueState>>>>,
    delayed: Mutex<HashMap<QueueName, DelayedTable>>,
    open_receives: AtomicU64,
    /// Told of every message that becomes receivable ([`Transport::wake_on_arrival`]).
    arrivals: Mutex<Option<Arc<dyn ArrivalSink>>>,
    /// The instance registry: each host process's last heartbeat, when it first and last beat.
    instances: Mutex<BTreeMap<Uuid, (Heartbeat, tokio::time::Instant, tokio::time::Instant)>>,
    /// The shares of fleet-wide limits: (queue, process) to (wanted, granted).
    shares: Mutex<BTreeMap<(QueueName, Uuid), (u32, u32)>>,
}

impl Shared {
    fn queue(&self, name: &QueueName) -> Result<Arc<Mutex<QueueState>>, TransportError> {
        lock(&self.queues)
            .get(name)
            .cloned()
            .ok_or_else(|| TransportError::QueueNotFound(name.to_string()))
    }

    /// Checks that `message` can be stored in `name` (the queue, or its delayed table when
    /// the message is delayed) without storing it.
    fn check(&self, name: &QueueName, message: &StoredMessage) -> Result<(), TransportError> {
        match message.due {
            Some(_) if !lock(&self.delayed).contains_key(name) => Err(no_delayed_table(name)),
            Some(_) => Ok(()),
            None => self.queue(name).map(|_| ()),
        }
    }

    fn insert(&self, name: &QueueName, mut message: StoredMessage) -> Result<(), TransportError> {
        if let Some(due) = message.due.take() {
            let mut tables = lock(&self.delayed);
            let table = tables.get_mut(name).ok_or_else(|| no_delayed_table(name))?;
            let n = table.next;
            table.next += 1;
            // The memory transport's address of a queue is its name.
            message.headers = delayed_headers(&message.headers, name.to_string());
            table.rows.insert((due, n), message);
            return Ok(());
        }
        let queue = self.queue(name)?;
        {
            let mut state = lock(&queue);
            let seq = state.next_seq;
            state.next_seq += 1;
            state.ready.insert(seq, message);
        }
        self.arrived(name);
        Ok(())
    }

    /// Wakes `name`'s idle receivers, when someone listens.
    fn arrived(&self, name: &QueueName) {
        let sink = lock(&self.arrivals).clone();
        if let Some(sink) = sink {
            sink.arrived(name);
        }
    }
}

/// A poisoned lock only means another thread panicked while holding it; the queue data is
/// still consistent (every mutation is a single map operation), so keep going.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A simulated database behind the queues: a session pool and a latency per statement.
struct SimulatedDatabase {
    sessions: Arc<Semaphore>,
    pool_size: u32,
    wait_timeout: Duration,
    latency: Duration,
}

/// The in-process transport.
#[derive(Clone)]
pub struct MemoryTransport {
    shared: Arc<Shared>,
    mode: TransactionMode,
    database: Option<Arc<SimulatedDatabase>>,
}

/// A session of the simulated database; None when not simulating.
type Session = Option<OwnedSemaphorePermit>;

impl MemoryTransport {
    /// An empty transport without limits; `mode` decides when a receive deletes.
    pub fn new(mode: TransactionMode) -> Self {
        MemoryTransport {
            shared: Arc::new(Shared::default()),
            mode,
            database: None,
        }
    }

    /// An empty transport that behaves like a pooled database: `pool_size` sessions, a wait of
    /// up to `wait_timeout` for one, `latency` per statement.
    pub fn simulating(
        mode: TransactionMode,
        pool_size: u32,
        wait_timeout: Duration,
        latency: Duration,
    ) -> Self {
        MemoryTransport {
            shared: Arc::new(Shared::default()),
            mode,
            database: Some(Arc::new(SimulatedDatabase {
                sessions: Arc::new(Semaphore::new(pool_size.max(1) as usize)),
                pool_size: pool_size.max(1),
                wait_timeout,
                latency,
            })),
        }
    }

    /// Takes a session and spends one statement's latency.
    async fn statement(&self) -> Result<Session, TransportError> {
        let Some(db) = &self.database else {
            return Ok(None);
        };
        let permit = tokio::time::timeout(db.wait_timeout, db.sessions.clone().acquire_owned())
            .await
            .map_err(|_| TransportError::PoolTimeout {
                waited: db.wait_timeout,
                pool_size: db.pool_size,
            })?
            .map_err(|_| TransportError::connection("the simulated database is closed"))?;
        if !db.latency.is_zero() {
            tokio::time::sleep(db.latency).await;
        }
        Ok(Some(permit))
    }
}

/// The row a message becomes; refused when its expiry or delay cannot be stored.
fn stored_from(message: &OutgoingMessage) -> Result<StoredMessage, TransportError> {
    super::ttbr_millis(message)?;
    let delay = message
        .checked_delay()
        .map_err(TransportError::InvalidMessage)?;
    Ok(StoredMessage {
        id: message.id,
        headers: message.headers.clone(),
        body: message.body.clone(),
        expires: message.time_to_be_received.map(|t| SystemTime::now() + t),
        due: delay.map(|d| SystemTime::now() + d),
    })
}

/// The error for `queue`'s missing delayed table, named as the SQL transports name it.
fn no_delayed_table(queue: &QueueName) -> TransportError {
    TransportError::DelayedTableNotFound {
        queue: queue.to_string(),
        table: format!("{queue}.{DEFAULT_DELAYED_TABLE_SUFFIX}"),
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    fn key_ordering(&self) -> Option<&dyn super::KeyOrdering> {
        Some(self)
    }

    fn batch_receive(&self) -> Option<&dyn super::BatchReceive> {
        Some(self)
    }

    fn describe(&self) -> String {
        "memory (in-process; messages are lost when the process exits)".into()
    }

    /// Every message stored ready in a queue (sent, committed with a receive, moved when
    /// due) wakes its receivers: an in-process queue needs no peek to know.
    fn wake_on_arrival(&self, _queues: &[QueueName], sink: Arc<dyn ArrivalSink>) {
        *lock(&self.shared.arrivals) = Some(sink);
    }

    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let stored = stored_from(message)?;
        let _session = self.statement().await?;
        self.shared.insert(queue, stored)
    }

    async fn receive(
        &self,
        queue: &QueueName,
    ) -> Result<Option<Box<dyn Received>>, TransportError> {
        let state = self.shared.queue(queue)?;
        let session = self.statement().await?;
        let Some((seq, stored, holds)) = lock(&state).take_next() else {
            return Ok(None);
        };
        let expired = stored.expires.is_some_and(|e| e <= SystemTime::now());
        let payload = if expired {
            Payload::Expired { id: stored.id }
        } else {
            Payload::Message(Message {
                id: stored.id,
                headers: stored.headers.clone(),
                body: Vec::new(),
                expires: stored.expires.map(DateTime::<Utc>::from),
            })
        };
        let mut received = MemoryReceived {
            shared: self.shared.clone(),
            queue_name: queue.clone(),
            queue: state,
            seq,
            holds,
            stored: Some(stored),
            payload,
            pending_sends: Vec::new(),
            restore_on_drop: self.mode != TransactionMode::None,
            // Mode none commits on receive: the session is not held through the handler.
            session: if self.mode == TransactionMode::None {
                None
            } else {
                session
            },
            failed: false,
        };
        // The body moves into the payload; `stored` keeps the rest for a rollback.
        if let (Payload::Message(m), Some(s)) = (&mut received.payload, &mut received.stored) {
            m.body = std::mem::take(&mut s.body);
        }
        self.shared.open_receives.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Box::new(received)))
    }

    async fn peek_depth(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let _session = self.statement().await?;
        let depth = lock(&state).ready.len() as u64;
        Ok(depth)
    }

    fn connections_in_use(&self) -> u64 {
        match &self.database {
            Some(db) => {
                (db.pool_size as usize).saturating_sub(db.sessions.available_permits()) as u64
            }
            None => self.shared.open_receives.load(Ordering::Relaxed),
        }
    }

    fn delayed_delivery(&self) -> Option<&dyn DelayedDelivery> {
        Some(self)
    }

    fn instance_registry(&self) -> Option<&dyn InstanceRegistry> {
        Some(self)
    }

    fn failed_store(&self) -> Option<&dyn super::failed::FailedStore> {
        Some(self)
    }

    fn fleet_shares(&self) -> Option<&dyn FleetShares> {
        Some(self)
    }

    async fn ping(&self) -> Result<(), TransportError> {
        Ok(())
    }
}

#[async_trait]
impl DelayedDelivery for MemoryTransport {
    async fn create_delayed(&self, queue: &QueueName) -> Result<(), TransportError> {
        lock(&self.shared.delayed).entry(queue.clone()).or_default();
        Ok(())
    }

    async fn move_due(&self, queue: &QueueName, batch: u32) -> Result<Moved, TransportError> {
        let target = self.shared.queue(queue)?;
        let _session = self.statement().await?;
        let now = SystemTime::now();
        let due: Vec<StoredMessage> = {
            let mut tables = lock(&self.shared.delayed);
            let table = tables
                .get_mut(queue)
                .ok_or_else(|| TransportError::QueueNotFound(format!("{queue}.Delayed")))?;
            let keys: Vec<(SystemTime, u64)> = table
                .rows
                .range(..(now, u64::MAX))
                .take(batch as usize)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| table.rows.remove(k)).collect()
        };
        let moved = due.len() as u64;
        {
            let mut state = lock(&target);
            for message in due {
                let seq = state.next_seq;
                state.next_seq += 1;
                state.ready.insert(seq, message);
            }
        }
        if moved > 0 {
            self.shared.arrived(queue);
        }
        let tables = lock(&self.shared.delayed);
        let table = tables.get(queue);
        Ok(Moved {
            moved,
            next_due_in: table
                .and_then(|t| t.rows.keys().next())
                .map(|(due, _)| due.duration_since(now).unwrap_or_default()),
            waiting: table.map_or(0, |t| t.rows.len() as u64),
            busy: false,
        })
    }

    async fn delayed_count(&self, queue: &QueueName) -> Result<u64, TransportError> {
        lock(&self.shared.delayed)
            .get(queue)
            .map(|t| t.rows.len() as u64)
            .ok_or_else(|| no_delayed_table(queue))
    }

    async fn delayed_table_exists(&self, queue: &QueueName) -> Result<bool, TransportError> {
        Ok(lock(&self.shared.delayed).contains_key(queue))
    }

    fn delayed_table(&self, queue: &QueueName) -> String {
        format!("{queue}.{DEFAULT_DELAYED_TABLE_SUFFIX}")
    }
}

#[async_trait]
impl QueueAdmin for MemoryTransport {
    async fn create_queue(&self, queue: &QueueName) -> Result<(), TransportError> {
        lock(&self.shared.queues).entry(queue.clone()).or_default();
        Ok(())
    }

    async fn purge_expired(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let mut state = lock(&state);
        let now = SystemTime::now();
        let before = state.ready.len();
        state.ready.retain(|_, m| m.expires.is_none_or(|e| e > now));
        Ok((before - state.ready.len()) as u64)
    }

    async fn purge(&self, queue: &QueueName) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let mut state = lock(&state);
        let n = state.ready.len() as u64;
        state.ready.clear();
        Ok(n)
    }

    async fn list_queues(&self) -> Result<Vec<String>, TransportError> {
        let mut names: Vec<String> = lock(&self.shared.queues)
            .keys()
            .map(|q| q.to_string())
            .collect();
        names.sort();
        Ok(names)
    }
}

struct MemoryReceived {
    shared: Arc<Shared>,
    queue_name: QueueName,
    queue: Arc<Mutex<QueueState>>,
    seq: u64,
    /// Its ordering key and stage, busy until this receive ends.
    holds: Holds,
    /// The row as stored minus its body (which is in the payload); None once finished.
    stored: Option<StoredMessage>,
    payload: Payload,
    pending_sends: Vec<(QueueName, StoredMessage)>,
    /// False in transaction mode `none`: the message was deleted for good on receive.
    restore_on_drop: bool,
    /// The simulated database session this receive holds until it ends.
    session: Session,
    /// A send inside this unit of work failed: like a database, refuse to commit it.
    failed: bool,
}

impl MemoryReceived {
    fn finish(&mut self, restore: bool) {
        let Some(mut stored) = self.stored.take() else {
            return;
        };
        self.shared.open_receives.fetch_sub(1, Ordering::Relaxed);
        self.session = None;
        let restored = restore && self.restore_on_drop;
        {
            let mut queue = lock(&self.queue);
            if restored {
                if let Payload::Message(m) = &mut self.payload {
                    stored.body = std::mem::take(&mut m.body);
                }
                queue.ready.insert(self.seq, stored);
            }
            // Back in place (or gone) before the key and stage are free: the next receive
            // sees the row it must take first, or wait for.
            queue.release(&self.holds);
        }
        // A message back in its queue, or a key or stage freed, is work for an idle receiver.
        if restored || self.holds.key.is_some() || self.holds.stage.is_some() {
            self.shared.arrived(&self.queue_name);
        }
    }
}

impl Drop for MemoryReceived {
    fn drop(&mut self) {
        self.finish(true);
    }
}

#[async_trait]
impl Received for MemoryReceived {
    fn payload(&self) -> &Payload {
        &self.payload
    }

    async fn send(
        &mut self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let stored = match stored_from(message)
            .and_then(|stored| self.shared.check(queue, &stored).map(|()| stored))
        {
            Ok(stored) => stored,
            Err(e) => {
                self.failed = true;
                return Err(e);
            }
        };
        if self.restore_on_drop {
            self.pending_sends.push((queue.clone(), stored));
            Ok(())
        } else {
            self.shared.insert(queue, stored)
        }
    }

    async fn dead_letter(&mut self, queue: &QueueName) -> Result<(), TransportError> {
        let Some(stored) = &self.stored else {
            return Err(TransportError::database("receive already ended"));
        };
        let mut copy = stored.clone();
        copy.expires = None;
        if let Payload::Message(m) = &self.payload {
            copy.body = m.body.clone();
        }
        self.shared.queue(queue)?;
        self.pending_sends.push((queue.clone(), copy));
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<(), TransportError> {
        if self.failed {
            self.pending_sends.clear();
            self.finish(true);
            return Err(TransportError::aborted(&self.queue_name));
        }
        for (queue, message) in std::mem::take(&mut self.pending_sends) {
            self.shared.insert(&queue, message)?;
        }
        self.finish(false);
        Ok(())
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), TransportError> {
        self.pending_sends.clear();
        self.finish(true);
        Ok(())
    }

    async fn hold(&mut self, key: &str, reason: &str) -> Result<(), TransportError> {
        let id = self.payload.id();
        let mut queue = lock(&self.queue);
        if !queue.held.iter().any(|h| h.message_id == id) {
            queue.held.push(HeldKey {
                key: key.to_string(),
                message_id: id,
                reason: reason.to_string(),
                held_at: chrono::Utc::now()
                    .format("%Y-%m-%d %H:%M:%S%.3f")
                    .to_string(),
            });
        }
        Ok(())
    }
}

/// The registry of hosts sharing this transport (in one process: tests, `demo`).
#[async_trait]
impl InstanceRegistry for MemoryTransport {
    async fn create_registry(&self) -> Result<(), TransportError> {
        Ok(())
    }

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<BeatRow>, TransportError> {
        let now = tokio::time::Instant::now();
        let mut instances = lock(&self.shared.instances);
        instances
            .entry(beat.process_id)
            .and_modify(|(last, _, seen)| {
                *last = beat.clone();
                *seen = now;
            })
            .or_insert_with(|| (beat.clone(), now, now));
        Ok(instances
            .iter()
            .map(|(id, (last, _, seen))| BeatRow {
                process_id: *id,
                summary: last.summary.clone(),
                seen_seconds_ago: seen.elapsed().as_secs_f64(),
            })
            .collect())
    }

    async fn instances(&self) -> Result<Vec<InstanceRecord>, TransportError> {
        let mut all: Vec<InstanceRecord> = lock(&self.shared.instances)
            .values()
            .filter(|(beat, _, _)| !FLEET_ORDER_ROWS.contains(&beat.process_id))
            .map(|(beat, started, seen)| InstanceRecord {
                heartbeat: beat.clone(),
                up_seconds: started.elapsed().as_secs_f64(),
                seen_seconds_ago: seen.elapsed().as_secs_f64(),
            })
            .collect();
        all.sort_by(|a, b| a.seen_seconds_ago.total_cmp(&b.seen_seconds_ago));
        Ok(all)
    }

    async fn forget(&self, older_than: Duration) -> Result<u64, TransportError> {
        let mut instances = lock(&self.shared.instances);
        let before = instances.len();
        instances.retain(|id, (_, _, seen)| {
            FLEET_ORDER_ROWS.contains(id) || seen.elapsed() <= older_than
        });
        Ok((before - instances.len()) as u64)
    }

    async fn leave(&self, process_id: Uuid) -> Result<(), TransportError> {
        lock(&self.shared.instances).remove(&process_id);
        Ok(())
    }
}

/// Shares of fleet-wide limits among hosts sharing this transport (in one process). The
/// shares' lock is the round's lock; the registry's is taken inside it, never the other way.
#[async_trait]
impl FleetShares for MemoryTransport {
    async fn create_shares(&self) -> Result<(), TransportError> {
        Ok(())
    }

    async fn share_round(
        &self,
        queue: &QueueName,
        me: Uuid,
        gone_after: Duration,
        decide: &mut (dyn for<'r> FnMut(&'r [ShareRow]) -> ShareClaim + Send),
    ) -> Result<ShareClaim, TransportError> {
        let mut shares = lock(&self.shared.shares);
        let seen: BTreeMap<Uuid, Duration> = {
            let mut instances = lock(&self.shared.instances);
            // A host that takes its share is alive.
            if let Some((_, _, seen)) = instances.get_mut(&me) {
                *seen = tokio::time::Instant::now();
            }
            instances
                .iter()
                .map(|(id, (_, _, seen))| (*id, seen.elapsed()))
                .collect()
        };
        shares.retain(|(q, id), _| q != queue || *id == me || seen.contains_key(id));
        let rows: Vec<ShareRow> = shares
            .iter()
            .filter(|((q, _), _)| q == queue)
            .map(|((_, id), (wanted, granted))| ShareRow {
                process_id: *id,
                wanted: *wanted,
                granted: *granted,
                alive: seen.get(id).is_some_and(|ago| *ago <= gone_after),
            })
            .collect();
        let claim = decide(&rows);
        shares.insert((queue.clone(), me), (claim.wanted, claim.granted));
        Ok(claim)
    }

    async fn drop_shares(&self, me: Uuid) -> Result<(), TransportError> {
        lock(&self.shared.shares).retain(|(_, id), _| *id != me);
        Ok(())
    }
}

#[async_trait]
impl super::KeyOrdering for MemoryTransport {
    async fn order_by_key(
        &self,
        queue: &QueueName,
        ordering: &OrderingConfig,
    ) -> Result<(), TransportError> {
        super::check_orderable(self.mode, queue)?;
        let state = self.shared.queue(queue)?;
        lock(&state).ordering = ordering.is_ordered().then(|| Arc::new(ordering.clone()));
        Ok(())
    }

    async fn held_keys(&self, queue: &QueueName) -> Result<Vec<HeldKey>, TransportError> {
        let state = self.shared.queue(queue)?;
        let held = lock(&state).held.clone();
        Ok(held)
    }

    async fn release_held(
        &self,
        queue: &QueueName,
        key: Option<&str>,
    ) -> Result<u64, TransportError> {
        let state = self.shared.queue(queue)?;
        let mut state = lock(&state);
        let before = state.held.len();
        state.held.retain(|h| key.is_some_and(|k| h.key != k));
        Ok((before - state.held.len()) as u64)
    }

    async fn waiting_in_order(&self, queue: &QueueName) -> Result<Option<u64>, TransportError> {
        let state = self.shared.queue(queue)?;
        let waiting = lock(&state).waiting();
        Ok(waiting)
    }
}

#[async_trait]
impl super::BatchReceive for MemoryTransport {
    async fn receive_batch(
        &self,
        queue: &QueueName,
        max: usize,
    ) -> Result<Vec<Box<dyn Received>>, TransportError> {
        let state = self.shared.queue(queue)?;
        if lock(&state).ordering.is_some() {
            return Err(super::refuse_ordered_batch(queue));
        }
        super::batch::EachOnItsOwn::receive(self, queue, max).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn q(name: &str) -> QueueName {
        QueueName::new(name).unwrap()
    }

    async fn transport() -> MemoryTransport {
        let t = MemoryTransport::new(TransactionMode::ReceiveOnly);
        t.create_queue(&q("in")).await.unwrap();
        t
    }

    async fn body_of(t: &MemoryTransport) -> Option<Vec<u8>> {
        let r = t.receive(&q("in")).await.unwrap()?;
        let body = match r.payload() {
            Payload::Message(m) => m.body.clone(),
            other => panic!("unexpected {other:?}"),
        };
        r.commit().await.unwrap();
        Some(body)
    }

    #[tokio::test]
    async fn fifo_order() {
        let t = transport().await;
        for i in 0..5u8 {
            t.send(&q("in"), &OutgoingMessage::new(vec![i]))
                .await
                .unwrap();
        }
        for i in 0..5u8 {
            assert_eq!(body_of(&t).await, Some(vec![i]));
        }
        assert_eq!(body_of(&t).await, None);
    }

    #[tokio::test]
    async fn rollback_returns_the_message_to_the_head() {
        let t = transport().await;
        for i in 0..3u8 {
            t.send(&q("in"), &OutgoingMessage::new(vec![i]))
                .await
                .unwrap();
        }
        let first = t.receive(&q("in")).await.unwrap().unwrap();
        assert_eq!(
            t.peek_depth(&q("in")).await.unwrap(),
            2,
            "in-flight row is not counted"
        );
        first.rollback().await.unwrap();
        assert_eq!(body_of(&t).await, Some(vec![0]));
        assert_eq!(body_of(&t).await, Some(vec![1]));
    }

    #[tokio::test]
    async fn dropping_a_receive_rolls_it_back() {
        let t = transport().await;
        t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
        drop(t.receive(&q("in")).await.unwrap());
        assert_eq!(t.connections_in_use(), 0);
        assert_eq!(body_of(&t).await, Some(b"x".to_vec()));
    }

    #[tokio::test]
    async fn expired_messages_are_flagged_on_receive() {
        let t = transport().await;
        let m = OutgoingMessage::new("old").with_time_to_be_received(Duration::from_millis(1));
        t.send(&q("in"), &m).await.unwrap();
        t.send(
            &q("in"),
            &OutgoingMessage::new("new").with_time_to_be_received(Duration::from_secs(60)),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let r = t.receive(&q("in")).await.unwrap().unwrap();
        assert!(matches!(r.payload(), Payload::Expired { id } if *id == m.id));
        r.commit().await.unwrap();
        assert_eq!(body_of(&t).await, Some(b"new".to_vec()));
    }

    #[tokio::test]
    async fn purge_expired_leaves_live_messages() {
        let t = transport().await;
        t.send(
            &q("in"),
            &OutgoingMessage::new("a").with_time_to_be_received(Duration::from_millis(1)),
        )
        .await
        .unwrap();
        t.send(&q("in"), &OutgoingMessage::new("b")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(t.purge_expired(&q("in")).await.unwrap(), 1);
        assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 1);
    }

    #[tokio::test]
    async fn sends_in_a_receive_appear_only_on_commit() {
        let t = transport().await;
        t.create_queue(&q("out")).await.unwrap();
        t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
        let mut r = t.receive(&q("in")).await.unwrap().unwrap();
        r.send(&q("out"), &OutgoingMessage::new("y")).await.unwrap();
        assert_eq!(t.peek_depth(&q("out")).await.unwrap(), 0);
        r.rollback().await.unwrap();
        assert_eq!(t.peek_depth(&q("out")).await.unwrap(), 0);
        let mut r = t.receive(&q("in")).await.unwrap().unwrap();
        r.send(&q("out"), &OutgoingMessage::new("y")).await.unwrap();
        r.commit().await.unwrap();
        assert_eq!(t.peek_depth(&q("out")).await.unwrap(), 1);
        assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn mode_none_deletes_on_receive() {
        let t = MemoryTransport::new(TransactionMode::None);
        t.create_queue(&q("in")).await.unwrap();
        t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
        let r = t.receive(&q("in")).await.unwrap().unwrap();
        r.rollback().await.unwrap();
        assert_eq!(t.peek_depth(&q("in")).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_simulated_database_holds_a_session_per_open_receive() {
        let t = MemoryTransport::simulating(
            TransactionMode::ReceiveOnly,
            2,
            Duration::from_millis(50),
            Duration::ZERO,
        );
        t.create_queue(&q("in")).await.unwrap();
        for _ in 0..3 {
            t.send(&q("in"), &OutgoingMessage::new("x")).await.unwrap();
        }
        let a = t.receive(&q("in")).await.unwrap().unwrap();
        let b = t.receive(&q("in")).await.unwrap().unwrap();
        assert_eq!(t.connections_in_use(), 2);
        let err = t
            .send(&q("in"), &OutgoingMessage::new("y"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransportError::PoolTimeout { pool_size: 2, .. }),
            "{err}"
        );
        a.commit().await.unwrap();
        assert_eq!(t.connections_in_use(), 1);
        t.send(&q("in"), &OutgoingMessage::new("y")).await.unwrap();
        drop(b);
        assert_eq!(t.connections_in_use(), 0);
    }

    #[tokio::test]
    async fn unknown_queue_is_an_error_that_names_it() {
        let t = transport().await;
        let err = t
            .send(&q("nope"), &OutgoingMessage::new("x"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("nope"));
    }
}
