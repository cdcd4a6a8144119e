//! Offered load: the backlog stored before a run, open-loop generation at a phase's rate, and
//! closed-loop senders.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::host::HostHandle;
use crate::load::scenario::{Phase, Scenario};
use crate::message::{EXECUTION_STAGE_HEADER, OutgoingMessage, PREVIOUS_STAGE_HEADER};
use crate::transport::{QueueName, Transport, TransportError};

use super::first_queue;
use super::ledger::Ledger;

/// Most sends of a phase waiting at once; beyond this the generator stops offering more (it
/// would otherwise turn a throttled publish path into unbounded memory).
pub(super) const MAX_OUTSTANDING_SENDS: usize = 100_000;

/// Stores the scenario's backlog (`prefill`, with its keys and stages) in the first phase's
/// queue, each message in the ledger.
pub(super) async fn store_backlog(
    scenario: &Scenario,
    transport: &Arc<dyn Transport>,
    body: &[u8],
    ledger: &Arc<Ledger>,
) -> Result<(), TransportError> {
    if scenario.prefill == 0 {
        return Ok(());
    }
    let target = first_queue(scenario, &scenario.phases[0]);
    transport.admin().create_queue(&target).await?;
    let key_header = scenario
        .queues
        .iter()
        .find(|q| q.name == target.as_str())
        .and_then(|q| q.ordering.key_header())
        .filter(|_| scenario.prefill_keys > 0)
        .map(|h| {
            (
                h.to_string(),
                scenario
                    .prefill_key_layout
                    .keys(scenario.prefill, scenario.prefill_keys),
            )
        });
    let backlog = Backlog {
        count: scenario.prefill,
        body,
        keys: key_header,
        stages: scenario.prefill_stages,
    };
    prefill(transport, &target, backlog, ledger).await
}

/// The backlog a scenario starts with.
pub(super) struct Backlog<'a> {
    pub(super) count: u64,
    pub(super) body: &'a [u8],
    /// The key header and each message's key.
    pub(super) keys: Option<(String, Vec<u32>)>,
    /// Stages the backlog is cut into, in send order (0: none).
    pub(super) stages: u32,
}

impl Backlog<'_> {
    /// The stage (from 0) of the `i`-th message.
    pub(super) fn stage_of(&self, i: u64) -> Option<u32> {
        (self.stages > 0).then(|| (i * u64::from(self.stages) / self.count) as u32)
    }
}

/// Stores the backlog, in batches, each message in the ledger (with its key and its place
/// among the key's messages).
pub(super) async fn prefill(
    transport: &Arc<dyn Transport>,
    queue: &QueueName,
    backlog: Backlog<'_>,
    ledger: &Arc<Ledger>,
) -> Result<(), TransportError> {
    /// Messages per statement (PostgreSQL stores a batch with one INSERT).
    const BATCH: u64 = 1000;
    let mut places: HashMap<u32, u32> = HashMap::new();
    let mut stage_places: HashMap<u32, u32> = HashMap::new();
    let mut stored = 0;
    while stored < backlog.count {
        let first = stored;
        let (messages, keys): (Vec<OutgoingMessage>, Vec<Option<u32>>) = (first
            ..first + BATCH.min(backlog.count - stored))
            .map(|i| {
                let mut m = OutgoingMessage::new(backlog.body.to_vec());
                if let Some(stage) = backlog.stage_of(i) {
                    m = m.with_header(EXECUTION_STAGE_HEADER, ((stage + 1) * 100).to_string());
                    if stage > 0 {
                        m = m.with_header(PREVIOUS_STAGE_HEADER, (stage * 100).to_string());
                    }
                }
                match &backlog.keys {
                    Some((header, keys)) => {
                        let key = keys[i as usize];
                        (
                            m.with_header(header.clone(), format!("key-{key}")),
                            Some(key),
                        )
                    }
                    None => (m, None),
                }
            })
            .unzip();
        transport.send_batch(queue, &messages).await?;
        for ((message, key), i) in messages.iter().zip(&keys).zip(first..) {
            match key {
                Some(key) => {
                    let place = places.entry(*key).or_insert(0);
                    ledger.sent_keyed(message, *key, *place);
                    *place += 1;
                }
                None => ledger.sent(message),
            }
            if let Some(stage) = backlog.stage_of(i) {
                let place = stage_places.entry(stage).or_insert(0);
                ledger.sent_staged(message, stage, *place);
                *place += 1;
            }
        }
        stored += messages.len() as u64;
    }
    Ok(())
}

/// Offers the phase's burst, then its rate (open loop, possibly ramped) or its closed-loop
/// producers, to the publish path.
#[allow(clippy::too_many_arguments)]
pub(super) async fn generate(
    host: HostHandle,
    queue: QueueName,
    phase: Phase,
    length: Duration,
    body: Vec<u8>,
    ledger: Arc<Ledger>,
    sends: TaskTracker,
    outstanding: Arc<Semaphore>,
    stop: CancellationToken,
) {
    let offered_so_far = std::sync::atomic::AtomicU64::new(0);
    let offer = |ledger: &Arc<Ledger>| {
        let Ok(permit) = outstanding.clone().try_acquire_owned() else {
            ledger.send_failures.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let (host, queue, ledger) = (host.clone(), queue.clone(), ledger.clone());
        let mut message = OutgoingMessage::new(body.clone());
        let n = offered_so_far.fetch_add(1, Ordering::Relaxed) + 1;
        if phase.poison_every > 0 && n.is_multiple_of(phase.poison_every) {
            message = message.with_header(crate::handlers::POISON_HEADER, "always");
        }
        if let Some(ttbr) = phase.ttbr {
            message = message.with_time_to_be_received(ttbr);
        }
        sends.spawn(async move {
            let sending = ledger.sending(&message);
            match host.send(queue.as_str(), message).await {
                Ok(()) => ledger.sent_as(sending),
                Err(e) => {
                    ledger.send_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "a load-test send failed");
                }
            }
            drop(permit);
        });
    };
    for _ in 0..phase.burst {
        if stop.is_cancelled() {
            return;
        }
        offer(&ledger);
        tokio::task::yield_now().await;
    }
    if phase.producers > 0 {
        let cap = (phase.publish_rate > 0.0).then_some(phase.publish_rate);
        produce_closed_loop(host, queue, &phase, cap, body, ledger, stop).await;
        return;
    }
    offer_open_loop(&phase, length, &stop, || offer(&ledger)).await;
}

/// Offers at the phase's rate (ramping to `publish_rate_end` over `length` if it says so)
/// until `stop`, whether or not earlier sends have finished.
async fn offer_open_loop(
    phase: &Phase,
    length: Duration,
    stop: &CancellationToken,
    offer: impl Fn(),
) {
    let peak = phase
        .publish_rate
        .max(phase.publish_rate_end.unwrap_or(0.0));
    if peak <= 0.0 {
        return;
    }
    let start = Instant::now();
    let mut offered = 0u64;
    // Due sends are the integral of the (possibly ramping) rate, summed per tick.
    let mut due = 0.0f64;
    let mut last = Duration::ZERO;
    let tick = Duration::from_secs_f64((1.0 / peak).clamp(0.001, 0.05));
    loop {
        let now = start.elapsed();
        let rate = (phase.rate_at(last, length) + phase.rate_at(now, length)) / 2.0;
        due += rate * (now - last).as_secs_f64();
        last = now;
        while (offered as f64) < due.floor() {
            offer();
            offered += 1;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(tick) => {}
        }
    }
}

/// `phase.producers` senders, each waiting for its send before the next; `cap` bounds their
/// total rate.
pub(super) async fn produce_closed_loop(
    host: HostHandle,
    queue: QueueName,
    phase: &Phase,
    cap: Option<f64>,
    body: Vec<u8>,
    ledger: Arc<Ledger>,
    stop: CancellationToken,
) {
    let spacing = cap.map(|rate| Duration::from_secs_f64(phase.producers as f64 / rate));
    let mut producers = tokio::task::JoinSet::new();
    for _ in 0..phase.producers {
        let (host, queue, body, ledger, stop) = (
            host.clone(),
            queue.clone(),
            body.clone(),
            ledger.clone(),
            stop.clone(),
        );
        let ttbr = phase.ttbr;
        producers.spawn(async move {
            while !stop.is_cancelled() {
                let started = Instant::now();
                let mut message = OutgoingMessage::new(body.clone());
                if let Some(ttbr) = ttbr {
                    message = message.with_time_to_be_received(ttbr);
                }
                // A send already waiting when the phase ends still completes (nothing offered
                // is dropped); the next one is not started.
                let sending = ledger.sending(&message);
                match host.send(queue.as_str(), message).await {
                    Ok(()) => ledger.sent_as(sending),
                    Err(e) => {
                        ledger.send_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "a load-test send failed");
                    }
                }
                if let Some(spacing) = spacing {
                    let rest = spacing.saturating_sub(started.elapsed());
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(rest) => {}
                    }
                }
            }
        });
    }
    while producers.join_next().await.is_some() {}
}
