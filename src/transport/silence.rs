//! Whether the database answers: the statements waiting for it, and when it last answered.
//! A server that stops answering (frozen, or a network that drops packets) shows here within
//! seconds, long before a statement's deadline passes, so `/status`, `throttlehost status`
//! and a pool that runs out of connections can say so instead of blaming the pool size.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// How long statements may wait with no answer at all before the database counts as not
/// answering (at most the statement deadline).
pub const SILENT_AFTER: Duration = Duration::from_secs(5);

/// The statements waiting for the database and its last answer.
#[derive(Debug, Default)]
pub struct Silence {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    /// Waiting statements by ticket: when each was asked.
    waiting: BTreeMap<u64, Instant>,
    /// When the last answer came.
    last_answer: Option<Instant>,
    /// The earliest ask of a statement whose deadline passed with no answer since.
    unanswered_since: Option<Instant>,
}

impl Silence {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A statement is sent: its ticket, which records the answer (or its absence).
    pub fn ask(self: &Arc<Self>) -> Ticket {
        let mut s = self.state();
        let id = s.next;
        s.next += 1;
        s.waiting.insert(id, Instant::now());
        Ticket {
            silence: self.clone(),
            id,
            done: false,
        }
    }

    /// How long the database has said nothing while statements waited: Some once that is
    /// at least `after`. Counted from the later of the oldest waiting statement's ask and the
    /// last answer (a statement asked before the last answer has waited in silence only
    /// since it), or from the ask of one whose deadline passed unanswered.
    pub fn silent_for(&self, after: Duration) -> Option<Duration> {
        let s = self.state();
        let waiting = s
            .waiting
            .values()
            .min()
            .map(|&asked| s.last_answer.map_or(asked, |answer| answer.max(asked)));
        let since = waiting.into_iter().chain(s.unanswered_since).min()?;
        Some(since.elapsed()).filter(|silent| *silent >= after)
    }
}

impl Silence {
    /// Whether a statement's deadline passed unanswered and nothing has answered since.
    pub fn deadline_passed(&self) -> bool {
        self.state().unanswered_since.is_some()
    }
}

/// One statement waiting for its answer.
#[derive(Debug)]
pub struct Ticket {
    silence: Arc<Silence>,
    id: u64,
    done: bool,
}

impl Ticket {
    /// The database answered (whatever it said).
    pub fn answered(mut self) {
        let mut s = self.silence.state();
        s.waiting.remove(&self.id);
        s.last_answer = Some(Instant::now());
        s.unanswered_since = None;
        self.done = true;
    }

    /// The statement's deadline passed with no answer.
    pub fn unanswered(mut self) {
        let mut s = self.silence.state();
        if let Some(asked) = s.waiting.remove(&self.id) {
            let earliest = s.unanswered_since.map_or(asked, |u| u.min(asked));
            s.unanswered_since = Some(earliest);
        }
        self.done = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Dropped without an outcome (the caller gave up): it waits no more.
        if !self.done {
            self.silence.state().waiting.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statement asked just before another was answered, then left waiting as the server
    /// froze: the silence counts from that answer. It was left out altogether, and a frozen
    /// server whose only waiting statement overlapped the last answer was said to be silent
    /// only when some later statement had waited 5 s (10 s and more on SQL Server).
    #[tokio::test(start_paused = true)]
    async fn a_statement_asked_before_the_last_answer_counts_from_that_answer() {
        let silence = Arc::new(Silence::default());
        let stuck = silence.ask();
        tokio::time::advance(Duration::from_secs(1)).await;
        silence.ask().answered();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(
            silence.silent_for(SILENT_AFTER),
            None,
            "4 s since the answer"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            silence.silent_for(SILENT_AFTER),
            Some(Duration::from_secs(6)),
            "6 s since the last answer, with a statement waiting"
        );
        stuck.answered();
        assert_eq!(silence.silent_for(Duration::ZERO), None, "nothing waits");
    }

    #[tokio::test(start_paused = true)]
    async fn silence_shows_after_a_while_and_ends_with_any_answer() {
        let silence = Arc::new(Silence::default());
        let first = silence.ask();
        first.answered();
        let waiting = silence.ask();
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(
            silence.silent_for(SILENT_AFTER),
            None,
            "3 s is not yet silence"
        );
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(
            silence.silent_for(SILENT_AFTER),
            Some(Duration::from_secs(6))
        );
        // Its deadline passes: still silent, though nothing waits now.
        assert!(!silence.deadline_passed());
        waiting.unanswered();
        assert!(silence.deadline_passed());
        assert_eq!(
            silence.silent_for(SILENT_AFTER),
            Some(Duration::from_secs(6))
        );
        // A statement asked later and answered: the database answers again.
        let later = silence.ask();
        later.answered();
        assert_eq!(silence.silent_for(Duration::ZERO), None);
        assert!(!silence.deadline_passed());
        // A statement given up on is no silence.
        let given_up = silence.ask();
        drop(given_up);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(silence.silent_for(SILENT_AFTER), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_statement_beside_answering_ones_is_no_silence() {
        let silence = Arc::new(Silence::default());
        let long = silence.ask();
        tokio::time::advance(Duration::from_secs(4)).await;
        silence.ask().answered();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(silence.silent_for(SILENT_AFTER), None);
        long.answered();
    }
}
