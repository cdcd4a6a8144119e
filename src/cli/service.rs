//! Telling the service manager how `run` is doing, over systemd's notify protocol
//! (`NOTIFY_SOCKET`, the `sd-notify` crate): `READY=1` once receivers run and the database
//! answered, `STATUS=` with each direction's throttling state, `WATCHDOG=1` with every sample
//! of the throttling controller, `RELOADING=1`/`READY=1` around a reload and `STOPPING=1` at
//! shutdown. Without `NOTIFY_SOCKET` (not started by systemd with `Type=notify`) every call
//! does nothing.
//!
//! The watchdog is fed from the controller's samples, not from a timer of its own: a
//! controller that stops deciding stops the pings, and systemd (`WatchdogSec=`) restarts the
//! host, which is the point.

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use throttlehost::throttling::Snapshot;
use throttlehost::throttling::controller::{Decision, DirectionDecision};
use tokio::sync::broadcast;

/// Sends notifications when a service manager listens.
#[derive(Clone, Debug)]
pub struct ServiceManager {
    listening: bool,
}

impl ServiceManager {
    /// The service manager of this process, if `NOTIFY_SOCKET` names one.
    pub fn from_environment() -> Self {
        ServiceManager {
            listening: std::env::var_os("NOTIFY_SOCKET").is_some(),
        }
    }

    fn send(&self, states: &[NotifyState]) {
        if !self.listening {
            return;
        }
        if let Err(e) = sd_notify::notify(states) {
            tracing::debug!(error = %e, "cannot notify the service manager");
        }
    }

    /// Still starting: waiting for the database, for `reason`; the next word comes within
    /// `next_within` (the next try and its connection timeout), so the start is extended by
    /// that, or systemd's `TimeoutStartSec=` would end a wait that is only waiting.
    pub fn waiting(&self, reason: &str, next_within: Duration) {
        let extend = u32::try_from(next_within.as_micros()).unwrap_or(u32::MAX);
        self.send(&[
            NotifyState::Status(reason),
            NotifyState::ExtendTimeoutUsec(extend),
        ]);
    }

    /// Started: receivers run and the database answered.
    pub fn ready(&self, status: &str) {
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    /// Reading the configuration again.
    pub fn reloading(&self) {
        self.send(&[
            NotifyState::Reloading,
            NotifyState::Status("reloading the configuration"),
        ]);
    }

    /// Shutting down: in-flight messages finish or roll back.
    pub fn stopping(&self) {
        self.send(&[
            NotifyState::Stopping,
            NotifyState::Status("stopping: in-flight messages finish or roll back"),
        ]);
    }

    /// Feeds the watchdog (when systemd asked for one: `WATCHDOG_USEC`) and keeps `STATUS=`
    /// current, from every controller sample in `samples`, until the channel closes.
    pub async fn follow(self, samples: broadcast::Receiver<Arc<Snapshot>>) {
        if !self.listening {
            return;
        }
        let watchdog = sd_notify::watchdog_enabled().is_some();
        feed(samples, watchdog, |states| self.send(states)).await;
    }
}

/// Sends `WATCHDOG=1` (with `watchdog`) for every sample received, and `STATUS=` whenever the
/// status line changes: nothing at all while no sample comes.
async fn feed(
    mut samples: broadcast::Receiver<Arc<Snapshot>>,
    watchdog: bool,
    send: impl Fn(&[NotifyState]),
) {
    let mut said = String::new();
    loop {
        let snapshot = match samples.recv().await {
            Ok(snapshot) => snapshot,
            // Samples were taken while this task waited: the controller is alive.
            Err(broadcast::error::RecvError::Lagged(_)) => {
                if watchdog {
                    send(&[NotifyState::Watchdog]);
                }
                continue;
            }
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let status = status_line(&snapshot.decision);
        let mut states = Vec::with_capacity(2);
        if watchdog {
            states.push(NotifyState::Watchdog);
        }
        if status != said {
            states.push(NotifyState::Status(&status));
        }
        if !states.is_empty() {
            send(&states);
        }
        said = status;
    }
}

/// `STATUS=` for a decision: each direction's state code and name, and its cause while it
/// recovers, e.g. `delivery 0 (not throttling); publishing 4 (process memory, recovering)`.
pub fn status_line(decision: &Decision) -> String {
    let part = |d: &DirectionDecision| {
        let recovering = if d.recovering { ", recovering" } else { "" };
        format!(
            "{} {} ({}{recovering})",
            d.direction.name(),
            d.state,
            d.state_name
        )
    };
    format!(
        "{}; {}",
        part(&decision.delivery),
        part(&decision.publishing)
    )
}

/// The status before the first sample.
pub const STARTED: &str = "receiving; throttling states follow with the first sample";

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use throttlehost::config::ThrottlingConfig;
    use throttlehost::throttling::controller::{
        Controller, MachineFacts, QueueLoad, Readings, Thresholds,
    };
    use throttlehost::transport::QueueName;

    use super::*;

    const MACHINE: MachineFacts = MachineFacts {
        total_memory: 1 << 30,
        cpus: 1,
    };

    /// Snapshots from the real controller: in-process messages per tick (threshold 50).
    fn samples(in_process: &[u64]) -> Vec<Arc<Snapshot>> {
        let config = ThrottlingConfig {
            in_process_per_cpu: 50,
            ..ThrottlingConfig::default()
        };
        let thresholds = Thresholds::resolve(&config, MACHINE);
        let mut controller = Controller::new(config, thresholds);
        in_process
            .iter()
            .enumerate()
            .map(|(i, &value)| {
                let readings = Readings {
                    in_process: value,
                    threads: 1,
                    ..Readings::default()
                };
                let loads = [QueueLoad {
                    name: QueueName::new("orders").expect("a valid name"),
                    max: 100,
                    in_flight: value as u32,
                }];
                let at = Duration::from_millis(250 * i as u64);
                let decision = controller.tick(at, &readings, &loads);
                Arc::new(Snapshot::of_tick(decision, readings, thresholds, MACHINE))
            })
            .collect()
    }

    /// Feeds `snapshots` through [`feed`] and returns every datagram it would send, as text.
    async fn sent_for(snapshots: Vec<Arc<Snapshot>>, watchdog: bool) -> Vec<String> {
        let (tx, rx) = broadcast::channel(64);
        for snapshot in snapshots {
            tx.send(snapshot).unwrap();
        }
        drop(tx);
        let sent = Mutex::new(Vec::new());
        feed(rx, watchdog, |states| {
            let text: String = states.iter().map(|s| format!("{s}\n")).collect();
            sent.lock().unwrap().push(text);
        })
        .await;
        sent.into_inner().unwrap()
    }

    #[tokio::test]
    async fn every_sample_feeds_the_watchdog_and_a_changed_state_updates_the_status() {
        let sent = sent_for(samples(&[0, 0, 200, 200]), true).await;
        assert_eq!(sent.len(), 4, "one datagram per sample: {sent:?}");
        assert!(
            sent.iter().all(|d| d.starts_with("WATCHDOG=1\n")),
            "{sent:?}"
        );
        assert_eq!(
            sent[0],
            "WATCHDOG=1\nSTATUS=delivery 0 (not throttling); publishing 0 (not throttling)\n"
        );
        assert_eq!(sent[1], "WATCHDOG=1\n", "the same status is not said again");
        assert!(
            sent[2].contains("STATUS=delivery 3 ("),
            "in-process messages over the threshold: {sent:?}"
        );
    }

    #[tokio::test]
    async fn without_samples_nothing_is_sent() {
        assert!(sent_for(Vec::new(), true).await.is_empty());
    }

    #[tokio::test]
    async fn without_a_watchdog_only_status_changes_are_sent() {
        let sent = sent_for(samples(&[0, 0, 0]), false).await;
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert!(sent[0].starts_with("STATUS=delivery 0"));
    }
}
