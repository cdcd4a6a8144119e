//! Babelfish's claiming receive: receivers that take different rows at once where `READPAST`
//! is ignored.
//!
//! On Babelfish a receive that aims at the oldest row waits for whoever holds it, then finds
//! it gone and returns nothing, so N receivers on a queue drain slower than one. Instead, a
//! host looks up the next rows it may take (a read: the oldest [`CANDIDATES`] RowVersions,
//! passing over the rows it holds by name), hands each to one receive ([`HeldRows::take`]),
//! and each receive deletes exactly its row with `SET LOCK_TIMEOUT` at 1 ms. A row another
//! transaction (another host) holds makes the attempt fail at once (error 1222), and a row
//! gone meanwhile makes it find nothing; either way the attempt is rolled back and the receive
//! takes the next candidate. After [`CLAIM_ATTEMPTS`] attempts the receive answers empty, as a
//! receive on a queue whose every row is taken does.
//!
//! Why by name: a host's receives never aim at the same row, whatever commits meanwhile.
//! Earlier versions aimed by position (`OFFSET n`): skipping held rows by count failed
//! 0.55-1.0 claims per message at 8 receivers, as commits shifted the positions; taking claims
//! one at a time made the claim's round trip the queue's limit (8 receivers drained at 0.7x
//! the rate of one); positions counted past claims under way still shifted when a fast
//! handler committed before a later claim ran (0.14 failed claims per message).
//!
//! What it keeps: a claimed row is deleted inside the receive's transaction, so a rollback or
//! a crash returns it to its place; nothing is taken twice. What it gives up: strict
//! oldest-first (a row rolled back or sent while the host still hands out candidates from a
//! look-up waits for the next one, at most [`CANDIDATE_LIFETIME`]; a row another host frees
//! while this one passes over it waits for the next look-up) — "nearly oldest first", the
//! order a competing-consumer queue under concurrency gives anyway.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::transport::QueueName;

/// The most claim attempts one receive makes before it answers empty.
pub(super) const CLAIM_ATTEMPTS: u32 = 16;
/// The most held rows a look-up names to pass over; further ones it skips by count.
pub(super) const MAX_EXCLUDED: usize = 512;
/// The fewest candidates one look-up asks for (more for a larger batch): one look-up per
/// this many messages at most.
pub(super) const CANDIDATES: usize = 32;
/// How long a look-up's candidates are handed out; older ones are dropped for a new look-up,
/// so rows rolled back or sent meanwhile are not passed over for long.
pub(super) const CANDIDATE_LIFETIME: Duration = Duration::from_millis(250);
/// How long look-ups pass over a row a claim found held by another transaction (another
/// host's receive, which will most likely delete it): it is not aimed at again and again.
pub(super) const HELD_ELSEWHERE_FOR: Duration = Duration::from_secs(1);

/// What this host's claiming receives hold on each queue, and the candidates they take next.
#[derive(Debug, Default)]
pub(super) struct HeldRows {
    queues: Mutex<HashMap<QueueName, Arc<QueueHeld>>>,
}

/// One queue's held rows (by RowVersion), its candidates, and its look-ups' turn.
#[derive(Debug, Default)]
struct QueueHeld {
    state: Mutex<QueueState>,
    lookup: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug, Default)]
struct QueueState {
    /// Rows taken by a receive of this host (claimed, or being claimed).
    rows: BTreeSet<i64>,
    /// Rows found free by the last look-up and not taken yet, oldest first.
    candidates: VecDeque<i64>,
    looked_up: Option<Instant>,
    /// Rows a claim found held by another transaction, and when.
    elsewhere: VecDeque<(i64, Instant)>,
}

impl QueueState {
    /// Whether the last look-up's candidates may still be handed out.
    fn fresh(&self) -> bool {
        self.looked_up
            .is_some_and(|at| at.elapsed() <= CANDIDATE_LIFETIME)
    }
}

impl QueueHeld {
    fn state(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl HeldRows {
    fn queue(&self, queue: &QueueName) -> Arc<QueueHeld> {
        self.queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_default()
            .clone()
    }

    /// Takes up to `n` of `queue`'s candidates, oldest first, each held until its guard
    /// drops (a receive keeps it while its transaction runs). Candidates older than
    /// [`CANDIDATE_LIFETIME`] are dropped instead.
    pub(super) fn take(&self, queue: &QueueName, n: usize) -> Vec<Held> {
        let of = self.queue(queue);
        let taken: Vec<i64> = {
            let mut state = of.state();
            if !state.fresh() {
                state.candidates.clear();
            }
            let n = n.min(state.candidates.len());
            let taken: Vec<i64> = state.candidates.drain(..n).collect();
            state.rows.extend(taken.iter().copied());
            taken
        };
        taken
            .into_iter()
            .map(|row_version| Held {
                of: of.clone(),
                row_version,
            })
            .collect()
    }

    /// Starts a look-up of `queue`'s candidates once no other is under way (the turn lasts
    /// while the [`LookingUp`] lives, so receives that find no candidate at once make one
    /// look-up, not one each): the rows it passes over by name, and how many more by count.
    pub(super) async fn look_up(&self, queue: &QueueName) -> LookingUp {
        let of = self.queue(queue);
        let turn = of.lookup.clone().lock_owned().await;
        let (excluded, skip) = {
            let mut state = of.state();
            while state
                .elsewhere
                .front()
                .is_some_and(|(_, at)| at.elapsed() > HELD_ELSEWHERE_FOR)
            {
                state.elsewhere.pop_front();
            }
            let mut excluded: Vec<i64> = state.rows.iter().take(MAX_EXCLUDED).copied().collect();
            let skip = (state.rows.len() - excluded.len()) as u32;
            let room = MAX_EXCLUDED - excluded.len();
            excluded.extend(state.elsewhere.iter().take(room).map(|(row, _)| *row));
            (excluded, skip)
        };
        LookingUp {
            of,
            _turn: turn,
            excluded,
            skip,
        }
    }
}

/// A look-up under way, in its queue's turn.
#[derive(Debug)]
pub(super) struct LookingUp {
    of: Arc<QueueHeld>,
    _turn: tokio::sync::OwnedMutexGuard<()>,
    /// Rows this host holds, then rows found held elsewhere, to pass over by name.
    pub excluded: Vec<i64>,
    /// Rows to skip past the head, besides the excluded ones.
    pub skip: u32,
}

impl LookingUp {
    /// Whether candidates are there to take: another look-up found some while this one
    /// waited for its turn.
    pub(super) fn found_meanwhile(&self) -> bool {
        let state = self.of.state();
        !state.candidates.is_empty() && state.fresh()
    }

    /// The look-up found these rows free, oldest first: they become the candidates (but any
    /// a receive of this host has taken meanwhile). The turn ends.
    pub(super) fn found(self, row_versions: &[i64]) {
        let mut state = self.of.state();
        let fresh: VecDeque<i64> = row_versions
            .iter()
            .copied()
            .filter(|row_version| !state.rows.contains(row_version))
            .collect();
        state.candidates = fresh;
        state.looked_up = Some(Instant::now());
    }
}

/// One held row; dropping it (the transaction ended, the connection closed) releases it.
#[derive(Debug)]
pub struct Held {
    of: Arc<QueueHeld>,
    row_version: i64,
}

impl Held {
    /// The row held.
    pub fn row_version(&self) -> i64 {
        self.row_version
    }

    /// A claim found the row held by another transaction: look-ups pass over it for
    /// [`HELD_ELSEWHERE_FOR`].
    pub fn held_elsewhere(self) {
        self.of
            .state()
            .elsewhere
            .push_back((self.row_version, Instant::now()));
    }

    /// The row went back to its queue (its transaction rolled back, or may have): the next
    /// receive looks up again, so the row is taken before the ones after it, as the receive
    /// of a queue without claims would.
    pub fn returned(self) {
        self.of.state().candidates.clear();
    }
}

/// Releases the rows a connection's transaction held: `returned` when it did not commit.
pub(super) fn release(held: &mut Vec<Held>, returned: bool) {
    for row in held.drain(..) {
        if returned {
            row.returned();
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.of.state().rows.remove(&self.row_version);
    }
}

/// What a failed claim attempt means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClaimFailure {
    /// The row is held by another transaction: try the next one.
    Held,
    /// Anything else: the receive fails.
    Other,
}

/// Classifies a server error of a claim attempt: SQL Server's lock timeout is error 1222;
/// Babelfish reports PostgreSQL's `lock_not_available` as 1222 or, unmapped, by its text.
pub(super) fn classify(code: u32, message: &str) -> ClaimFailure {
    if code == 1222 || message.to_ascii_lowercase().contains("lock timeout") {
        ClaimFailure::Held
    } else {
        ClaimFailure::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn receives_take_different_candidates_and_look_ups_pass_over_held_rows() {
        let held = HeldRows::default();
        let q = QueueName::new("orders").unwrap();
        let other = QueueName::new("billing").unwrap();
        assert!(held.take(&q, 1).is_empty(), "nothing looked up yet");
        let first = held.look_up(&q).await;
        assert_eq!((first.excluded.clone(), first.skip), (vec![], 0));
        assert!(!first.found_meanwhile());
        first.found(&[40, 41, 42, 43]);
        let a = held.take(&q, 1);
        let batch = held.take(&q, 2);
        assert_eq!(a[0].row_version, 40, "oldest first");
        assert_eq!(
            batch.iter().map(|h| h.row_version).collect::<Vec<_>>(),
            vec![41, 42],
            "each row to one receive"
        );
        assert!(held.take(&other, 1).is_empty(), "per queue");
        // A look-up passes over every row taken, and finds no row taken meanwhile.
        drop(batch);
        let second = held.look_up(&q).await;
        assert_eq!(
            second.excluded,
            vec![40],
            "released rows are not passed over"
        );
        assert!(second.found_meanwhile(), "43 is still there to take");
        let b = held.take(&q, 1);
        second.found(&[43, 44]);
        assert_eq!(b[0].row_version, 43);
        assert_eq!(held.take(&q, 5)[0].row_version, 44, "43 is taken");
        // A row rolled back is looked up again before anything else is handed out.
        let c = held.look_up(&q).await;
        c.found(&[45, 46]);
        let mut rolled_back = held.take(&q, 1);
        release(&mut rolled_back, true);
        assert!(
            held.take(&q, 1).is_empty(),
            "46 waits for a look-up that sees 45"
        );
        drop((a, b));
        // A row another transaction holds is passed over for a while.
        let d = held.look_up(&q).await;
        d.found(&[47, 48]);
        held.take(&q, 1).pop().unwrap().held_elsewhere();
        drop(held.take(&q, 5));
        assert_eq!(held.look_up(&q).await.excluded, vec![47]);
        tokio::time::advance(HELD_ELSEWHERE_FOR + Duration::from_millis(1)).await;
        assert!(held.look_up(&q).await.excluded.is_empty(), "for a while");
        // A second look-up waits for the first.
        let turn = held.look_up(&q).await;
        let waiting = tokio::time::timeout(Duration::from_millis(50), held.look_up(&q));
        assert!(waiting.await.is_err(), "one look-up at a time per queue");
        turn.found(&[50]);
        // Candidates expire.
        tokio::time::advance(CANDIDATE_LIFETIME + Duration::from_millis(1)).await;
        assert!(held.take(&q, 1).is_empty(), "a stale look-up is not used");
        let many: Vec<Held> = {
            let l = held.look_up(&q).await;
            l.found(&(0..MAX_EXCLUDED as i64 + 3).collect::<Vec<_>>());
            held.take(&q, MAX_EXCLUDED + 3)
        };
        let bounded = held.look_up(&q).await;
        assert_eq!((bounded.excluded.len(), bounded.skip), (MAX_EXCLUDED, 3));
        drop(many);
    }

    #[test]
    fn lock_timeouts_are_told_from_other_errors() {
        assert_eq!(
            classify(1222, "Lock request time out period exceeded."),
            ClaimFailure::Held
        );
        assert_eq!(
            classify(33557097, "canceling statement due to lock timeout"),
            ClaimFailure::Held,
            "Babelfish without a mapped code"
        );
        assert_eq!(
            classify(208, "Invalid object name 'dbo.orders'."),
            ClaimFailure::Other
        );
        assert_eq!(classify(1205, "deadlock victim"), ClaimFailure::Other);
    }
}
