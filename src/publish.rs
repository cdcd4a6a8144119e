//! The one send path: the library API, the forward handler, handler sends and HTTP ingest all
//! come through here, so all of them wait the publishing throttle and are counted once.
//!
//! A send is two steps: [`Publisher::admit`] (counts the request as incoming, then waits the
//! publishing delay or pacing) and an insert (counts it as outgoing: stored). Incoming is what
//! publishers ask for, counted before any wait, so pacing cannot hide the imbalance it is
//! pacing and cancel itself; outgoing is what the database has taken. [`Publisher::send`]
//! does both steps; handler sends admit when the handler asks and insert when it has
//! succeeded.
//!
//! Publishing an event ([`Publisher::publish`]) is a send to every subscriber of its topics:
//! each copy is admitted as a send is (so events are publishing load like any send), and all
//! copies are stored in one transaction. Who subscribes is read from the subscription table
//! and kept for `transport.subscription_cache` (see [`events`]).

mod events;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub use self::events::EventTypes;
use self::events::{SubscriberCache, TopicLabels};
use crate::depth::DepthCell;
use crate::message::{MessageIntent, OutgoingMessage};
use crate::metrics::Metrics;
use crate::throttling::Throttle;
use crate::transport::{QueueName, Received, Transport, TransportError};

/// The throttled publisher.
pub(crate) struct Publisher {
    transport: Arc<dyn Transport>,
    throttle: Arc<Throttle>,
    metrics: Metrics,
    /// Every queue published to or tracked, with its published-messages counter and depth:
    /// one lookup per insert.
    targets: RwLock<HashMap<QueueName, Target>>,
    /// Where the delayed tables' movers hear of messages stored here.
    schedule: Arc<crate::delayed::Schedule>,
    /// The subscribers of the topics published to, kept for a while.
    subscribers: SubscriberCache,
    /// The event metrics' topic labels.
    topics: TopicLabels,
    /// The connections sends may hold at once.
    sessions: SendSessions,
}

/// The connections of the transport's pool sends may hold at once, so receives keep theirs.
///
/// Sends and receives share one pool. A publishing burst queues a send for every connection
/// and more, and the receivers waited behind them: delivery completed 7 messages in 6 s while
/// the backlog grew by 1 482 and showed state 0, since nothing it measures was over a line.
/// Receives are kept the smaller of their total concurrency and a quarter of the pool; sends
/// hold the rest. A send inside an open receive uses the receive's connection and holds none.
/// (Half the pool cost publishing too much: a flood stored at 2 of 4 connections left
/// `load/publishing-rate.toml` throttled 17 s after it ended; at 3 of 4 delivery still drains
/// at 295 a second where it stopped.)
#[derive(Default)]
struct SendSessions(Option<tokio::sync::Semaphore>);

impl SendSessions {
    /// Sends may hold `pool` less what receives are kept (see [`SendSessions`]).
    fn for_pool(pool: u32, receive_concurrency: u32) -> Self {
        let kept = receive_concurrency.min(pool / 4);
        match kept {
            0 => SendSessions(None),
            _ => SendSessions(Some(tokio::sync::Semaphore::new((pool - kept) as usize))),
        }
    }

    /// Waits for a connection sends may hold; held until the permit drops.
    async fn hold(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        match &self.0 {
            // Never closed: the semaphore lives as long as the publisher.
            Some(sessions) => sessions.acquire().await.ok(),
            None => None,
        }
    }

    /// How many connections sends may hold, if they are bounded.
    #[cfg(test)]
    fn limit(&self) -> Option<usize> {
        self.0.as_ref().map(|s| s.available_permits())
    }
}

/// What publishing an event did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// The queues a copy was stored in (none: nobody subscribes to its topics).
    pub subscribers: Vec<QueueName>,
}

#[derive(Clone)]
struct Target {
    published: metrics::Counter,
    depth: Arc<DepthCell>,
    /// Published to (not only tracked).
    used: bool,
}

impl Publisher {
    /// A publisher writing through `transport`, throttled by `throttle`.
    pub(crate) fn new(
        transport: Arc<dyn Transport>,
        throttle: Arc<Throttle>,
        metrics: Metrics,
    ) -> Self {
        Publisher {
            transport,
            throttle,
            metrics,
            targets: RwLock::new(HashMap::new()),
            schedule: Arc::default(),
            subscribers: SubscriberCache::new(DEFAULT_SUBSCRIPTION_CACHE),
            topics: TopicLabels::default(),
            sessions: SendSessions::default(),
        }
    }

    /// Bounds the connections sends hold at once to what a pool of `pool` leaves after
    /// keeping receives theirs (see [`SendSessions`]); `receive_concurrency` is the queues'
    /// total max.
    pub(crate) fn with_pool(mut self, pool: u32, receive_concurrency: u32) -> Self {
        self.sessions = SendSessions::for_pool(pool, receive_concurrency);
        self
    }

    /// Keeps the subscribers found for a topic for `ttl` (`transport.subscription_cache`;
    /// zero: read on every publish).
    pub(crate) fn with_subscription_cache(mut self, ttl: Duration) -> Self {
        self.subscribers = SubscriberCache::new(ttl);
        self
    }

    /// Publishes an event of `types`: a copy in the queue of every subscriber of its topics,
    /// each admitted as a send (one publishing wait per copy), all stored in one transaction
    /// with intent `Publish` and `EnclosedMessageTypes` the types. A topic without
    /// subscribers stores nothing and is counted (`events_without_subscribers_total`); a
    /// transport without a subscription table, or a table that cannot be read, is an error
    /// and nothing is stored.
    pub(crate) async fn publish(
        &self,
        types: &EventTypes,
        message: OutgoingMessage,
    ) -> Result<Published, TransportError> {
        let queues = self.subscriber_queues(types).await?;
        let message = as_event(message, types);
        let copies: Vec<(QueueName, OutgoingMessage)> = queues
            .iter()
            .map(|q| (q.clone(), message.clone()))
            .collect();
        for _ in &copies {
            self.admit().await;
        }
        self.store_copies(&copies).await?;
        self.event_published(types, copies.len());
        Ok(Published {
            subscribers: queues,
        })
    }

    /// Stores an admitted event's copies in one transaction and counts each as a send.
    pub(crate) async fn store_copies(
        &self,
        copies: &[(QueueName, OutgoingMessage)],
    ) -> Result<(), TransportError> {
        if let (Some(store), false) = (self.transport.subscriptions(), copies.is_empty()) {
            let _session = self.sessions.hold().await;
            store.deliver(copies).await?;
        }
        for (queue, copy) in copies {
            self.published(queue, copy);
        }
        Ok(())
    }

    /// The queues subscribed to any of `types`' topics, as this transport names them.
    /// Addresses it cannot read as its own (another transport's, a catalog it cannot reach)
    /// are passed over with a warning.
    pub(crate) async fn subscriber_queues(
        &self,
        types: &EventTypes,
    ) -> Result<Vec<QueueName>, TransportError> {
        let store = self
            .transport
            .subscriptions()
            .ok_or_else(|| TransportError::Setting {
                setting: "transport.kind",
                message: "this transport keeps no subscription table, so it cannot publish".into(),
            })?;
        let addresses = self.subscribers.subscribers(store, &types.topics()).await?;
        let mut queues = Vec::with_capacity(addresses.len());
        for address in addresses.iter() {
            match self.transport.resolve_address(address) {
                Some(queue) if !queues.contains(&queue) => queues.push(queue),
                Some(_) => {}
                None => tracing::warn!(
                    topic = types.topic(),
                    address = %address,
                    "a subscriber's queue address is not one this transport can reach; the event is not stored for it"
                ),
            }
        }
        Ok(queues)
    }

    /// Counts a published event with its copies.
    pub(crate) fn event_published(&self, types: &EventTypes, copies: usize) {
        let label = self.topics.label(types.topic());
        self.metrics.event_published(&label, copies as u64);
    }

    /// Tells the mover of `queue`'s delayed table that this process stored a message due
    /// after `delay`, so it looks no later than then (NServiceBus shortens its back-off the
    /// same way). Nothing when no mover listens.
    pub(crate) fn scheduled(&self, queue: &QueueName, delay: Option<Duration>) {
        if let Some(delay) = delay {
            self.schedule.due_in(queue, delay);
        }
    }

    /// The movers' schedule this publisher tells of delayed sends.
    pub(crate) fn schedule(&self) -> &Arc<crate::delayed::Schedule> {
        &self.schedule
    }

    /// The transport messages are sent through.
    pub(crate) fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Admits and inserts one message.
    pub(crate) async fn send(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.admit().await;
        self.insert(queue, message).await
    }

    /// Waits until publishing admits each message (one wait per message, as for
    /// [`Publisher::send`]), and stores them with as few statements as the throttle allows:
    /// in one batch when nothing had to wait, otherwise what was admitted so far each time a
    /// wait was needed, so a throttled batch is stored at the pace it is admitted.
    pub(crate) async fn send_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        let mut stored = 0;
        for admitted in 0..messages.len() {
            // `admitted` messages before this one have passed: store them before a wait.
            let waited = self.admit().await;
            if !waited.is_zero() && admitted > stored {
                self.insert_batch(queue, &messages[stored..admitted])
                    .await?;
                stored = admitted;
            }
        }
        self.insert_batch(queue, &messages[stored..]).await
    }

    /// Inserts admitted messages, in one statement where the transport can.
    async fn insert_batch(
        &self,
        queue: &QueueName,
        messages: &[OutgoingMessage],
    ) -> Result<(), TransportError> {
        // Every transport takes an empty slice as nothing to do.
        let session = self.sessions.hold().await;
        self.transport.send_batch(queue, messages).await?;
        drop(session);
        for m in messages {
            self.published(queue, m);
        }
        Ok(())
    }

    /// Counts one request, then waits until publishing admits it; returns the wait.
    pub(crate) async fn admit(&self) -> Duration {
        self.throttle.publishing_rates.incoming();
        self.throttle.publishing.admit().await
    }

    /// Inserts an admitted message on its own connection.
    pub(crate) async fn insert(
        &self,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let session = self.sessions.hold().await;
        self.transport.send(queue, message).await?;
        drop(session);
        self.published(queue, message);
        Ok(())
    }

    /// Inserts an admitted message inside an open receive (it appears if the receive commits).
    pub(crate) async fn insert_within(
        &self,
        received: &mut dyn Received,
        queue: &QueueName,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        received.send(queue, message).await?;
        self.published(queue, message);
        Ok(())
    }

    /// Counts a stored message: published, and in the queue's depth unless it waits in the
    /// delayed table (its mover counts those, and tells the depth nothing when it moves them:
    /// the next read does).
    pub(crate) fn published(&self, queue: &QueueName, message: &OutgoingMessage) {
        if message.deliver_after.is_some() {
            self.scheduled(queue, message.deliver_after);
        }
        self.throttle.publishing_rates.outgoing();
        let known = self
            .targets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .filter(|t| t.used)
            .cloned();
        let target = known.unwrap_or_else(|| {
            let mut targets = self.targets.write().unwrap_or_else(|e| e.into_inner());
            let target = targets
                .entry(queue.clone())
                .or_insert_with(|| self.target(queue, Arc::default()));
            target.used = true;
            target.clone()
        });
        target.published.increment(1);
        if message.deliver_after.is_none() {
            target.depth.arrived();
        }
    }

    fn target(&self, queue: &QueueName, depth: Arc<DepthCell>) -> Target {
        Target {
            published: self.metrics.published(queue.as_str()),
            depth,
            used: false,
        }
    }

    /// Counts this host's sends into `depth` (a receiving queue's cell, shared with its
    /// receiver and the throttling probe).
    pub(crate) fn track_depth(&self, queue: &QueueName, depth: Arc<DepthCell>) {
        let mut targets = self.targets.write().unwrap_or_else(|e| e.into_inner());
        match targets.get_mut(queue) {
            Some(t) => t.depth = depth,
            None => {
                let target = self.target(queue, depth);
                targets.insert(queue.clone(), target);
            }
        }
    }

    /// The depth of a queue published to, with this host's sends counted in.
    pub(crate) fn depth(&self, queue: &QueueName) -> Option<Arc<DepthCell>> {
        self.targets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .map(|t| t.depth.clone())
    }

    /// Every queue this host has published to (their depths count toward database size).
    pub(crate) fn targets(&self) -> Vec<QueueName> {
        self.targets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, t)| t.used)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The wait a new send would see right now (delay plus one pacing interval).
    pub(crate) fn current_wait(&self) -> Duration {
        self.throttle.publishing.delay() + self.throttle.publishing.pace().unwrap_or_default()
    }
}

/// NServiceBus's default time to keep a topic's subscribers (`CacheInvalidationPeriod`).
const DEFAULT_SUBSCRIPTION_CACHE: Duration = Duration::from_secs(5);

/// `message` as a published event of `types`: intent `Publish` and the enclosed types.
pub(crate) fn as_event(message: OutgoingMessage, types: &EventTypes) -> OutgoingMessage {
    message
        .with_intent(MessageIntent::Publish)
        .with_enclosed_message_types(types.header())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TransactionMode;
    use crate::transport::Payload;
    use crate::transport::memory::MemoryTransport;

    async fn bodies(transport: &dyn Transport, queue: &QueueName) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(r) = transport.receive(queue).await.unwrap() {
            if let Payload::Message(m) = r.payload() {
                out.push(m.body.clone());
            }
            r.commit().await.unwrap();
        }
        out
    }

    /// Receives keep the smaller of their concurrency and a quarter of the pool; sends hold
    /// the rest, and all of it when nothing receives or the pool has under 4 connections.
    #[tokio::test(start_paused = true)]
    async fn sends_leave_receives_their_share_of_the_pool() {
        assert_eq!(SendSessions::for_pool(4, 2).limit(), Some(3));
        assert_eq!(SendSessions::for_pool(30, 20).limit(), Some(23));
        assert_eq!(SendSessions::for_pool(20, 4).limit(), Some(16));
        assert_eq!(SendSessions::for_pool(20, 0).limit(), None);
        assert_eq!(SendSessions::for_pool(3, 8).limit(), None);
        let sessions = SendSessions::for_pool(4, 2);
        let (a, b, c) = (
            sessions.hold().await,
            sessions.hold().await,
            sessions.hold().await,
        );
        assert!(a.is_some() && b.is_some() && c.is_some());
        let fourth = tokio::time::timeout(Duration::from_millis(20), sessions.hold()).await;
        assert!(
            fourth.is_err(),
            "a fourth send waits for a connection sends may hold"
        );
        drop(a);
        assert!(sessions.hold().await.is_some());
    }

    /// Every message of a batch is admitted and counted, stored in order, whether publishing
    /// is open or paced.
    #[tokio::test]
    async fn a_batch_is_admitted_message_by_message_and_stored_in_order() {
        let transport: Arc<dyn Transport> =
            Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
        let queue = QueueName::new("out").unwrap();
        transport.admin().create_queue(&queue).await.unwrap();
        let throttle = Arc::new(Throttle::default());
        let publisher = Publisher::new(transport.clone(), throttle.clone(), Metrics::new());
        let batch: Vec<OutgoingMessage> =
            (0..20u8).map(|i| OutgoingMessage::new(vec![i])).collect();

        publisher.send_batch(&queue, &batch).await.unwrap();
        assert_eq!(throttle.publishing_rates.totals(), (20, 20));
        // Paced at one message per 2 ms: each waits its turn, all are stored.
        throttle
            .publishing
            .set(Duration::ZERO, Some(Duration::from_millis(2)));
        let started = tokio::time::Instant::now();
        publisher.send_batch(&queue, &batch).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(30), "paced");
        assert_eq!(throttle.publishing_rates.totals(), (40, 40));
        let expected: Vec<Vec<u8>> = (0..2).flat_map(|_| (0..20u8).map(|i| vec![i])).collect();
        assert_eq!(bodies(transport.as_ref(), &queue).await, expected);
    }
}
