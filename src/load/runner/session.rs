//! A session plays the scenario's phases against the running host, then drains and waits for the
//! states to clear.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, OverrideMode};
use crate::handlers::SimulateHandler;
use crate::host::HostHandle;
use crate::load::options::{Display, LoadOptions};
use crate::load::peer::{Peers, now_ns};
use crate::load::record::PhaseSpan;
use crate::load::scenario::{Phase, Scenario};
use crate::transport::{QueueName, Transport};

use super::first_queue;
use super::generate::generate;
use super::ledger::Ledger;
use super::recorder::{Recorder, take_latencies};

/// One load run in progress: the host under load, what it records, and the phases so far.
pub(super) struct Session<'a> {
    pub(super) scenario: &'a Scenario,
    pub(super) options: &'a LoadOptions,
    /// The host under load, through the handle any caller gets.
    pub(super) host: HostHandle,
    /// The settings in force: the scenario's, with what the phases changed so far (each
    /// change is applied as a reload of them).
    pub(super) settings: Config,
    /// The simulate handlers the host runs, whose knobs the phases turn.
    pub(super) simulated: Vec<Arc<SimulateHandler>>,
    pub(super) admin: Option<std::net::SocketAddr>,
    pub(super) recorder: Recorder,
    pub(super) ledger: Arc<Ledger>,
    pub(super) body: Vec<u8>,
    pub(super) started: Instant,
    pub(super) sample_interval: Duration,
    /// Sends in flight, waited for before the drain.
    pub(super) sends: TaskTracker,
    pub(super) outstanding: Arc<Semaphore>,
    /// When the progress line was last shown.
    pub(super) shown_at: f64,
    pub(super) spans: Vec<PhaseSpan>,
    /// The peer processes (`processes` above 1), until they are stopped.
    pub(super) peers: Option<Peers>,
    /// Peers that could not be killed, paused or resumed when a phase asked, in words.
    pub(super) peer_signal_failures: Vec<String>,
}

impl Session<'_> {
    /// Shows progress for `phase` (the `index`-th of `phases`).
    pub(super) fn show(&mut self, phase: &str, position: (usize, usize)) {
        show(
            self.options.display,
            &self.host,
            &self.recorder,
            phase,
            position,
            &self.ledger,
            self.admin,
            &mut self.shown_at,
        );
    }

    pub(super) fn out_of_time(&self) -> bool {
        self.options.stop.is_cancelled()
            || self
                .options
                .repeat_for
                .is_some_and(|t| self.started.elapsed() >= t)
    }

    /// Plays the phases, `rounds` times (or for as long as the options say).
    pub(super) async fn play(&mut self) {
        let total = self.options.repeat_for;
        let mut round = 0u32;
        'rounds: loop {
            for (index, phase) in self.scenario.phases.iter().enumerate() {
                if self.out_of_time() {
                    break 'rounds;
                }
                let label = if round > 0 {
                    format!("{} (round {})", phase.name, round + 1)
                } else {
                    phase.name.clone()
                };
                self.play_phase(phase, label, index).await;
            }
            round += 1;
            if !(self.options.repeat_forever || total.is_some()) && round >= self.scenario.rounds {
                break;
            }
        }
    }

    /// One phase: its settings applied, its load offered, shown every sample interval.
    pub(super) async fn play_phase(&mut self, phase: &Phase, label: String, index: usize) {
        let queue = first_queue(self.scenario, phase);
        self.apply_phase(phase, &queue);
        if let Some(number) = phase.kill_peer {
            self.kill_peer(number as usize);
        }
        if let Some(number) = phase.pause_peer {
            self.pause_peer(number as usize, true);
        }
        let phase_stop = self.options.stop.child_token();
        let length = phase.duration.mul_f64(self.options.duration_scale.max(0.0));
        let length = match self.options.repeat_for {
            Some(t) => length.min(t.saturating_sub(self.started.elapsed())),
            None => length,
        };
        let generator = tokio::spawn(generate(
            self.host.clone(),
            queue,
            phase.clone(),
            length,
            self.body.clone(),
            self.ledger.clone(),
            self.sends.clone(),
            self.outstanding.clone(),
            phase_stop.clone(),
        ));
        let start = self.started.elapsed().as_secs_f64();
        self.recorder.set_phase(&label);
        take_latencies(&self.simulated);
        let phase_end = Instant::now() + length;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.sample_interval) => {}
                _ = self.options.stop.cancelled() => {}
            }
            self.show(&label, (index, self.scenario.phases.len()));
            if self.options.stop.is_cancelled() || Instant::now() >= phase_end {
                break;
            }
            if phase.until_drained && generator.is_finished() && drained(&self.host).await {
                break;
            }
        }
        if let Some(number) = phase.pause_peer {
            self.pause_peer(number as usize, false);
        }
        phase_stop.cancel();
        let _ = generator.await;
        self.spans.push(PhaseSpan {
            name: label,
            start,
            end: self.started.elapsed().as_secs_f64(),
            latencies: take_latencies(&self.simulated),
            causes: phase.causes.clone(),
        });
    }

    /// Plays the phases, lets the load stop and the queues drain, stops the peers (they
    /// report what they held before the count is taken) and waits for the states to clear:
    /// when the last message was done (seconds from the start), what the peers reported
    /// wrong, and whether both directions cleared.
    pub(super) async fn run_through(&mut self) -> (f64, Vec<String>, bool) {
        self.play().await;
        self.stop_load().await;
        let busy_seconds = self.drain().await;
        let mut peer_failures = match self.peers.take() {
            Some(peers) => peers.stop().await,
            None => Vec::new(),
        };
        peer_failures.append(&mut self.peer_signal_failures);
        let cleared = self.settle().await;
        if self.options.display == Display::Progress {
            eprintln!();
        }
        (busy_seconds, peer_failures, cleared)
    }

    /// Kills peer `number` (`kill -9`) and tells the ledger, which ends its handlings then.
    pub(super) fn kill_peer(&mut self, number: usize) {
        let outcome = match self.peers.as_mut() {
            Some(peers) => peers.kill(number),
            None => Err(format!("there is no peer {number} to kill")),
        };
        match outcome {
            Ok(()) => self.ledger.span(|spans| spans.killed(number, now_ns())),
            Err(e) => self.peer_signal_failures.push(e),
        }
    }

    /// Pauses (SIGSTOP) or resumes (SIGCONT) peer `number`; a failure fails the run, as a
    /// kill's does.
    pub(super) fn pause_peer(&mut self, number: usize, paused: bool) {
        let outcome = match self.peers.as_mut() {
            Some(peers) => peers.pause(number, paused),
            None => Err(format!("there is no peer {number} to pause")),
        };
        if let Err(e) = outcome {
            self.peer_signal_failures.push(e);
        }
    }

    /// Lets offered sends finish (or fail), lifts the overrides, and stops the simulate
    /// handlers holding memory and threads, so the resource conditions can clear while the
    /// backlog drains; latency and failure rate stay as the last phase left them.
    pub(super) async fn stop_load(&mut self) {
        self.sends.close();
        if tokio::time::timeout(self.scenario.drain_timeout, self.sends.wait())
            .await
            .is_err()
        {
            tracing::warn!("some sends did not finish within the drain timeout");
        }
        let throttling = &mut self.settings.throttling;
        let mut lifted = false;
        for direction in [&mut throttling.delivery, &mut throttling.publishing] {
            lifted |= direction.override_mode != OverrideMode::None;
            direction.override_mode = OverrideMode::None;
        }
        if lifted {
            self.host.apply_config(self.settings.clone());
        }
        for sim in &self.simulated {
            let mut knobs = sim.knobs();
            knobs.memory_per_message = crate::config::ByteSize(0);
            knobs.blocking = false;
            sim.set_knobs(knobs);
        }
    }

    /// Waits for the queues to drain (when asked to); returns when the last message was done,
    /// in seconds from the start.
    pub(super) async fn drain(&mut self) -> f64 {
        let drain_start = self.started.elapsed().as_secs_f64();
        self.recorder.set_phase("drain");
        take_latencies(&self.simulated);
        let drain_deadline = Instant::now() + self.scenario.drain_timeout;
        while self.options.drain
            && !drained(&self.host).await
            && Instant::now() < drain_deadline
            && !self.options.stop.is_cancelled()
        {
            tokio::time::sleep(self.sample_interval).await;
            self.show("drain", (0, 0));
        }
        self.spans.push(PhaseSpan {
            name: "drain".into(),
            start: drain_start,
            end: self.started.elapsed().as_secs_f64(),
            latencies: take_latencies(&self.simulated),
            causes: Vec::new(),
        });
        let last_done = *self
            .ledger
            .last_done
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        last_done
            .map(|t| t.duration_since(self.started).as_secs_f64())
            .unwrap_or(0.0)
    }

    /// Waits for both directions to return to state 0; whether they did.
    pub(super) async fn settle(&mut self) -> bool {
        let settle_start = self.started.elapsed().as_secs_f64();
        self.recorder.set_phase("settle");
        let cleared = if self.options.drain {
            settle(
                &self.recorder,
                self.sample_interval,
                self.scenario.settle_timeout,
                &self.options.stop,
            )
            .await
        } else {
            false
        };
        self.spans.push(PhaseSpan {
            name: "settle".into(),
            start: settle_start,
            end: self.started.elapsed().as_secs_f64(),
            latencies: Vec::new(),
            causes: Vec::new(),
        });
        cleared
    }
}

impl Session<'_> {
    /// Applies what `phase` changes: the queue's max and latency limit and the overrides as a
    /// reload of the settings in force (so none of them undoes another), the simulate
    /// handlers' knobs directly.
    fn apply_phase(&mut self, phase: &Phase, queue: &QueueName) {
        let settings = &mut self.settings;
        let mut changed = false;
        if let Some(q) = settings
            .queues
            .iter_mut()
            .find(|q| q.name == queue.as_str())
        {
            if let Some(max) = phase.max_concurrency {
                q.concurrency.max = max;
                changed = true;
            }
            if let Some(on) = phase.latency_limit {
                q.latency_limit.enabled = on;
                changed = true;
            }
        }
        let throttling = &mut settings.throttling;
        for (mode, direction) in [
            (phase.delivery_override, &mut throttling.delivery),
            (phase.publishing_override, &mut throttling.publishing),
        ] {
            if let Some(mode) = mode {
                direction.override_mode = mode;
                changed = true;
            }
        }
        if changed {
            self.host.apply_config(self.settings.clone());
        }
        if let Some(change) = &phase.handler {
            for sim in &self.simulated {
                sim.set_knobs(change.apply(sim.knobs()));
            }
        }
    }
}

/// Waits until both directions are back at state 0 (true: no delay, no pace, full limits, as
/// the controller reports only then) or the timeout passes (false).
pub(super) async fn settle(
    recorder: &Recorder,
    interval: Duration,
    timeout: Duration,
    stop: &CancellationToken,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        tokio::time::sleep(interval).await;
        if let Some(last) = recorder.latest() {
            let d = &last.snapshot.decision;
            if d.delivery.state == 0 && d.publishing.state == 0 {
                return true;
            }
        }
        if Instant::now() >= deadline || stop.is_cancelled() {
            return false;
        }
    }
}

/// Whether nothing is in process and every receiving queue and its delayed table is empty.
pub(super) async fn drained(host: &HostHandle) -> bool {
    let status = host.status();
    if status.in_process > 0 || status.queues.iter().any(|q| q.in_flight > 0) {
        return false;
    }
    for q in &status.queues {
        let Ok(name) = QueueName::new(&q.name) else {
            return false;
        };
        match host.transport().peek_depth(&name).await {
            Ok(0) => {}
            _ => return false,
        }
        // Delayed retries still waiting will come back: not drained yet.
        if delayed_waiting(host.transport().as_ref(), &name).await > 0 {
            return false;
        }
    }
    true
}

/// Messages in `queue`'s delayed table (0 where it has none).
pub(super) async fn delayed_waiting(transport: &dyn Transport, queue: &QueueName) -> u64 {
    match transport.delayed_delivery() {
        Some(d) => d.delayed_count(queue).await.unwrap_or(0),
        None => 0,
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn show(
    display: Display,
    host: &HostHandle,
    recorder: &Recorder,
    phase: &str,
    (index, phases): (usize, usize),
    ledger: &Ledger,
    admin: Option<std::net::SocketAddr>,
    shown_at: &mut f64,
) {
    let Some(last) = recorder.latest() else {
        return;
    };
    let last = &last;
    match display {
        Display::Quiet => {}
        Display::Progress => {
            let d = &last.snapshot.decision;
            let line = format!(
                "[{}/{} {}] t={:.1}s delivery={} ({}) publishing={} ({}) sent={} done={} depth={}",
                index + 1,
                phases.max(1),
                phase,
                last.t,
                d.delivery.state,
                crate::load::units::format_wait(d.delivery.effective_wait()),
                d.publishing.state,
                crate::load::units::format_wait(d.publishing.effective_wait()),
                ledger.sent.load(Ordering::Relaxed),
                ledger.done.load(Ordering::Relaxed),
                last.queues.iter().map(|q| q.3).sum::<u64>(),
            );
            if std::io::stderr().is_terminal() {
                eprint!("\r{line:<120}");
            } else if last.t - *shown_at >= 5.0 {
                *shown_at = last.t;
                eprintln!("{line}");
            }
        }
        Display::Table => {
            // Once a second is enough for a person.
            if last.t.floor() != shown_at.floor() {
                *shown_at = last.t;
                print!(
                    "{}",
                    crate::load::live_table::render(
                        &host.status().queues,
                        last,
                        phase,
                        index,
                        phases,
                        admin
                    )
                );
            }
        }
    }
}
