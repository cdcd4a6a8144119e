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

use super::TransportError;

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

    /// Records `beat` as this process's latest heartbeat and answers the fleet's orders: the
    /// `summary` of each [`FLEET_ORDER_ROWS`] row present, in that order (one round trip).
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<String>, TransportError>;

    /// Every registered instance (not the fleet's order rows), most recently seen first.
    async fn instances(&self) -> Result<Vec<InstanceRecord>, TransportError>;

    /// Removes the rows of instances not seen for longer than `older_than` (never the fleet's
    /// order rows); returns how many.
    async fn forget(&self, older_than: Duration) -> Result<u64, TransportError>;

    /// Removes this process's row (it is stopping).
    async fn leave(&self, process_id: Uuid) -> Result<(), TransportError>;
}
