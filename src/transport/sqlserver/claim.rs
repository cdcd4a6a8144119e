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

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::transport::QueueName;

/// The most claim attempts one receive makes before it answers empty.
pub const CLAIM_ATTEMPTS: u32 = 16;
/// The furthest from the head a claim starts, however many rows this host holds.
pub const MAX_START_SKIP: usize = 256;

/// Rows of each queue held by this host's open claiming receives.
#[derive(Debug, Default)]
pub struct HeldRows {
    queues: Mutex<HashMap<QueueName, Arc<AtomicUsize>>>,
}

impl HeldRows {
    fn counter(&self, queue: &QueueName) -> Arc<AtomicUsize> {
        self.queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_default()
            .clone()
    }

    /// Where a claim on `queue` starts: past the rows this host holds there.
    pub fn start(&self, queue: &QueueName) -> u32 {
        self.counter(queue)
            .load(Ordering::Relaxed)
            .min(MAX_START_SKIP) as u32
    }

    /// Counts a row claimed on `queue` as held until the returned guard drops.
    pub fn hold(&self, queue: &QueueName) -> Held {
        let counter = self.counter(queue);
        counter.fetch_add(1, Ordering::Relaxed);
        Held(counter)
    }
}

/// One held row; dropping it (the transaction ended, the connection closed) releases it.
#[derive(Debug)]
pub struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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
    fn held_rows_count_while_their_guards_live() {
        let held = HeldRows::default();
        let q = QueueName::new("orders").unwrap();
        let other = QueueName::new("billing").unwrap();
        assert_eq!(held.start(&q), 0);
        let a = held.hold(&q);
        let b = held.hold(&q);
        assert_eq!(held.start(&q), 2, "past the two rows this host holds");
        assert_eq!(held.start(&other), 0, "per queue");
        drop(a);
        assert_eq!(held.start(&q), 1);
        drop(b);
        assert_eq!(held.start(&q), 0);
        let many: Vec<Held> = (0..MAX_START_SKIP + 10).map(|_| held.hold(&q)).collect();
        assert_eq!(held.start(&q), MAX_START_SKIP as u32, "bounded");
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
