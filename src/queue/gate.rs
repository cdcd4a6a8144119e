//! A queue's concurrency gate: at most `min(max, limit, guard, fleet)` permits out at once,
//! where `max` is the configured MaximumConcurrencyLevel (changed by a config reload), `limit`
//! is the throttling controller's current limit, `guard` the limit the queue's downstream
//! guards set (outage mode, the latency-aware limit; see `queue::downstream`) and `fleet` this
//! instance's share of the queue's fleet-wide limit (`fleet_max`, see `fleet::share`; the only
//! one that may be 0). Any may change at any moment: a lower value stops new permits at once
//! while held ones run to completion; a higher value wakes waiters.
//!
//! The permits are a tokio [`Semaphore`], so waiters are served first come, first served and
//! an acquire that is cancelled leaves the queue. The semaphore is resized as vector's
//! adaptive concurrency does it: growing adds permits; shrinking forgets the free ones at
//! once and records the rest as owed, and a held permit that comes back while some are owed
//! is forgotten instead of returned. So the semaphore's capacity (free plus held minus owed)
//! always equals the effective limit.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The gate. Share it in an `Arc`; permits release themselves when dropped.
#[derive(Debug)]
pub(crate) struct ConcurrencyGate {
    permits: Arc<Semaphore>,
    /// The four sizes; resizing happens under this lock so two changes cannot both apply the
    /// same difference.
    sizes: Mutex<Sizes>,
    /// The effective limit, readable without the lock.
    effective: AtomicU32,
    /// Held permits to forget on release instead of returning them (a shrink that found too
    /// few free permits).
    owed: AtomicU32,
    in_flight: AtomicU32,
    peak: AtomicU32,
}

impl ConcurrencyGate {
    /// A gate with `max` permits and no throttling limit below it.
    pub(crate) fn new(max: u32) -> Self {
        let max = max.max(1);
        ConcurrencyGate {
            permits: Arc::new(Semaphore::new(max as usize)),
            sizes: Mutex::new(Sizes {
                max,
                limit: u32::MAX,
                guard: u32::MAX,
                fleet: u32::MAX,
            }),
            effective: AtomicU32::new(max),
            owed: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            peak: AtomicU32::new(0),
        }
    }

    /// The limit this instance sets itself, without its fleet share: `min(max, limit, guard)`
    /// (what it would take of a fleet-wide limit if the others let it).
    pub(crate) fn local_limit(&self) -> u32 {
        self.lock_sizes().local()
    }

    /// The permits available in total right now: `min(max, limit, guard)`.
    pub(crate) fn effective(&self) -> u32 {
        self.effective.load(Ordering::Relaxed)
    }

    /// Permits held now.
    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Most permits ever held at once (for tests and load reports).
    pub(crate) fn peak(&self) -> u32 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Changes the configured maximum.
    pub(crate) fn set_max(&self, max: u32) {
        self.change(|sizes| sizes.max = max.max(1));
    }

    /// Changes the throttling limit.
    pub(crate) fn set_limit(&self, limit: u32) {
        self.change(|sizes| sizes.limit = limit.max(1));
    }

    /// Changes the downstream guards' limit (`u32::MAX`: none).
    pub(crate) fn set_guard_limit(&self, limit: u32) {
        self.change(|sizes| sizes.guard = limit.max(1));
    }

    /// Changes this instance's share of the fleet-wide limit (`u32::MAX`: none; 0: no
    /// permit at all until the share grows).
    pub(crate) fn set_fleet_share(&self, share: u32) {
        self.change(|sizes| sizes.fleet = share);
    }

    /// This instance's share of the fleet-wide limit (`u32::MAX`: none).
    pub(crate) fn fleet_share(&self) -> u32 {
        self.lock_sizes().fleet
    }

    fn change(&self, set: impl FnOnce(&mut Sizes)) {
        let mut sizes = self.lock_sizes();
        set(&mut sizes);
        self.resize(sizes.local().min(sizes.fleet));
    }

    /// Takes a permit if one is free now (never ahead of a waiter: tokio hands returned
    /// permits to waiters first).
    pub(crate) fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(self.issued(permit))
    }

    /// Waits for a permit, behind those who asked earlier. Cancel-safe.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Permit {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the gate's semaphore is never closed");
        self.issued(permit)
    }

    fn issued(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Permit {
        let held = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak.fetch_max(held, Ordering::Relaxed);
        Permit {
            gate: self.clone(),
            permit: Some(permit),
        }
    }

    /// Moves the semaphore's capacity to `effective` (called with the sizes lock held).
    fn resize(&self, effective: u32) {
        let old = self.effective.swap(effective, Ordering::Relaxed);
        if effective > old {
            // Pay what is owed first: those permits are still out and will come back.
            let grow = effective - old;
            let paid = self.take_owed(grow);
            self.permits.add_permits((grow - paid) as usize);
        } else if effective < old {
            let shrink = old - effective;
            let forgotten = self.permits.forget_permits(shrink as usize) as u32;
            self.owed.fetch_add(shrink - forgotten, Ordering::AcqRel);
        }
    }

    /// Cancels up to `n` owed permits; returns how many.
    fn take_owed(&self, n: u32) -> u32 {
        let mut taken = 0;
        let _ = self
            .owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |owed| {
                taken = owed.min(n);
                Some(owed - taken)
            });
        taken
    }

    fn lock_sizes(&self) -> std::sync::MutexGuard<'_, Sizes> {
        // Integers cannot be left half-written: a poisoned lock is still consistent.
        self.sizes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What bounds the gate (see the module documentation).
#[derive(Debug)]
struct Sizes {
    max: u32,
    limit: u32,
    guard: u32,
    fleet: u32,
}

impl Sizes {
    fn local(&self) -> u32 {
        self.max.min(self.limit).min(self.guard)
    }
}

/// A held permit; dropping it frees the slot (or pays one owed by a shrink).
#[derive(Debug)]
pub(crate) struct Permit {
    gate: Arc<ConcurrencyGate>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.in_flight.fetch_sub(1, Ordering::AcqRel);
        if let Some(permit) = self.permit.take() {
            if self.gate.take_owed(1) == 1 {
                permit.forget();
            } else {
                drop(permit);
            }
        }
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

    #[test]
    fn raising_the_limit_pays_owed_permits_before_adding_new_ones() {
        let g = Arc::new(ConcurrencyGate::new(4));
        let held: Vec<_> = (0..4).map(|_| g.try_acquire().unwrap()).collect();
        g.set_limit(1); // 3 owed: all four are out
        g.set_limit(3); // 2 of the owed cancelled, none added
        assert!(g.try_acquire().is_none(), "4 out, limit 3");
        drop(held);
        let again: Vec<_> = (0..5).filter_map(|_| g.try_acquire()).collect();
        assert_eq!(again.len(), 3, "capacity is exactly the limit");
        g.set_limit(u32::MAX);
        assert_eq!(g.effective(), 4, "back to max");
        let _fourth = g.try_acquire().expect("the limit rose by one");
        assert!(g.try_acquire().is_none());
    }

    /// Random resizes, acquires and releases: a permit is only ever handed out while fewer
    /// than the effective limit are held, and once everything is back the semaphore holds
    /// exactly the effective limit.
    #[test]
    fn capacity_follows_every_resize() {
        let g = Arc::new(ConcurrencyGate::new(8));
        let mut held = Vec::new();
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..20_000 {
            match next(5) {
                0 => g.set_limit(1 + next(12) as u32),
                1 => g.set_max(1 + next(12) as u32),
                4 => g.set_fleet_share(next(13) as u32),
                2 if !held.is_empty() => {
                    let at = next(held.len() as u64) as usize;
                    held.swap_remove(at);
                }
                _ => {
                    let before = g.in_flight();
                    if let Some(p) = g.try_acquire() {
                        assert!(
                            before < g.effective(),
                            "{before} held, limit {}",
                            g.effective()
                        );
                        held.push(p);
                    }
                }
            }
        }
        held.clear();
        assert_eq!(g.permits.available_permits() as u32, g.effective());
        assert_eq!(g.owed.load(Ordering::Relaxed), 0);
    }

    /// A fleet share of 0 closes the gate (no other size can), a share above the local limit
    /// does not widen it, and the local limit leaves the share out.
    #[test]
    fn a_fleet_share_bounds_the_gate_down_to_zero() {
        let g = Arc::new(ConcurrencyGate::new(4));
        g.set_fleet_share(0);
        assert!(g.try_acquire().is_none(), "share 0: nothing");
        assert_eq!((g.effective(), g.local_limit()), (0, 4));
        g.set_fleet_share(2);
        let held: Vec<_> = (0..4).filter_map(|_| g.try_acquire()).collect();
        assert_eq!(held.len(), 2);
        g.set_fleet_share(0);
        drop(held);
        assert!(g.try_acquire().is_none(), "the returned permits were owed");
        g.set_fleet_share(10);
        assert_eq!(g.effective(), 4, "the max still bounds it");
        g.set_limit(3);
        assert_eq!(
            (g.effective(), g.local_limit(), g.fleet_share()),
            (3, 3, 10)
        );
    }

    // Paused time: the sleeps below only let the waiters run and park, in no wall time.
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

    /// Waiters are served in the order they asked, one per returned permit, and a permit
    /// returned while waiters queue is not taken by a caller that did not wait.
    #[tokio::test(start_paused = true)]
    async fn waiters_are_served_first_come_first_served() {
        let g = Arc::new(ConcurrencyGate::new(1));
        let mut held = Some(g.try_acquire().unwrap());
        let (order_tx, mut order_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut waiters = Vec::new();
        for who in 0..4 {
            let (g, order_tx) = (g.clone(), order_tx.clone());
            waiters.push(tokio::spawn(async move {
                let permit = g.acquire().await;
                order_tx.send(who).unwrap();
                // Hold it a moment so the next one has to wait for this release.
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(permit);
            }));
            // Let this waiter queue before the next one asks.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(held.take());
        assert!(
            g.try_acquire().is_none(),
            "the returned permit went to the first waiter"
        );
        for w in waiters {
            w.await.unwrap();
        }
        let served: Vec<_> = std::iter::from_fn(|| order_rx.try_recv().ok()).collect();
        assert_eq!(served, vec![0, 1, 2, 3]);
    }

    /// A shrink while waiters queue: returned permits pay the shrink first, so waiters get
    /// in only as in-flight work falls below the new limit.
    #[tokio::test(start_paused = true)]
    async fn waiters_get_in_only_below_a_lowered_limit() {
        let g = Arc::new(ConcurrencyGate::new(3));
        let held: Vec<_> = (0..3).map(|_| g.try_acquire().unwrap()).collect();
        let waiter = {
            let g = g.clone();
            tokio::spawn(async move { g.acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        g.set_limit(1);
        let mut held = held.into_iter();
        drop(held.next());
        drop(held.next());
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!waiter.is_finished(), "1 in flight = limit 1");
        drop(held.next());
        let permit = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken")
            .unwrap();
        assert_eq!(g.in_flight(), 1);
        drop(permit);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_leaves_the_queue() {
        let g = Arc::new(ConcurrencyGate::new(1));
        let held = g.try_acquire().unwrap();
        let gone = {
            let g = g.clone();
            tokio::spawn(async move { g.acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        assert!(
            g.try_acquire().is_some(),
            "no permit parked with the cancelled waiter"
        );
    }
}
