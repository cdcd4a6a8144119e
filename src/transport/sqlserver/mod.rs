//! SQL Server transport (in progress).
use super::TransportError;
use crate::config::TransportConfig;

/// SQL Server transport.
pub struct SqlServerTransport;

impl SqlServerTransport {
    /// Connects.
    pub async fn connect(
        _config: &TransportConfig,
    ) -> Result<super::memory::MemoryTransport, TransportError> {
        Err(TransportError::Config(
            "sqlserver transport is not built yet".into(),
        ))
    }
}
