//! A queue's concurrency gate: at most `min(max, limit)` permits out at once, where `max` is
//! the configured MaximumConcurrencyLevel (changed by a config reload) and `limit` is the
//! throttling controller's current limit. Either may change at any moment: a lower value
//! stops new permits at once while held ones run to completion; a higher value wakes waiters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::Notify;

/// The gate. Share it in an `Arc`; permits release themselves when dropped.
#[derive(Debug)]
pub struct ConcurrencyGate {
    max: AtomicU32,
    limit: AtomicU32,
    in_flight: AtomicU32,
    peak: AtomicU32,
    released: Notify,
}

impl ConcurrencyGate {
    /// A gate with `max` permits and no throttling limit below it.
    pub fn new(max: u32) -> Self {
        ConcurrencyGate {
            max: AtomicU32::new(max.max(1)),
            limit: AtomicU32::new(u32::MAX),
            in_flight: AtomicU32::new(0),
            peak: AtomicU32::new(0),
            released: Notify::new(),
        }
    }

    /// The configured maximum.
    pub fn max(&self) -> u32 {
        self.max.load(Ordering::Relaxed)
    }

    /// The permits available in total right now: `min(max, limit)`.
    pub fn effective(&self) -> u32 {
        self.max().min(self.limit.load(Ordering::Relaxed))
    }

    /// Permits held now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Permits that could be taken now without waiting.
    pub fn free(&self) -> u32 {
        self.effective().saturating_sub(self.in_flight())
    }

    /// Most permits ever held at once (for tests and load reports).
    pub fn peak(&self) -> u32 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Changes the configured maximum.
    pub fn set_max(&self, max: u32) {
        let old = self.max.swap(max.max(1), Ordering::Relaxed);
        if max > old {
            self.released.notify_waiters();
        }
    }

    /// Changes the throttling limit.
    pub fn set_limit(&self, limit: u32) {
        let old = self.limit.swap(limit.max(1), Ordering::Relaxed);
        if limit > old {
            self.released.notify_waiters();
        }
    }

    /// Takes a permit if one is free now.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let mut current = self.in_flight.load(Ordering::Relaxed);
        loop {
            if current >= self.effective() {
                return None;
            }
            match self.in_flight.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.peak.fetch_max(current + 1, Ordering::Relaxed);
                    return Some(Permit { gate: self.clone() });
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Waits for a permit. Cancel-safe.
    pub async fn acquire(self: &Arc<Self>) -> Permit {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(p) = self.try_acquire() {
                return p;
            }
            released.await;
        }
    }
}

/// A held permit; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit {
    gate: Arc<ConcurrencyGate>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.gate.released.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn never_more_than_the_effective_limit() {
        let g = Arc::new(ConcurrencyGate::new(3));
        let held: Vec<_> = (0..5).filter_map(|_| g.try_acquire()).collect();
        assert_eq!(held.len(), 3);
        g.set_limit(1);
        drop(held);
        let a = g.try_acquire();
        assert!(a.is_some());
        assert!(g.try_acquire().is_none(), "limit 1 holds");
        assert_eq!(g.peak(), 3);
    }

    #[tokio::test]
    async fn a_lower_limit_waits_for_in_flight_work_to_drain() {
        let g = Arc::new(ConcurrencyGate::new(4));
        let held: Vec<_> = (0..4).map(|_| g.try_acquire().unwrap()).collect();
        g.set_limit(2);
        let mut held = held.into_iter();
        drop(held.next());
        assert!(g.try_acquire().is_none(), "3 in flight > 2");
        drop(held.next());
        drop(held.next());
        assert!(g.try_acquire().is_some(), "1 in flight < 2");
    }

    // Paused time: the sleeps below only let the waiter run and park, in no wall time.
    #[tokio::test(start_paused = true)]
    async fn raising_the_max_wakes_waiters() {
        let g = Arc::new(ConcurrencyGate::new(1));
        let _held = g.try_acquire().unwrap();
        let waiter = {
            let g = g.clone();
            tokio::spawn(async move { g.acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished());
        g.set_max(2);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn release_wakes_one_waiter() {
        let g = Arc::new(ConcurrencyGate::new(1));
        let held = g.try_acquire().unwrap();
        let waiter = {
            let g = g.clone();
            tokio::spawn(async move { g.acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(held);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken")
            .unwrap();
    }
}
