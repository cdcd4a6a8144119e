//! Reloading: a new configuration applied to a running host, and what it could not apply said.

use std::path::Path;
use std::sync::Arc;

use crate::config::{Config, HandlerConfig, QueueConfig, TransactionMode};
use crate::receive::QueueSettings;

use super::HostInner;

impl HostInner {
    /// Applies a new configuration without restarting: throttling settings, queue
    /// concurrency, retries, peek intervals and simulate knobs. Returns the changes that need a
    /// restart (they are left as they are).
    pub(crate) fn apply_config(&self, new: Config) -> Vec<String> {
        let old = self.config.load_full();
        let mut needs_restart = restart_needed(&old, &new);
        let mode = new.transport.transaction_mode;
        for qc in &new.queues {
            let Some(before) = old.queues.iter().find(|q| q.name == qc.name) else {
                continue;
            };
            if !self.reconfigure_queue(qc, mode) && qc.handler != before.handler {
                needs_restart.push(format!("queue `{}` handler", qc.name));
            }
        }
        self.control.reconfigure(new.throttling.clone());
        self.overrides.reloaded();
        self.config.store(Arc::new(new));
        needs_restart.sort();
        needs_restart.dedup();
        needs_restart
    }

    /// Applies `qc`'s settings to its queue and its instance queue, and a simulate handler's
    /// new knobs to it. False when its handler is not a simulate handler whose knobs could
    /// take the change.
    fn reconfigure_queue(&self, qc: &QueueConfig, mode: TransactionMode) -> bool {
        let instance_queue = format!("{}.{}", qc.name, self.instance);
        let mut knobs_applied = true;
        for q in self.queues.iter() {
            let settings = if q.name().as_str() == qc.name {
                QueueSettings::from_config(qc, qc.concurrency.max, mode)
            } else if qc.instance_queue.enabled && q.name().as_str() == instance_queue {
                QueueSettings::from_config(qc, qc.instance_queue.max_concurrency, mode).local_only()
            } else {
                continue;
            };
            q.reconfigure(settings);
            let sim = self.simulated.iter().find(|(name, _)| name == q.name());
            match (&qc.handler, sim.map(|(_, sim)| sim)) {
                (Some(HandlerConfig::Simulate(knobs)), Some(sim)) => sim.set_knobs(knobs.clone()),
                _ => knobs_applied = false,
            }
        }
        knobs_applied
    }

    /// Re-reads the configuration file; an invalid file keeps the running settings.
    pub(crate) fn reload(&self) -> Result<Vec<String>, String> {
        let Some(path) = &self.config_path else {
            return Err("the host was not started from a configuration file".into());
        };
        self.reload_from(path)
    }

    /// Reads `path` and applies it (see [`HostInner::apply_config`]).
    pub(crate) fn reload_from(&self, path: &Path) -> Result<Vec<String>, String> {
        match crate::config::load_file(path) {
            Ok(config) => {
                let restart = self.apply_config(config);
                self.metrics.config_reload(true);
                if restart.is_empty() {
                    tracing::info!(path = %path.display(), "configuration reloaded");
                } else {
                    tracing::warn!(path = %path.display(), needs_restart = ?restart,
                        "configuration reloaded; some changes take effect only after a restart");
                }
                Ok(restart)
            }
            Err(e) => {
                self.metrics.config_reload(false);
                tracing::error!(path = %path.display(), error = %e, "configuration reload failed; the running settings stay");
                Err(e.to_string())
            }
        }
    }
}

/// What a reload cannot change while the host runs, named for the operator.
fn restart_needed(old: &Config, new: &Config) -> Vec<String> {
    let mut needs_restart = Vec::new();
    if old.transport != new.transport {
        needs_restart.push("[transport]".to_string());
    }
    if old.host != new.host {
        needs_restart.push("[host]".to_string());
    }
    if old.fleet.enabled != new.fleet.enabled {
        needs_restart.push("fleet.enabled".to_string());
    }
    let old_names: Vec<&str> = old.queues.iter().map(|q| q.name.as_str()).collect();
    let new_names: Vec<&str> = new.queues.iter().map(|q| q.name.as_str()).collect();
    if old_names != new_names {
        needs_restart.push("the list of queues".to_string());
    }
    for qc in &new.queues {
        let Some(before) = old.queues.iter().find(|q| q.name == qc.name) else {
            continue;
        };
        if before.concurrency.model != qc.concurrency.model
            || before.error_queue != qc.error_queue
            || before.instance_queue.enabled != qc.instance_queue.enabled
        {
            needs_restart.push(format!(
                "queue `{}` model, error queue or instance queue",
                qc.name
            ));
        }
        if before.metrics != qc.metrics {
            needs_restart.push(format!("queue `{}` metrics", qc.name));
        }
    }
    needs_restart
}
