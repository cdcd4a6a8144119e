//! The instance registry, the ability of a transport to keep a row per running host in the
//! database the hosts already share, so that every instance sees the others.
//!
//! One small table in the queue schema (`throttlehost_instances`), created like the queues:
//! a row per host process, written by its heartbeat (one statement: insert or update), read
//! by whoever shows the fleet, removed when the process stops, and forgotten by any instance
//! once it has not been seen for long. The database's own clock stamps every heartbeat and
//! measures how long ago each was, so hosts whose clocks differ still agree on who is gone.
//!
//! Two rows of the same table carry the fleet's orders instead of an instance
//! ([`FLEET_ORDER_ROWS`]: the fleet-wide override of each direction, as JSON in `summary`).
//! Every heartbeat reads them back in the same round trip, so an order reaches every instance
//! within one heartbeat at no extra statement; they are never listed as instances nor
//! forgotten.

use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use uuid::Uuid;

use super::{QueueName, TransportError};

/// The registry table's name in the queue schema.
pub const INSTANCES_TABLE: &str = "throttlehost_instances";

/// The registry rows that hold the fleet's orders (delivery's, then publishing's override),
/// written with [`InstanceRegistry::heartbeat`] like an instance's row. No process draws
/// these ids: instances take random (version 4) ids, and these are version 0.
pub const FLEET_ORDER_ROWS: [Uuid; 2] = [Uuid::from_u128(1), Uuid::from_u128(2)];

/// What one heartbeat writes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Heartbeat {
    /// This process: a new id at every start, so two processes never share a row.
    pub process_id: Uuid,
    /// The host's logical name (`[host] name`).
    pub host_name: String,
    /// The instance id (`[host] instance_id`, or the machine's name).
    pub instance_id: String,
    /// The running version.
    pub version: String,
    /// Where its admin endpoint answers, when it has one.
    pub admin_address: Option<String>,
    /// Its throttling summary now (JSON text: state per direction, cause, delay, in flight,
    /// rates).
    pub summary: String,
}

/// A registry row as a heartbeat reads it back: whose it is, what its last heartbeat wrote,
/// and how long ago.
#[derive(Debug, Clone, PartialEq)]
pub struct BeatRow {
    /// The row's process (or one of [`FLEET_ORDER_ROWS`]).
    pub process_id: Uuid,
    /// Its summary (an order's text for an order row).
    pub summary: String,
    /// Seconds since it was written, by the database's clock.
    pub seen_seconds_ago: f64,
    /// Whether the database session that wrote its last heartbeat is still open (None: the
    /// transport cannot tell). A process killed outright closes its sessions at once, so a
    /// closed one tells a crash within a heartbeat, long before `gone_after`.
    pub connected: Option<bool>,
}

impl BeatRow {
    /// The summaries of the fleet's order rows among `rows`, in [`FLEET_ORDER_ROWS`] order.
    pub fn orders(rows: &[BeatRow]) -> Vec<String> {
        FLEET_ORDER_ROWS
            .iter()
            .filter_map(|id| rows.iter().find(|r| r.process_id == *id))
            .map(|r| r.summary.clone())
            .collect()
    }
}

/// One registered instance, as the database last saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceRecord {
    /// What its last heartbeat wrote.
    #[serde(flatten)]
    pub heartbeat: Heartbeat,
    /// Seconds since its first heartbeat, by the database's clock.
    pub up_seconds: f64,
    /// Seconds since its last heartbeat, by the database's clock.
    pub seen_seconds_ago: f64,
}

/// A transport that can keep the instance registry (see the module documentation).
#[async_trait]
pub trait InstanceRegistry: Send + Sync {
    /// Creates the registry table when it is missing (safe when hosts do it at once).
    async fn create_registry(&self) -> Result<(), TransportError>;

    /// Records `beat` as this process's latest heartbeat and answers every row of the
    /// registry, the fleet's order rows ([`FLEET_ORDER_ROWS`]) included, with its age by the
    /// database's clock (one round trip; this process's own row may show its previous beat).
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<BeatRow>, TransportError>;

    /// Every registered instance (not the fleet's order rows), most recently seen first.
    async fn instances(&self) -> Result<Vec<InstanceRecord>, TransportError>;

    /// Removes the rows of instances not seen for longer than `older_than` (never the fleet's
    /// order rows); returns how many.
    async fn forget(&self, older_than: Duration) -> Result<u64, TransportError>;

    /// Removes this process's row (it is stopping).
    async fn leave(&self, process_id: Uuid) -> Result<(), TransportError>;
}

/// How many times `fleet.gone_after` an instance that is not seen keeps its fleet share while
/// the database still has its heartbeat's session open (PostgreSQL): a paused process
/// (SIGSTOP) or one whose every statement waits keeps its sessions, and its handlers resume
/// where they stopped; were its share taken at `gone_after`, they would run beside the
/// others' full share. A process that is killed closes its sessions, so its share is free at
/// `gone_after`; one paused longer than this (or cut off by a network the server has not
/// noticed) counts as gone then.
pub const HELD_WHILE_CONNECTED: u32 = 5;

/// The shares table's name in the queue schema: a row per instance and queue with a
/// fleet-wide limit (`fleet_max`), saying how much of it the instance wants and holds.
pub const SHARES_TABLE: &str = "throttlehost_shares";

/// One instance's row of a queue's fleet-wide limit, as a share round reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareRow {
    /// The instance's process.
    pub process_id: Uuid,
    /// What it asked for at its last round.
    pub wanted: u32,
    /// What it may hold: never less than it had in flight when it wrote the row.
    pub granted: u32,
    /// Its registry row was seen within `gone_after` (by the database's clock), or within
    /// [`HELD_WHILE_CONNECTED`] times that while its heartbeat's session is still open (where
    /// the transport can tell). The grant of an instance that is not alive is free for the
    /// others.
    pub alive: bool,
}

/// What a share round writes as this instance's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShareClaim {
    /// What this instance would use now.
    pub wanted: u32,
    /// What it holds from now on.
    pub granted: u32,
}

impl ShareClaim {
    /// Wanted and granted as the shares table's integer columns keep them.
    pub fn columns(&self) -> (i32, i32) {
        let column = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
        (column(self.wanted), column(self.granted))
    }
}

/// A transport that can share a queue's fleet-wide limit among the instances on its
/// database: rounds that never interleave for one queue, each reading every instance's row
/// and writing one (see `fleet::share`, which decides what a round writes).
#[async_trait]
pub trait FleetShares: Send + Sync {
    /// Creates the shares table when it is missing (safe when hosts do it at once).
    async fn create_shares(&self) -> Result<(), TransportError>;

    /// One round for `queue` and this process (`me`), in one transaction under a lock of the
    /// queue's share that only one round holds at a time: reads every instance's row of the
    /// queue (alive when its registry row was seen within `gone_after`), asks `decide` for
    /// this process's row, writes it, stamps this process's registry row as seen (an instance
    /// whose rounds go through is alive, however late its heartbeat), removes the rows of
    /// instances the registry no longer lists, and commits. Returns what was written. `decide` runs while the lock is held, so
    /// what it reads of the others stays true until the commit.
    async fn share_round(
        &self,
        queue: &QueueName,
        me: Uuid,
        gone_after: Duration,
        decide: &mut (dyn for<'r> FnMut(&'r [ShareRow]) -> ShareClaim + Send),
    ) -> Result<ShareClaim, TransportError>;

    /// Removes this process's rows (it is stopping: what it held is free at once).
    async fn drop_shares(&self, me: Uuid) -> Result<(), TransportError>;
}
