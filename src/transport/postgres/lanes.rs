//! The pool in lanes: each queue's statements go to a few connections of their own first.
//!
//! A PostgreSQL backend pays once for every table it touches (it loads the table's and its
//! indexes' catalog entries and plans the receive prepared for it: about half a millisecond of
//! the server's CPU, measured here). With one pool a message of a host with 1 000 queues went
//! to whichever of 40 connections was free, so nearly every receive was some backend's first
//! touch of that table: 20 000 messages spread over 1 000 queues drained at under a quarter of
//! the rate of the same messages in one queue, PostgreSQL the bottleneck. Split into lanes of
//! a few connections, with each queue at home in one lane, a backend touches only its lane's
//! share of the tables.
//!
//! A lane lends what its own queues do not wait for: a receive takes a connection from its home
//! lane when one is free, else from any lane that has one free (or room for one), and only
//! then waits, on its home lane. One busy queue among idle ones therefore still has the whole
//! pool. Under pressure the lanes share fairly: a queue stands in its lane's line once, however
//! many receives it has started, and a receive chain (each commit bringing the queue's next
//! receive along on the same connection) gives its connection back after a [`TURN`] when others
//! of the lane wait, so a busy queue cannot keep the others of its lane from theirs.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError, TimeoutType};
use tokio::sync::Semaphore;

use crate::transport::QueueName;

/// Connections per lane, about: few enough that a backend touches a small share of many
/// queues' tables, enough that a queue's own lane carries it alone when the pool is full.
const LANE_CONNECTIONS: usize = 4;

/// How long a queue keeps a connection of its lane, receiving one message after another on
/// it, while other queues of the lane wait for one. Giving it back costs a round trip of its
/// own (the commit no longer brings the next receive along): after every message, 20 000
/// messages over 1 000 queues drained at about 60 % of the rate they did with 100 ms turns.
const TURN: Duration = Duration::from_millis(100);

/// A lane's index.
pub(super) type Lane = usize;

/// A pooled connection and the lane that lent it: a connection is known by its lane and its
/// id, as every lane numbers its own.
pub(super) struct Lent {
    lane: Lane,
    client: Object,
    /// When the lane lent it.
    since: tokio::time::Instant,
}

impl Lent {
    fn new(lane: Lane, client: Object) -> Self {
        Lent {
            lane,
            client,
            since: tokio::time::Instant::now(),
        }
    }

    pub(super) fn lane(&self) -> Lane {
        self.lane
    }

    /// Whether this connection has served its holder for a turn's length (see
    /// [`Lanes::waiting_in`]).
    pub(super) fn turn_over(&self) -> bool {
        self.since.elapsed() >= TURN
    }

    /// The connection, to close instead of returning it (`Object::take`).
    pub(super) fn into_object(self) -> Object {
        self.client
    }
}

impl Deref for Lent {
    type Target = Object;

    fn deref(&self) -> &Object {
        &self.client
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut Object {
        &mut self.client
    }
}

/// The pool's connections in lanes.
pub(super) struct Lanes {
    pools: Vec<Pool>,
    /// Each queue's home lane and its place in that lane's line, made on first use.
    routes: RwLock<HashMap<QueueName, Arc<Route>>>,
}

/// Where one queue's statements go.
struct Route {
    home: Lane,
    /// One of the queue's statements at a time waits in its lane's line; the others wait
    /// here. A lane then serves its waiting queues in turn: a queue with eight receives
    /// started no longer stood eight times in line ahead of a queue with one, which is how
    /// the last of 1 000 queues waited for its first message until most of the others were
    /// done.
    line: Semaphore,
}

impl Lanes {
    /// Splits `pool_size` connections into lanes of about [`LANE_CONNECTIONS`]; `build` makes
    /// a lane's pool of the size it is given.
    pub(super) fn split<E>(
        pool_size: usize,
        mut build: impl FnMut(usize) -> Result<Pool, E>,
    ) -> Result<Self, E> {
        let count = (pool_size / LANE_CONNECTIONS).max(1);
        let pools = (0..count)
            .map(|i| build(pool_size / count + usize::from(i < pool_size % count)))
            .collect::<Result<_, _>>()?;
        Ok(Lanes {
            pools,
            routes: RwLock::default(),
        })
    }

    /// The lane `queue` is at home in: a fixed hash of its name, so every start agrees.
    fn home(&self, queue: &QueueName) -> Lane {
        let mut hasher = std::hash::DefaultHasher::new();
        queue.hash(&mut hasher);
        (hasher.finish() % self.pools.len() as u64) as Lane
    }

    fn route(&self, queue: &QueueName) -> Arc<Route> {
        if let Some(route) = self
            .routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return route.clone();
        }
        let route = Arc::new(Route {
            home: self.home(queue),
            line: Semaphore::new(1),
        });
        self.routes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(queue.clone())
            .or_insert(route)
            .clone()
    }

    /// The lane statements that serve no one queue (depth reads of all queues, sweeps,
    /// heartbeats) are at home in. Its pool lends the connection returned last first, so an
    /// idle host's few statements keep to one or two backends.
    pub(super) const SHARED: Lane = 0;

    /// A connection for `queue`'s statements: one free anywhere (its home lane first), else
    /// the first its home lane frees once the queue's turn in that lane's line has come
    /// (within the pool's wait timeout).
    pub(super) async fn get_for(&self, queue: &QueueName) -> Result<Lent, PoolError> {
        let route = self.route(queue);
        if let Some(lent) = self.free(route.home).await? {
            return Ok(lent);
        }
        let timeouts = self.pools[route.home].timeouts();
        let started = tokio::time::Instant::now();
        let in_line = match timeouts.wait {
            Some(wait) => tokio::time::timeout(wait, route.line.acquire())
                .await
                .map_err(|_| PoolError::Timeout(TimeoutType::Wait))?,
            None => route.line.acquire().await,
        };
        let _in_line = in_line.map_err(|_| PoolError::Closed)?;
        if let Some(lent) = self.free(route.home).await? {
            return Ok(lent);
        }
        // The pool's wait timeout counts from the ask, the time in the queue's line included.
        let remaining = deadpool_postgres::Timeouts {
            wait: timeouts.wait.map(|w| w.saturating_sub(started.elapsed())),
            ..timeouts
        };
        let client = self.pools[route.home].timeout_get(&remaining).await?;
        Ok(Lent::new(route.home, client))
    }

    /// A connection, from `home` when it has one free, else from the first lane after it that
    /// has one free or room to open one, else the first `home` frees (within the pool's wait
    /// timeout).
    pub(super) async fn get(&self, home: Lane) -> Result<Lent, PoolError> {
        if let Some(lent) = self.free(home).await? {
            return Ok(lent);
        }
        let client = self.pools[home].get().await?;
        Ok(Lent::new(home, client))
    }

    /// A connection free now (or room to open one), `home` asked first, then the lanes after
    /// it; none when every lane is in use.
    async fn free(&self, home: Lane) -> Result<Option<Lent>, PoolError> {
        let count = self.pools.len();
        for lane in (0..count).map(|k| (home + k) % count) {
            let pool = &self.pools[lane];
            let now = deadpool_postgres::Timeouts {
                wait: Some(Duration::ZERO),
                ..pool.timeouts()
            };
            match pool.timeout_get(&now).await {
                Ok(client) => return Ok(Some(Lent::new(lane, client))),
                // None free there: a lane whose queues wait gets its connections back first.
                Err(PoolError::Timeout(TimeoutType::Wait)) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(None)
    }

    /// Whether someone waits for a connection of `lane`.
    pub(super) fn waiting_in(&self, lane: Lane) -> bool {
        self.pools[lane].status().waiting > 0
    }

    /// Connections open and lent out, over all lanes.
    pub(super) fn in_use(&self) -> usize {
        self.pools
            .iter()
            .map(|pool| {
                let status = pool.status();
                status.size.saturating_sub(status.available)
            })
            .sum()
    }

    /// How many lanes there are.
    #[cfg(test)]
    pub(super) fn count(&self) -> usize {
        self.pools.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(size: usize) -> Result<Pool, String> {
        let config: tokio_postgres::Config = "host=127.0.0.1 user=nobody".parse().unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        Pool::builder(manager)
            .max_size(size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| e.to_string())
    }

    #[test]
    fn lanes_share_the_pool_without_losing_a_connection() {
        for size in [1, 3, 4, 10, 40, 41, 100] {
            let lanes = Lanes::split(size, pool).unwrap();
            let sizes: Vec<usize> = lanes.pools.iter().map(|p| p.status().max_size).collect();
            assert_eq!(sizes.iter().sum::<usize>(), size, "pool {size}: {sizes:?}");
            assert!(
                sizes.iter().all(|s| *s >= 1 && *s <= 2 * LANE_CONNECTIONS),
                "pool {size}: {sizes:?}"
            );
        }
        assert_eq!(Lanes::split(40, pool).unwrap().count(), 10);
        assert_eq!(Lanes::split(3, pool).unwrap().count(), 1);
    }

    #[test]
    fn queues_spread_over_the_lanes_the_same_way_every_time() {
        let lanes = Lanes::split(40, pool).unwrap();
        let mut per_lane = vec![0usize; lanes.count()];
        for i in 0..1000 {
            let queue = QueueName::new(&format!("q{i:04}")).unwrap();
            let home = lanes.home(&queue);
            assert_eq!(home, lanes.home(&queue));
            per_lane[home] += 1;
        }
        // 100 each on average; a hash that bunched queues would leave lanes idle.
        assert!(
            per_lane.iter().all(|n| (60..=140).contains(n)),
            "{per_lane:?}"
        );
    }
}
