//! One in-memory queue: stored messages in sequence order, what receives hold, keys held by failed
//! messages.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use uuid::Uuid;

use crate::config::OrderingConfig;
use crate::message::{EXECUTION_STAGE_HEADER, Headers, PREVIOUS_STAGE_HEADER};
use crate::transport::HeldKey;

#[derive(Debug, Clone)]
pub(super) struct StoredMessage {
    pub(super) id: Uuid,
    pub(super) headers: Headers,
    pub(super) body: Vec<u8>,
    pub(super) expires: Option<SystemTime>,
    /// Deliver no sooner than this: stored in the queue's delayed table until then.
    pub(super) due: Option<SystemTime>,
}

#[derive(Default)]
pub(super) struct QueueState {
    pub(super) ready: BTreeMap<u64, StoredMessage>,
    pub(super) next_seq: u64,
    /// How receives keep order; None = plain FIFO (shared so a receive need not copy it).
    pub(super) ordering: Option<Arc<OrderingConfig>>,
    /// Keys with a message in flight: none of their messages may be taken until it ends.
    pub(super) busy_keys: HashSet<String>,
    /// Stages with messages in flight, and how many.
    pub(super) busy_stages: HashMap<String, usize>,
    /// Keys held by a failed message (`failed_key = "hold"`), oldest first.
    pub(super) held: Vec<HeldKey>,
}

/// What an ordered message holds while it is in flight: its key and its stage.
#[derive(Debug, Default)]
pub(super) struct Holds {
    pub(super) key: Option<String>,
    pub(super) stage: Option<String>,
}

pub(super) fn header_of(m: &StoredMessage, name: &str) -> Option<String> {
    m.headers.get(name).cloned().flatten()
}

impl QueueState {
    /// The stages with a message left, ready or in flight (empty unless stages are ordered).
    pub(super) fn unfinished_stages(&self, ordering: &OrderingConfig) -> HashSet<String> {
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
    pub(super) fn may_run(
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
    pub(super) fn take_next(&mut self) -> Option<(u64, StoredMessage, Holds)> {
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
    pub(super) fn waiting(&self) -> Option<u64> {
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
    pub(super) fn release(&mut self, holds: &Holds) {
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
