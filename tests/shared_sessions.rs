//! Sends and receives share the transport's pool of connections: a publishing burst leaves
//! receives theirs. The memory transport simulates a database (a pool of 4, 5 ms per
//! statement) and the host runs in paused time, so the verdict does not hang on the machine.

mod common;

use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::ConcurrencyModel;
use throttlehost::message::OutgoingMessage;
use tokio::time::Instant;

use common::{Probe, ProbeHandler};

/// 60 messages a second for 3 s into a queue of 2 receivers, then a flood of 2 000 sends
/// issued at once, throttling off so nothing but the pool stands between them. Before sends
/// were bounded, the flood queued for every connection and each receive waited behind it:
/// delivery fell from 60 a second to none for the flood's 2.5 s. Now receives keep 1 of the 4
/// connections and delivery drains the growing backlog at 295 a second while the flood takes
/// 4.5 s to store.
#[tokio::test(start_paused = true)]
async fn a_flood_of_sends_leaves_receives_their_connections() {
    let mut config = common::memory_config("orders");
    config.host.admin_address = "off".into();
    config.throttling.enabled = false;
    config.transport.pool_size = 4;
    config.transport.simulated_latency = Duration::from_millis(5);
    config.queues[0].concurrency.model = ConcurrencyModel::Monitor;
    config.queues[0].concurrency.max = 2;
    let probe = Probe::new(Duration::from_millis(1));
    let host = HostBuilder::new(config)
        .handler("orders", ProbeHandler(probe.clone()))
        .start()
        .await
        .unwrap();
    let handle = host.handle();

    for _ in 0..180 {
        handle
            .send("orders", OutgoingMessage::new(b"steady".to_vec()))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_micros(16_667)).await;
    }
    let steady = probe.handled() as f64 / 3.0;

    let (before, started) = (probe.handled(), Instant::now());
    let flood: Vec<_> = (0..2000)
        .map(|_| {
            let handle = handle.clone();
            tokio::spawn(async move {
                handle
                    .send("orders", OutgoingMessage::new(b"flood".to_vec()))
                    .await
            })
        })
        .collect();
    for send in flood {
        send.await.unwrap().unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let during = (probe.handled() - before) as f64 / seconds;
    println!("steady {steady:.0}/s; during the flood ({seconds:.1} s) {during:.0}/s");
    assert!(
        steady >= 55.0,
        "kept up with the steady load: {steady:.0}/s"
    );
    assert!(
        during >= steady,
        "delivery during the flood {during:.0}/s, before it {steady:.0}/s"
    );
    host.shutdown().await;
}
