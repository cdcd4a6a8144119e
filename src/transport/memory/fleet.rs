//! The instance registry and fleet shares in memory, for tests of several hosts in one process.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::transport::fleet::{
    BeatRow, FLEET_ORDER_ROWS, FleetShares, Heartbeat, InstanceRecord, InstanceRegistry,
    ShareClaim, ShareRow,
};
use crate::transport::{QueueName, TransportError};

use super::{MemoryTransport, lock};

/// The registry of hosts sharing this transport (in one process: tests, `demo`).
#[async_trait]
impl InstanceRegistry for MemoryTransport {
    async fn create_registry(&self) -> Result<(), TransportError> {
        Ok(())
    }

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<BeatRow>, TransportError> {
        let now = tokio::time::Instant::now();
        let mut instances = lock(&self.shared.instances);
        instances
            .entry(beat.process_id)
            .and_modify(|(last, _, seen)| {
                *last = beat.clone();
                *seen = now;
            })
            .or_insert_with(|| (beat.clone(), now, now));
        Ok(instances
            .iter()
            .map(|(id, (last, _, seen))| BeatRow {
                process_id: *id,
                summary: last.summary.clone(),
                seen_seconds_ago: seen.elapsed().as_secs_f64(),
                connected: None,
            })
            .collect())
    }

    async fn instances(&self) -> Result<Vec<InstanceRecord>, TransportError> {
        let mut all: Vec<InstanceRecord> = lock(&self.shared.instances)
            .values()
            .filter(|(beat, _, _)| !FLEET_ORDER_ROWS.contains(&beat.process_id))
            .map(|(beat, started, seen)| InstanceRecord {
                heartbeat: beat.clone(),
                up_seconds: started.elapsed().as_secs_f64(),
                seen_seconds_ago: seen.elapsed().as_secs_f64(),
            })
            .collect();
        all.sort_by(|a, b| a.seen_seconds_ago.total_cmp(&b.seen_seconds_ago));
        Ok(all)
    }

    async fn forget(&self, older_than: Duration) -> Result<u64, TransportError> {
        let mut instances = lock(&self.shared.instances);
        let before = instances.len();
        instances.retain(|id, (_, _, seen)| {
            FLEET_ORDER_ROWS.contains(id) || seen.elapsed() <= older_than
        });
        Ok((before - instances.len()) as u64)
    }

    async fn leave(&self, process_id: Uuid) -> Result<(), TransportError> {
        lock(&self.shared.instances).remove(&process_id);
        Ok(())
    }
}

/// Shares of fleet-wide limits among hosts sharing this transport (in one process). The
/// shares' lock is the round's lock; the registry's is taken inside it, never the other way.
#[async_trait]
impl FleetShares for MemoryTransport {
    async fn create_shares(&self) -> Result<(), TransportError> {
        Ok(())
    }

    async fn share_round(
        &self,
        queue: &QueueName,
        me: Uuid,
        gone_after: Duration,
        decide: &mut (dyn for<'r> FnMut(&'r [ShareRow]) -> ShareClaim + Send),
    ) -> Result<ShareClaim, TransportError> {
        let mut shares = lock(&self.shared.shares);
        let seen: BTreeMap<Uuid, Duration> = {
            let mut instances = lock(&self.shared.instances);
            // A host that takes its share is alive.
            if let Some((_, _, seen)) = instances.get_mut(&me) {
                *seen = tokio::time::Instant::now();
            }
            instances
                .iter()
                .map(|(id, (_, _, seen))| (*id, seen.elapsed()))
                .collect()
        };
        shares.retain(|(q, id), _| q != queue || *id == me || seen.contains_key(id));
        let rows: Vec<ShareRow> = shares
            .iter()
            .filter(|((q, _), _)| q == queue)
            .map(|((_, id), (wanted, granted))| ShareRow {
                process_id: *id,
                wanted: *wanted,
                granted: *granted,
                alive: seen.get(id).is_some_and(|ago| *ago <= gone_after),
            })
            .collect();
        let claim = decide(&rows);
        shares.insert((queue.clone(), me), (claim.wanted, claim.granted));
        Ok(claim)
    }

    async fn drop_shares(&self, me: Uuid) -> Result<(), TransportError> {
        lock(&self.shared.shares).retain(|(_, id), _| *id != me);
        Ok(())
    }
}
