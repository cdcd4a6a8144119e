//! Receives that need not run. A host of many queues has far more receives than connections,
//! so a receive often waits for one; meanwhile another receive of its queue may find the queue
//! empty. Run now, the waiting receive would cost a transaction and most likely find nothing
//! too: it ends empty instead, as of the moment the other one looked, which lies within its own
//! wait. A message that arrives after that moment is the peeker's, as it would be after any
//! receive that came back empty. At the end of a spread drain each queue's last receives
//! otherwise queued for a connection one after another only to find nothing, while other
//! queues waited for the same connections.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

use crate::transport::QueueName;

/// When each queue was last found empty by a receive: when that receive's statement went out.
#[derive(Default)]
pub(super) struct FoundEmpty {
    last: Mutex<HashMap<QueueName, Instant>>,
}

impl FoundEmpty {
    /// A receive of `queue` whose statement went out at `sent` found nothing.
    pub(super) fn found(&self, queue: &QueueName, sent: Instant) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.get_mut(queue) {
            Some(at) => *at = (*at).max(sent),
            None => {
                last.insert(queue.clone(), sent);
            }
        }
    }

    /// Whether a receive of `queue` asked for at `asked` may end empty without a statement: a
    /// receive whose statement went out since then found nothing.
    pub(super) fn since(&self, queue: &QueueName, asked: Instant) -> bool {
        self.last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .is_some_and(|at| *at >= asked)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn queue(name: &str) -> QueueName {
        QueueName::new(name).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_receive_sent_during_the_wait_ends_it() {
        let found = FoundEmpty::default();
        let before = Instant::now();
        tokio::time::advance(Duration::from_millis(5)).await;
        let asked = Instant::now();
        assert!(!found.since(&queue("a"), asked), "nothing found yet");

        found.found(&queue("a"), before);
        assert!(
            !found.since(&queue("a"), asked),
            "found empty before the wait began: the queue may have had messages since"
        );

        tokio::time::advance(Duration::from_millis(5)).await;
        found.found(&queue("a"), Instant::now());
        assert!(found.since(&queue("a"), asked));
        assert!(
            !found.since(&queue("b"), asked),
            "another queue's emptiness"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_of_an_older_receive_does_not_move_the_mark_back() {
        let found = FoundEmpty::default();
        let early = Instant::now();
        tokio::time::advance(Duration::from_millis(5)).await;
        let late = Instant::now();
        found.found(&queue("a"), late);
        found.found(&queue("a"), early);
        assert!(found.since(&queue("a"), late));
    }
}
