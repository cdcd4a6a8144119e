//! The receive circuit breaker (after the NServiceBus SQL transport's
//! `RepeatedFailuresOverTimeCircuitBreaker`): the first transport error arms it, errors that
//! go on for `trigger_after` trigger it, any success disarms it. Armed, a receiver pauses one
//! second after each error; triggered, ten seconds, and the monitor model receives one message
//! at a time. The host keeps running either way; the state is logged and exported.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Pause after an error while armed.
pub const ARMED_DELAY: Duration = Duration::from_secs(1);
/// Pause after an error once triggered.
pub const TRIGGERED_DELAY: Duration = Duration::from_secs(10);
/// How long errors must go on before the breaker triggers.
pub const TRIGGER_AFTER: Duration = Duration::from_secs(30);

/// One queue's breaker.
#[derive(Debug)]
pub struct CircuitBreaker {
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
}

impl CircuitBreaker {
    /// A disarmed breaker for `queue`; `open_gauge` is set to 1 while triggered.
    pub fn new(queue: &str, open_gauge: metrics::Gauge) -> Self {
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
    pub fn success(&self) {
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
    pub fn failure(&self, error: &dyn std::fmt::Display) -> Duration {
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
            TRIGGERED_DELAY
        } else {
            ARMED_DELAY
        }
    }

    /// True once errors have lasted `TRIGGER_AFTER`.
    pub fn is_triggered(&self) -> bool {
        self.armed.load(Ordering::Relaxed) && self.state().triggered
    }

    /// "closed", "armed" or "open", for the status page.
    pub fn describe(&self) -> &'static str {
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
        assert_eq!(b.failure(&"boom"), TRIGGERED_DELAY);
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
