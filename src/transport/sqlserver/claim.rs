//! Babelfish's claiming receive: receivers that take different rows at once where `READPAST`
//! is ignored.
//!
//! On Babelfish a receive that aims at the oldest row waits for whoever holds it, then finds
//! it gone and returns nothing, so N receivers on a queue drain slower than one. A claim passes
//! over the rows this host holds by name and aims at the first row past them, with `SET
//! LOCK_TIMEOUT` at 1 ms: a row another transaction (another host) holds makes the attempt
//! fail at once (error 1222), the attempt is rolled back, and the next one aims one row
//! further. A host takes its claims on a queue one at a time ([`HeldRows::start`]), so its
//! receivers never aim at each other's rows: when they claimed at once, skipping by a count,
//! positions shifted as rows committed and 0.55-1.0 claims per message failed at 8 receivers.
//! When the aimed-at row turns out gone, the claim tries once more from the head. After
//! [`CLAIM_ATTEMPTS`] held rows in a row the receive answers empty, as a receive on a queue
//! whose every row is taken does.
//!
//! What it keeps: a claimed row is deleted inside the receive's transaction, so a rollback or
//! a crash returns it to its place; nothing is taken twice. What it gives up: strict
//! oldest-first across hosts (a row another host frees while a claim passes over it waits for
//! the next receive) — "nearly oldest first", the order a competing-consumer queue
//! under concurrency gives anyway.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use crate::transport::QueueName;

/// The most claim attempts one receive makes before it answers empty.
pub const CLAIM_ATTEMPTS: u32 = 16;
/// The most held rows a claim names to pass over; further ones it skips by count.
pub const MAX_EXCLUDED: usize = 512;

/// What this host's claiming receives hold on each queue, and whose turn it is to claim.
#[derive(Debug, Default)]
pub struct HeldRows {
    queues: Mutex<HashMap<QueueName, Arc<QueueHeld>>>,
}

/// One queue's held rows (by RowVersion) and its claims' turn.
#[derive(Debug, Default)]
struct QueueHeld {
    rows: Mutex<BTreeSet<i64>>,
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl QueueHeld {
    fn rows(&self) -> std::sync::MutexGuard<'_, BTreeSet<i64>> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl HeldRows {
    /// Starts a claim on `queue` once it is this host's turn (the turn lasts while the
    /// [`Claiming`] lives): the rows this host holds there, which the claim passes over by
    /// name (the oldest [`MAX_EXCLUDED`]), and how many more it skips by count. A claim is one
    /// short statement; handlers and commits still run at once.
    pub async fn start(&self, queue: &QueueName) -> Claiming {
        let of = self
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_default()
            .clone();
        let turn = of.turn.clone().lock_owned().await;
        let (excluded, skip) = {
            let rows = of.rows();
            let excluded: Vec<i64> = rows.iter().take(MAX_EXCLUDED).copied().collect();
            let skip = (rows.len() - excluded.len()) as u32;
            (excluded, skip)
        };
        Claiming {
            of,
            _turn: turn,
            excluded,
            skip,
        }
    }
}

/// A claim under way, in its host's turn.
#[derive(Debug)]
pub struct Claiming {
    of: Arc<QueueHeld>,
    _turn: tokio::sync::OwnedMutexGuard<()>,
    /// Rows this host holds, to pass over by name.
    pub excluded: Vec<i64>,
    /// Rows to skip past the head, besides the excluded ones.
    pub skip: u32,
}

impl Claiming {
    /// The claim took these rows: each held until its guard drops. The turn ends.
    pub fn landed(self, row_versions: &[i64]) -> Vec<Held> {
        self.of.rows().extend(row_versions.iter().copied());
        row_versions
            .iter()
            .map(|&row_version| Held {
                of: self.of.clone(),
                row_version,
            })
            .collect()
    }
}

/// One held row; dropping it (the transaction ended, the connection closed) releases it.
#[derive(Debug)]
pub struct Held {
    of: Arc<QueueHeld>,
    row_version: i64,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.of.rows().remove(&self.row_version);
    }
}

/// What a failed claim attempt means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimFailure {
    /// The row is held by another transaction: try the next one.
    Held,
    /// Anything else: the receive fails.
    Other,
}

/// Classifies a server error of a claim attempt: SQL Server's lock timeout is error 1222;
/// Babelfish reports PostgreSQL's `lock_not_available` as 1222 or, unmapped, by its text.
pub fn classify(code: u32, message: &str) -> ClaimFailure {
    if code == 1222 || message.to_ascii_lowercase().contains("lock timeout") {
        ClaimFailure::Held
    } else {
        ClaimFailure::Other
    }
}

/// Where the next claim aims: `skip` rows from the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// Rows from the head.
    pub skip: u32,
    /// The head has been tried since the cursor last found nothing (or it started there).
    head_tried: bool,
}

impl Cursor {
    /// A cursor aiming `skip` rows from the head.
    pub fn starting_at(skip: u32) -> Self {
        Cursor {
            skip,
            head_tried: skip == 0,
        }
    }

    /// Moves on after an attempt that took nothing: past a held row, or, when the aimed-at
    /// row was gone, once back to the head. False: stop, nothing is free.
    pub fn advance(&mut self, found_held: bool) -> bool {
        if found_held {
            self.skip += 1;
        } else if self.head_tried {
            return false;
        } else {
            *self = Cursor::starting_at(0);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_claim_passes_over_held_rows_by_name_in_its_turn() {
        let held = HeldRows::default();
        let q = QueueName::new("orders").unwrap();
        let other = QueueName::new("billing").unwrap();
        let first = held.start(&q).await;
        assert_eq!((first.excluded.clone(), first.skip), (vec![], 0));
        // Another claim on the queue waits for the turn; on another queue it does not.
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), held.start(&q));
        assert!(waiting.await.is_err(), "one claim at a time per queue");
        assert!(held.start(&other).await.excluded.is_empty(), "per queue");
        let mut a = first.landed(&[41, 40]);
        let second = held.start(&q).await;
        assert_eq!((second.excluded.clone(), second.skip), (vec![40, 41], 0));
        drop(second);
        drop(a.pop());
        let third = held.start(&q).await;
        assert_eq!(
            third.excluded,
            vec![41],
            "a released row is not passed over"
        );
        drop(third);
        drop(a);
        let many: Vec<Held> = held
            .start(&q)
            .await
            .landed(&(0..MAX_EXCLUDED as i64 + 3).collect::<Vec<_>>());
        let bounded = held.start(&q).await;
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

    #[test]
    fn a_claim_moves_past_held_rows_and_retries_from_the_head_once() {
        let mut c = Cursor::starting_at(3);
        assert!(c.advance(true));
        assert_eq!(c.skip, 4, "past a held row");
        assert!(c.advance(false), "nothing 4 rows in: try the head");
        assert_eq!(c.skip, 0);
        assert!(c.advance(true));
        assert_eq!(c.skip, 1);
        assert!(!c.advance(false), "the head was tried: stop");

        let mut head = Cursor::starting_at(0);
        assert!(!head.advance(false), "nothing at the head: stop at once");
    }
}
