//! A `[[queue]]`: its handler, concurrency, recoverability, delayed delivery, downstream guards and
//! ordering.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ByteSize;
use super::units;

/// `[[queues]]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Queue (table) name.
    pub name: String,
    /// Where messages go after their retries are used up, and where poison rows go.
    pub error_queue: String,
    /// Immediate retries after the first failed attempt (NServiceBus default 5).
    pub immediate_retries: u32,
    /// A handler attempt running longer than this fails. `"off"` = no limit.
    #[serde(with = "units::optional_duration")]
    pub handler_timeout: Option<Duration>,
    /// MaximumConcurrencyLevel and the model that enforces it.
    pub concurrency: ConcurrencyConfig,
    /// The per-instance queue `<name>.<instance_id>` (secondary queue).
    pub instance_queue: InstanceQueueConfig,
    /// Per-key sequential processing; off unless a key header is named.
    pub ordering: OrderingConfig,
    /// Delayed retries after the immediate ones (NServiceBus recoverability).
    pub recoverability: RecoverabilityConfig,
    /// The queue's delayed table and its mover.
    pub delayed_delivery: DelayedDeliveryConfig,
    /// Outage mode: one message at a time with a pause after a run of failures.
    pub outage: OutageConfig,
    /// The latency-aware concurrency limit (off by default).
    pub latency_limit: LatencyLimitConfig,
    /// The handler for this queue's messages (binary); the library can register one instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handler: Option<HandlerConfig>,
    /// The events this queue subscribes to, by topic: an event type's full name as NServiceBus
    /// names it (`Sales.Messages.OrderAccepted`). The host keeps a row for each in the
    /// subscription table (`transport.subscription_table`) under the queue's name.
    pub subscribe: Vec<String>,
    /// Export this queue's Prometheus series (about 32, labelled `queue`, 3 more on an
    /// ordered queue; its instance queue's too). Off, the queue is still counted in the
    /// host-wide series, `/status` and the console: with many queues, set it off in
    /// `[queue_defaults]` and on for the queues to chart. Restart to change.
    pub metrics: bool,
}

impl QueueConfig {
    /// This queue's instance queue, `<name>.<instance>`.
    pub fn instance_queue_name(&self, instance: &str) -> String {
        format!("{}.{}", self.name, instance)
    }

    /// Every table this queue uses, each with the setting that names it: the queue, its error
    /// queue, its instance queue (when enabled) and a forward handler's target.
    pub fn tables(&self, instance: &str) -> Vec<(&'static str, String)> {
        let mut tables = vec![
            ("name", self.name.clone()),
            ("error_queue", self.error_queue.clone()),
        ];
        if self.instance_queue.enabled {
            tables.push(("instance_queue.enabled", self.instance_queue_name(instance)));
        }
        if let Some(HandlerConfig::Forward(f)) = &self.handler {
            tables.push(("handler.to", f.to.clone()));
        }
        tables
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            name: String::new(),
            error_queue: "error".into(),
            immediate_retries: 5,
            handler_timeout: None,
            concurrency: ConcurrencyConfig::default(),
            instance_queue: InstanceQueueConfig::default(),
            ordering: OrderingConfig::default(),
            recoverability: RecoverabilityConfig::default(),
            delayed_delivery: DelayedDeliveryConfig::default(),
            outage: OutageConfig::default(),
            latency_limit: LatencyLimitConfig::default(),
            handler: None,
            subscribe: Vec::new(),
            metrics: true,
        }
    }
}

/// `[queues.recoverability]`: what happens after a message's immediate retries, as in
/// NServiceBus: it is stored in the queue's delayed table and tried again later, up to
/// `delayed_retries` times, `delayed_retry_increment` x the retry's number later (10 s, 20 s,
/// 30 s by default); after the last, it goes to the error queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecoverabilityConfig {
    /// Delayed retries (0: none, straight to the error queue after the immediate retries).
    /// Unset: 3, except in transaction mode `none` (the message is gone before its handler
    /// runs, so nothing can be retried) and on queues that keep key order or stages (a
    /// message taken out to wait would let the later messages of its key pass it), where it
    /// is 0 and a number set is refused, naming this setting.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delayed_retries: Option<u32>,
    /// The delay of retry n is n x this.
    #[serde(with = "units::duration")]
    pub delayed_retry_increment: Duration,
}

/// NServiceBus's default number of delayed retries.
pub const DEFAULT_DELAYED_RETRIES: u32 = 3;

impl RecoverabilityConfig {
    /// The delayed retries in force: as set, else the default where retries can be taken
    /// (`can_retry`: not mode `none`, not an ordered queue) and 0 elsewhere.
    pub fn effective_delayed_retries(&self, can_retry: bool) -> u32 {
        match (self.delayed_retries, can_retry) {
            (Some(n), _) => n,
            (None, true) => DEFAULT_DELAYED_RETRIES,
            (None, false) => 0,
        }
    }
}

impl Default for RecoverabilityConfig {
    fn default() -> Self {
        RecoverabilityConfig {
            delayed_retries: None,
            delayed_retry_increment: Duration::from_secs(10),
        }
    }
}

/// `[queues.delayed_delivery]`: the queue's delayed table (`<queue>.Delayed` on both engines,
/// see `transport.delayed_table_suffix`), created with the queue, and the mover that moves due
/// messages into the queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DelayedDeliveryConfig {
    /// Create the delayed table and run its mover. Off: delayed sends to this queue and its
    /// delayed retries are refused (set `recoverability.delayed_retries = 0` too).
    pub enabled: bool,
    /// Due messages moved per transaction (NServiceBus default 100).
    pub batch_size: u32,
}

impl Default for DelayedDeliveryConfig {
    fn default() -> Self {
        DelayedDeliveryConfig {
            enabled: true,
            batch_size: 100,
        }
    }
}

/// `[queues.outage]`: after `consecutive_failures` different messages failed in a row on the
/// queue, it takes one message at a time with `pause` between attempts (doubling while the
/// failures go on, up to `max_pause`), and returns to its limits at the first success.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutageConfig {
    /// Different messages (by logical id) failing in a row, with no success between, that
    /// start outage mode; 0 = never. A message's retries count once, so a few bad messages
    /// failing again and again never look like an outage; 20 is seen within a fifth of a
    /// second at 100 messages/s.
    pub consecutive_failures: u32,
    /// The first pause between attempts in outage mode.
    #[serde(with = "units::duration")]
    pub pause: Duration,
    /// The longest pause (the pause doubles after each failure in outage mode).
    #[serde(with = "units::duration")]
    pub max_pause: Duration,
}

impl Default for OutageConfig {
    fn default() -> Self {
        OutageConfig {
            consecutive_failures: 20,
            pause: Duration::from_secs(1),
            max_pause: Duration::from_secs(10),
        }
    }
}

/// `[queues.latency_limit]`: keeps handler latency near its unloaded baseline by lowering the
/// queue's limit when latency rises (additive increase, multiplicative decrease: +1 per
/// interval while the limit is used and latency stays within `tolerance` of the baseline,
/// x `decrease_ratio` when it rises past it or an attempt times out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyLimitConfig {
    /// Switch it on.
    pub enabled: bool,
    /// The lowest limit it sets.
    pub min: u32,
    /// The limit it starts from (capped by the queue's max).
    pub initial: u32,
    /// How far the limit falls when latency rises (0 < ratio < 1).
    pub decrease_ratio: f64,
    /// How far above its baseline (the lowest latency seen) latency may be and still count as
    /// healthy: 0.05 = 5 %, measured on the mean of an interval of at least 50 ms, so timer
    /// jitter averages out. Raise it for a downstream whose latency varies by itself.
    pub tolerance: f64,
}

impl Default for LatencyLimitConfig {
    fn default() -> Self {
        LatencyLimitConfig {
            enabled: false,
            min: 1,
            initial: 1,
            decrease_ratio: 0.9,
            tolerance: 0.05,
        }
    }
}

/// The three MaximumConcurrencyLevel models of the NServiceBus SQL transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencyModel {
    /// `max` receive loops polling with back-off (transport < 2.0).
    Fixed,
    /// One loop to start, more on consecutive successes, fewer on consecutive empties (2.1).
    Adaptive,
    /// One peeker starting a receive task per pending message, bounded by `max` (3.0+).
    #[default]
    Monitor,
}

/// `[queues.concurrency]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrencyConfig {
    /// `fixed`, `adaptive` or `monitor`.
    pub model: ConcurrencyModel,
    /// MaximumConcurrencyLevel: messages of this queue in flight at most.
    pub max: u32,
    /// Wait between peeks (monitor) and the longest idle back-off (fixed, adaptive) when the
    /// queue is empty.
    #[serde(with = "units::duration")]
    pub peek_interval: Duration,
    /// Adaptive: a loop with more consecutive successful receives than this starts another.
    pub ramp_up_after: u32,
    /// Adaptive: a loop with more consecutive empty receives than this retires (never the last).
    pub ramp_down_after: u32,
    /// Messages one receive may take in one transaction (1: one per transaction). A batch
    /// takes only messages that may be in flight now (free places under the effective limit)
    /// and only while delivery is not throttled; it commits once, after every message of it
    /// has ended, and a crash returns all of it (duplicates after a crash: up to this many).
    pub receive_batch: u32,
    /// The most messages of this queue in flight across every instance on the database at
    /// once (unset: no fleet-wide limit). The instances share it by demand through the
    /// database (`[fleet]`); each one's own `max` still bounds it.
    pub fleet_max: Option<u32>,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        ConcurrencyConfig {
            model: ConcurrencyModel::Monitor,
            max: 8,
            peek_interval: Duration::from_secs(1),
            ramp_up_after: 5,
            ramp_down_after: 2,
            receive_batch: 1,
            fleet_max: None,
        }
    }
}

/// `[queues.instance_queue]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InstanceQueueConfig {
    /// Also receive from `<name>.<instance_id>`.
    pub enabled: bool,
    /// MaximumConcurrencyLevel of the instance queue.
    pub max_concurrency: u32,
}

impl Default for InstanceQueueConfig {
    fn default() -> Self {
        InstanceQueueConfig {
            enabled: false,
            max_concurrency: 1,
        }
    }
}

/// `[queues.ordering]`: messages that share a key are handled one at a time, in the order
/// they were stored, by every receiver of every host on the queue; different keys run in
/// parallel. Messages without the key header are not ordered. With `stages`, a message
/// whose `throttlehost.PreviousStage` header names a stage starts only when no message of
/// that stage (`throttlehost.ExecutionStage`) is left in the queue or in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrderingConfig {
    /// The header whose value is the key (e.g. `NServiceBus.ConversationId`); empty = no
    /// per-key order.
    pub key_header: String,
    /// Ordered stages by the `throttlehost.ExecutionStage` and `throttlehost.PreviousStage`
    /// headers.
    pub stages: bool,
    /// How many of the oldest rows a receive looks at to find a message that may run. Keep it
    /// above the in-flight messages of every host on the queue together: a receive that sees
    /// only waiting messages finds nothing and waits like an empty one.
    pub lookahead: u32,
    /// What a keyed message that failed after its retries does to its key: `continue` (it
    /// goes to the error queue and the key goes on) or `hold` (it stays in the queue, its
    /// key's later messages wait behind it, until `throttlehost queues release` lifts the
    /// hold and it is tried again, first).
    pub failed_key: FailedKey,
}

/// What a keyed message that failed after its retries does to its key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailedKey {
    /// To the error queue; the key continues with its next message.
    #[default]
    Continue,
    /// Stays in place and holds its key (recorded in the database) until released.
    Hold,
}

impl OrderingConfig {
    /// The key header when the queue keeps per-key order.
    pub fn key_header(&self) -> Option<&str> {
        Some(self.key_header.as_str()).filter(|h| !h.is_empty())
    }

    /// Whether receives must keep any order (per key, stages or both).
    pub fn is_ordered(&self) -> bool {
        self.key_header().is_some() || self.stages
    }
}

impl Default for OrderingConfig {
    fn default() -> Self {
        OrderingConfig {
            key_header: String::new(),
            stages: false,
            lookahead: 64,
            failed_key: FailedKey::Continue,
        }
    }
}

/// `[queues.handler]`: a built-in handler of the binary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HandlerConfig {
    /// Accepts every message and does nothing.
    Noop,
    /// Simulated work with tunable latency, memory, CPU, threads and failures.
    Simulate(SimulateConfig),
    /// Sends every message on to another queue through the throttled publish path.
    Forward(ForwardConfig),
    /// Runs a program per message with the body on stdin; exit code 0 is success.
    Command(CommandConfig),
    /// POSTs every message to a URL; a 2xx answer is success.
    Http(HttpConfig),
    /// Publishes every message as an event to the subscribers of its types.
    Publish(PublishConfig),
}

/// How the simulated handler's latency is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LatencyDistribution {
    /// Always `latency`.
    #[default]
    Fixed,
    /// Uniform between 0 and twice `latency`.
    Uniform,
    /// Exponential with mean `latency` (many short, a few long).
    Exponential,
}

/// `kind = "simulate"`: the knobs load tests turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulateConfig {
    /// Mean time a message takes.
    #[serde(with = "units::duration")]
    pub latency: Duration,
    /// `fixed`, `uniform` or `exponential`.
    pub latency_distribution: LatencyDistribution,
    /// Memory allocated and touched per message, held until the message is done.
    pub memory_per_message: ByteSize,
    /// CPU time burned per message (busy loop).
    #[serde(with = "units::duration")]
    pub cpu_work: Duration,
    /// Spend the latency blocking a thread of the blocking pool instead of sleeping
    /// asynchronously (raises the process thread count under load).
    pub blocking: bool,
    /// Share of attempts that fail, 0.0 to 1.0.
    pub failure_rate: f64,
    /// A downstream the handler calls for its latency that serves this many calls at once
    /// (the rest wait their turn, so latency grows with the calls made); 0 = unlimited.
    pub downstream_capacity: u32,
}

impl Default for SimulateConfig {
    fn default() -> Self {
        SimulateConfig {
            latency: Duration::from_millis(10),
            latency_distribution: LatencyDistribution::Fixed,
            memory_per_message: ByteSize(0),
            cpu_work: Duration::ZERO,
            blocking: false,
            failure_rate: 0.0,
            downstream_capacity: 0,
        }
    }
}

/// `kind = "forward"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardConfig {
    /// Destination queue.
    pub to: String,
}

/// `kind = "publish"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishConfig {
    /// The event's type and the types it derives from, `;`-separated, as
    /// `NServiceBus.EnclosedMessageTypes` writes them: `Sales.OrderAccepted, Sales`.
    pub types: String,
}

/// `kind = "command"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandConfig {
    /// Program to run (looked up on PATH).
    pub program: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
}

/// `kind = "http"`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `http://` URL the message body is POSTed to; headers travel as `X-Header-<name>`.
    pub url: String,
}
