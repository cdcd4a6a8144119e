//! The `[host]`, `[admin]`, `[fleet]` and `[failed_messages]` sections.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::units;
use super::{ByteSize, Secret};

/// `[host]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// Logical name of the host (the NServiceBus endpoint name written into failure headers).
    pub name: String,
    /// This instance's id: names the instance queues (`<queue>.<instance_id>`). Empty = the
    /// machine's host name.
    pub instance_id: String,
    /// Address of the admin HTTP endpoint (/metrics, /status, ingest). `"off"` disables it.
    pub admin_address: String,
    /// How long in-flight messages may run after a shutdown signal before they are rolled back.
    #[serde(with = "units::duration")]
    pub shutdown_timeout: Duration,
    /// Create missing queue tables (input, instance and error queues) at start-up.
    pub create_queues: bool,
    /// Async worker threads of `throttlehost run`; 0 = one per CPU. Fewer cost less CPU per
    /// message when the host shares its cores with the database. Needs a restart.
    pub worker_threads: u32,
    /// `run` keeps trying (every second, answering on the admin address meanwhile) when the
    /// database cannot be reached at start, instead of exiting; false = exit with an error at
    /// once. A refused login is not waited for.
    pub wait_for_database: bool,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            name: "throttlehost".into(),
            instance_id: String::new(),
            admin_address: "127.0.0.1:9464".into(),
            shutdown_timeout: Duration::from_secs(30),
            create_queues: true,
            worker_threads: 0,
            wait_for_database: true,
        }
    }
}

impl HostConfig {
    /// The instance id, falling back to the machine's host name.
    pub fn effective_instance_id(&self) -> String {
        if !self.instance_id.trim().is_empty() {
            return self.instance_id.trim().to_string();
        }
        sysinfo::System::host_name()
            .ok()
            .filter(|h| !h.is_empty())
            .map(|h| {
                h.chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '-' {
                            c
                        } else {
                            '-'
                        }
                    })
                    .collect()
            })
            .unwrap_or_else(|| "local".into())
    }
}

/// `[admin]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token required by mutating endpoints (ingest, override). Empty = no auth.
    pub token: Secret,
    /// Largest message body accepted by `POST /queues/{name}/messages`.
    pub max_body_size: ByteSize,
    /// Ingest answers 503 with Retry-After while the publishing delay exceeds this.
    #[serde(with = "units::duration")]
    pub ingest_reject_after: Duration,
    /// Host names the endpoint answers to besides IP addresses, `localhost` and this
    /// machine's name (a request naming another is refused: DNS rebinding); `"*"` = any.
    pub allowed_hosts: Vec<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            token: Secret::default(),
            max_body_size: ByteSize(4 << 20),
            ingest_reject_after: Duration::from_secs(5),
            allowed_hosts: Vec::new(),
        }
    }
}

/// `[fleet]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Write this host into the instance registry and read the others from it.
    pub enabled: bool,
    /// How often this host writes its heartbeat (one statement each).
    #[serde(with = "units::duration")]
    pub heartbeat_interval: Duration,
    /// An instance not seen for this long is shown as gone.
    #[serde(with = "units::duration")]
    pub gone_after: Duration,
    /// The row of an instance not seen for this long is deleted (by any instance).
    #[serde(with = "units::duration")]
    pub forget_after: Duration,
    /// How often this host takes its share of each fleet-wide limit (`fleet_max`) again:
    /// a few statements per fleet-limited queue each time (sooner while shares move).
    #[serde(with = "units::duration")]
    pub share_interval: Duration,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            enabled: true,
            heartbeat_interval: Duration::from_secs(5),
            gone_after: Duration::from_secs(20),
            forget_after: Duration::from_secs(3600),
            share_interval: Duration::from_secs(1),
        }
    }
}

/// `[failed_messages]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailedMessagesConfig {
    /// How often the host counts the failed messages in its error queues, by the queue they
    /// failed in and by group, for the `failed_messages` gauges. Each count reads every
    /// row's headers once (about 0.7 s per 100 000 rows on PostgreSQL); zero = never.
    #[serde(with = "units::duration")]
    pub count_interval: Duration,
}

impl Default for FailedMessagesConfig {
    fn default() -> Self {
        FailedMessagesConfig {
            count_interval: Duration::from_secs(60),
        }
    }
}
