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
use tokio::sync::{Notify, Semaphore};

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
    /// Some until the connection goes back to its lane or is closed.
    client: Option<Object>,
    /// When the lane lent it.
    since: tokio::time::Instant,
    /// Told when a connection comes back to a lane none of whose own queues waits for it.
    returned: Arc<Notify>,
}

impl Lent {
    pub(super) fn lane(&self) -> Lane {
        self.lane
    }

    /// Whether this connection has served its holder for a turn's length (see
    /// [`Lanes::waiting_in`]).
    pub(super) fn turn_over(&self) -> bool {
        self.since.elapsed() >= TURN
    }

    /// Closes the connection instead of returning it (its state is unknown): the server
    /// rolls back what it held, and the lane has room for a new one.
    pub(super) fn close(mut self) {
        self.give_back(true);
    }

    /// Returns the connection to its lane, or closes it; either way, when none of the lane's
    /// own queues waits for the room that leaves, a queue of another lane that waits in its
    /// own line is told, or the room would sit unused while that queue waited out the pool's
    /// timeout.
    fn give_back(&mut self, close: bool) {
        let Some(client) = self.client.take() else {
            return;
        };
        let lane = Object::pool(&client);
        match close {
            true => drop(Object::take(client)),
            false => drop(client),
        }
        if lane.is_some_and(|pool| pool.status().waiting == 0) {
            self.returned.notify_one();
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.give_back(false);
    }
}

impl Deref for Lent {
    type Target = Object;

    fn deref(&self) -> &Object {
        self.client.as_ref().expect("lent until returned")
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut Object {
        self.client.as_mut().expect("lent until returned")
    }
}

/// The pool's connections in lanes.
pub(super) struct Lanes {
    pools: Vec<Pool>,
    /// Told when a connection comes back that its own lane does not wait for.
    returned: Arc<Notify>,
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
            returned: Arc::default(),
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
        self.wait_in(route.home, started).await
    }

    /// A connection, from `home` when it has one free, else from another lane that has one
    /// free or room to open one, else the first `home` frees (within the pool's wait timeout).
    pub(super) async fn get(&self, home: Lane) -> Result<Lent, PoolError> {
        self.wait_in(home, tokio::time::Instant::now()).await
    }

    /// The first connection free anywhere, or the first `home` frees, within the pool's wait
    /// timeout counted from `asked`. Waiting on `home` alone, a receive waited out the timeout
    /// while other lanes had connections come back that none of their queues wanted.
    async fn wait_in(&self, home: Lane, asked: tokio::time::Instant) -> Result<Lent, PoolError> {
        let timeouts = self.pools[home].timeouts();
        loop {
            let returned = self.returned.notified();
            tokio::pin!(returned);
            returned.as_mut().enable();
            if let Some(lent) = self.free(home).await? {
                return Ok(lent);
            }
            let remaining = deadpool_postgres::Timeouts {
                wait: timeouts.wait.map(|w| w.saturating_sub(asked.elapsed())),
                ..timeouts
            };
            tokio::select! {
                got = self.pools[home].timeout_get(&remaining) => {
                    return got.map(|client| self.lent(home, client));
                }
                () = &mut returned => {}
            }
        }
    }

    /// A connection free now, none when every lane is in use: an open idle one first (`home`
    /// asked first, then the lanes after it), so the host opens no more connections than one
    /// pool would; else room to open one, `home` first.
    async fn free(&self, home: Lane) -> Result<Option<Lent>, PoolError> {
        let count = self.pools.len();
        let order = || (0..count).map(|k| (home + k) % count);
        let status = |lane: Lane| self.pools[lane].status();
        let idle = order().filter(|&lane| status(lane).available > 0);
        let room = order().filter(|&lane| {
            let s = status(lane);
            s.size < s.max_size
        });
        for lane in idle.chain(room) {
            let pool = &self.pools[lane];
            let now = deadpool_postgres::Timeouts {
                wait: Some(Duration::ZERO),
                ..pool.timeouts()
            };
            match pool.timeout_get(&now).await {
                Ok(client) => return Ok(Some(self.lent(lane, client))),
                // None free there: a lane whose queues wait gets its connections back first.
                Err(PoolError::Timeout(TimeoutType::Wait)) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(None)
    }

    fn lent(&self, lane: Lane, client: Object) -> Lent {
        Lent {
            lane,
            client: Some(client),
            since: tokio::time::Instant::now(),
            returned: self.returned.clone(),
        }
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

    /// Returns once the queue asking is in lane 0's line (its own), not before: a connection
    /// given back earlier would be found free and prove nothing of the wake.
    async fn waiting_in_lane_0(lanes: &Lanes) {
        while !lanes.waiting_in(0) {
            tokio::task::yield_now().await;
        }
    }

    /// Needs PostgreSQL (DATABASE_URL, default the local `test` database), as the suite does.
    #[tokio::test]
    async fn a_connection_back_in_another_lane_goes_to_a_queue_waiting_in_its_own() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let config: tokio_postgres::Config = url.parse().unwrap();
        let lanes = Lanes::split(8, |size| {
            let manager = deadpool_postgres::Manager::new(config.clone(), tokio_postgres::NoTls);
            Pool::builder(manager)
                .max_size(size)
                .wait_timeout(Some(Duration::from_secs(2)))
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .build()
        })
        .unwrap();
        let queue = (0..)
            .map(|i| QueueName::new(&format!("q{i}")).unwrap())
            .find(|q| lanes.home(q) == 0)
            .unwrap();
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(lanes.get(0).await.expect("PostgreSQL at DATABASE_URL"));
        }
        let in_other_lane = held.iter().position(|l| l.lane() == 1).unwrap();
        let (waited, ()) = tokio::join!(lanes.get_for(&queue), async {
            waiting_in_lane_0(&lanes).await;
            drop(held.remove(in_other_lane));
        });
        // Waiting on its own lane alone, it would have waited out the 2 s timeout.
        let lent = waited.expect("the connection that came back in the other lane");
        assert_eq!(lent.lane(), 1);
        // A connection closed in the other lane leaves room there for a new one: it goes to
        // the queue waiting in its own lane too.
        held.push(lent);
        let in_other_lane = held.iter().position(|l| l.lane() == 1).unwrap();
        let (waited, ()) = tokio::join!(lanes.get_for(&queue), async {
            waiting_in_lane_0(&lanes).await;
            held.remove(in_other_lane).close();
        });
        let lent = waited.expect("a new connection where one was closed");
        assert_eq!(lent.lane(), 1);
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
