//! Cost of the throttling machinery on its own: one controller tick, one admission check
//! (open, the common case), one rate-window sample.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use throttlehost::bench_internals::{Admission, RateCounters, RateWindow};
use throttlehost::config::ThrottlingConfig;
use throttlehost::throttling::controller::{
    Controller, MachineFacts, QueueLoad, Readings, Thresholds,
};
use throttlehost::transport::QueueName;

fn controller_tick(c: &mut Criterion) {
    let config = ThrottlingConfig::default();
    let machine = MachineFacts {
        total_memory: 16 << 30,
        cpus: 2,
    };
    let mut controller = Controller::new(config.clone(), Thresholds::resolve(&config, machine));
    let queues: Vec<QueueLoad> = (0..8)
        .map(|i| {
            QueueLoad::idle(
                QueueName::new(&format!("queue-{i}")).expect("a valid name"),
                16,
            )
        })
        .collect();
    let readings = Readings {
        process_memory: 50 << 20,
        in_process: 12,
        threads: 9,
        database_size: 1200,
        ..Readings::default()
    };
    let mut now = Duration::ZERO;
    c.bench_function("controller_tick_8_queues", |b| {
        b.iter(|| {
            now += Duration::from_millis(500);
            black_box(controller.tick(now, black_box(&readings), &queues));
        })
    });
}

fn admission(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let open = Admission::default();
    c.bench_function("admission_open", |b| {
        b.iter(|| rt.block_on(black_box(&open).admit()))
    });
    c.bench_function("admission_open_check_only", |b| {
        b.iter(|| black_box(&open).is_open())
    });
}

fn rates(c: &mut Criterion) {
    let counters = RateCounters::default();
    c.bench_function("rate_counter_increment", |b| {
        b.iter(|| black_box(&counters).incoming())
    });
    let mut window = RateWindow::default();
    let mut now = Duration::ZERO;
    let mut total = 0u64;
    c.bench_function("rate_window_record_15s", |b| {
        b.iter(|| {
            now += Duration::from_millis(500);
            total += 100;
            black_box(window.record(now, (total, total), Duration::from_secs(15)));
        })
    });
}

criterion_group!(benches, controller_tick, admission, rates);
criterion_main!(benches);
