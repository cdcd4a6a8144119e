//! Where each direction's override came from: the configuration, an operator on this
//! instance, or a fleet order (see `crate::fleet`), and which fleet orders this instance has
//! applied. An order is applied once, when a heartbeat first reads it, so a local override set
//! afterwards holds until the next order; a reload goes back to the configuration and applies
//! the orders in force again at the next heartbeat.

use std::sync::Mutex;

use uuid::Uuid;

use crate::fleet::FleetOrder;
use crate::status::OverrideScope;
use crate::throttling::Direction;

/// The override origins of both directions.
#[derive(Debug, Default)]
pub(crate) struct Overrides {
    inner: Mutex<Origins>,
}

#[derive(Debug, Default)]
struct Origins {
    scope: [OverrideScope; 2],
    /// The revision of the last fleet order applied, per direction.
    applied: [Option<Uuid>; 2],
    /// The orders the last heartbeat read.
    orders: Vec<FleetOrder>,
    /// The revision of the last order refused (not sealed with this instance's token), per
    /// direction: each is said once.
    refused: [Option<Uuid>; 2],
}

impl Overrides {
    fn lock(&self) -> std::sync::MutexGuard<'_, Origins> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An operator set `direction`'s override on this instance.
    pub(crate) fn set_locally(&self, direction: Direction) {
        self.lock().scope[direction.index()] = OverrideScope::Local;
    }

    /// The configuration was reloaded: its overrides are in force, and the fleet's orders
    /// are to be applied again.
    pub(crate) fn reloaded(&self) {
        let mut o = self.lock();
        o.scope = Default::default();
        o.applied = [None; 2];
    }

    /// Records the orders a heartbeat read and returns those not applied yet, marking them
    /// applied.
    pub(crate) fn to_apply(&self, orders: Vec<FleetOrder>) -> Vec<FleetOrder> {
        let mut o = self.lock();
        let mut fresh = Vec::new();
        for order in &orders {
            let i = order.direction.index();
            if o.applied[i] != Some(order.revision) {
                o.applied[i] = Some(order.revision);
                o.scope[i] = OverrideScope::Fleet;
                fresh.push(order.clone());
            }
        }
        o.orders = orders;
        fresh
    }

    /// Of `refused` (orders this instance will not obey), those not said yet.
    pub(crate) fn newly_refused(&self, refused: &[FleetOrder]) -> Vec<FleetOrder> {
        let mut o = self.lock();
        refused
            .iter()
            .filter(|order| {
                let last = &mut o.refused[order.direction.index()];
                let new = *last != Some(order.revision);
                *last = Some(order.revision);
                new
            })
            .cloned()
            .collect()
    }

    /// Where `direction`'s override in force came from.
    pub(crate) fn scope(&self, direction: Direction) -> OverrideScope {
        self.lock().scope[direction.index()]
    }

    /// The fleet's orders as the last heartbeat read them.
    pub(crate) fn orders(&self) -> Vec<FleetOrder> {
        self.lock().orders.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OverrideMode;

    fn order(direction: Direction, mode: OverrideMode) -> FleetOrder {
        FleetOrder {
            seal: String::new(),
            direction,
            mode,
            set_by: "node-1".into(),
            revision: Uuid::new_v4(),
        }
    }

    /// An order is applied once; a local override after it holds until the next order; a
    /// reload applies the order in force again.
    #[test]
    fn each_order_is_applied_once_and_a_local_override_holds_until_the_next() {
        let o = Overrides::default();
        assert_eq!(o.scope(Direction::Delivery), OverrideScope::Configured);
        let first = order(Direction::Delivery, OverrideMode::Throttle);
        assert_eq!(o.to_apply(vec![first.clone()]), vec![first.clone()]);
        assert_eq!(o.scope(Direction::Delivery), OverrideScope::Fleet);
        assert!(o.to_apply(vec![first.clone()]).is_empty(), "applied once");
        o.set_locally(Direction::Delivery);
        assert!(o.to_apply(vec![first.clone()]).is_empty());
        assert_eq!(o.scope(Direction::Delivery), OverrideScope::Local);
        let second = order(Direction::Delivery, OverrideMode::None);
        assert_eq!(o.to_apply(vec![second.clone()]), vec![second.clone()]);
        assert_eq!(o.scope(Direction::Delivery), OverrideScope::Fleet);
        o.reloaded();
        assert_eq!(o.scope(Direction::Delivery), OverrideScope::Configured);
        assert_eq!(o.to_apply(vec![second.clone()]), vec![second]);
        assert_eq!(o.scope(Direction::Publishing), OverrideScope::Configured);
    }
}
