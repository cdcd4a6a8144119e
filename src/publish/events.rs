//! Events: the types an event is published as, the subscribers a publisher finds for them
//! (kept for a while, as NServiceBus's `CachedSubscriptionStore` keeps them), and the topic
//! labels its metrics use.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::names::{event_type_entries, topic_of};
use crate::transport::{Subscriptions, TransportError};

/// The topics a process gives a metric label of their own; later ones count as `other`.
const LABELLED_TOPICS: usize = 100;

/// An event's type and the types it derives from, most derived first, as NServiceBus writes
/// them into `NServiceBus.EnclosedMessageTypes`: each entry a type's full name, optionally
/// followed by its assembly (`Sales.OrderAccepted, Sales, Version=1.0.0.0`). Each entry's
/// full name is a topic the event is published to, so a subscriber of a base type or an
/// interface receives it, as NServiceBus's publishers do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTypes {
    entries: Vec<String>,
}

impl EventTypes {
    /// Reads `;`-separated entries (the header's form). Errors name the entry at fault.
    pub fn parse(text: &str) -> Result<Self, String> {
        event_type_entries(text).map(|entries| EventTypes { entries })
    }

    /// The event's own topic: its type's full name.
    pub fn topic(&self) -> &str {
        topic_of(&self.entries[0])
    }

    /// Every topic the event is published to: its type and the types it derives from.
    pub fn topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = Vec::with_capacity(self.entries.len());
        for topic in self.entries.iter().map(|e| topic_of(e)) {
            if !topics.iter().any(|t| t == topic) {
                topics.push(topic.to_string());
            }
        }
        topics
    }

    /// The `NServiceBus.EnclosedMessageTypes` value.
    pub fn header(&self) -> String {
        self.entries.join(";")
    }
}

/// The queue addresses found for a set of topics, and when they were read.
type Found = (Instant, Arc<Vec<String>>);

/// The subscribers a publisher found for a set of topics, kept for `ttl`.
pub(crate) struct SubscriberCache {
    ttl: Duration,
    found: Mutex<HashMap<Vec<String>, Found>>,
    /// One read of the table at a time: publishes that find the cache stale at once wait for
    /// the first one's read instead of each reading.
    reading: tokio::sync::Mutex<()>,
}

impl SubscriberCache {
    pub(crate) fn new(ttl: Duration) -> Self {
        SubscriberCache {
            ttl,
            found: Mutex::default(),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    fn fresh(&self, topics: &[String]) -> Option<Arc<Vec<String>>> {
        let found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        found
            .get(topics)
            .filter(|(at, _)| at.elapsed() < self.ttl)
            .map(|(_, addresses)| addresses.clone())
    }

    /// The queue addresses subscribed to any of `topics`, read from `store` when what is kept
    /// is older than the time to live (every time when it is zero). A failed read is the
    /// caller's error, as a failed send is: nothing is published.
    pub(crate) async fn subscribers(
        &self,
        store: &dyn Subscriptions,
        topics: &[String],
    ) -> Result<Arc<Vec<String>>, TransportError> {
        if let Some(addresses) = self.fresh(topics) {
            return Ok(addresses);
        }
        let _reading = self.reading.lock().await;
        if let Some(addresses) = self.fresh(topics) {
            return Ok(addresses);
        }
        let addresses = Arc::new(store.subscribers(topics).await?);
        if !self.ttl.is_zero() {
            let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
            // What is past its time is read again anyway: kept, sets of topics published
            // once would stay for good.
            found.retain(|_, (at, _)| at.elapsed() < self.ttl);
            found.insert(topics.to_vec(), (Instant::now(), addresses.clone()));
        }
        Ok(addresses)
    }
}

/// The topic labels of the event metrics: the first [`LABELLED_TOPICS`] topics seen have one
/// each, later ones share `other`, so the series stay bounded whatever is published.
#[derive(Default)]
pub(crate) struct TopicLabels {
    seen: Mutex<HashSet<String>>,
}

impl TopicLabels {
    pub(crate) fn label(&self, topic: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if !seen.contains(topic) {
            if seen.len() >= LABELLED_TOPICS {
                return "other".into();
            }
            seen.insert(topic.to_string());
        }
        topic.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_published_to_its_type_and_the_types_it_derives_from() {
        let types = EventTypes::parse(
            "Sales.OrderAccepted, Sales, Version=1.0.0.0; Sales.IOrderEvent, Sales;Sales.OrderAccepted",
        )
        .unwrap();
        assert_eq!(types.topic(), "Sales.OrderAccepted");
        assert_eq!(types.topics(), ["Sales.OrderAccepted", "Sales.IOrderEvent"]);
        assert_eq!(
            types.header(),
            "Sales.OrderAccepted, Sales, Version=1.0.0.0;Sales.IOrderEvent, Sales;Sales.OrderAccepted"
        );
    }

    #[test]
    fn an_event_without_a_type_or_with_a_bad_one_is_refused_by_name() {
        assert!(
            EventTypes::parse(" ; ")
                .unwrap_err()
                .contains("needs its type")
        );
        let long = "x".repeat(201);
        assert!(
            EventTypes::parse(&long)
                .unwrap_err()
                .contains("200 characters")
        );
        assert!(
            EventTypes::parse("A.\u{7}B")
                .unwrap_err()
                .contains("not a type's full name")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn subscribers_are_kept_for_the_time_to_live_and_read_again_after_it() {
        use crate::config::TransactionMode;
        use crate::transport::Transport;
        use crate::transport::memory::MemoryTransport;
        let transport = MemoryTransport::new(TransactionMode::ReceiveOnly);
        let table = transport.subscriptions().unwrap();
        table.create_subscription_table().await.unwrap();
        let cache = SubscriberCache::new(Duration::from_secs(5));
        let topics = vec!["Sales.OrderAccepted".to_string()];
        assert!(cache.subscribers(table, &topics).await.unwrap().is_empty());
        table
            .subscribe("Billing", &topics[0], "billing")
            .await
            .unwrap();
        tokio::time::advance(Duration::from_millis(4_999)).await;
        assert!(
            cache.subscribers(table, &topics).await.unwrap().is_empty(),
            "kept: a subscriber added within the time to live is not seen yet"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            *cache.subscribers(table, &topics).await.unwrap(),
            ["billing"]
        );
        // Without a time to live every publish reads the table.
        let fresh = SubscriberCache::new(Duration::ZERO);
        assert_eq!(
            *fresh.subscribers(table, &topics).await.unwrap(),
            ["billing"]
        );
        table.unsubscribe("Billing", &topics[0]).await.unwrap();
        assert!(fresh.subscribers(table, &topics).await.unwrap().is_empty());
    }

    #[test]
    fn topics_past_the_hundredth_share_the_label_other() {
        let labels = TopicLabels::default();
        for i in 0..LABELLED_TOPICS {
            assert_eq!(labels.label(&format!("T{i}")), format!("T{i}"));
        }
        assert_eq!(labels.label("T0"), "T0");
        assert_eq!(labels.label("Late"), "other");
    }
}
