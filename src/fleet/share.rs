//! Fleet-wide concurrency limits: a queue's `fleet_max` shared among the instances that
//! receive from it, by demand, through the database they share.
//!
//! Every instance keeps a row per fleet-limited queue in the shares table
//! (`transport::FleetShares`): what it wants and what it was granted. A **round** reads every
//! row of the queue and writes this instance's, in one transaction under a lock that only one
//! round of that queue holds at a time, so grants are decided one after another:
//!
//! - **want**: the instance's own limit (`min(max, throttling limit, downstream guards)`)
//!   while every place of its share is in use or the queue holds messages nobody has taken
//!   (a peek, only when not every place is in use), else what it has in flight (an idle
//!   instance gives its share back);
//! - **fair share**: `fleet_max` split max-min fairly over the wants of the instances alive
//!   (seen by the registry within `fleet.gone_after`; on PostgreSQL also an instance whose
//!   heartbeat session is still open, for up to `transport::HELD_WHILE_CONNECTED` times that:
//!   a paused process keeps its share, a killed one frees it at `gone_after`);
//! - **target**: the fair share, but never more than what the others' grants leave free;
//! - **grant written**: `max(target, in flight now)`, read after the gate was narrowed to the
//!   target, so a grant is always at least what the instance holds or can still take.
//!
//! The sum of the alive instances' grants therefore never exceeds `fleet_max`, and each
//! instance's gate never lets more through than its grant: the messages in flight on the queue
//! across the fleet stay within `fleet_max`, without a statement per message. A share that
//! shrinks frees its room at the owner's next round (soon: a round that gave back less than it
//! meant to, or waits for room, is followed by another after [`SETTLE`]). A dead instance's
//! grant is free once it is no longer alive. An instance that cannot finish a round for half
//! of `gone_after` (a round that fails, or one that hangs that long) closes its gates: the
//! others will count it as gone at `gone_after` and take its room. Every round also stamps the
//! instance's registry row as seen, so an instance whose rounds go through is never counted
//! as gone for a late heartbeat.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::FleetConfig;
use crate::queue::QueueRuntime;
use crate::transport::{FleetShares, QueueName, ShareClaim, ShareRow, Transport, TransportError};

/// The wait before the next round when the last one did not reach its target (room still
/// held by others) or gave back less than it wanted to (messages still in flight).
pub(crate) const SETTLE: Duration = Duration::from_millis(100);

/// Splits `total` over `wants` max-min fairly: nobody gets more than it wants, and what one
/// does not want is split among the others. Ties go to the lower process id, so instances that
/// read the same wants compute the same split.
pub(crate) fn fair_split(total: u32, wants: &[(Uuid, u32)]) -> Vec<(Uuid, u32)> {
    let mut order: Vec<(Uuid, u32)> = wants.to_vec();
    order.sort_by_key(|(id, want)| (*want, *id));
    let mut left = total;
    let count = order.len() as u32;
    let mut split: Vec<(Uuid, u32)> = order
        .iter()
        .enumerate()
        .map(|(i, (id, want))| {
            let share = (*want).min(left / (count - i as u32));
            left -= share;
            (*id, share)
        })
        .collect();
    split.sort_by_key(|(id, _)| *id);
    split
}

/// What this instance should hold of a queue's `fleet_max` after reading the rows: its fair
/// share of the alive instances' wants, capped by the room the others' grants leave free.
/// Zero when this instance's own row says it is not alive (the others already took its room).
pub(crate) fn target(fleet_max: u32, me: Uuid, wanted: u32, rows: &[ShareRow]) -> u32 {
    if rows.iter().any(|r| r.process_id == me && !r.alive) {
        return 0;
    }
    // The rows are anyone's to write: no grant or want counts for more than the whole limit,
    // and the sum saturates (a forged grant of 2^31 - 1 beside another wrapped it to a few).
    let others = rows.iter().filter(|r| r.alive && r.process_id != me);
    let held = others
        .clone()
        .map(|r| r.granted.min(fleet_max))
        .fold(0u32, u32::saturating_add);
    let mut wants: Vec<(Uuid, u32)> = others
        .map(|r| (r.process_id, r.wanted.min(fleet_max)))
        .collect();
    wants.push((me, wanted.min(fleet_max)));
    let fair = fair_split(fleet_max, &wants)
        .into_iter()
        .find(|(id, _)| *id == me)
        .map_or(0, |(_, share)| share);
    fair.min(fleet_max.saturating_sub(held))
}

/// One fleet-limited queue's round, as the share loop ran it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoundOutcome {
    /// What the gate lets through now.
    pub target: u32,
    /// What the row says this instance holds (at least `target`).
    pub granted: u32,
    /// What it asked for.
    pub wanted: u32,
}

impl RoundOutcome {
    /// Whether another round should follow soon: room is still held by others, or the grant
    /// could not yet come down to the target.
    pub(crate) fn unsettled(&self) -> bool {
        self.granted > self.target || self.target < self.wanted
    }

    /// Nothing held, nothing wanted: the instance is idle on the queue, and its row (or none)
    /// says so.
    pub(crate) fn quiet(&self) -> bool {
        self.granted == 0 && self.wanted == 0
    }
}

/// Runs one round for `queue`: reads its backlog, then decides and writes this instance's
/// share, narrowing the gate before the write and widening it after the commit. `last` is the
/// queue's previous round: an instance that was and stays idle writes nothing.
pub(crate) async fn round(
    transport: &dyn Transport,
    shares: &dyn FleetShares,
    queue: &QueueRuntime,
    fleet_max: u32,
    me: Uuid,
    gone_after: Duration,
    last: Option<RoundOutcome>,
) -> Result<RoundOutcome, TransportError> {
    let gate = &queue.gate();
    let wanted = wanted(transport, queue).await?.min(fleet_max);
    // Idle and already written down as idle: nothing to decide, no transaction (an idle queue
    // costs its peek only).
    if wanted == 0 && last.is_some_and(|l| l.quiet()) {
        return Ok(RoundOutcome {
            target: 0,
            granted: 0,
            wanted: 0,
        });
    }
    let mut target_now = 0;
    let claim = shares
        .share_round(queue.name(), me, gone_after, &mut |rows| {
            let target = target(fleet_max, me, wanted, rows);
            if target < gate.fleet_share() {
                gate.set_fleet_share(target);
            }
            target_now = target;
            ShareClaim {
                wanted,
                granted: target.max(gate.in_flight()),
            }
        })
        .await?;
    gate.set_fleet_share(target_now);
    Ok(RoundOutcome {
        target: target_now,
        granted: claim.granted,
        wanted,
    })
}

/// What this instance wants of `queue`'s fleet-wide limit: its own limit while messages wait
/// or every place of its share is in use, else what it has in flight.
async fn wanted(transport: &dyn Transport, queue: &QueueRuntime) -> Result<u32, TransportError> {
    let gate = queue.gate();
    // Every place of its share in use: it wants more, whatever a peek would say (and a peek
    // under load costs a statement, or on Babelfish waits behind the receives' locks).
    let share = gate.fleet_share();
    let saturated = share > 0 && gate.in_flight() >= share;
    let waiting = match saturated {
        true => true,
        false => {
            let start = queue.depth().read_started();
            let depth = transport.peek_depth(queue.name()).await?;
            queue.depth().set_read(depth, start);
            // Receivers sleeping out the long safety interval (their arrivals are told of)
            // look now: a message that came without a notification, or whose notification
            // was lost, is otherwise left to the next depth read, after the gate opened.
            queue.depth_read(depth);
            depth > 0
        }
    };
    Ok(match waiting {
        true => gate.local_limit(),
        false => gate.in_flight(),
    })
}

/// Shares the fleet-wide limit of every queue with `fleet_max` until `stop`: a round per
/// queue every `fleet.share_interval`, sooner while a round is unsettled or when messages
/// arrive at a queue where this instance holds no share. While idle, a queue's round is its
/// peek alone (its receivers wait at the closed gate instead of polling). Starts once `ready` (the first heartbeat is
/// written, so the others count this instance as alive); on stop closes the gates, waits for
/// the messages in flight, removes this instance's rows and cancels `released`.
pub(crate) async fn run_shares(
    transport: Arc<dyn Transport>,
    queues: Vec<Arc<QueueRuntime>>,
    me: Uuid,
    settings: impl Fn() -> FleetConfig + Send + 'static,
    ready: CancellationToken,
    stop: CancellationToken,
    released: CancellationToken,
) {
    let _released = released.drop_guard();
    let Some(shares) = transport.fleet_shares() else {
        return;
    };
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = ready.cancelled() => {}
    }
    let mut rounds = Rounds {
        created: false,
        last_success: Instant::now(),
        last: HashMap::new(),
        failing: None,
    };
    while !stop.is_cancelled() {
        let config = settings();
        let unsettled = rounds.pass(&*transport, shares, &queues, me, &config).await;
        let pause = match unsettled {
            true => SETTLE,
            false => config.share_interval,
        };
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
            _ = any_arrival(&queues) => tokio::time::sleep(SETTLE.min(pause)).await,
        }
    }
    if rounds.created {
        give_back(shares, &queues, me).await;
    }
}

/// What the rounds carry from one pass over the queues to the next.
struct Rounds {
    /// The share table exists (this instance's first round makes it).
    created: bool,
    /// When a pass last went through without a failure.
    last_success: Instant,
    /// Each queue's last round.
    last: HashMap<QueueName, RoundOutcome>,
    /// Whether rounds fail, and whether that has closed the gates yet (said once each).
    failing: Option<bool>,
}

impl Rounds {
    /// A round for every queue with a fleet-wide limit (a queue without one gets its gate's
    /// share lifted); true when some share has not settled yet.
    async fn pass(
        &mut self,
        transport: &dyn Transport,
        shares: &dyn FleetShares,
        queues: &[Arc<QueueRuntime>],
        me: Uuid,
        config: &FleetConfig,
    ) -> bool {
        let mut unsettled = false;
        let mut failed = None;
        for queue in queues {
            let Some(fleet_max) = queue.settings().fleet_max else {
                queue.gate().set_fleet_share(u32::MAX);
                continue;
            };
            let created = &mut self.created;
            let before = self.last.get(queue.name()).copied();
            let attempt = async {
                if !*created {
                    shares.create_shares().await?;
                    *created = true;
                }
                round(
                    transport,
                    shares,
                    queue,
                    fleet_max,
                    me,
                    config.gone_after,
                    before,
                )
                .await
            };
            match within_cut_off(attempt, queues, self.last_success, config).await {
                Ok(done) => {
                    queue.metrics().fleet_share.set(done.target as f64);
                    unsettled |= done.unsettled();
                    self.last.insert(queue.name().clone(), done);
                }
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            None => {
                if self.failing.take().is_some() {
                    tracing::info!("the rounds of the fleet-wide limits work again");
                }
                self.last_success = Instant::now();
            }
            Some(e) => close_when_cut_off(queues, self.last_success, config, &e, &mut self.failing),
        }
        unsettled
    }
}

/// Runs a round; if it is still running when half of `gone_after` has passed since the last
/// round that worked (a connection not free, a lock held), the gates close at that moment (the
/// others may soon count this instance as gone) and the round gets as long again to finish.
async fn within_cut_off(
    attempt: impl Future<Output = Result<RoundOutcome, TransportError>>,
    queues: &[Arc<QueueRuntime>],
    last_success: Instant,
    config: &FleetConfig,
) -> Result<RoundOutcome, TransportError> {
    let mut attempt = std::pin::pin!(attempt);
    tokio::select! {
        done = &mut attempt => done,
        _ = tokio::time::sleep_until(last_success + config.gone_after / 2) => {
            close_gates(queues);
            tokio::time::timeout(config.gone_after / 2, attempt)
                .await
                .unwrap_or_else(|_| {
                    Err(TransportError::Unanswered {
                        what: "a round of a fleet-wide limit",
                        after: config.gone_after / 2,
                    })
                })
        }
    }
}

/// Closes the gates of every fleet-limited queue (this instance may count as gone soon).
fn close_gates(queues: &[Arc<QueueRuntime>]) {
    for q in queues.iter().filter(|q| q.settings().fleet_max.is_some()) {
        q.gate().set_fleet_share(0);
        q.metrics().fleet_share.set(0.0);
    }
}

/// After half of `gone_after` without a round, the others may soon count this instance as
/// gone and take its room: its gates close until a round works again. `failing` keeps what
/// was said, so a database that stays away is logged when rounds start failing and when the
/// gates close, not at every round.
fn close_when_cut_off(
    queues: &[Arc<QueueRuntime>],
    last_success: Instant,
    config: &FleetConfig,
    error: &TransportError,
    failing: &mut Option<bool>,
) {
    let cut_off = last_success.elapsed() >= config.gone_after / 2;
    if *failing != Some(cut_off) {
        tracing::warn!(error = %error, cut_off,
            "a round of the fleet-wide limits failed; {}",
            if cut_off { "receiving from fleet-limited queues pauses until one works" } else { "the shares stay as they are" });
        *failing = Some(cut_off);
    }
    if cut_off {
        close_gates(queues);
    }
}

/// Resolves when messages arrive at a fleet-limited queue where this instance holds no
/// share (it gave it back while idle): it asks for one at once instead of at the next round.
async fn any_arrival(queues: &[Arc<QueueRuntime>]) {
    let waits: Vec<_> = queues
        .iter()
        .filter(|q| q.settings().fleet_max.is_some() && q.gate().fleet_share() == 0)
        .map(|q| Box::pin(q.share_wanted()))
        .collect();
    match waits.is_empty() {
        true => std::future::pending().await,
        false => {
            futures_util::future::select_all(waits).await;
        }
    }
}

/// Stopping: closes the gates, waits (polling, bounded by shutdown itself) for this
/// instance's messages in flight on fleet-limited queues, then removes its rows.
async fn give_back(shares: &dyn FleetShares, queues: &[Arc<QueueRuntime>], me: Uuid) {
    close_gates(queues);
    let limited: Vec<_> = queues
        .iter()
        .filter(|q| q.settings().fleet_max.is_some())
        .collect();
    while limited.iter().any(|q| q.gate().in_flight() > 0) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Err(e) = shares.drop_shares(me).await {
        tracing::debug!(error = %e, "could not remove this host's fleet shares; they free when it counts as gone");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forged rows (grants far above the limit, two that would wrap a u32 when summed) count
    /// as holding the whole limit at most: no panic, no wrap to a small number.
    #[test]
    fn grants_above_the_limit_count_as_the_limit() {
        let me = Uuid::from_u128(1);
        let rows = [row(2, u32::MAX, u32::MAX - 1, true), row(3, 1, 2, true)];
        assert_eq!(
            target(4, me, 4, &rows),
            0,
            "the others hold at least the limit"
        );
        let gone = [row(2, u32::MAX, u32::MAX, false)];
        assert_eq!(
            target(4, me, 4, &gone),
            4,
            "a forged row of no live instance"
        );
    }

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn row(n: u128, wanted: u32, granted: u32, alive: bool) -> ShareRow {
        ShareRow {
            process_id: id(n),
            wanted,
            granted,
            alive,
        }
    }

    #[test]
    fn the_split_is_max_min_fair_and_adds_up() {
        let wants = [(id(3), 12), (id(1), 2), (id(2), 12)];
        assert_eq!(fair_split(12, &wants), [(id(1), 2), (id(2), 5), (id(3), 5)]);
        let even = fair_split(12, &[(id(1), 12), (id(2), 12), (id(3), 12)]);
        assert_eq!(even.iter().map(|s| s.1).collect::<Vec<_>>(), [4, 4, 4]);
        let odd = fair_split(10, &[(id(1), 9), (id(2), 9), (id(3), 9)]);
        assert_eq!(odd.iter().map(|s| s.1).sum::<u32>(), 10);
        assert!(fair_split(5, &[]).is_empty());
    }

    #[test]
    fn a_target_takes_only_the_room_others_leave() {
        // Another holds all 12: its fair share is 6, but nothing is free yet.
        let rows = [row(1, 12, 12, true)];
        assert_eq!(target(12, id(2), 12, &rows), 0);
        // It came down to 6: the other 6 are free.
        let rows = [row(1, 12, 6, true)];
        assert_eq!(target(12, id(2), 12, &rows), 6);
        // The holder is gone: all of it.
        let rows = [row(1, 12, 12, false)];
        assert_eq!(target(12, id(2), 12, &rows), 12);
        // An idle instance wants nothing and gets nothing.
        assert_eq!(target(12, id(2), 0, &rows), 0);
        // This instance counted as gone by the others: nothing.
        let rows = [row(1, 12, 0, true), row(2, 12, 6, false)];
        assert_eq!(target(12, id(2), 12, &rows), 0);
    }

    /// The most in flight at once across four instances over 50 000 random steps: rounds,
    /// deaths, returns, pauses and resumes, messages starting and ending. A paused instance
    /// (SIGSTOP, a frozen machine) keeps what it holds and does nothing; `paused_counts_alive`
    /// says whether the others' rounds count it alive meanwhile, as they do while the
    /// database has its sessions open (`transport::HELD_WHILE_CONNECTED`).
    fn most_in_flight(fleet_max: u32, paused_counts_alive: bool) -> u32 {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut rows: Vec<ShareRow> = (1..=4).map(|n| row(n, 0, 0, true)).collect();
        let (mut gate, mut holding, mut paused) = ([0u32; 4], [0u32; 4], [false; 4]);
        let mut most = 0;
        for _ in 0..50_000 {
            let who = next(4) as usize;
            match next(44) {
                // Paused or resumed: what it holds stays in flight.
                40..=43 => {
                    paused[who] = !paused[who];
                    if !paused_counts_alive {
                        rows[who].alive = !paused[who];
                    }
                }
                _ if paused[who] => {}
                0 => {
                    // Dies (its messages end with it) or, counted as gone, is back (its gate
                    // stayed closed, its row still says what it held).
                    rows[who].alive = !rows[who].alive;
                    (gate[who], holding[who]) = (0, 0);
                }
                1..=19 => {
                    // Messages end, or start within what the gate lets through.
                    holding[who] = match next(2) {
                        0 => next(u64::from(holding[who]) + 1) as u32,
                        _ => {
                            let top = holding[who].max(gate[who]);
                            holding[who] + next(u64::from(top - holding[who]) + 1) as u32
                        }
                    }
                }
                _ if rows[who].alive => {
                    let wanted = next(13) as u32;
                    let t = target(fleet_max, rows[who].process_id, wanted, &rows);
                    gate[who] = t;
                    rows[who].wanted = wanted;
                    rows[who].granted = t.max(holding[who]);
                }
                _ => {}
            }
            most = most.max(holding.iter().sum());
        }
        most
    }

    /// Rounds, deaths, returns, pauses and messages starting and ending, in any order: the
    /// messages in flight across the instances never add up to more than `fleet_max`, as long
    /// as a paused instance counts as alive. Counted as gone while paused (as before its
    /// sessions were looked at), its resumed handlers run beside the share the others took.
    #[test]
    fn rounds_in_any_order_never_overcommit() {
        assert!(most_in_flight(12, true) <= 12);
        assert!(
            most_in_flight(12, false) > 12,
            "a pause counted as a death passes the limit"
        );
    }
}
