//! A real memory-pressure episode on PostgreSQL: simulate handlers hold memory, the process
//! memory threshold sits just above this process's RSS; the host enters state 4, shrinks the
//! queue's concurrency limit, recovers, and loses no message. Alone in its file, because RSS
//! is per process.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{
    ByteSize, ConcurrencyModel, HandlerConfig, MemoryThreshold, SimulateConfig, TransactionMode,
};
use throttlehost::throttling::sensors::{ResourceSensor, SystemSensor};
use throttlehost::transport::{QueueName, Transport};
use throttlehost::{DispatchObserver, Outcome};

use common::{PgSchema, q};

#[derive(Default)]
struct Done {
    ids: Mutex<Vec<String>>,
    other: AtomicU64,
}

impl DispatchObserver for Done {
    fn completed(&self, _: &QueueName, _: uuid::Uuid, logical: Option<&str>, outcome: Outcome) {
        match (outcome, logical) {
            (Outcome::Success, Some(id)) => self.ids.lock().unwrap().push(id.to_string()),
            _ => {
                self.other.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_pressure_enters_state_4_shrinks_the_limit_and_recovers_without_loss() {
    let schema = PgSchema::new();
    let transport: Arc<dyn Transport> =
        Arc::new(schema.transport(TransactionMode::ReceiveOnly, 24).await);
    transport.admin().create_queue(&q("work")).await.unwrap();
    let sent: HashSet<String> = common::fill(&transport, &q("work"), 300)
        .await
        .into_iter()
        .collect();

    let baseline = SystemSensor::new().read().process_memory;
    let mut config = common::pg_config(&schema, "work", ConcurrencyModel::Monitor, 16);
    config.transport.pool_size = 24;
    config.throttling.process_memory = MemoryThreshold::Bytes(baseline + (48 << 20));
    config.throttling.sample_interval = Duration::from_millis(200);
    config.queues[0].handler = Some(HandlerConfig::Simulate(SimulateConfig {
        latency: Duration::from_millis(150),
        memory_per_message: ByteSize(8 << 20),
        ..SimulateConfig::default()
    }));
    let done = Arc::new(Done::default());
    let host = HostBuilder::new(config)
        .transport(transport.clone())
        .observer(done.clone())
        .start()
        .await
        .unwrap();

    let mut saw_state_4 = false;
    let mut lowest_limit = u32::MAX;
    let mut max_delay = Duration::ZERO;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while done.ids.lock().unwrap().len() < 300 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "did not finish in 90 s"
        );
        if let Some(s) = host.handle().throttling() {
            saw_state_4 |= s.decision.delivery.state == 4;
            max_delay = max_delay.max(s.decision.delivery.delay);
            lowest_limit = lowest_limit.min(s.decision.queue_limits["work"]);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        saw_state_4,
        "delivery entered state 4 (process memory pressure)"
    );
    assert!(
        lowest_limit < 8,
        "the limit shrank under pressure (lowest {lowest_limit})"
    );
    assert!(
        max_delay >= Duration::from_millis(10),
        "a delay was applied ({max_delay:?})"
    );

    // Recovery: the condition clears and the limit grows back to max.
    common::wait_until(
        Duration::from_secs(30),
        "state 0 and limit 16 again",
        || {
            host.handle().throttling().is_some_and(|s| {
                s.decision.delivery.state == 0 && s.decision.queue_limits["work"] == 16
            })
        },
    )
    .await;
    host.shutdown().await;
    let handled: Vec<String> = done.ids.lock().unwrap().clone();
    let unique: HashSet<String> = handled.iter().cloned().collect();
    assert_eq!(unique, sent, "every message handled: none lost");
    assert_eq!(
        done.other.load(Ordering::Relaxed),
        0,
        "none failed or expired"
    );
    assert_eq!(transport.peek_depth(&q("work")).await.unwrap(), 0);
}
