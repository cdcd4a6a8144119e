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
//!
//! This file is the face: the transport, its shared state and the message path. The rooms:
//! `queue` (one queue), `received` (an open receive), `delayed`, `admin` (with key ordering
//! and batches), `fleet` and `failed`.

mod admin;
mod delayed;
mod failed;
mod fleet;
mod queue;
mod received;
mod subscriptions;

use self::delayed::{DelayedTable, no_delayed_table};
use self::queue::{QueueState, StoredMessage};
use self::received::MemoryReceived;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use super::delayed::{DelayedDelivery, delayed_headers};
use super::fleet::{FleetShares, Heartbeat, InstanceRegistry};
use super::{ArrivalSink, Payload, QueueName, Received, Transport, TransportError};
use crate::config::TransactionMode;
use crate::message::{Message, OutgoingMessage};

#[derive(Default)]
struct Shared {
    clock: StoreClock,
    queues: Mutex<HashMap<QueueName, Arc<Mutex<QueueState>>>>,
    delayed: Mutex<HashMap<QueueName, DelayedTable>>,
    open_receives: AtomicU64,
    /// Told of every message that becomes receivable ([`Transport::wake_on_arrival`]).
    arrivals: Mutex<Option<Arc<dyn ArrivalSink>>>,
    /// The instance registry: each host process's last heartbeat, when it first and last beat.
    instances: Mutex<BTreeMap<Uuid, (Heartbeat, tokio::time::Instant, tokio::time::Instant)>>,
    /// The shares of fleet-wide limits: (queue, process) to (wanted, granted).
    shares: Mutex<BTreeMap<(QueueName, Uuid), (u32, u32)>>,
    /// The subscription table once created: (endpoint, topic) to queue address.
    subscriptions: Mutex<Option<BTreeMap<(String, String), String>>>,
}

/// The store's wall clock: the wall-clock time it was made at, plus tokio's time since. In
/// real time it is the wall clock; in a test under paused time, expiries and due times
/// follow the paused clock as the receive loops and the movers do.
struct StoreClock {
    wall: SystemTime,
    origin: tokio::time::Instant,
}

impl Default for StoreClock {
    fn default() -> Self {
        StoreClock {
            wall: SystemTime::now(),
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Shared {
    /// Now, by the store's clock ([`StoreClock`]).
    fn now(&self) -> SystemTime {
        self.clock.wall + self.clock.origin.elapsed()
    }

    /// The row a message becomes; refused when its expiry or delay cannot be stored.
    fn stored_from(&self, message: &OutgoingMessage) -> Result<StoredMessage, TransportError> {
        super::ttbr_millis(message)?;
        let delay = message
            .checked_delay()
            .map_err(TransportError::InvalidMessage)?;
        let now = self.now();
        Ok(StoredMessage {
            id: message.id,
            headers: message.headers.clone(),
            body: message.body.clone(),
            expires: message.time_to_be_received.map(|t| now + t),
            due: delay.map(|d| now + d),
        })
    }

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

#[async_trait]
impl Transport for MemoryTransport {
    fn admin(&self) -> &dyn crate::transport::QueueAdmin {
        self
    }

    fn key_ordering(&self) -> Option<&dyn super::KeyOrdering> {
        Some(self)
    }

    fn batch_receive(&self) -> Option<&dyn super::BatchReceive> {
        Some(self)
    }

    fn describe(&self) -> String {
        "memory (in-process; messages are lost when the process exits)".into()
    }

    async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let stored = self.shared.stored_from(message)?;
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
        let expired = stored.expires.is_some_and(|e| e <= self.shared.now());
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
            transport: self.clone(),
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

    fn subscriptions(&self) -> Option<&dyn super::Subscriptions> {
        Some(self)
    }

    fn fleet_shares(&self) -> Option<&dyn FleetShares> {
        Some(self)
    }

    async fn ping(&self) -> Result<(), TransportError> {
        Ok(())
    }

    fn host_hooks(&self) -> Option<&dyn super::HostHooks> {
        Some(self)
    }
}

impl super::HostHooks for MemoryTransport {
    /// Every message stored ready in a queue (sent, committed with a receive, moved when
    /// due) wakes its receivers: an in-process queue needs no peek to know.
    fn wake_on_arrival(&self, _queues: &[QueueName], sink: Arc<dyn ArrivalSink>) -> bool {
        *lock(&self.shared.arrivals) = Some(sink);
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::transport::QueueAdmin;

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
