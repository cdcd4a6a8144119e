//! The wait a direction imposes before each admission: before each receive (delivery) and
//! before each insert (publishing).
//!
//! Two mechanisms, set by the controller every sample:
//!
//! * a **delay**: every admission waits this long (resource conditions, override);
//! * **pacing**: admissions are spaced `pace` apart across all callers (rate imbalance). Paced
//!   callers queue in FIFO order behind a fair async lock; only the head of the queue waits on
//!   the timer, so thousands of waiting callers cost one wake-up per admission, not thousands.
//!   Slots are due `pace` after the previous slot, not after the late wake-up that served it,
//!   so the rate holds for paces finer than the timer; an idle pace banks one slot at most.
//!
//! When neither is set, [`Admission::admit`] is two relaxed atomic loads. Waiters are woken
//! when the controller relaxes either setting, so a delay that ends early ends for them too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;

/// How late the timer may wake a paced waiter: twice its millisecond resolution.
const TIMER_SLACK_NS: u64 = 2_000_000;

/// One direction's admission control.
#[derive(Debug)]
pub struct Admission {
    origin: Instant,
    delay_ns: AtomicU64,
    pace_ns: AtomicU64,
    /// Receives the delivery ceiling still lets start before it reads again ([`OPEN`] when it
    /// does not limit them); see `super::ceiling`. Taken by [`Admission::start`], not by the
    /// wait: a receiver admitted long ago that waited for a slot of its queue starts only now,
    /// and what it costs shows only now.
    allowance: AtomicU64,
    /// Callers inside the slow path (waiting out a delay, a hold or their pacing turn).
    waiting: AtomicU64,
    /// Of those, the callers waiting for the ceiling's allowance (past any delay).
    waiting_on_allowance: AtomicU64,
    /// Messages handed to handlers since creation ([`Admission::message_started`]).
    started: AtomicU64,
    /// Receives started ([`Admission::start`]) that have not come back yet.
    receiving: AtomicU64,
    next_slot_ns: AtomicU64,
    /// Paced callers take turns in FIFO order.
    pacing_turn: Mutex<()>,
    relaxed: Notify,
    wait_histogram: metrics::Histogram,
}

impl Default for Admission {
    fn default() -> Self {
        Self::new(metrics::Histogram::noop())
    }
}

/// The allowance when the ceiling does not limit admissions.
const OPEN: u64 = u64::MAX;

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Admission {
    /// An open admission; waits longer than zero are recorded in `wait_histogram`.
    pub fn new(wait_histogram: metrics::Histogram) -> Self {
        Admission {
            origin: Instant::now(),
            delay_ns: AtomicU64::new(0),
            pace_ns: AtomicU64::new(0),
            allowance: AtomicU64::new(OPEN),
            waiting: AtomicU64::new(0),
            waiting_on_allowance: AtomicU64::new(0),
            started: AtomicU64::new(0),
            receiving: AtomicU64::new(0),
            next_slot_ns: AtomicU64::new(0),
            pacing_turn: Mutex::new(()),
            relaxed: Notify::new(),
            wait_histogram,
        }
    }

    fn now_ns(&self) -> u64 {
        nanos(self.origin.elapsed())
    }

    fn instant_at(&self, ns: u64) -> Instant {
        self.origin + Duration::from_nanos(ns)
    }

    /// Sets the delay per admission and the pacing interval (None = no pacing).
    pub fn set(&self, delay: Duration, pace: Option<Duration>) {
        let delay = nanos(delay);
        let pace = pace.map(nanos).unwrap_or(0);
        let old_delay = self.delay_ns.swap(delay, Ordering::Relaxed);
        let old_pace = self.pace_ns.swap(pace, Ordering::Relaxed);
        if pace == 0 {
            self.next_slot_ns.store(0, Ordering::Relaxed);
        } else if pace < old_pace || old_pace == 0 {
            // A slot reserved under a slower pace must not hold callers back now.
            let cap = self.now_ns().saturating_add(pace);
            self.next_slot_ns.fetch_min(cap, Ordering::Relaxed);
        }
        let relaxed = delay < old_delay || (old_pace != 0 && (pace == 0 || pace < old_pace));
        if relaxed {
            self.relaxed.notify_waiters();
        }
    }

    /// The current delay per admission.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_ns.load(Ordering::Relaxed))
    }

    /// The current pacing interval, if pacing.
    pub fn pace(&self) -> Option<Duration> {
        match self.pace_ns.load(Ordering::Relaxed) {
            0 => None,
            p => Some(Duration::from_nanos(p)),
        }
    }

    /// True when an admission would pass without waiting.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.delay_ns.load(Ordering::Relaxed) == 0
            && self.pace_ns.load(Ordering::Relaxed) == 0
            && self.allowance.load(Ordering::Relaxed) == OPEN
    }

    /// Holds every admission (`true`) until released (`false`), on top of the delay and pace:
    /// the ceiling a fast sensor sets between controller ticks.
    pub fn hold(&self, held: bool) {
        self.allow(if held { Some(0) } else { None });
    }

    /// Lets at most `count` more admissions through until the next call (`None`: no limit),
    /// on top of the delay and pace. A release of a hold this way cannot let every waiting
    /// caller through at once: each takes one from the allowance.
    pub fn allow(&self, count: Option<u64>) {
        let count = count.map_or(OPEN, |c| c.min(OPEN - 1));
        let was = self.allowance.swap(count, Ordering::AcqRel);
        if count > 0 && count != was {
            self.relaxed.notify_waiters();
        }
    }

    /// Takes one admission from the allowance; false when none is left.
    fn take_allowance(&self) -> bool {
        self.allowance
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| match a {
                OPEN => Some(OPEN),
                0 => None,
                a => Some(a - 1),
            })
            .is_ok()
    }

    /// Starts one receive if the ceiling's allowance has room for it (it always has when
    /// the ceiling does not limit receives), taking one from it. The receive counts as
    /// [`Admission::started`] until the returned guard is dropped, when it has come back.
    /// None: the allowance ran out since the wait; wait again.
    pub fn start(&self) -> Option<Receiving<'_>> {
        self.take_allowance().then(|| {
            self.receiving.fetch_add(1, Ordering::Relaxed);
            Receiving(&self.receiving)
        })
    }

    /// Counts a message handed to its handler (on whatever path it came: a started receive,
    /// a batch, a follow-on receive brought by a commit).
    pub fn message_started(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    /// Messages handed to handlers so far, plus the receives out now that may bring one:
    /// what the delivery ceiling counts as let through. A receive that comes back empty
    /// leaves the count as if it had never started.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::Relaxed) + self.receiving.load(Ordering::Relaxed)
    }

    /// Receives started that have not come back yet.
    pub fn receiving(&self) -> u64 {
        self.receiving.load(Ordering::Relaxed)
    }

    /// Callers waiting to be admitted now.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Callers waiting now for the ceiling's allowance, past any delay: those the ceiling
    /// holds back.
    pub fn waiting_on_allowance(&self) -> u64 {
        self.waiting_on_allowance.load(Ordering::Relaxed)
    }

    /// What is left of the ceiling's allowance (`None`: no limit).
    pub fn allowance(&self) -> Option<u64> {
        match self.allowance.load(Ordering::Acquire) {
            OPEN => None,
            n => Some(n),
        }
    }

    /// Whether the ceiling holds admissions now (no allowance left).
    pub fn is_held(&self) -> bool {
        self.allowance.load(Ordering::Acquire) == 0
    }

    /// Admits one more message if that needs no wait (nothing throttles this direction);
    /// false otherwise, and then nothing was admitted. A batch receive takes its second and
    /// later messages this way, so any wait makes it a receive of one.
    #[inline]
    pub fn try_admit(&self) -> bool {
        self.is_open()
    }

    /// Waits until this direction admits one more message; returns how long it waited.
    /// While the ceiling holds receives (an allowance of none) it waits for it to give some;
    /// the receive then takes its share with [`Admission::start`].
    /// Cancel-safe: dropping the future gives up the wait and its place in the pacing queue.
    #[inline]
    pub async fn admit(&self) -> Duration {
        if self.is_open() {
            return Duration::ZERO;
        }
        let waited = self.admit_slow().await;
        if !waited.is_zero() {
            self.wait_histogram.record(waited.as_secs_f64());
        }
        waited
    }

    async fn admit_slow(&self) -> Duration {
        let _waiting = Waiting::enter(&self.waiting);
        let start = self.now_ns();
        // The delay: every caller waits it, concurrently.
        self.until_relaxed(|| {
            let delay_until = start.saturating_add(self.delay_ns.load(Ordering::Relaxed));
            match self.now_ns() >= delay_until {
                true => Ready(()),
                false => RecheckAt(delay_until),
            }
        })
        .await;
        // Only callers past the delay wait on the ceiling: those still in a delay (an
        // override, a throttling delay) are not the ceiling's to report.
        let on_allowance = Waiting::enter(&self.waiting_on_allowance);
        self.until_relaxed(|| match self.is_held() {
            false => Ready(()),
            true => RecheckWhenRelaxed,
        })
        .await;
        drop(on_allowance);
        if self.pace_ns.load(Ordering::Relaxed) == 0 {
            return Duration::from_nanos(self.now_ns() - start);
        }
        // Pacing: one caller at a time waits for the next slot.
        let _turn = self.pacing_turn.lock().await;
        self.until_relaxed(|| {
            let now = self.now_ns();
            let pace = self.pace_ns.load(Ordering::Relaxed);
            let slot = self.next_slot_ns.load(Ordering::Relaxed);
            if pace == 0 {
                return Ready(Duration::from_nanos(now - start));
            }
            if slot > now {
                return RecheckAt(slot);
            }
            // The next slot follows this one, not the wake-up: the timer wakes a waiter up
            // to a millisecond late, and counted from the wake-up a 2.5 ms pace admitted one
            // per 3 ms. Slots that fell due while the waiter slept are served at once, so a
            // pace finer than the timer admits its rate in small batches (a 200 us pace gave
            // 2 000 a second for 5 000 asked when only one interval could be caught up). A
            // slot long past (an idle pace) leaves that much credit at most.
            let catch_up = pace.max(TIMER_SLACK_NS);
            let next = slot.max(now.saturating_sub(catch_up)).saturating_add(pace);
            self.next_slot_ns.store(next, Ordering::Relaxed);
            Ready(Duration::from_nanos(now - start))
        })
        .await
    }

    /// Calls `check` until it is ready: again at the time it names, and whenever the
    /// controller relaxes a setting (so a delay shortened or a hold lifted takes effect for
    /// callers already waiting). The wake-up is registered before each check, so a
    /// relaxation between the check and the wait is not missed.
    async fn until_relaxed<T>(&self, mut check: impl FnMut() -> Check<T>) -> T {
        loop {
            let relaxed = self.relaxed.notified();
            tokio::pin!(relaxed);
            relaxed.as_mut().enable();
            match check() {
                Ready(value) => return value,
                RecheckAt(ns) => tokio::select! {
                    _ = tokio::time::sleep_until(self.instant_at(ns)) => {}
                    _ = &mut relaxed => {}
                },
                RecheckWhenRelaxed => relaxed.await,
            }
        }
    }
}

/// A receive started by [`Admission::start`]; dropped when it has come back.
#[derive(Debug)]
#[must_use = "the receive counts as out only while this lives"]
pub struct Receiving<'a>(&'a AtomicU64);

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What one check of a waiting admission found.
enum Check<T> {
    Ready(T),
    /// Not yet; check again at this time (ns from the admission's origin) or when relaxed.
    RecheckAt(u64),
    /// Not yet; check again when the controller relaxes a setting.
    RecheckWhenRelaxed,
}
use Check::{Ready, RecheckAt, RecheckWhenRelaxed};

/// One caller waiting, counted in `count` until it is dropped however the wait ends,
/// cancellation included.
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn enter(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn open_admission_does_not_wait() {
        let a = Admission::default();
        assert_eq!(a.admit().await, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn delay_is_waited_by_every_caller() {
        let a = Arc::new(Admission::default());
        a.set(Duration::from_millis(20), None);
        let start = Instant::now();
        let (x, y) = tokio::join!(a.admit(), a.admit());
        assert_eq!(x, Duration::from_millis(20));
        assert_eq!(y, Duration::from_millis(20));
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(20),
            "concurrent, not serial"
        );
    }

    /// Callers in a delay (an override) are waiting, but not on the ceiling's allowance,
    /// even while it is used up: only those past the delay are the ceiling's holds.
    #[tokio::test(start_paused = true)]
    async fn callers_in_a_delay_are_not_counted_as_held_by_the_ceiling() {
        let a = Arc::new(Admission::default());
        a.set(Duration::from_secs(1), None);
        a.hold(true);
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.admit().await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            (a.waiting(), a.waiting_on_allowance()),
            (1, 0),
            "in the delay"
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(
            (a.waiting(), a.waiting_on_allowance()),
            (1, 1),
            "past it, held"
        );
        a.hold(false);
        waiter.await.unwrap();
        assert_eq!((a.waiting(), a.waiting_on_allowance()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_spaces_admissions_across_callers() {
        let a = Arc::new(Admission::default());
        a.set(Duration::ZERO, Some(Duration::from_millis(100)));
        let start = Instant::now();
        let mut handles = Vec::new();
        for _ in 0..5 {
            let a = a.clone();
            handles.push(tokio::spawn(async move {
                a.admit().await;
                start.elapsed()
            }));
        }
        let mut times: Vec<Duration> = Vec::new();
        for h in handles {
            times.push(h.await.unwrap());
        }
        times.sort();
        let ms: Vec<u128> = times.iter().map(|t| t.as_millis()).collect();
        assert_eq!(ms, vec![0, 100, 200, 300, 400]);
    }

    #[tokio::test(start_paused = true)]
    async fn many_paced_waiters_are_served_in_order_at_the_pace() {
        let a = Arc::new(Admission::default());
        a.set(Duration::ZERO, Some(Duration::from_millis(10)));
        let start = Instant::now();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        for i in 0..1000 {
            let (a, order) = (a.clone(), order.clone());
            handles.push(tokio::spawn(async move {
                a.admit().await;
                order.lock().unwrap().push(i);
            }));
            tokio::task::yield_now().await;
        }
        for h in handles {
            h.await.unwrap();
        }
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(9990),
            "1000 admissions 10 ms apart"
        );
        let order = order.lock().unwrap();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "FIFO");
    }

    /// The timer wakes a waiter up to a millisecond after its slot. Counted from the wake-up,
    /// a pace of 400 a second (2.5 ms) admitted about 333 (one per 3 ms); catching up one
    /// interval only, 5 000 a second (200 us) admitted 2 000. Slots follow each other from
    /// where the last one was due, and those that fell due while the waiter slept are served
    /// as it wakes, so one second's worth of admissions takes one second.
    #[tokio::test(start_paused = true)]
    async fn paces_finer_than_the_timer_admit_at_their_rate() {
        for (interval_us, per_second) in [(2500, 400), (200, 5000)] {
            let a = Arc::new(Admission::default());
            a.set(Duration::ZERO, Some(Duration::from_micros(interval_us)));
            let start = Instant::now();
            for _ in 0..per_second {
                a.admit().await;
            }
            let elapsed = start.elapsed();
            assert!(
                (990..=1005).contains(&elapsed.as_millis()),
                "{per_second} admissions at {interval_us} us took {elapsed:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn relaxing_the_delay_releases_waiters_early() {
        let a = Arc::new(Admission::default());
        a.set(Duration::from_secs(300), None);
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        a.set(Duration::ZERO, None);
        let waited = waiter.await.unwrap();
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ending_pacing_releases_a_far_slot() {
        let a = Arc::new(Admission::default());
        a.set(Duration::ZERO, Some(Duration::from_secs(300)));
        a.admit().await; // takes the slot at t=0; the next is due at t=300s
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await })
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        a.set(Duration::ZERO, Some(Duration::from_millis(10)));
        let waited = waiter.await.unwrap();
        assert!(waited < Duration::from_secs(3), "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_stops_every_admission_until_released() {
        let a = Arc::new(Admission::default());
        a.hold(true);
        assert!(!a.is_open());
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiter.is_finished(), "held for as long as the hold lasts");
        a.hold(false);
        let waited = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("released at once")
            .unwrap();
        assert_eq!(waited, Duration::from_secs(5));
        assert!(a.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn an_allowance_lets_that_many_receives_start_and_no_more() {
        let a = Arc::new(Admission::default());
        a.hold(true);
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let waiters: Vec<_> = (0..5)
            .map(|_| {
                let (a, gate) = (a.clone(), gate.clone());
                // A receiver: the wait, a slot of its queue, then the start.
                tokio::spawn(async move {
                    loop {
                        a.admit().await;
                        let _slot = gate.acquire().await.unwrap();
                        if let Some(receiving) = a.start() {
                            std::mem::forget(receiving); // out for the rest of the test
                            break;
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(10)).await;
        a.allow(Some(2));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "no slot yet: nothing started, nothing taken"
        );
        assert_eq!(a.allowance(), Some(2));
        // The slots free long after the wait ended: the allowance still bounds the starts.
        gate.add_permits(5);
        tokio::time::sleep(Duration::from_millis(10)).await;
        let done = waiters.iter().filter(|w| w.is_finished()).count();
        assert_eq!(done, 2, "two started from an allowance of two");
        assert!(a.is_held(), "the allowance is used up");
        assert_eq!(a.started(), 2, "two receives out");
        a.allow(None);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(waiters.iter().all(|w| w.is_finished()), "released");
        assert_eq!(a.started(), 5);
    }

    #[test]
    fn a_receive_that_comes_back_empty_leaves_no_count() {
        let a = Admission::default();
        let empty = a.start().expect("open");
        let full = a.start().expect("open");
        assert_eq!(a.started(), 2);
        drop(empty);
        assert_eq!(a.started(), 1);
        // The message is handed to its handler, then its receive guard goes.
        a.message_started();
        drop(full);
        assert_eq!(a.started(), 1);
    }
}
