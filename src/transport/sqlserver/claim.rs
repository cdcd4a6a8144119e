//! Babelfish's claiming receive: receivers that take different rows at once where `READPAST`
//! is ignored.
//!
//! On Babelfish a receive that aims at the oldest row waits for whoever holds it, then finds
//! it gone and returns nothing, so N receivers on a queue drain slower than one. A claim aims
//! at the row `skip` places from the head instead, with `SET LOCK_TIMEOUT` at 1 ms: a row
//! another transaction holds makes the attempt fail at once (error 1222), the attempt is
//! rolled back, and the next one aims one row further. `skip` starts at the number of rows
//! this host's receives already hold on the queue ([`HeldRows`]), since those are the oldest
//! it took, so receivers of one host rarely collide; receivers of other hosts pay one failed
//! attempt per row they find held. When the aimed-at row turns out gone (fewer rows than
//! counted), the claim tries once more from the head. After [`CLAIM_ATTEMPTS`] held rows in
//! a row the receive answers empty, as a receive on a queue whose every row is taken does.
//!
//! What it keeps: a claimed row is deleted inside the receive's transaction, so a rollback or
//! a crash returns it to its place; nothing is taken twice. What it gives up: strict
//! oldest-first across hosts (a row freed while `skip` counted it held is passed over until
//! the next receive finds it) — "nearly oldest first", the order a competing-consumer queue
//! under concurrency gives anyway.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use crate::transport::QueueName;

/// The most claim attempts one receive makes before it answers empty.
pub const CLAIM_ATTEMPTS: u32 = 16;
/// The most held rows a claim names to pass over; further ones it skips by count.
pub const MAX_EXCLUDED: usize = 512;

/// What this host's claiming receives hold on each queue.
#[derive(Debug, Default)]
pub struct HeldRows {
    queues: Mutex<HashMap<QueueName, Arc<Mutex<QueueHeld>>>>,
    /// Per queue: whose turn it is to claim ([`HeldRows::turn`]).
    turns: Mutex<HashMap<QueueName, Arc<tokio::sync::Mutex<()>>>>,
}

/// One queue's held rows (by RowVersion) and claims under way.
#[derive(Debug, Default)]
struct QueueHeld {
    rows: BTreeSet<i64>,
    claiming: u32,
}

impl HeldRows {
    fn of(&self, queue: &QueueName) -> Arc<Mutex<QueueHeld>> {
        self.queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_default()
            .clone()
    }

    /// Waits for this host's turn to claim on `queue`; the turn lasts while the guard lives.
    /// One claim at a time: claims made at once by receivers of one host aimed at rows
    /// another of them was taking (positions shift as rows commit, so a count of claims under
    /// way does not keep them apart): at 8 receivers on Babelfish 0.55-0.75 claims per
    /// message failed on a row lock, and 8 drained slower than 1. A claim is one short
    /// statement; the handlers and commits still run at once.
    pub async fn turn(&self, queue: &QueueName) -> tokio::sync::OwnedMutexGuard<()> {
        let turns = self
            .turns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_default()
            .clone();
        turns.lock_owned().await
    }

    /// Starts a claim on `queue`: the rows this host holds there, which the claim passes
    /// over by name (the oldest [`MAX_EXCLUDED`]; it skips the rest by count), and how many
    /// claims of this host are under way, which it skips by count so that claims made at
    /// once aim at different rows.
    pub fn start(&self, queue: &QueueName) -> Claiming {
        let of = self.of(queue);
        let (excluded, skip) = {
            let mut held = of.lock().unwrap_or_else(|e| e.into_inner());
            let excluded: Vec<i64> = held.rows.iter().take(MAX_EXCLUDED).copied().collect();
            let beyond = (held.rows.len() - excluded.len()) as u32;
            let skip = held.claiming + beyond;
            held.claiming += 1;
            (excluded, skip)
        };
        Claiming {
            of,
            excluded,
            skip,
            ended: false,
        }
    }
}

/// A claim under way; dropped without [`Claiming::landed`], it counts no more.
#[derive(Debug)]
pub struct Claiming {
    of: Arc<Mutex<QueueHeld>>,
    /// Rows this host holds, to pass over by name.
    pub excluded: Vec<i64>,
    /// Rows to skip past the head, besides the excluded ones.
    pub skip: u32,
    ended: bool,
}

impl Claiming {
    /// The claim took these rows: each held until its guard drops.
    pub fn landed_many(self, row_versions: &[i64]) -> Vec<Held> {
        let of = self.of.clone();
        let mut held = Vec::with_capacity(row_versions.len());
        if let Some((first, rest)) = row_versions.split_first() {
            held.push(self.landed(*first));
            of.lock()
                .unwrap_or_else(|e| e.into_inner())
                .rows
                .extend(rest.iter().copied());
            held.extend(rest.iter().map(|&row_version| Held {
                of: of.clone(),
                row_version,
            }));
        }
        held
    }

    /// The claim took row `row_version`: held until the returned guard drops.
    pub fn landed(mut self, row_version: i64) -> Held {
        let mut held = self.of.lock().unwrap_or_else(|e| e.into_inner());
        held.claiming = held.claiming.saturating_sub(1);
        held.rows.insert(row_version);
        drop(held);
        self.ended = true;
        Held {
            of: self.of.clone(),
            row_version,
        }
    }
}

impl Drop for Claiming {
    fn drop(&mut self) {
        if !self.ended {
            let mut held = self.of.lock().unwrap_or_else(|e| e.into_inner());
            held.claiming = held.claiming.saturating_sub(1);
        }
    }
}

/// One held row; dropping it (the transaction ended, the connection closed) releases it.
#[derive(Debug)]
pub struct Held {
    of: Arc<Mutex<QueueHeld>>,
    row_version: i64,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.of.lock().unwrap_or_else(|e| e.into_inner());
        held.rows.remove(&self.row_version);
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

    #[test]
    fn a_claim_passes_over_held_rows_by_name_and_claims_under_way_by_count() {
        let held = HeldRows::default();
        let q = QueueName::new("orders").unwrap();
        let other = QueueName::new("billing").unwrap();
        let first = held.start(&q);
        let second = held.start(&q);
        assert_eq!(
            (first.skip, second.skip),
            (0, 1),
            "claims at once aim apart"
        );
        let a = first.landed(41);
        let b = second.landed(40);
        let third = held.start(&q);
        assert_eq!((third.excluded.clone(), third.skip), (vec![40, 41], 0));
        assert!(held.start(&other).excluded.is_empty(), "per queue");
        drop(third);
        drop(a);
        let fourth = held.start(&q);
        assert_eq!((fourth.excluded.clone(), fourth.skip), (vec![40], 0));
        drop(fourth);
        drop(b);
        let many: Vec<Held> = (0..MAX_EXCLUDED as i64 + 3)
            .map(|rv| held.start(&q).landed(rv))
            .collect();
        let bounded = held.start(&q);
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
