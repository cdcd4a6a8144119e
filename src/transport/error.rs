//! What can go wrong talking to the queues, said so an operator can act on it: the
//! configuration's fault (retrying will not help) or the database's (it may).

use super::QueueName;

/// What went wrong talking to the queues.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The queue table does not exist.
    #[error("queue `{0}` does not exist (create it with `throttlehost queues create`)")]
    QueueNotFound(String),
    /// A queue's delayed table does not exist (and the host was not to create it).
    #[error(
        "the delayed table {table} of queue `{queue}` does not exist: create it with `throttlehost queues create --config FILE` (an account that may create tables), or set the queue's delayed_delivery.enabled = false"
    )]
    DelayedTableNotFound {
        /// The queue.
        queue: String,
        /// The delayed table, schema-qualified and quoted as the database names it.
        table: String,
    },
    /// A queue or schema name is not acceptable.
    #[error("{0}")]
    InvalidName(String),
    /// No pooled connection became free in time.
    #[error(
        "no database connection became free within {waited:?} (pool size {pool_size}); raise transport.pool_size or lower concurrency"
    )]
    PoolTimeout {
        /// How long it waited.
        waited: std::time::Duration,
        /// The pool's maximum size.
        pool_size: u32,
    },
    /// The statement was chosen as a deadlock victim; retrying is safe.
    #[error("deadlock victim: {0}")]
    Deadlock(String),
    /// The connection broke or could not be opened.
    #[error("database connection failed: {message}")]
    Connection {
        /// What happened, in words.
        message: String,
        /// The driver's error, when there was one: kept so error chains (the ExceptionInfo
        /// headers of a failed message) carry it.
        #[source]
        source: Option<DriverError>,
    },
    /// The server did not answer within the command timeout and a little more (a frozen
    /// server or a network that drops packets): the connection was closed.
    #[error(
        "the database did not answer {what} within {after:?} (transport.command_timeout plus 2 s); the connection was closed"
    )]
    Unanswered {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: std::time::Duration,
    },
    /// A commit reported an error and whether it took effect could not be found out (the
    /// database did not answer the look-up either): if it did not, the message returns.
    #[error(
        "not known whether the commit took effect ({error}; looking for its row: {check}); if it did not, the message returns to the queue"
    )]
    InDoubt {
        /// The commit's error.
        error: String,
        /// Why the look-up failed.
        check: String,
    },
    /// The database rejected a statement.
    #[error("database error: {message}")]
    Database {
        /// What happened, in words.
        message: String,
        /// The driver's error, when there was one.
        #[source]
        source: Option<DriverError>,
    },
    /// A transport setting cannot work as written; names the setting.
    #[error("{setting}: {message}")]
    Setting {
        /// The setting, as written in the configuration file (`transport.connection_string`).
        setting: &'static str,
        /// What is wrong with it and, where possible, what to write instead.
        message: String,
    },
    /// The server refused the credentials: waiting will not make them right.
    #[error("{0}")]
    Login(String),
    /// A queue cannot do what was asked of it: its table has another layout, or it keeps key
    /// order and the request would break it.
    #[error("queue `{queue}` {message}")]
    Queue {
        /// The queue.
        queue: String,
        /// What it cannot do, and what to change.
        message: String,
    },
    /// This transport or receive lacks an ability a setting asks for.
    #[error("{what} ({setting})")]
    Unsupported {
        /// What cannot be done.
        what: &'static str,
        /// The setting that asks for it.
        setting: &'static str,
    },
    /// A message to send cannot be stored as it is (nothing was written).
    #[error("message not sent: {0}")]
    InvalidMessage(String),
}

/// A database driver's own error, kept as the source of a [`TransportError`].
pub type DriverError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl TransportError {
    /// A broken or unopenable connection, said in words.
    pub fn connection(message: impl Into<String>) -> Self {
        TransportError::Connection {
            message: message.into(),
            source: None,
        }
    }

    /// A statement the database rejected, said in words.
    pub fn database(message: impl Into<String>) -> Self {
        TransportError::Database {
            message: message.into(),
            source: None,
        }
    }

    /// The settings, the credentials or the queue's layout are wrong: retrying will not
    /// help, a changed configuration or database will.
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            TransportError::Setting { .. }
                | TransportError::Login(_)
                | TransportError::Queue { .. }
                | TransportError::Unsupported { .. }
                | TransportError::DelayedTableNotFound { .. }
        )
    }

    /// A queue that cannot do what was asked of it.
    pub(crate) fn queue(queue: &QueueName, message: impl Into<String>) -> Self {
        TransportError::Queue {
            queue: queue.to_string(),
            message: message.into(),
        }
    }

    /// The same error with the driver's error behind it.
    pub fn caused_by(self, driver: impl std::error::Error + Send + Sync + 'static) -> Self {
        let driver: Option<DriverError> = Some(Box::new(driver));
        match self {
            TransportError::Connection { message, .. } => TransportError::Connection {
                message,
                source: driver,
            },
            TransportError::Database { message, .. } => TransportError::Database {
                message,
                source: driver,
            },
            other => other,
        }
    }
}

impl TransportError {
    /// A unit of work that a failed statement aborted: committing it rolled it back instead.
    pub fn aborted(queue: &QueueName) -> Self {
        TransportError::database(format!(
            "the receive transaction on `{queue}` was aborted by an earlier error and has been rolled back"
        ))
    }

    /// Deadlocks are retried rather than counted as failures.
    pub fn is_deadlock(&self) -> bool {
        matches!(self, TransportError::Deadlock(_))
    }
}

impl From<crate::names::InvalidName> for TransportError {
    fn from(e: crate::names::InvalidName) -> Self {
        TransportError::InvalidName(e.0)
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    /// The driver's error stays behind a transport error, so the chain a failed message
    /// carries in its ExceptionInfo headers names it.
    #[test]
    fn a_driver_error_stays_the_source() {
        let driver = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = TransportError::connection("the connection was closed").caused_by(driver);
        assert_eq!(
            e.to_string(),
            "database connection failed: the connection was closed"
        );
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("reset by peer")
        );
        assert!(TransportError::database("x").source().is_none());
        assert!(
            TransportError::Deadlock("d".into())
                .caused_by(std::io::Error::other("y"))
                .source()
                .is_none(),
            "only connection and database errors carry one"
        );
    }
}
