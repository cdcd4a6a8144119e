//! The receive circuit breaker (after the NServiceBus SQL transport's
//! `RepeatedFailuresOverTimeCircuitBreaker`): the first transport error arms it, errors that
//! go on for `trigger_after` trigger it, any success disarms it. Armed, a receiver pauses one
//! second after each error; triggered, it backs off 1, 2, 4 s up to [`TRIGGERED_DELAY`] (not
//! NServiceBus's fixed 10 s: receiving resumes within 5 s of the database answering again), and
//! the monitor model receives one message at a time. The host keeps running either way; the
//! state is logged, exported and reported by `/readyz`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Pause after an error while armed.
pub(crate) const ARMED_DELAY: Duration = Duration::from_secs(1);
/// The longest pause after an error once triggered.
pub(crate) const TRIGGERED_DELAY: Duration = Duration::from_secs(5);
/// How long errors must go on before the breaker triggers.
pub(crate) const TRIGGER_AFTER: Duration = Duration::from_secs(30);

/// One queue's breaker.
#[derive(Debug)]
pub(crate) struct CircuitBreaker {
    queue: String,
    armed: AtomicBool,
    state: Mutex<State>,
    open_gauge: metrics::Gauge,
}

#[derive(Debug, Default)]
struct State {
    armed_at: Option<Instant>,
    triggered: bool,
    failures: u64,
    /// Failures since the breaker triggered: the back-off's exponent.
    failures_triggered: u32,
}

impl CircuitBreaker {
    /// A disarmed breaker for `queue`; `open_gauge` is set to 1 while triggered.
    pub(crate) fn new(queue: &str, open_gauge: metrics::Gauge) -> Self {
        CircuitBreaker {
            queue: queue.to_string(),
            armed: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            open_gauge,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a success; cheap when already disarmed.
    #[inline]
    pub(crate) fn success(&self) {
        if !self.armed.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.state();
        if s.triggered {
            tracing::info!(queue = %self.queue, failures = s.failures, "receive circuit breaker closed: the transport answers again");
        }
        *s = State::default();
        self.armed.store(false, Ordering::Relaxed);
        self.open_gauge.set(0.0);
    }

    /// Records a failure and returns how long the receiver should pause.
    pub(crate) fn failure(&self, error: &dyn std::fmt::Display) -> Duration {
        let now = Instant::now();
        let mut s = self.state();
        s.failures += 1;
        let armed_at = *s.armed_at.get_or_insert(now);
        self.armed.store(true, Ordering::Relaxed);
        if !s.triggered && now.duration_since(armed_at) >= TRIGGER_AFTER {
            s.triggered = true;
            self.open_gauge.set(1.0);
            tracing::error!(queue = %self.queue, failures = s.failures, error = %error,
                "receive circuit breaker triggered: transport errors for {}s; receiving slowly until it recovers",
                TRIGGER_AFTER.as_secs());
        } else if s.failures == 1 {
            tracing::warn!(queue = %self.queue, error = %error, "receive failed; circuit breaker armed");
        } else {
            tracing::debug!(queue = %self.queue, error = %error, failures = s.failures, "receive failed again");
        }
        if s.triggered {
            let delay = ARMED_DELAY.saturating_mul(1 << s.failures_triggered.min(8));
            s.failures_triggered += 1;
            delay.min(TRIGGERED_DELAY)
        } else {
            ARMED_DELAY
        }
    }

    /// True once errors have lasted `TRIGGER_AFTER`.
    pub(crate) fn is_triggered(&self) -> bool {
        self.armed.load(Ordering::Relaxed) && self.state().triggered
    }

    /// "closed", "armed" or "open", for the status page.
    pub(crate) fn describe(&self) -> &'static str {
        if !self.armed.load(Ordering::Relaxed) {
            "closed"
        } else if self.state().triggered {
            "open"
        } else {
            "armed"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn arms_triggers_and_disarms() {
        let b = CircuitBreaker::new("q", metrics::Gauge::noop());
        assert_eq!(b.describe(), "closed");
        assert_eq!(b.failure(&"boom"), ARMED_DELAY);
        assert_eq!(b.describe(), "armed");
        tokio::time::advance(TRIGGER_AFTER).await;
        let backoff: Vec<u64> = (0..5).map(|_| b.failure(&"boom").as_secs()).collect();
        assert_eq!(
            backoff,
            [1, 2, 4, 5, 5],
            "short tries first, never above 5 s"
        );
        assert!(b.is_triggered());
        assert_eq!(b.describe(), "open");
        b.success();
        assert_eq!(b.describe(), "closed");
        assert_eq!(
            b.failure(&"boom"),
            ARMED_DELAY,
            "a new episode starts armed"
        );
    }
}
