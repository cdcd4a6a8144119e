//! `throttlehost queues subscriptions|unsubscribe`: the subscription table as an operator
//! reads and edits it.

use throttlehost::transport::{Subscriptions, Transport};

/// The transport's subscription table, or why there is none.
fn table(transport: &dyn Transport) -> Result<&dyn Subscriptions, String> {
    transport.subscriptions().ok_or_else(|| {
        format!(
            "the {} transport keeps no subscription table",
            transport.describe()
        )
    })
}

/// Prints every row: topic, endpoint, queue address, tab-separated.
pub async fn list(transport: &dyn Transport) -> Result<(), String> {
    let rows = table(transport)?
        .all_subscriptions()
        .await
        .map_err(|e| e.to_string())?;
    for row in &rows {
        println!("{}\t{}\t{}", row.topic, row.endpoint, row.queue_address);
    }
    if rows.is_empty() {
        eprintln!("no subscriptions");
    }
    Ok(())
}

/// Removes `endpoint`'s subscription to `topic` and says whether there was one.
pub async fn unsubscribe(
    transport: &dyn Transport,
    endpoint: &str,
    topic: &str,
) -> Result<(), String> {
    let removed = table(transport)?
        .unsubscribe(endpoint, topic)
        .await
        .map_err(|e| e.to_string())?;
    match removed {
        true => println!("{endpoint} no longer subscribes to {topic}"),
        false => println!("{endpoint} did not subscribe to {topic}"),
    }
    Ok(())
}
