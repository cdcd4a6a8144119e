//! The fleet seen from one instance: the view of its members, orders written for all, and orders
//! heard at a heartbeat.

use crate::throttling::Direction;

use super::HostInner;

impl HostInner {
    /// Every instance on this host's database, as `/fleet` shows it. Err: the registry is off
    /// (`fleet.enabled = false`), the transport keeps none, or it cannot be read.
    pub(crate) async fn fleet(&self) -> Result<crate::fleet::FleetView, String> {
        let config = self.config();
        if !config.fleet.enabled {
            return Err("the instance registry is off (fleet.enabled = false)".into());
        }
        let Some(registry) = self.transport.instance_registry() else {
            return Err(format!(
                "the {} transport keeps no instance registry",
                self.transport.describe()
            ));
        };
        let records = registry
            .instances()
            .await
            .map_err(|e| format!("cannot read the instance registry: {e}"))?;
        Ok(crate::fleet::FleetView::of(
            records,
            self.process_id,
            &config.fleet,
            self.fleet_health.failing(),
            self.overrides.orders(),
        ))
    }
}

impl HostInner {
    /// Orders every instance on the database to override `direction` (this one at once, the
    /// others at their next heartbeat): the order is written into the instance registry.
    pub(crate) async fn set_fleet_override(
        &self,
        direction: Direction,
        mode: crate::config::OverrideMode,
    ) -> Result<crate::fleet::FleetOrder, crate::fleet::FleetOrderError> {
        use crate::fleet::FleetOrderError;
        let config = self.config();
        if !config.fleet.enabled {
            return Err(FleetOrderError::NoRegistry(
                "a fleet-wide override goes through the instance registry, which is off (fleet.enabled = false)"
                    .into(),
            ));
        }
        let Some(registry) = self.transport.instance_registry() else {
            return Err(FleetOrderError::NoRegistry(format!(
                "the {} transport keeps no instance registry to send a fleet-wide override through",
                self.transport.describe()
            )));
        };
        let token = config.admin.token.expose();
        if token.is_empty() {
            return Err(FleetOrderError::NoToken);
        }
        let order = crate::fleet::FleetOrder::sealed(direction, mode, &self.instance, token);
        let write = async {
            registry.create_registry().await?;
            registry
                .heartbeat(&order.as_heartbeat(&config.host.name))
                .await
        };
        write
            .await
            .map_err(|e| FleetOrderError::NotWritten(e.to_string()))?;
        let mut orders: Vec<_> = self
            .overrides
            .orders()
            .into_iter()
            .filter(|o| o.direction != direction)
            .collect();
        orders.push(order.clone());
        self.apply_fleet_orders(orders);
        Ok(order)
    }

    /// What a heartbeat brought: the fleet's orders to apply, and who leads each queue's
    /// background reading (`fleet::lead`); None (the heartbeat failed): this host leads all
    /// its queues, as it would alone.
    pub(super) fn heard_from_fleet(
        &self,
        heard: Option<(
            Vec<crate::fleet::FleetOrder>,
            Vec<crate::transport::BeatRow>,
        )>,
    ) {
        let Some((orders, rows)) = heard else {
            for q in &self.queues {
                q.set_leads(true);
                q.set_delayed_unmoved(
                    super::tasks::owns_delayed_table(q) && !self.moves_delayed(q),
                );
            }
            return;
        };
        self.apply_fleet_orders(orders);
        let mine: Vec<crate::fleet::lead::Mine<'_>> = self
            .queues
            .iter()
            .map(|q| crate::fleet::lead::Mine {
                queue: q.name().as_str(),
                moves_delayed: self.moves_delayed(q),
            })
            .collect();
        let gone_after = self.config().fleet.gone_after.as_secs_f64();
        let leads =
            crate::fleet::lead::leads(self.process_id, &self.instance, &mine, &rows, gone_after);
        for (q, lead) in self.queues.iter().zip(leads) {
            q.set_delayed_unmoved(super::tasks::owns_delayed_table(q) && lead.unmoved);
            match lead.lead {
                crate::fleet::lead::Lead::Here => q.set_leads(true),
                crate::fleet::lead::Lead::Elsewhere { depth } => {
                    q.set_leads(false);
                    if let Some(depth) = depth {
                        q.depth().set(depth);
                        q.depth_read(depth);
                    }
                }
            }
        }
    }
}

impl HostInner {
    /// Applies the fleet's orders this instance has not applied yet, among those sealed with
    /// its own `admin.token`; an order sealed otherwise (another token, none, a row written by
    /// hand) is refused and said once.
    pub(super) fn apply_fleet_orders(&self, orders: Vec<crate::fleet::FleetOrder>) {
        let config = self.config();
        let token = config.admin.token.expose();
        let (sealed, refused): (Vec<_>, Vec<_>) =
            orders.into_iter().partition(|o| o.is_sealed_with(token));
        for order in self.overrides.newly_refused(&refused) {
            tracing::warn!(direction = %order.direction, mode = ?order.mode,
                set_by = %order.set_by.escape_debug(),
                "a fleet-wide override not sealed with this instance's admin.token is refused (the fleet's instances need the same token)");
        }
        for order in self.overrides.to_apply(sealed) {
            tracing::info!(direction = %order.direction, mode = ?order.mode, set_by = %order.set_by,
                "fleet-wide throttling override applied");
            self.control.set_override(order.direction, order.mode);
        }
    }
}
