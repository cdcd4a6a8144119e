//! Checks that need more than one field or a range: everything serde's types cannot say.
//! Each problem is returned as (key path, message) so the loader can point at the line.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use super::{
    Config, FailedKey, HandlerConfig, QueueConfig, ThrottlingConfig, TransactionMode, TransportKind,
};
use crate::names::{
    QueueName, validate_delayed_table_suffix, validate_postgres_table_name, validate_queue_name,
    validate_schema_name,
};

/// The most async worker threads a host may ask for; each costs a stack and a run queue.
pub const MAX_WORKER_THREADS: u32 = 1024;
/// The longest command timeout: PostgreSQL's `statement_timeout` is an int of milliseconds.
const MAX_COMMAND_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);
/// The example configuration's placeholder token, refused so it never guards a real host.
const PLACEHOLDER_TOKEN: &str = "change-me";
/// A token an earlier example configuration shipped: published, so refused like the
/// placeholder.
const PUBLISHED_TOKENS: [&str; 1] = ["8d1f0c2b7e5a4f3c9b6d2e1a0f7c5b3e"];

type Problems = Vec<(String, String)>;

/// Returns every problem found; empty means the configuration can be used.
pub fn validate(config: &Config) -> Problems {
    let mut problems = Problems::new();
    let mut add = |key: String, message: String| problems.push((key, message));
    let instance = config.host.effective_instance_id();
    validate_host(config, &instance, &mut add);
    validate_transport(config, &instance, &mut add);
    let mut names = HashSet::new();
    for (i, q) in config.queues.iter().enumerate() {
        validate_queue(i, q, &instance, &mut names, &mut add);
        validate_ordering(i, config, &mut add);
        validate_recoverability(i, config, &mut add);
        if q.concurrency.fleet_max.is_some() && !config.fleet.enabled {
            add(
                format!("queues[{i}].concurrency.fleet_max"),
                "needs fleet.enabled = true: the instances share the limit through the instance registry".into(),
            );
        }
        if q.concurrency.receive_batch > 1
            && config.transport.transaction_mode == TransactionMode::None
        {
            add(
                format!("queues[{i}].concurrency.receive_batch"),
                "must be 1 with transport.transaction_mode = \"none\": that mode deletes each message before its handler runs, so a batch would delete all of it before the first handler ran".into(),
            );
        }
    }
    validate_throttling(&config.throttling, &mut add);
    validate_fleet(&config.fleet, &mut add);
    let count = config.failed_messages.count_interval;
    if !count.is_zero() && count < Duration::from_secs(1) {
        add(
            "failed_messages.count_interval".into(),
            format!(
                "{count:?} is too short: at least 1s, or 0s for never (each count reads every failed message's headers)"
            ),
        );
    }
    problems
}

/// `[fleet]`: a heartbeat that comes, and an instance called gone only after it missed some.
fn validate_fleet(f: &super::FleetConfig, add: &mut impl FnMut(String, String)) {
    if f.heartbeat_interval < Duration::from_millis(100) {
        add(
            "fleet.heartbeat_interval".into(),
            format!(
                "{:?} is too short: at least 100ms (each heartbeat is a statement)",
                f.heartbeat_interval
            ),
        );
    }
    if f.gone_after < f.heartbeat_interval * 2 {
        add(
            "fleet.gone_after".into(),
            format!(
                "{:?} must be at least twice fleet.heartbeat_interval ({:?}): a host that missed one heartbeat is not gone",
                f.gone_after, f.heartbeat_interval
            ),
        );
    }
    if f.share_interval < Duration::from_millis(50) || f.share_interval > f.heartbeat_interval {
        add(
            "fleet.share_interval".into(),
            format!(
                "{:?} must be between 50ms and fleet.heartbeat_interval ({:?}): an idle instance gives its share back within one heartbeat",
                f.share_interval, f.heartbeat_interval
            ),
        );
    }
    if f.forget_after < f.gone_after {
        add(
            "fleet.forget_after".into(),
            format!(
                "{:?} must be at least fleet.gone_after ({:?}): a row is shown as gone before it is forgotten",
                f.forget_after, f.gone_after
            ),
        );
    }
}

/// `[queues.recoverability]`, `[queues.outage]`, `[queues.latency_limit]`: retries that can be
/// taken, pauses and limits that make sense.
fn validate_recoverability(i: usize, config: &Config, add: &mut impl FnMut(String, String)) {
    let q = &config.queues[i];
    let key = |field: &str| format!("queues[{i}].{field}");
    if let Some(n) = q.recoverability.delayed_retries.filter(|n| *n > 0) {
        let refusal = if config.transport.transaction_mode == TransactionMode::None {
            Some(
                "transport.transaction_mode = \"none\" deletes each message before its handler runs, so there is nothing left to retry",
            )
        } else if q.ordering.is_ordered() {
            Some(
                "an ordered queue keeps a failed message in its place (immediate retries, then ordering.failed_key); one taken out to wait would let the later messages of its key pass it",
            )
        } else if !q.delayed_delivery.enabled {
            Some(
                "delayed retries wait in the queue's delayed table, and delayed_delivery.enabled = false",
            )
        } else {
            None
        };
        if let Some(why) = refusal {
            add(
                key("recoverability.delayed_retries"),
                format!(
                    "{n} delayed retries cannot be taken here: {why}; set it to 0 or leave it out"
                ),
            );
        }
    }
    let increment = q.recoverability.delayed_retry_increment;
    if increment.is_zero() || increment > crate::message::MAX_DELIVERY_DELAY / 100 {
        add(
            key("recoverability.delayed_retry_increment"),
            format!(
                "{} is not between 1 ms and 6 months",
                humantime::format_duration(increment)
            ),
        );
    }
    if q.delayed_delivery.enabled && !(1..=10_000).contains(&q.delayed_delivery.batch_size) {
        add(
            key("delayed_delivery.batch_size"),
            format!(
                "{} is not between 1 and 10000",
                q.delayed_delivery.batch_size
            ),
        );
    }
    if q.outage.pause.is_zero() || q.outage.pause > q.outage.max_pause {
        add(
            key("outage.pause"),
            format!(
                "{} must be above 0 and at most outage.max_pause ({})",
                humantime::format_duration(q.outage.pause),
                humantime::format_duration(q.outage.max_pause)
            ),
        );
    }
    let l = &q.latency_limit;
    if l.enabled {
        if l.min == 0 || l.min > q.concurrency.max {
            add(
                key("latency_limit.min"),
                format!(
                    "{} is not between 1 and concurrency.max ({})",
                    l.min, q.concurrency.max
                ),
            );
        }
        if !(l.decrease_ratio > 0.0 && l.decrease_ratio < 1.0) {
            add(
                key("latency_limit.decrease_ratio"),
                format!("{} is not between 0 and 1 (exclusive)", l.decrease_ratio),
            );
        }
        if !(l.tolerance.is_finite() && l.tolerance > 0.0 && l.tolerance <= 10.0) {
            add(
                key("latency_limit.tolerance"),
                format!("{} is not between 0 (exclusive) and 10", l.tolerance),
            );
        }
    }
}

/// `[queues.ordering]`: a usable key header and lookahead, and a receive that can keep order.
fn validate_ordering(i: usize, config: &Config, add: &mut impl FnMut(String, String)) {
    let q = &config.queues[i];
    let key = |field: &str| format!("queues[{i}].ordering.{field}");
    if q.ordering.failed_key == FailedKey::Hold && q.ordering.key_header().is_none() {
        add(
            key("failed_key"),
            "\"hold\" holds a key: it needs key_header (the header whose value is the key)".into(),
        );
    }
    if !q.ordering.is_ordered() {
        return;
    }
    let what = if q.ordering.key_header().is_some() {
        "key_header"
    } else {
        "stages"
    };
    let header = q.ordering.key_header().unwrap_or_default();
    if header.len() > 200
        || header
            .chars()
            .any(|c| c.is_control() || c == '"' || c == '\\')
    {
        add(
            key("key_header"),
            format!(
                "`{header}` must be at most 200 characters without quotes, backslashes or control characters"
            ),
        );
    }
    if !(1..=10_000).contains(&q.ordering.lookahead) {
        add(
            key("lookahead"),
            format!("{} is not between 1 and 10000", q.ordering.lookahead),
        );
    }
    if config.transport.transaction_mode == TransactionMode::None {
        add(
            key(what),
            "needs transport.transaction_mode receive_only or sends_atomic_with_receive: mode \"none\" deletes a message before its handler runs, so a message that must wait for it could start while it still runs".into(),
        );
    }
    if q.concurrency.receive_batch > 1 {
        add(
            key(what),
            format!(
                "cannot be combined with concurrency.receive_batch = {}: a batch takes the oldest rows whatever their keys and stages, so messages that must wait for each other could run side by side",
                q.concurrency.receive_batch
            ),
        );
    }
}

/// `[host]` and `[admin]`.
fn validate_host(config: &Config, instance: &str, add: &mut impl FnMut(String, String)) {
    if config.host.name.trim().is_empty() {
        add("host.name".into(), "must not be empty".into());
    }
    for (i, name) in config.admin.allowed_hosts.iter().enumerate() {
        let is_name = name == "*"
            || (!name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'));
        if !is_name {
            add(
                format!("admin.allowed_hosts[{i}]"),
                format!(
                    "`{}` is not a host name (letters, digits, '-' and '.', without a port), or \"*\" for any",
                    name.escape_debug()
                ),
            );
        }
    }
    if let Err(e) = validate_queue_name(instance) {
        add("host.instance_id".into(), e);
    }
    if config.host.worker_threads > MAX_WORKER_THREADS {
        add(
            "host.worker_threads".into(),
            format!(
                "{} is more than {MAX_WORKER_THREADS} threads (0 = one per CPU)",
                config.host.worker_threads
            ),
        );
    }
    let admin = config.host.admin_address.trim();
    if !admin.eq_ignore_ascii_case("off") {
        match admin.parse::<SocketAddr>() {
            Err(_) => add(
                "host.admin_address".into(),
                format!("`{admin}` is not an address like \"127.0.0.1:9464\" (or \"off\")"),
            ),
            Ok(address) => {
                let token = config.admin.token.expose();
                if token == PLACEHOLDER_TOKEN || PUBLISHED_TOKENS.contains(&token) {
                    add(
                        "admin.token".into(),
                        "is a token published in an example; set a secret of your own (e.g. `openssl rand -hex 32`)"
                            .into(),
                    );
                } else if token.is_empty() && !address.ip().is_loopback() {
                    add(
                        "admin.token".into(),
                        format!(
                            "must be set when host.admin_address ({admin}) is not a loopback address: without it anyone who reaches the port can send messages and override throttling"
                        ),
                    );
                }
            }
        }
    }
}

/// `[transport]`, with what the queues ask of it.
fn validate_transport(config: &Config, instance: &str, add: &mut impl FnMut(String, String)) {
    let t = &config.transport;
    if t.kind != TransportKind::Memory && t.connection_string.is_empty() {
        add(
            "transport.connection_string".into(),
            format!("required for kind = \"{}\"", kind_name(t.kind)),
        );
    }
    if !t.schema.is_empty()
        && let Err(e) = validate_schema_name(&t.schema)
    {
        add("transport.schema".into(), e);
    }
    if t.pool_size == 0 {
        add("transport.pool_size".into(), "must be at least 1".into());
    }
    if let Err(e) = validate_delayed_table_suffix(&t.delayed_table_suffix) {
        add("transport.delayed_table_suffix".into(), e);
    }
    if let Err(e) = validate_queue_name(&t.subscription_table) {
        add("transport.subscription_table".into(), e);
    }
    if !t.subscription_schema.is_empty()
        && let Err(e) = validate_schema_name(&t.subscription_schema)
    {
        add("transport.subscription_schema".into(), e);
    }
    let forwards = config
        .queues
        .iter()
        .any(|q| matches!(q.handler, Some(HandlerConfig::Forward(_))));
    if t.kind != TransportKind::Memory
        && t.pool_size < 2
        && forwards
        && t.transaction_mode != super::TransactionMode::SendsAtomicWithReceive
    {
        add(
            "transport.pool_size".into(),
            format!(
                "{} cannot make progress: a forward handler sends on a second connection while its receive holds the first; raise it to at least 2 (or use transaction_mode = \"sends_atomic_with_receive\")",
                t.pool_size
            ),
        );
    }
    if t.connect_timeout.is_zero() {
        add("transport.connect_timeout".into(), "must be above 0".into());
    }
    if t.kind != TransportKind::Memory && !t.simulated_latency.is_zero() {
        add(
            "transport.simulated_latency".into(),
            "only the memory transport simulates latency; remove it or set kind = \"memory\""
                .into(),
        );
    }
    if t.kind != TransportKind::Postgres && !t.notify_on_insert {
        add(
            "transport.notify_on_insert".into(),
            "only the PostgreSQL transport notifies on insert; remove it or set kind = \"postgres\""
                .into(),
        );
    }
    if t.command_timeout.is_zero() {
        add("transport.command_timeout".into(), "must be above 0".into());
    }
    if t.command_timeout > MAX_COMMAND_TIMEOUT {
        add(
            "transport.command_timeout".into(),
            format!(
                "{} is longer than {} (PostgreSQL's statement_timeout limit)",
                humantime::format_duration(t.command_timeout),
                humantime::format_duration(MAX_COMMAND_TIMEOUT)
            ),
        );
    }
    if t.kind == TransportKind::Postgres {
        let mut seen = HashSet::new();
        for (i, q) in config.queues.iter().enumerate() {
            for (field, name) in q.tables(instance) {
                // A name that is no queue name is reported where it is checked.
                let Ok(queue) = QueueName::new(&name) else {
                    continue;
                };
                if queue.parts().catalog.is_some() {
                    add(
                        format!("queues[{i}].{field}"),
                        format!(
                            "`{name}` names a catalog: a PostgreSQL address is \"schema\".\"table\""
                        ),
                    );
                }
                if let Err(e) = validate_postgres_table_name(queue.table())
                    && seen.insert(name)
                {
                    add(format!("queues[{i}].{field}"), e);
                }
            }
        }
    }
}

fn kind_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Sqlserver => "sqlserver",
        TransportKind::Postgres => "postgres",
        TransportKind::Memory => "memory",
    }
}

fn validate_queue(
    i: usize,
    q: &QueueConfig,
    instance: &str,
    names: &mut HashSet<String>,
    add: &mut impl FnMut(String, String),
) {
    let key = |field: &str| format!("queues[{i}].{field}");
    match validate_queue_name(&q.name) {
        Err(e) => add(key("name"), e),
        Ok(()) => {
            if !names.insert(q.name.clone()) {
                add(key("name"), format!("queue `{}` is listed twice", q.name));
            }
            if q.instance_queue.enabled {
                let instance_queue = q.instance_queue_name(instance);
                if let Err(e) = validate_queue_name(&instance_queue) {
                    add(key("instance_queue.enabled"), e);
                } else if !names.insert(instance_queue.clone()) {
                    add(
                        key("instance_queue.enabled"),
                        format!("instance queue `{instance_queue}` is also listed as a queue"),
                    );
                }
            }
        }
    }
    // The error queue and forward targets may be addresses of another schema or catalog.
    if let Err(e) = QueueName::new(&q.error_queue) {
        add(key("error_queue"), e.to_string());
    } else if q.error_queue == q.name {
        add(
            key("error_queue"),
            "must differ from the queue itself, or failed messages would loop".into(),
        );
    }
    for (t, topic) in q.subscribe.iter().enumerate() {
        if let Err(e) = crate::names::validate_topic(topic) {
            add(key(&format!("subscribe[{t}]")), e);
        }
    }
    if q.handler_timeout == Some(Duration::ZERO) {
        add(
            key("handler_timeout"),
            "must be above 0 (or \"off\")".into(),
        );
    }
    let c = &q.concurrency;
    if c.max == 0 {
        add(key("concurrency.max"), "must be at least 1".into());
    }
    if c.max > 10_000 {
        add(
            key("concurrency.max"),
            format!("{} is more than 10000 messages in flight per queue", c.max),
        );
    }
    if let Some(fleet_max) = c.fleet_max.filter(|n| !(1..=100_000).contains(n)) {
        add(
            key("concurrency.fleet_max"),
            format!("{fleet_max} is not between 1 and 100000"),
        );
    }
    if !(1..=1000).contains(&c.receive_batch) {
        add(
            key("concurrency.receive_batch"),
            format!("{} is not between 1 and 1000", c.receive_batch),
        );
    }
    if c.peek_interval < Duration::from_millis(100) {
        add(
            key("concurrency.peek_interval"),
            format!(
                "{} is below the minimum of 100ms",
                humantime::format_duration(c.peek_interval)
            ),
        );
    }
    if q.instance_queue.max_concurrency == 0 {
        add(
            key("instance_queue.max_concurrency"),
            "must be at least 1".into(),
        );
    }
    validate_handler(q, &key, add);
}

/// A queue's `[queues.handler]`.
fn validate_handler(
    q: &QueueConfig,
    key: &impl Fn(&str) -> String,
    add: &mut impl FnMut(String, String),
) {
    match &q.handler {
        Some(HandlerConfig::Simulate(s)) => {
            if !(0.0..=1.0).contains(&s.failure_rate) {
                add(
                    key("handler.failure_rate"),
                    format!("{} is not between 0.0 and 1.0", s.failure_rate),
                );
            }
        }
        Some(HandlerConfig::Forward(f)) => {
            if let Err(e) = QueueName::new(&f.to) {
                add(key("handler.to"), e.to_string());
            } else if f.to == q.name {
                add(
                    key("handler.to"),
                    "forwarding a queue to itself would loop forever".into(),
                );
            }
        }
        Some(HandlerConfig::Command(c)) => {
            if c.program.trim().is_empty() {
                add(key("handler.program"), "must not be empty".into());
            }
        }
        Some(HandlerConfig::Http(h)) => {
            if !h.url.starts_with("http://") {
                add(
                    key("handler.url"),
                    format!("`{}` must start with http://", h.url),
                );
            }
        }
        Some(HandlerConfig::Publish(p)) => {
            if let Err(e) = crate::names::event_type_entries(&p.types) {
                add(key("handler.types"), e);
            }
        }
        Some(HandlerConfig::Noop) | None => {}
    }
}

fn validate_throttling(t: &ThrottlingConfig, add: &mut impl FnMut(String, String)) {
    let key = |field: &str| format!("throttling.{field}");
    if t.sample_interval < Duration::from_millis(10) {
        add(key("sample_interval"), "must be at least 10ms".into());
    }
    if t.min_dwell > std::time::Duration::from_secs(10) {
        add(
            key("min_dwell"),
            format!(
                "{} is longer than 10s: a direction must be back at state 0 within 10 s of its cause ending",
                humantime::format_duration(t.min_dwell)
            ),
        );
    }
    if !(t.resume_ratio > 0.0 && t.resume_ratio <= 1.0) {
        add(
            key("resume_ratio"),
            format!("{} is not in (0, 1]", t.resume_ratio),
        );
    }
    if t.initial_delay.is_zero() {
        add(key("initial_delay"), "must be above 0".into());
    }
    if t.database_size_refresh < Duration::from_millis(100) {
        add(
            key("database_size_refresh"),
            "must be at least 100ms".into(),
        );
    }
    if !(t.concurrency_decrease_ratio > 0.0 && t.concurrency_decrease_ratio < 1.0) {
        add(
            key("concurrency_decrease_ratio"),
            format!("{} is not in (0, 1)", t.concurrency_decrease_ratio),
        );
    }
    if t.concurrency_increase_step == 0 {
        add(
            key("concurrency_increase_step"),
            "must be at least 1".into(),
        );
    }
    let s = &t.severity;
    for (name, value) in [
        ("process_memory", s.process_memory),
        ("system_memory", s.system_memory),
        ("in_process", s.in_process),
        ("threads", s.threads),
        ("database_size", s.database_size),
        ("database_sessions", s.database_sessions),
    ] {
        if !(1..=1000).contains(&value) {
            add(
                key(&format!("severity.{name}")),
                format!("{value} is not between 1 and 1000"),
            );
        }
    }
    for (dir, d) in [("delivery", &t.delivery), ("publishing", &t.publishing)] {
        let key = |field: &str| format!("throttling.{dir}.{field}");
        if d.overdrive_percent == 0 {
            add(key("overdrive_percent"), "must be at least 1".into());
        }
        if d.sampling_window < t.sample_interval {
            add(
                key("sampling_window"),
                "must be at least one sample_interval long".into(),
            );
        }
        if d.min_samples == 0 {
            add(key("min_samples"), "must be at least 1".into());
        }
        if d.max_delay < t.initial_delay {
            add(
                key("max_delay"),
                "must be at least throttling.initial_delay".into(),
            );
        }
        if !(1..=1000).contains(&d.override_severity) {
            add(
                key("override_severity"),
                format!("{} is not between 1 and 1000", d.override_severity),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_str;

    fn problems(text: &str) -> Vec<String> {
        match parse_str(text, "t") {
            Ok(_) => vec![],
            Err(e) => e.problems().iter().map(|p| p.to_string()).collect(),
        }
    }

    #[test]
    fn every_problem_is_reported_with_its_line() {
        let p = problems("[throttling]\nresume_ratio = 1.5\n[throttling.severity]\nthreads = 0\n");
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].starts_with("2: `throttling.resume_ratio`"), "{p:?}");
        assert!(
            p[1].starts_with("4: `throttling.severity.threads`"),
            "{p:?}"
        );
    }

    #[test]
    fn error_queues_and_forward_targets_may_be_addresses_input_queues_may_not() {
        let queue = |name: &str, error: &str| {
            format!(
                "[transport]\nkind = \"postgres\"\nconnection_string = \"host=db\"\n[[queues]]\nname = '{name}'\nerror_queue = '{error}'\n"
            )
        };
        assert!(problems(&queue("Sales", "\"audit\".\"error\"")).is_empty());
        let p = problems(&queue("Sales@[dbo]", "error"));
        assert!(p.iter().any(|p| p.contains("queues[0].name")), "{p:?}");
        let p = problems(&queue("Sales", "error@[dbo]@[Shop]"));
        assert!(
            p.iter()
                .any(|p| p.contains("queues[0].error_queue") && p.contains("catalog")),
            "PostgreSQL has no catalog: {p:?}"
        );
        let p = problems(&queue("Sales", "error@[bad schema]"));
        assert!(p.iter().any(|p| p.contains("error_queue")), "{p:?}");
        let sqlserver = "[transport]\nkind = \"sqlserver\"\nconnection_string = \"Server=db\"\n[[queues]]\nname = 'Sales'\nerror_queue = 'error@[dbo]@[Shop]'\n[queues.handler]\nkind = 'forward'\nto = 'Billing@[billing]'\n";
        assert!(problems(sqlserver).is_empty(), "{:?}", problems(sqlserver));
    }

    #[test]
    fn notify_on_insert_is_turned_off_on_postgres_only() {
        let off = "notify_on_insert = false\n";
        let postgres = "kind = \"postgres\"\nconnection_string = \"host=db\"\n";
        let p = problems(&format!("[transport]\n{postgres}{off}"));
        assert!(p.is_empty(), "{p:?}");
        let p = problems(&format!("[transport]\nkind = \"memory\"\n{off}"));
        assert!(
            p.iter()
                .any(|m| m.contains("transport.notify_on_insert") && m.contains("PostgreSQL")),
            "{p:?}"
        );
    }

    #[test]
    fn a_fleet_max_needs_the_registry_and_a_share_interval_within_a_heartbeat() {
        let queue = "[[queues]]\nname = \"q\"\n[queues.concurrency]\n";
        assert!(problems(&format!("{queue}fleet_max = 12\n")).is_empty());
        let p = problems(&format!("{queue}fleet_max = 0\n"));
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].concurrency.fleet_max")
                    && m.contains("between 1 and 100000")),
            "{p:?}"
        );
        let p = problems(&format!(
            "[fleet]\nenabled = false\n{queue}fleet_max = 12\n"
        ));
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].concurrency.fleet_max")
                    && m.contains("fleet.enabled")),
            "{p:?}"
        );
        let p = problems("[fleet]\nheartbeat_interval = \"1s\"\nshare_interval = \"2s\"\n");
        assert!(
            p.iter().any(|m| m.contains("fleet.share_interval")),
            "{p:?}"
        );
    }

    #[test]
    fn batch_sizes_are_bounded_and_refused_in_mode_none() {
        let queue = "[[queues]]\nname = \"q\"\n[queues.concurrency]\n";
        let p = problems(&format!("{queue}receive_batch = 0\n"));
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].concurrency.receive_batch")
                    && m.contains("between 1 and 1000")),
            "{p:?}"
        );
        assert!(problems(&format!("{queue}receive_batch = 32\n")).is_empty());
        let p = problems(&format!(
            "[transport]\ntransaction_mode = \"none\"\n{queue}receive_batch = 32\n"
        ));
        assert!(
            p.iter()
                .any(|m| m.contains("receive_batch") && m.contains("transaction_mode = \"none\"")),
            "{p:?}"
        );
    }

    #[test]
    fn ordering_needs_a_plain_header_and_a_receive_that_keeps_order() {
        let queue = "[[queues]]\nname = \"q\"\n[queues.ordering]\n";
        assert!(
            problems(&format!(
                "{queue}key_header = \"NServiceBus.ConversationId\"\n"
            ))
            .is_empty()
        );
        assert!(
            problems(&format!("{queue}lookahead = 0\n")).is_empty(),
            "off: nothing to check"
        );
        let p = problems(&format!("{queue}key_header = \"a\\\"b\"\nlookahead = 0\n"));
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].ordering.key_header") && m.contains("quotes")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|m| m.contains("queues[0].ordering.lookahead")),
            "{p:?}"
        );
        let p = problems(&format!(
            "[transport]\ntransaction_mode = \"none\"\n{queue}key_header = \"k\"\n"
        ));
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].ordering.key_header") && m.contains("\"none\"")),
            "{p:?}"
        );
        let p = problems(
            "[[queues]]\nname = \"q\"\n[queues.concurrency]\nreceive_batch = 8\n[queues.ordering]\nkey_header = \"k\"\n",
        );
        assert!(p.iter().any(|m| m.contains("receive_batch = 8")), "{p:?}");
    }

    #[test]
    fn delayed_retries_are_refused_where_they_cannot_be_taken_naming_the_field() {
        let set = "[[queues]]\nname = \"q\"\n[queues.recoverability]\ndelayed_retries = 2\n";
        assert!(problems(set).is_empty(), "{:?}", problems(set));
        let none = format!("[transport]\ntransaction_mode = \"none\"\n{set}");
        assert!(
            problems(&none)
                .iter()
                .any(|m| m.contains("queues[0].recoverability.delayed_retries")
                    && m.contains("\"none\"")),
            "{:?}",
            problems(&none)
        );
        let ordered = format!("{set}[queues.ordering]\nkey_header = \"k\"\n");
        assert!(
            problems(&ordered)
                .iter()
                .any(|m| m.contains("ordered queue"))
        );
        // Unset, the default adapts: no refusal in mode none.
        let unset = "[transport]\ntransaction_mode = \"none\"\n[[queues]]\nname = \"q\"\n";
        assert!(problems(unset).is_empty(), "{:?}", problems(unset));
        let bad = "[[queues]]\nname = \"q\"\n[queues.outage]\npause = \"20s\"\n[queues.latency_limit]\nenabled = true\ndecrease_ratio = 1.5\n";
        let p = problems(bad);
        assert!(
            p.iter().any(|m| m.contains("queues[0].outage.pause")),
            "{p:?}"
        );
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].latency_limit.decrease_ratio")),
            "{p:?}"
        );
    }

    #[test]
    fn holding_a_failed_key_needs_a_key() {
        let queue = "[[queues]]\nname = \"q\"\n[queues.ordering]\n";
        let p = problems(&format!("{queue}failed_key = \"hold\"\n"));
        assert!(
            p.iter()
                .any(|m| m.contains("queues[0].ordering.failed_key") && m.contains("key_header")),
            "{p:?}"
        );
        let p = problems(&format!(
            "{queue}failed_key = \"hold\"\nkey_header = \"k\"\n"
        ));
        assert!(!p.iter().any(|m| m.contains("failed_key")), "{p:?}");
        let p = problems(&format!("{queue}failed_key = \"stop\"\n"));
        assert!(p.iter().any(|m| m.contains("failed_key")), "{p:?}");
    }

    #[test]
    fn queue_names_that_could_inject_sql_are_rejected() {
        for bad in ["a'b", "a]b", "a;drop", "a\"b", "a b", ""] {
            let p = problems(&format!("[[queues]]\nname = {bad:?}\n"));
            assert!(
                p.iter().any(|m| m.contains("queues[0].name")),
                "{bad}: {p:?}"
            );
        }
    }

    #[test]
    fn duplicate_queues_and_self_forwarding_are_rejected() {
        let p = problems(
            "[[queues]]\nname = \"a\"\n[[queues]]\nname = \"a\"\n[queues.handler]\nkind = \"forward\"\nto = \"a\"\n",
        );
        assert!(p.iter().any(|m| m.contains("listed twice")), "{p:?}");
        assert!(p.iter().any(|m| m.contains("loop forever")), "{p:?}");
    }

    #[test]
    fn database_transports_need_a_connection_string() {
        let p = problems("[transport]\nkind = \"postgres\"\n");
        assert!(
            p.iter().any(|m| m.contains("transport.connection_string")),
            "{p:?}"
        );
    }
}
