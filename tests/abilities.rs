//! A transport's abilities (key order, batch receive, fleet shares, the registry, delayed
//! delivery) are asked for at start: a configuration that needs one the transport lacks is
//! refused, naming the setting, before anything is created.

mod common;

use std::sync::Arc;

use throttlehost::config::{Config, HandlerConfig, OrderingConfig, TransactionMode};
use throttlehost::host::{HostBuilder, HostError};
use throttlehost::transport::memory::MemoryTransport;

/// One queue with a built-in handler.
fn config() -> Config {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Noop);
    config
}

async fn refusal(config: Config) -> String {
    let memory = Arc::new(MemoryTransport::new(TransactionMode::ReceiveOnly));
    let bare = common::Counting::bare(memory);
    match HostBuilder::new(config).transport(bare).start().await {
        Err(HostError::Setting { setting, message }) => format!("{setting}: {message}"),
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(host) => {
            host.shutdown().await;
            panic!("started on a transport without the ability")
        }
    }
}

#[tokio::test]
async fn a_configuration_that_needs_a_missing_ability_is_refused_naming_it() {
    let mut ordered = config();
    ordered.queues[0].ordering = OrderingConfig {
        key_header: "Sales.OrderId".into(),
        ..OrderingConfig::default()
    };
    let message = refusal(ordered).await;
    assert!(
        message.contains("queues[0].ordering") && message.contains("key order"),
        "{message}"
    );

    let mut batched = config();
    batched.queues[0].concurrency.receive_batch = 8;
    let message = refusal(batched).await;
    assert!(
        message.contains("queues[0].concurrency.receive_batch"),
        "{message}"
    );

    let mut shared = config();
    shared.queues[0].concurrency.fleet_max = Some(4);
    let message = refusal(shared).await;
    assert!(
        message.contains("queues[0].concurrency.fleet_max"),
        "{message}"
    );

    // The same configurations start on the transport itself.
    let mut all = config();
    all.queues[0].concurrency.receive_batch = 8;
    all.queues[0].concurrency.fleet_max = Some(4);
    let host = HostBuilder::new(all).start().await.unwrap();
    host.shutdown().await;
}
