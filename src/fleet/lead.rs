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
//!
//! A row of another process with this instance's id is this instance before a restart: it
//! leads nothing, so a restarted instance leads again at once.
//!
//! An instance whose heartbeat session the database no longer has open (a process killed
//! outright closes its sessions; `BeatRow::connected`) leads nothing either: its leads pass
//! at the next heartbeat of another, in seconds, instead of after `gone_after`.
//!
//! Only an instance that moves a queue's delayed table may lead it while one that does is
//! alive (the summary's `moves_delayed` lists them; a summary without the list, from an
//! earlier version, counts as moving all its queues): a leader with delayed delivery off
//! would leave the table unpolled, and delayed messages would wait for ever.

use std::collections::BTreeMap;

use uuid::Uuid;

use crate::transport::{BeatRow, FLEET_ORDER_ROWS};

/// Who does a queue's background reading, as this instance sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lead {
    /// This instance.
    Here,
    /// Another instance, which last published this depth (None: it published none).
    Elsewhere {
        /// The queue's depth the leader wrote with its last heartbeat.
        depth: Option<u64>,
    },
}

/// The candidate that leads `queue`: the highest hash of (candidate, queue).
pub(crate) fn leader(queue: &str, candidates: &[Uuid]) -> Option<Uuid> {
    candidates
        .iter()
        .copied()
        .max_by_key(|id| Uuid::new_v5(id, queue.as_bytes()).as_u128())
}

/// What an instance's summary says of its queues: each queue it receives from with the
/// depth it knows, and the queues whose delayed tables it moves (None: not said).
struct Summary {
    queues: BTreeMap<String, Option<u64>>,
    moves_delayed: Option<Vec<String>>,
    /// The instance id it runs as (None: an earlier version's summary).
    instance: Option<String>,
}

impl Summary {
    fn of(summary: &str) -> Summary {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(summary) else {
            return Summary {
                queues: BTreeMap::new(),
                moves_delayed: Some(Vec::new()),
                instance: None,
            };
        };
        let queues = value["queues"]
            .as_object()
            .map(|queues| {
                queues
                    .iter()
                    .map(|(name, depth)| (name.clone(), depth.as_u64()))
                    .collect()
            })
            .unwrap_or_default();
        let moves_delayed = value["moves_delayed"].as_array().map(|names| {
            names
                .iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        });
        Summary {
            queues,
            moves_delayed,
            instance: value["instance"].as_str().map(str::to_string),
        }
    }

    /// Whether it moves `queue`'s delayed table (an earlier version's summary: yes).
    fn moves(&self, queue: &str) -> bool {
        self.moves_delayed
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| n == queue))
    }
}

/// Who leads one of this instance's queues, and whether anyone moves its delayed table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueueLead {
    /// Who does the queue's background reading.
    pub lead: Lead,
    /// No instance alive that receives from the queue moves its delayed table, this one
    /// included: delayed messages sent to the queue wait until one does.
    pub unmoved: bool,
}

/// One of this instance's queues, for [`leads`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mine<'a> {
    /// The queue.
    pub queue: &'a str,
    /// This instance moves its delayed table.
    pub moves_delayed: bool,
}

/// Who leads each of `mine` (this instance's queues), from the rows a heartbeat read: the
/// instances seen within `gone_after` seconds that receive from the queue, this one always
/// among them; only those that move its delayed table when any of them does. A row of
/// another process with this instance's id (`instance`) is this instance before a restart
/// (a crash leaves its row behind): it leads nothing, so a restarted instance takes its
/// leads back at once instead of after `gone_after`.
pub(crate) fn leads(
    me: Uuid,
    instance: &str,
    mine: &[Mine<'_>],
    rows: &[BeatRow],
    gone_after: f64,
) -> Vec<QueueLead> {
    let members: Vec<(Uuid, Summary)> = rows
        .iter()
        .filter(|r| r.process_id != me && !FLEET_ORDER_ROWS.contains(&r.process_id))
        .filter(|r| r.seen_seconds_ago <= gone_after && r.connected != Some(false))
        .map(|r| (r.process_id, Summary::of(&r.summary)))
        .filter(|(_, s)| s.instance.as_deref() != Some(instance))
        .collect();
    mine.iter()
        .map(|mine| {
            let queue = mine.queue;
            let receiving: Vec<&(Uuid, Summary)> = members
                .iter()
                .filter(|(_, summary)| summary.queues.contains_key(queue))
                .collect();
            let others_moving = receiving.iter().any(|(_, s)| s.moves(queue));
            let mut candidates = Vec::new();
            if mine.moves_delayed || !others_moving {
                candidates.push(me);
            }
            candidates.extend(
                receiving
                    .iter()
                    .filter(|(_, s)| (!mine.moves_delayed && !others_moving) || s.moves(queue))
                    .map(|(id, _)| *id),
            );
            let lead = match leader(queue, &candidates) {
                Some(id) if id != me => Lead::Elsewhere {
                    depth: members
                        .iter()
                        .find(|(member, _)| *member == id)
                        .and_then(|(_, s)| s.queues.get(queue).copied().flatten()),
                },
                _ => Lead::Here,
            };
            QueueLead {
                lead,
                unmoved: !mine.moves_delayed && !others_moving,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moving(queue: &str) -> Mine<'_> {
        Mine {
            queue,
            moves_delayed: true,
        }
    }

    fn not_moving(queue: &str) -> Mine<'_> {
        Mine {
            queue,
            moves_delayed: false,
        }
    }

    /// Who leads `mine`'s queue, as [`leads`] tells it.
    fn lead_of(me: Uuid, instance: &str, mine: Mine<'_>, rows: &[BeatRow]) -> Lead {
        leads(me, instance, &[mine], rows, 20.0)[0].lead
    }

    fn row(id: Uuid, queues: &str, seen: f64) -> BeatRow {
        BeatRow {
            process_id: id,
            summary: format!(r#"{{"queues":{queues}}}"#),
            seen_seconds_ago: seen,
            connected: None,
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
                .filter(|me| lead_of(**me, "me", moving(queue), &rows) == Lead::Here)
                .count();
            assert_eq!(leading, 1, "{queue}");
        }
        // A follower takes the depth the leader published.
        let leader_of_orders = leader("orders", &ids).unwrap();
        let follower = ids.iter().find(|id| **id != leader_of_orders).unwrap();
        assert_eq!(
            lead_of(*follower, "me", moving("orders"), &rows),
            Lead::Elsewhere { depth: Some(5) }
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
            connected: None,
        });
        assert_eq!(lead_of(me, "me", moving("orders"), &rows), Lead::Here);
        assert_eq!(lead_of(me, "me", moving("orders"), &[]), Lead::Here);
    }

    /// Of two instances on a queue, one with delayed delivery off: the other leads, seen from
    /// either side, however the hash falls; with nobody moving, the hash decides as before.
    #[test]
    fn only_an_instance_that_moves_the_delayed_table_leads_its_queue() {
        for _ in 0..50 {
            let (mover, idle) = (Uuid::new_v4(), Uuid::new_v4());
            let rows = [
                BeatRow {
                    process_id: mover,
                    summary: r#"{"queues":{"orders":3},"moves_delayed":["orders"]}"#.into(),
                    seen_seconds_ago: 1.0,
                    connected: None,
                },
                BeatRow {
                    process_id: idle,
                    summary: r#"{"queues":{"orders":3},"moves_delayed":[]}"#.into(),
                    seen_seconds_ago: 1.0,
                    connected: None,
                },
            ];
            assert_eq!(
                lead_of(idle, "idle", not_moving("orders"), &rows),
                Lead::Elsewhere { depth: Some(3) }
            );
            assert_eq!(lead_of(mover, "mover", moving("orders"), &rows), Lead::Here);
            // Alone, or beside others that do not move it either, it leads by the hash, and
            // the table is told as moved by nobody.
            assert_eq!(
                lead_of(idle, "idle", not_moving("orders"), &rows[1..]),
                Lead::Here
            );
            let alone = leads(idle, "idle", &[not_moving("orders")], &rows[1..], 20.0);
            assert!(alone[0].unmoved);
            let beside_a_mover = leads(idle, "idle", &[not_moving("orders")], &rows, 20.0);
            assert!(!beside_a_mover[0].unmoved);
        }
        // An earlier version's summary says nothing: it counts as moving.
        let (old, idle) = (Uuid::new_v4(), Uuid::new_v4());
        let rows = [row(old, r#"{"orders":1}"#, 1.0)];
        assert_eq!(
            lead_of(idle, "idle", not_moving("orders"), &rows),
            Lead::Elsewhere { depth: Some(1) }
        );
    }

    /// An instance restarted after a crash (a new process, the same instance id) takes its
    /// leads back at once: the row its previous process left behind, still seen within
    /// `gone_after`, leads nothing.
    #[test]
    fn a_restarted_instance_takes_its_lead_back_from_its_previous_process() {
        for _ in 0..50 {
            let (before, after) = (Uuid::new_v4(), Uuid::new_v4());
            let rows = [BeatRow {
                process_id: before,
                summary:
                    r#"{"instance":"node-1","queues":{"orders":2},"moves_delayed":["orders"]}"#
                        .into(),
                seen_seconds_ago: 3.0,
                connected: None,
            }];
            assert_eq!(
                lead_of(after, "node-1", moving("orders"), &rows),
                Lead::Here
            );
        }
    }

    /// A leader killed outright: its heartbeat session is closed, so the others take its
    /// leads at their next heartbeat though its row is still within `gone_after`; a row that
    /// cannot tell (None) counts as connected.
    #[test]
    fn a_leader_whose_session_closed_leads_nothing() {
        for _ in 0..50 {
            let (crashed, me) = (Uuid::new_v4(), Uuid::new_v4());
            let beat = |connected| BeatRow {
                process_id: crashed,
                summary: r#"{"queues":{"orders":2},"moves_delayed":["orders"]}"#.into(),
                seen_seconds_ago: 1.0,
                connected,
            };
            assert_eq!(
                lead_of(me, "me", moving("orders"), &[beat(Some(false))]),
                Lead::Here
            );
            let expected = if leader("orders", &[crashed, me]) == Some(me) {
                Lead::Here
            } else {
                Lead::Elsewhere { depth: Some(2) }
            };
            for connected in [Some(true), None] {
                assert_eq!(
                    lead_of(me, "me", moving("orders"), &[beat(connected)]),
                    expected
                );
            }
        }
    }
}
