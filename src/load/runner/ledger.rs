//! The ledger: every message sent and every end seen, by logical id, to count what was lost or
//! duplicated and to judge key and stage order.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;
use uuid::Uuid;

use crate::dispatch::{DispatchObserver, Outcome};
use crate::load::in_flight::InFlightSpans;
use crate::load::peer::{PeerEvent, now_ns};
use crate::load::record::Accounting;
use crate::message::OutgoingMessage;
use crate::transport::QueueName;

/// Counts every message by id; the host reports outcomes through [`DispatchObserver`].
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) track_ids: bool,
    pub(super) sent: AtomicU64,
    pub(super) send_failures: AtomicU64,
    pub(super) done: AtomicU64,
    /// Per outcome (success, error, expired, poison), counted whether or not ids are tracked.
    pub(super) outcomes: [AtomicU64; 4],
    pub(super) last_done: Mutex<Option<Instant>>,
    /// Messages done per process: this one first, then its peers.
    pub(super) done_by_process: Mutex<Vec<u64>>,
    pub(super) ids: Mutex<LedgerIds>,
    /// Every handling's start and end across the processes, when a queue has a fleet-wide
    /// limit to check.
    pub(super) in_flight: Option<Mutex<InFlightSpans>>,
    /// Queues that subscribe to events: each receives its own copy of an event, with the
    /// id every copy shares, so the ledger counts a copy per queue (`id@queue`).
    pub(super) subscribers: HashSet<QueueName>,
}

/// What the ledger knows per message, keyed compactly so that tracking a 20 000-message
/// backlog costs the measured process well under a megabyte.
#[derive(Default)]
pub(super) struct LedgerIds {
    /// Per logical id: the last outcome reported and how many successes.
    pub(super) messages: HashMap<Uuid, Tally>,
    /// Row ids whose logical id is not the row id itself (the id header was set).
    pub(super) native: HashMap<Uuid, Uuid>,
    /// Per key of a keyed backlog: every handling of its messages, in any process.
    pub(super) keys: Vec<Vec<KeyRun>>,
    /// Per stage of a staged backlog: every handling of its messages, in any process.
    pub(super) stages: Vec<Vec<KeyRun>>,
}

impl LedgerIds {
    /// The ledger key of a message the dispatcher reports by row id and logical id.
    pub(super) fn key_of(&self, id: Uuid, logical_id: Option<&str>) -> Uuid {
        match logical_id {
            Some(l) => ledger_key(l),
            None => self.native.get(&id).copied().unwrap_or(id),
        }
    }
}

/// The outcomes reported for one logical message.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) last: Option<Outcome>,
    /// Successful handlings: more than one is a duplicate.
    pub(super) successes: u32,
    /// Its key and its place among the key's messages (keyed backlogs).
    pub(super) place: Option<(u32, u32)>,
    /// Its stage (from 0) and its place among the stage's messages (staged backlogs).
    pub(super) stage: Option<(u32, u32)>,
}

/// One handling of a keyed message: its place among the key's messages, when its handling
/// began and when its last attempt ended (None while it runs, or if it never ended), in
/// nanoseconds of the wall clock ([`now_ns`]), which every process of the machine shares.
#[derive(Clone, Copy)]
pub(super) struct KeyRun {
    pub(super) place: u32,
    pub(super) start: u64,
    pub(super) end: Option<u64>,
}

/// Checks stage barriers: no handling of a stage began before every handling of the stage
/// before it had ended. Returns how many began too early and the first, in words.
pub(super) fn stage_barrier_problems(stages: &[Vec<KeyRun>]) -> (u64, Option<String>) {
    let mut count = 0;
    let mut first = None;
    for (s, pair) in stages.windows(2).enumerate() {
        let (before, after) = (&pair[0], &pair[1]);
        // Until when the stage before ran (a handling that never ended: for ever).
        let Some(barrier) = before.iter().map(|r| r.end.unwrap_or(u64::MAX)).max() else {
            continue;
        };
        for run in after.iter().filter(|r| r.start < barrier) {
            count += 1;
            first.get_or_insert(format!(
                "stage {}: message {} started before stage {} had ended",
                (s + 2) * 100,
                run.place,
                (s + 1) * 100
            ));
        }
    }
    (count, first)
}

/// Checks one key's handlings: in the order they began, each is the message due (the one
/// after the last, or the last again after a rollback), and none began before a different
/// message's handling ended. Returns the first violation and how many there were.
pub(super) fn key_order_problems(key: usize, runs: &[KeyRun]) -> (u64, Option<String>) {
    let mut runs = runs.to_vec();
    runs.sort_by_key(|r| r.start);
    let mut count = 0;
    let mut first = None;
    for pair in runs.windows(2) {
        let (before, after) = (pair[0], pair[1]);
        let problem =
            if after.place != before.place && before.end.is_none_or(|end| end > after.start) {
                Some(format!(
                    "key {key}: message {} started while another of the key was running",
                    after.place
                ))
            } else if after.place > before.place + 1 || after.place < before.place {
                Some(format!(
                    "key {key}: message {} started before message {} ended",
                    after.place,
                    before.place + 1
                ))
            } else {
                None
            };
        if let Some(what) = problem {
            count += 1;
            first.get_or_insert(what);
        }
    }
    if let Some(r) = runs.first().filter(|r| r.place > 0) {
        count += 1;
        first.get_or_insert(format!(
            "key {key}: message {} started before message 0 ended",
            r.place
        ));
    }
    (count, first)
}

/// A message about to be sent, as the ledger will record it: its native id and ledger key
/// when ids are tracked.
pub(super) struct Sending(Option<(Uuid, Uuid)>);

/// A logical id as a ledger key: itself when it is a UUID (the host's own ids), else a
/// name-based UUID of its text.
pub(super) fn ledger_key(logical: &str) -> Uuid {
    Uuid::parse_str(logical)
        .unwrap_or_else(|_| Uuid::new_v5(&Uuid::NAMESPACE_OID, logical.as_bytes()))
}

pub(super) fn outcome_index(o: Outcome) -> usize {
    match o {
        Outcome::Success => 0,
        Outcome::Error => 1,
        Outcome::Expired => 2,
        Outcome::Poison => 3,
    }
}

impl Ledger {
    pub(super) fn new(track_ids: bool, track_in_flight: bool) -> Self {
        Ledger {
            track_ids,
            in_flight: track_in_flight.then(Mutex::default),
            ..Ledger::default()
        }
    }

    /// Enters a handling's start or end into the spans, when they are kept.
    pub(super) fn span(&self, change: impl FnOnce(&mut InFlightSpans)) {
        if let Some(spans) = &self.in_flight {
            change(&mut spans.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    pub(super) fn ids(&self) -> std::sync::MutexGuard<'_, LedgerIds> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn sent(&self, message: &OutgoingMessage) {
        self.sent_as(self.sending(message));
    }

    /// What the ledger needs of `message` to record it once a send has taken it (nothing
    /// when it does not track ids, so a send costs no id text then).
    pub(super) fn sending(&self, message: &OutgoingMessage) -> Sending {
        Sending(
            self.track_ids
                .then(|| (message.id, ledger_key(&message.logical_id()))),
        )
    }

    /// Records a message sent.
    pub(super) fn sent_as(&self, Sending(ids): Sending) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        if let Some((id, key)) = ids {
            let mut ids = self.ids();
            if key != id {
                ids.native.insert(id, key);
            }
            ids.messages.entry(key).or_default();
        }
    }

    /// Records a prefilled message as the `place`-th of key `key`.
    pub(super) fn sent_keyed(&self, message: &OutgoingMessage, key: u32, place: u32) {
        self.sent(message);
        let mut ids = self.ids();
        let k = ledger_key(&message.logical_id());
        ids.messages.entry(k).or_default().place = Some((key, place));
        if ids.keys.len() <= key as usize {
            ids.keys.resize(key as usize + 1, Vec::new());
        }
    }

    /// Records a prefilled message as the `place`-th of stage `stage` (from 0).
    pub(super) fn sent_staged(&self, message: &OutgoingMessage, stage: u32, place: u32) {
        let mut ids = self.ids();
        let k = ledger_key(&message.logical_id());
        ids.messages.entry(k).or_default().stage = Some((stage, place));
        if ids.stages.len() <= stage as usize {
            ids.stages.resize(stage as usize + 1, Vec::new());
        }
    }

    /// Enters what process `source` (0: this one) saw.
    pub(super) fn record(&self, source: usize, event: PeerEvent) {
        match event {
            PeerEvent::Started(s) => {
                self.span(|spans| spans.began(source, s.id, s.at));
                self.began(s.id, s.logical_id.as_deref(), s.at)
            }
            PeerEvent::Handled(s) => {
                self.span(|spans| spans.ended(source, s.id, s.at));
                self.ended(s.id, s.logical_id.as_deref(), s.at)
            }
            PeerEvent::Completed(s, outcome) => {
                self.finished(source, s.id, s.logical_id.as_deref(), outcome)
            }
        }
    }

    pub(super) fn finished(
        &self,
        source: usize,
        id: Uuid,
        logical_id: Option<&str>,
        outcome: Outcome,
    ) {
        self.done.fetch_add(1, Ordering::Relaxed);
        self.outcomes[outcome_index(outcome)].fetch_add(1, Ordering::Relaxed);
        *self.last_done.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        {
            let mut by = self
                .done_by_process
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if by.len() <= source {
                by.resize(source + 1, 0);
            }
            by[source] += 1;
        }
        if !self.track_ids {
            return;
        }
        let mut ids = self.ids();
        let key = ids.key_of(id, logical_id);
        let tally = ids.messages.entry(key).or_default();
        tally.last = Some(outcome);
        tally.successes += u32::from(outcome == Outcome::Success);
    }

    /// A keyed message's handling began at `at`.
    pub(super) fn began(&self, id: Uuid, logical_id: Option<&str>, at: u64) {
        if !self.track_ids {
            return;
        }
        let mut ids = self.ids();
        let key = ids.key_of(id, logical_id);
        let Some(tally) = ids.messages.get(&key) else {
            return;
        };
        let (place, stage) = (tally.place, tally.stage);
        let ids = &mut *ids;
        for (runs, (k, place)) in [(&mut ids.keys, place), (&mut ids.stages, stage)]
            .into_iter()
            .filter_map(|(runs, at_place)| Some((runs, at_place?)))
        {
            if let Some(runs) = runs.get_mut(k as usize) {
                runs.push(KeyRun {
                    place,
                    start: at,
                    end: None,
                });
            }
        }
    }

    /// A keyed message's last attempt ended at `at` (before its unit of work ends, so before
    /// the next of its key can be received).
    pub(super) fn ended(&self, id: Uuid, logical_id: Option<&str>, at: u64) {
        if !self.track_ids {
            return;
        }
        let mut ids = self.ids();
        let key = ids.key_of(id, logical_id);
        let Some(tally) = ids.messages.get(&key) else {
            return;
        };
        let (place, stage) = (tally.place, tally.stage);
        let ids = &mut *ids;
        for (runs, (k, place)) in [(&mut ids.keys, place), (&mut ids.stages, stage)]
            .into_iter()
            .filter_map(|(runs, at_place)| Some((runs, at_place?)))
        {
            if let Some(run) = runs.get_mut(k as usize).and_then(|runs| {
                runs.iter_mut()
                    .rev()
                    .find(|r| r.place == place && r.end.is_none())
            }) {
                run.end = Some(at);
            }
        }
    }

    pub(super) fn accounting(&self, remaining: u64) -> Accounting {
        let ids = self.ids();
        let count = |o: Outcome| self.outcomes[outcome_index(o)].load(Ordering::Relaxed);
        let unaccounted = ids.messages.values().filter(|t| t.last.is_none()).count() as u64;
        let (mut order_violations, mut first_order_violation) = (0, None);
        for (key, runs) in ids.keys.iter().enumerate() {
            let (count, first) = key_order_problems(key, runs);
            order_violations += count;
            if first_order_violation.is_none() {
                first_order_violation = first;
            }
        }
        let (stage_violations, first_stage_violation) = stage_barrier_problems(&ids.stages);
        Accounting {
            sent: self.sent.load(Ordering::Relaxed),
            processed: count(Outcome::Success),
            in_error_queue: count(Outcome::Error),
            expired: count(Outcome::Expired),
            poison: count(Outcome::Poison),
            lost: if self.track_ids {
                unaccounted.saturating_sub(remaining)
            } else {
                0
            },
            remaining,
            duplicated: ids.messages.values().filter(|t| t.successes > 1).count() as u64,
            send_failures: self.send_failures.load(Ordering::Relaxed),
            order_violations,
            first_order_violation,
            stage_violations,
            first_stage_violation,
            done_by_process: self
                .done_by_process
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            peer_failures: Vec::new(),
            fleet_in_flight: self
                .in_flight
                .as_ref()
                .map(|spans| spans.lock().unwrap_or_else(|e| e.into_inner()).summary()),
        }
    }
}

impl Ledger {
    /// The ids a handling in `queue` is counted under: an event's copy in a subscriber's
    /// queue as a message of its own (`logical@queue`, the row id made distinct per queue).
    fn in_queue(
        &self,
        queue: &QueueName,
        id: Uuid,
        logical_id: Option<&str>,
    ) -> (Uuid, Option<String>) {
        if !self.subscribers.contains(queue) {
            return (id, logical_id.map(str::to_string));
        }
        let copy = Uuid::new_v5(&id, queue.as_str().as_bytes());
        (
            copy,
            Some(format!(
                "{}@{queue}",
                logical_id.map_or_else(|| id.to_string(), str::to_string)
            )),
        )
    }
}

impl DispatchObserver for Ledger {
    fn completed(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>, outcome: Outcome) {
        let (id, logical_id) = self.in_queue(queue, id, logical_id);
        self.finished(0, id, logical_id.as_deref(), outcome);
    }

    fn handled(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let (id, logical_id) = self.in_queue(queue, id, logical_id);
        let at = now_ns();
        self.span(|spans| spans.ended(0, id, at));
        self.ended(id, logical_id.as_deref(), at);
    }

    fn started(&self, queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        let (id, logical_id) = self.in_queue(queue, id, logical_id);
        let at = now_ns();
        self.span(|spans| spans.began(0, id, at));
        self.began(id, logical_id.as_deref(), at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::peer::Seen;
    use crate::message::MESSAGE_ID_HEADER;

    fn queue() -> QueueName {
        QueueName::new("orders").unwrap()
    }

    #[test]
    fn an_events_copies_count_once_in_each_subscribers_queue() {
        let mut ledger = Ledger::new(true, false);
        ledger.subscribers = ["billing", "shipping"]
            .iter()
            .map(|n| QueueName::new(n).unwrap())
            .collect();
        let id = Uuid::new_v4();
        for queue in ["billing", "shipping"] {
            ledger.completed(
                &QueueName::new(queue).unwrap(),
                id,
                Some("event-1"),
                Outcome::Success,
            );
        }
        let a = ledger.accounting(0);
        assert_eq!((a.processed, a.duplicated, a.lost), (2, 0, 0));
        ledger.completed(
            &QueueName::new("billing").unwrap(),
            id,
            Some("event-1"),
            Outcome::Success,
        );
        assert_eq!(
            ledger.accounting(0).duplicated,
            1,
            "a copy handled twice in one queue"
        );
    }

    #[test]
    fn the_ledger_counts_lost_and_duplicated_messages_by_logical_id() {
        let ledger = Ledger::new(true, false);
        let plain = OutgoingMessage::new(b"a".to_vec());
        let named = OutgoingMessage::new(b"b".to_vec()).with_header(MESSAGE_ID_HEADER, "order-17");
        let never_seen = OutgoingMessage::new(b"c".to_vec());
        for m in [&plain, &named, &never_seen] {
            ledger.sent(m);
        }
        // The plain one is handled twice; the named one once, reported by its row id only.
        ledger.completed(&queue(), plain.id, None, Outcome::Success);
        ledger.completed(&queue(), plain.id, None, Outcome::Success);
        ledger.completed(&queue(), named.id, None, Outcome::Error);
        let a = ledger.accounting(0);
        assert_eq!((a.sent, a.lost, a.duplicated), (3, 1, 1));
        assert_eq!((a.processed, a.in_error_queue), (2, 1));
        // A forwarded copy is a new row that reports its logical id itself.
        ledger.completed(&queue(), Uuid::new_v4(), Some("order-17"), Outcome::Success);
        assert_eq!(
            ledger.accounting(0).duplicated,
            1,
            "error then success is not a duplicate"
        );
        assert_eq!(
            ledger.accounting(1).lost,
            0,
            "the unseen one is still queued"
        );
    }

    #[test]
    fn the_ledger_sees_a_key_run_out_of_order_or_beside_itself() {
        let m: Vec<OutgoingMessage> = (0..3)
            .map(|_| OutgoingMessage::new(b"x".to_vec()))
            .collect();
        let keyed_ledger = || {
            let ledger = Ledger::new(true, false);
            for (place, message) in m.iter().enumerate() {
                ledger.sent_keyed(message, 0, place as u32);
            }
            ledger
        };
        // Message i handled from `start` to `end` (nanoseconds).
        let run_on = |ledger: &Ledger, i: usize, start: u64, end: u64| {
            ledger.began(m[i].id, None, start);
            ledger.ended(m[i].id, None, end);
        };
        let ledger = keyed_ledger();
        for (i, start) in [(0, 10), (0, 20), (1, 30), (2, 40)] {
            run_on(&ledger, i, start, start + 5);
        }
        assert_eq!(
            ledger.accounting(0).order_violations,
            0,
            "in order, a redelivery included"
        );

        let ledger = keyed_ledger();
        ledger.began(m[0].id, None, 10);
        ledger.began(m[1].id, None, 20);
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 1, "1 began beside 0");
        assert!(a.first_order_violation.unwrap().contains("while another"));

        let ledger = keyed_ledger();
        run_on(&ledger, 0, 10, 15);
        ledger.began(m[2].id, None, 20);
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 1, "2 began before 1");
        assert!(
            a.first_order_violation
                .unwrap()
                .contains("before message 1 ended")
        );
    }

    /// A stage may start only once every message of the stage before it has ended, in
    /// whichever process; its own members may overlap.
    #[test]
    fn the_ledger_sees_a_stage_start_before_the_stage_before_it_ended() {
        let m: Vec<OutgoingMessage> = (0..4)
            .map(|_| OutgoingMessage::new(b"x".to_vec()))
            .collect();
        let staged_ledger = || {
            let ledger = Ledger::new(true, false);
            // Stage 100: m0, m1; stage 200: m2, m3.
            for (i, message) in m.iter().enumerate() {
                ledger.sent(message);
                ledger.sent_staged(message, (i / 2) as u32, (i % 2) as u32);
            }
            ledger
        };
        let seen = |i: usize, at: u64| Seen {
            at,
            id: m[i].id,
            logical_id: None,
        };
        let ledger = staged_ledger();
        for (source, i, start, end) in [
            (1, 0, 10, 30),
            (0, 1, 12, 25),
            (2, 2, 31, 50),
            (0, 3, 32, 40),
        ] {
            ledger.record(source, PeerEvent::Started(seen(i, start)));
            ledger.record(source, PeerEvent::Handled(seen(i, end)));
        }
        let a = ledger.accounting(0);
        assert_eq!(a.stage_violations, 0, "{:?}", a.first_stage_violation);

        let ledger = staged_ledger();
        for (source, i, start, end) in [
            (1, 0, 10, 30),
            (0, 1, 12, 25),
            (2, 2, 29, 50),
            (0, 3, 32, 40),
        ] {
            ledger.record(source, PeerEvent::Started(seen(i, start)));
            ledger.record(source, PeerEvent::Handled(seen(i, end)));
        }
        let a = ledger.accounting(0);
        assert_eq!(a.stage_violations, 1, "m2 began at 29, m0 ended at 30");
        assert!(
            a.first_stage_violation
                .unwrap()
                .contains("stage 200: message 0 started before stage 100 had ended")
        );
    }

    /// Events of peer processes arrive late and out of order; the ledger judges by their
    /// times, not by when they arrived.
    #[test]
    fn the_ledger_judges_key_order_across_processes_by_the_events_times() {
        let m: Vec<OutgoingMessage> = (0..2)
            .map(|_| OutgoingMessage::new(b"x".to_vec()))
            .collect();
        let ledger = Ledger::new(true, false);
        for (place, message) in m.iter().enumerate() {
            ledger.sent_keyed(message, 0, place as u32);
        }
        let seen = |i: usize, at: u64| Seen {
            at,
            id: m[i].id,
            logical_id: None,
        };
        // Process 0 takes message 1 at 30, after peer 1 ended message 0 at 25; peer 1's
        // lines arrive only afterwards.
        ledger.record(0, PeerEvent::Started(seen(1, 30)));
        ledger.record(1, PeerEvent::Started(seen(0, 10)));
        ledger.record(1, PeerEvent::Handled(seen(0, 25)));
        ledger.record(1, PeerEvent::Completed(seen(0, 26), Outcome::Success));
        ledger.record(0, PeerEvent::Handled(seen(1, 40)));
        ledger.record(0, PeerEvent::Completed(seen(1, 41), Outcome::Success));
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 0, "{:?}", a.first_order_violation);
        assert_eq!(a.done_by_process, vec![1, 1]);
        assert_eq!((a.processed, a.lost, a.duplicated), (2, 0, 0));

        // The same, but message 1 began at 20, while message 0 ran elsewhere until 25.
        let ledger = Ledger::new(true, false);
        for (place, message) in m.iter().enumerate() {
            ledger.sent_keyed(message, 0, place as u32);
        }
        ledger.record(0, PeerEvent::Started(seen(1, 20)));
        ledger.record(1, PeerEvent::Started(seen(0, 10)));
        ledger.record(1, PeerEvent::Handled(seen(0, 25)));
        let a = ledger.accounting(0);
        assert_eq!(a.order_violations, 1);
        assert!(a.first_order_violation.unwrap().contains("while another"));
    }
}
