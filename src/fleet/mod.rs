//! This host among the others on its database: its heartbeat into the instance registry
//! (`transport::fleet`), and the view of every instance that `/fleet` and
//! `throttlehost status --fleet` show.
//!
//! The registry is for seeing, never a point of failure: a heartbeat that cannot be written
//! is said (a warning when it starts failing, a line when it works again, and the error in
//! the view) and the host goes on receiving. Each heartbeat is one statement; every
//! [`FORGET_EVERY`] heartbeats the instance also deletes the rows of instances gone for longer
//! than `fleet.forget_after`, so a crashed host's row does not stay for ever. A stopping host
//! removes its own row.
//!
//! The fleet's orders ride on the same statement: a fleet-wide override is written into the
//! registry as a [`FleetOrder`] (one row per direction), every heartbeat reads the orders
//! back, and each instance applies an order it has not applied yet, so an override reaches
//! the whole fleet within one heartbeat. A local override set afterwards on one instance
//! holds there until the next fleet order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{FleetConfig, OverrideMode};
use crate::throttling::Direction;
use crate::transport::{BeatRow, Heartbeat, InstanceRecord, Transport, TransportError};

pub(crate) mod lead;
pub(crate) mod share;

/// Every this many heartbeats an instance forgets the long-gone rows.
pub(crate) const FORGET_EVERY: u32 = 12;
/// How long a stopping host waits to remove its row.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The last heartbeat's failure, when it failed (shared with the view).
#[derive(Debug, Default)]
pub(crate) struct HeartbeatHealth {
    failing: Mutex<Option<String>>,
}

impl HeartbeatHealth {
    /// Why the last heartbeat failed; None when it was written.
    pub(crate) fn failing(&self) -> Option<String> {
        self.failing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records a heartbeat's outcome; says so in the log when it changes.
    fn record(&self, outcome: Result<(), TransportError>) {
        let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        match (outcome, failing.is_some()) {
            (Ok(()), true) => {
                tracing::info!("the heartbeat into the instance registry is written again");
                *failing = None;
            }
            (Ok(()), false) => {}
            (Err(e), was_failing) => {
                if !was_failing {
                    tracing::warn!(error = %e,
                        "cannot write this host's heartbeat into the instance registry; receiving goes on, and the other instances will show this one as gone");
                }
                *failing = Some(e.to_string());
            }
        }
    }
}

/// Whether a registry row's admin address is one a host writes (`http://` and an IP address
/// with a port): anything else (`127.0.0.1:9464@evil.example`, a script) is not shown, so the
/// console never links it.
fn is_admin_address(address: &str) -> bool {
    address
        .strip_prefix("http://")
        .unwrap_or(address)
        .parse::<std::net::SocketAddr>()
        .is_ok()
}

/// A fleet-wide override, as the registry keeps it (the `summary` of its direction's order
/// row, see `transport::FLEET_ORDER_ROWS`).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct FleetOrder {
    /// The direction it overrides.
    pub direction: Direction,
    /// The override every instance applies.
    pub mode: OverrideMode,
    /// The instance it was given on.
    pub set_by: String,
    /// New at every order: an instance applies each revision once, so a local override set
    /// after it holds until the next order.
    pub revision: Uuid,
    /// HMAC-SHA256 of the order under the `admin.token` of the instance that gave it (hex):
    /// an instance obeys only orders sealed with its own token. Empty in an unsealed row.
    #[serde(default)]
    pub seal: String,
}

impl FleetOrder {
    /// A new order, given on instance `set_by` and sealed with `token`.
    pub fn sealed(direction: Direction, mode: OverrideMode, set_by: &str, token: &str) -> Self {
        let mut order = FleetOrder {
            direction,
            mode,
            set_by: set_by.to_string(),
            revision: Uuid::new_v4(),
            seal: String::new(),
        };
        order.seal = order.seal_with(token);
        order
    }

    /// Whether it was sealed with `token` (compared in constant time); never with an empty
    /// token.
    pub fn is_sealed_with(&self, token: &str) -> bool {
        if token.is_empty() {
            return false;
        }
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
        data_encoding::HEXLOWER
            .decode(self.seal.as_bytes())
            .is_ok_and(|tag| ring::hmac::verify(&key, self.sealed_text().as_bytes(), &tag).is_ok())
    }

    fn seal_with(&self, token: &str) -> String {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
        let tag = ring::hmac::sign(&key, self.sealed_text().as_bytes());
        data_encoding::HEXLOWER.encode(tag.as_ref())
    }

    /// What the seal covers: every field but the seal.
    fn sealed_text(&self) -> String {
        format!(
            "throttlehost fleet order 1\n{}\n{:?}\n{}\n{}",
            self.direction, self.mode, self.set_by, self.revision
        )
    }

    /// The orders among `summaries` (the order rows' text); a row that is not an order (written
    /// by another version, or by hand) is skipped and said.
    pub fn parse_all(summaries: &[String]) -> Vec<FleetOrder> {
        summaries
            .iter()
            .filter_map(|text| match serde_json::from_str::<FleetOrder>(text) {
                Ok(order) => Some(order),
                Err(e) => {
                    // A row anyone can write: shown short and escaped.
                    let row: String = text.chars().take(200).flat_map(char::escape_debug).collect();
                    tracing::warn!(error = %e, row = %row, length = text.len(),
                        "a fleet order in the instance registry is not one this version reads; ignored");
                    None
                }
            })
            .collect()
    }

    /// The heartbeat that writes this order into its direction's row.
    pub fn as_heartbeat(&self, host_name: &str) -> Heartbeat {
        Heartbeat {
            process_id: crate::transport::FLEET_ORDER_ROWS[self.direction.index()],
            host_name: host_name.to_string(),
            instance_id: format!("fleet order ({})", self.direction),
            version: crate::version::VERSION.to_string(),
            admin_address: None,
            summary: serde_json::to_string(self).unwrap_or_default(),
        }
    }
}

/// Why a fleet-wide override was not given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum FleetOrderError {
    /// This host has no instance registry to send it through (`fleet.enabled = false`, or a
    /// transport without one).
    #[error("{0}")]
    NoRegistry(String),
    /// This instance has no `admin.token` to seal it with: the others would not obey it.
    #[error(
        "a fleet-wide override needs admin.token: every instance obeys only orders sealed with the token it is configured with, so give the fleet's instances the same token"
    )]
    NoToken,
    /// The registry did not take it.
    #[error("cannot write the fleet-wide override: {0}")]
    NotWritten(String),
}

/// What the heartbeat loop reads and reports besides its row.
pub(crate) struct HeartbeatHooks<S, C, O> {
    /// This host's throttling summary now.
    pub summary: S,
    /// The `[fleet]` settings now.
    pub settings: C,
    /// Called after every heartbeat with the fleet's orders and every registry row it read
    /// back (None when the heartbeat failed: the fleet cannot be seen).
    pub heard: O,
    /// Cancelled once the first heartbeat is written (the others count this host as alive
    /// from then on: its share rounds may start).
    pub written: CancellationToken,
    /// Awaited (up to the shutdown's own bounds) before the row is removed: this host's
    /// fleet shares are given back first, so nobody takes them while its messages run.
    pub shares_released: CancellationToken,
}

/// Writes `me`'s heartbeat every `fleet.heartbeat_interval` (as the settings say now) with
/// the summary the hooks give, hands them the fleet's orders and the registry's rows each
/// time, until `stop`; then removes its row.
pub(crate) async fn run_heartbeat<S, C, O>(
    transport: Arc<dyn Transport>,
    mut me: Heartbeat,
    hooks: HeartbeatHooks<S, C, O>,
    health: Arc<HeartbeatHealth>,
    stop: CancellationToken,
) where
    S: Fn() -> String + Send + 'static,
    C: Fn() -> FleetConfig + Send + 'static,
    O: Fn(Option<(Vec<FleetOrder>, Vec<BeatRow>)>) + Send + 'static,
{
    let Some(registry) = transport.instance_registry() else {
        return;
    };
    let mut created = false;
    let mut beats = 0u32;
    loop {
        let config = (hooks.settings)();
        me.summary = (hooks.summary)();
        let outcome = async {
            if !created {
                registry.create_registry().await?;
                created = true;
            }
            let rows = registry.heartbeat(&me).await?;
            hooks.written.cancel();
            let orders = FleetOrder::parse_all(&BeatRow::orders(&rows));
            (hooks.heard)(Some((orders, rows)));
            if beats.is_multiple_of(FORGET_EVERY) {
                registry.forget(config.forget_after).await?;
            }
            Ok(())
        }
        .await;
        if outcome.is_err() {
            (hooks.heard)(None);
        }
        health.record(outcome);
        beats = beats.wrapping_add(1);
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(config.heartbeat_interval) => {}
        }
    }
    hooks.shares_released.cancelled().await;
    match tokio::time::timeout(LEAVE_TIMEOUT, registry.leave(me.process_id)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "could not remove this host's registry row"),
        Err(_) => tracing::debug!("removing this host's registry row took too long"),
    }
}

/// Every instance on the database, as `/fleet` shows it.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct FleetView {
    /// This process's id.
    pub this_process: Uuid,
    /// Seconds without a heartbeat after which an instance shows as gone.
    pub gone_after_seconds: f64,
    /// Why this host's own heartbeat is failing, if it is.
    pub heartbeat_error: Option<String>,
    /// The fleet-wide overrides in force (as this host's last heartbeat read them).
    pub orders: Vec<FleetOrder>,
    /// Every registered instance, most recently seen first.
    pub instances: Vec<FleetMember>,
}

/// One instance in the view.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct FleetMember {
    /// The process id.
    pub process_id: Uuid,
    /// `[host] name`.
    pub host_name: String,
    /// The instance id.
    pub instance_id: String,
    /// The version it runs.
    pub version: String,
    /// Its admin endpoint, when it has one.
    pub admin_address: Option<String>,
    /// Its throttling summary at its last heartbeat (as it wrote it).
    pub summary: serde_json::Value,
    /// Seconds since it started.
    pub up_seconds: f64,
    /// Seconds since its last heartbeat.
    pub seen_seconds_ago: f64,
    /// Not seen for longer than `fleet.gone_after`.
    pub gone: bool,
    /// This process.
    pub this: bool,
}

impl FleetView {
    /// The view of `records` from `this_process`.
    pub fn of(
        records: Vec<InstanceRecord>,
        this_process: Uuid,
        config: &FleetConfig,
        heartbeat_error: Option<String>,
        orders: Vec<FleetOrder>,
    ) -> Self {
        let gone_after = config.gone_after.as_secs_f64();
        let instances = records
            .into_iter()
            .map(|r| {
                let beat = r.heartbeat;
                FleetMember {
                    this: beat.process_id == this_process,
                    process_id: beat.process_id,
                    host_name: beat.host_name,
                    instance_id: beat.instance_id,
                    version: beat.version,
                    admin_address: beat.admin_address.filter(|a| is_admin_address(a)),
                    summary: serde_json::from_str(&beat.summary)
                        .unwrap_or(serde_json::Value::String(beat.summary)),
                    up_seconds: r.up_seconds,
                    seen_seconds_ago: r.seen_seconds_ago,
                    gone: r.seen_seconds_ago > gone_after,
                }
            })
            .collect();
        FleetView {
            this_process,
            gone_after_seconds: gone_after,
            heartbeat_error,
            orders,
            instances,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only an address a host writes is shown: a link to another site, or text that is no
    /// address, is dropped from the view.
    #[test]
    fn a_registry_rows_admin_address_is_shown_only_when_it_is_one() {
        for ok in [
            "http://10.0.0.9:9464",
            "127.0.0.1:9464",
            "http://[::1]:9464",
        ] {
            assert!(is_admin_address(ok), "{ok}");
        }
        for bad in [
            "127.0.0.1:9464@evil.example",
            "http://evil.example:9464",
            "javascript:alert(1)",
            "",
        ] {
            assert!(!is_admin_address(bad), "{bad}");
        }
    }

    /// A sealed order verifies with its token only, survives the registry's text, and fails
    /// once any field is changed.
    #[test]
    fn an_order_is_sealed_with_the_token_and_nothing_else() {
        let order = FleetOrder::sealed(Direction::Delivery, OverrideMode::Throttle, "a", "t0ken");
        assert!(order.is_sealed_with("t0ken"));
        assert!(!order.is_sealed_with("other"));
        assert!(!order.is_sealed_with(""));
        let read = FleetOrder::parse_all(&[order.as_heartbeat("sales").summary]);
        assert!(read[0].is_sealed_with("t0ken"), "through the registry row");
        let forged = FleetOrder {
            mode: OverrideMode::Never,
            ..order.clone()
        };
        assert!(!forged.is_sealed_with("t0ken"));
        let unsealed = FleetOrder {
            seal: String::new(),
            ..order
        };
        assert!(!unsealed.is_sealed_with("t0ken"));
    }

    fn record(id: Uuid, seen: f64) -> InstanceRecord {
        InstanceRecord {
            heartbeat: Heartbeat {
                process_id: id,
                host_name: "sales".into(),
                instance_id: "node-1".into(),
                version: "0.1.0".into(),
                admin_address: None,
                summary: r#"{"delivery":{"state":4}}"#.into(),
            },
            up_seconds: 60.0,
            seen_seconds_ago: seen,
        }
    }

    /// An instance past `gone_after` is gone, this process is marked, and the summary is
    /// JSON again (or its text, when it is not JSON).
    #[test]
    fn the_view_marks_gone_instances_and_this_one() {
        let (me, other) = (Uuid::new_v4(), Uuid::new_v4());
        let mut odd = record(other, 3.0);
        odd.heartbeat.summary = "not json".into();
        let view = FleetView::of(
            vec![record(me, 1.0), odd, record(Uuid::new_v4(), 25.0)],
            me,
            &FleetConfig::default(),
            None,
            Vec::new(),
        );
        let flags: Vec<(bool, bool)> = view.instances.iter().map(|m| (m.this, m.gone)).collect();
        assert_eq!(flags, [(true, false), (false, false), (false, true)]);
        assert_eq!(view.instances[0].summary["delivery"]["state"], 4);
        assert_eq!(view.instances[1].summary, "not json");
        assert_eq!(view.gone_after_seconds, 20.0);
    }
}
