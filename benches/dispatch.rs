//! Host throughput with a no-op handler on the memory transport, throttling enabled (but
//! idle: no condition near its threshold) versus disabled. The ratio is the price of
//! throttling when it has nothing to do; the target is >= 98 %.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use throttlehost::config::{ConcurrencyModel, Config, HandlerConfig, QueueConfig, TransactionMode};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::memory::MemoryTransport;
use throttlehost::transport::{QueueName, Transport};
use throttlehost::{DispatchObserver, Outcome};
use throttlehost::{Host, HostBuilder};

const BATCH: u64 = 5_000;

#[derive(Default)]
struct Count {
    done: AtomicU64,
    reached: tokio::sync::Notify,
    target: AtomicU64,
}

impl DispatchObserver for Count {
    fn completed(&self, _: &QueueName, _: uuid::Uuid, _: Option<&str>, _: Outcome) {
        if self.done.fetch_add(1, Ordering::Relaxed) + 1 == self.target.load(Ordering::Relaxed) {
            self.reached.notify_one();
        }
    }
}

async fn start(throttling: bool) -> (Host, Arc<dyn Transport>, Arc<Count>) {
    let transport: Arc<dyn Transport> =
        Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
    let mut config = Config::default();
    config.host.admin_address = "off".into();
    config.throttling.enabled = throttling;
    let mut q = QueueConfig {
        name: "bench".into(),
        handler: Some(HandlerConfig::Noop),
        ..QueueConfig::default()
    };
    q.concurrency.model = ConcurrencyModel::Monitor;
    q.concurrency.max = 8;
    q.concurrency.peek_interval = Duration::from_millis(100);
    config.queues.push(q);
    let count = Arc::new(Count::default());
    let host = HostBuilder::new(config)
        .transport(transport.clone())
        .observer(count.clone())
        .start()
        .await
        .unwrap();
    (host, transport, count)
}

fn drain(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("drain_memory_noop_concurrency_8");
    group.throughput(Throughput::Elements(BATCH));
    group.sample_size(20);
    for (name, throttling) in [("throttling_off", false), ("throttling_on_idle", true)] {
        let (host, transport, count) = rt.block_on(start(throttling));
        let queue = QueueName::new("bench").unwrap();
        let message = OutgoingMessage::new(vec![b'x'; 200]);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        // Time sending a batch and draining it: receivers start as soon as it arrives.
                        let base = count.done.load(Ordering::Relaxed);
                        count.target.store(base + BATCH, Ordering::Relaxed);
                        let notified = count.reached.notified();
                        tokio::pin!(notified);
                        let started = Instant::now();
                        for _ in 0..BATCH {
                            transport.send(&queue, &message).await.unwrap();
                        }
                        notified.as_mut().await;
                        total += started.elapsed();
                    }
                    total
                })
            })
        });
        rt.block_on(host.shutdown());
    }
    group.finish();
}

criterion_group!(benches, drain);
criterion_main!(benches);
