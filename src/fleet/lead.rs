//! One instance per queue does the queue's background reading: its delayed mover's polling
//! and its depth reading for database size. The others use the depth it publishes and move
//! only the delayed messages they scheduled themselves, when those are due.
//!
//! The lead is decided without a statement of its own: every heartbeat already reads back
//! every registry row, and each instance's summary lists the queues it receives from with the
//! depth it knows (`queues`). For each queue, the instances alive (seen within
//! `fleet.gone_after`) that receive from it are the candidates, and the one whose id hashed
//! with the queue's name is highest leads (rendezvous hashing: every instance that reads the
//! same rows picks the same leader, queues spread over the instances, and when one goes only
//! its queues move). Views may differ for a heartbeat while instances come and go; two
//! leaders for a moment cost a few statements (the mover's lock keeps moves apart), no leader
//! for a moment delays a poll by a heartbeat. An instance that cannot read the registry leads
//! all its queues, as it would alone.

use std::collections::BTreeMap;

use uuid::Uuid;

use crate::transport::{BeatRow, FLEET_ORDER_ROWS};

/// Who does a queue's background reading, as this instance sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lead {
    /// This instance.
    Here,
    /// Another instance, which last published this depth (None: it published none).
    Elsewhere {
        /// The queue's depth the leader wrote with its last heartbeat.
        depth: Option<u64>,
    },
}

/// The candidate that leads `queue`: the highest hash of (candidate, queue).
pub fn leader(queue: &str, candidates: &[Uuid]) -> Option<Uuid> {
    candidates
        .iter()
        .copied()
        .max_by_key(|id| Uuid::new_v5(id, queue.as_bytes()).as_u128())
}

/// The queues an instance's summary says it receives from, with the depth it knows.
fn queues_of(summary: &str) -> BTreeMap<String, Option<u64>> {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(summary) else {
        return BTreeMap::new();
    };
    value["queues"]
        .as_object()
        .map(|queues| {
            queues
                .iter()
                .map(|(name, depth)| (name.clone(), depth.as_u64()))
                .collect()
        })
        .unwrap_or_default()
}

/// Who leads each of `mine` (this instance's queues), from the rows a heartbeat read: the
/// instances seen within `gone_after` seconds that receive from the queue, this one always
/// among them.
pub fn leads(me: Uuid, mine: &[&str], rows: &[BeatRow], gone_after: f64) -> Vec<Lead> {
    let members: Vec<(Uuid, BTreeMap<String, Option<u64>>)> = rows
        .iter()
        .filter(|r| r.process_id != me && !FLEET_ORDER_ROWS.contains(&r.process_id))
        .filter(|r| r.seen_seconds_ago <= gone_after)
        .map(|r| (r.process_id, queues_of(&r.summary)))
        .collect();
    mine.iter()
        .map(|queue| {
            let mut candidates = vec![me];
            candidates.extend(
                members
                    .iter()
                    .filter(|(_, queues)| queues.contains_key(*queue))
                    .map(|(id, _)| *id),
            );
            match leader(queue, &candidates) {
                Some(id) if id != me => Lead::Elsewhere {
                    depth: members
                        .iter()
                        .find(|(member, _)| *member == id)
                        .and_then(|(_, queues)| queues.get(*queue).copied().flatten()),
                },
                _ => Lead::Here,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: Uuid, queues: &str, seen: f64) -> BeatRow {
        BeatRow {
            process_id: id,
            summary: format!(r#"{{"queues":{queues}}}"#),
            seen_seconds_ago: seen,
        }
    }

    #[test]
    fn every_instance_that_reads_the_same_rows_picks_one_leader_per_queue() {
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
        let rows: Vec<BeatRow> = ids
            .iter()
            .map(|id| row(*id, r#"{"orders":5,"billing":7}"#, 1.0))
            .collect();
        for queue in ["orders", "billing"] {
            let leading = ids
                .iter()
                .filter(|me| leads(**me, &[queue], &rows, 20.0)[0] == Lead::Here)
                .count();
            assert_eq!(leading, 1, "{queue}");
        }
        // A follower takes the depth the leader published.
        let leader_of_orders = leader("orders", &ids).unwrap();
        let follower = ids.iter().find(|id| **id != leader_of_orders).unwrap();
        assert_eq!(
            leads(*follower, &["orders"], &rows, 20.0),
            [Lead::Elsewhere { depth: Some(5) }]
        );
    }

    #[test]
    fn the_gone_the_order_rows_and_those_without_the_queue_never_lead() {
        let me = Uuid::new_v4();
        let others: Vec<Uuid> = (0..20).map(|_| Uuid::new_v4()).collect();
        let mut rows: Vec<BeatRow> = others
            .iter()
            .map(|id| row(*id, r#"{"orders":1}"#, 25.0))
            .collect();
        rows.push(row(Uuid::new_v4(), r#"{"billing":1}"#, 1.0));
        rows.push(BeatRow {
            process_id: FLEET_ORDER_ROWS[0],
            summary: "{}".into(),
            seen_seconds_ago: 0.0,
        });
        assert_eq!(leads(me, &["orders"], &rows, 20.0), [Lead::Here]);
        assert_eq!(leads(me, &["orders"], &[], 20.0), [Lead::Here]);
    }
}
