//! Opening the transport a configuration names.

use std::sync::Arc;

use super::{Transport, TransportError, memory, postgres, sqlserver};
use crate::config::{TransportConfig, TransportKind};

/// Opens the transport a configuration describes.
pub async fn connect(config: &TransportConfig) -> Result<Arc<dyn Transport>, TransportError> {
    Ok(match config.kind {
        TransportKind::Memory => Arc::new(memory::MemoryTransport::simulating(
            config.transaction_mode,
            config.pool_size,
            config.connect_timeout,
            config.simulated_latency,
        )),
        TransportKind::Postgres => Arc::new(postgres::PostgresTransport::connect(config).await?),
        TransportKind::Sqlserver => Arc::new(sqlserver::SqlServerTransport::connect(config).await?),
    })
}
