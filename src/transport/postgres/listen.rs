//! The listening connection: one per host, outside the pool, that hears the queue tables'
//! insert notifications (`statements::notify_on_insert`) and wakes the queues' idle receivers.
//!
//! A hint, never the only way in: a notification lost (the connection dropped, a table made by
//! an older host without the trigger) costs at most a peek interval, as before. After every
//! (re)connection the queues are woken once, for what arrived while nobody listened. The
//! queues whose tables have the trigger are told they are notified while the connection
//! lasts ([`ArrivalSink::listening`]): their idle receivers then peek only as a safety net.
//!
//! A quiet listening connection sends no statements: a server that goes away is found by TCP
//! keepalive probes (after [`KEEPALIVE_IDLE`], then every [`KEEPALIVE_INTERVAL`], given up after
//! [`KEEPALIVE_RETRIES`] unanswered), which the kernels answer without the database doing any
//! work, so listening adds nothing to an idle queue's statement count. A server that still
//! answers probes but no longer sends notifications costs at most a peek interval, as above.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::{AsyncMessage, Client, Connection};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use crate::transport::{ArrivalSink, QueueName};

/// The quiet time after which TCP starts probing the listening connection.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// The time between unanswered probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes after which the connection counts as dead (found within about a minute).
const KEEPALIVE_RETRIES: u32 = 3;
/// The wait before connecting again after the listening connection failed.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// What the listener needs: where to connect, which channel is which queue, whom to tell.
pub(super) struct Listener {
    pub config: tokio_postgres::Config,
    pub tls: Option<MakeRustlsConnect>,
    pub channels: HashMap<String, QueueName>,
    pub sink: Arc<dyn ArrivalSink>,
    pub stop: CancellationToken,
    /// The schema of queue names that name none.
    pub schema: String,
}

impl Listener {
    /// Listens until `stop`, connecting again after every failure.
    pub(super) async fn run(mut self) {
        self.config
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(KEEPALIVE_INTERVAL)
            .keepalives_retries(KEEPALIVE_RETRIES);
        let mut failed_before = false;
        while !self.stop.is_cancelled() {
            let ended = match &self.tls {
                None => match self.config.connect(tokio_postgres::NoTls).await {
                    Ok((client, connection)) => self.listen_on(client, connection).await,
                    Err(e) => Err(e.to_string()),
                },
                Some(tls) => match self.config.connect(tls.clone()).await {
                    Ok((client, connection)) => self.listen_on(client, connection).await,
                    Err(e) => Err(e.to_string()),
                },
            };
            // Whatever ended the connection, notifications may be missed until it is back.
            for queue in self.channels.values() {
                self.sink.listening(queue, false);
            }
            match ended {
                Ok(()) => return,
                Err(e) => {
                    if !failed_before {
                        tracing::warn!(error = %e, "the listening connection failed; receivers find new messages by peeking until it is back");
                    }
                    failed_before = true;
                }
            }
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(RECONNECT_AFTER) => {}
            }
        }
    }

    /// Listens on one connection: Ok when stopped, Err when the connection failed.
    async fn listen_on<S, T>(
        &self,
        client: Client,
        mut connection: Connection<S, T>,
    ) -> Result<(), String>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let channels = self.channels.clone();
        let sink = self.sink.clone();
        let mut driver = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                if let AsyncMessage::Notification(n) = message?
                    && let Some(queue) = channels.get(n.channel())
                {
                    sink.arrived(queue);
                }
            }
            Ok::<(), tokio_postgres::Error>(())
        });
        // Which tables notify, read before listening (LISTEN stays the connection's last
        // statement, which is how an operator finds it in pg_stat_activity).
        let triggered = self.triggered(&client).await?;
        let listen: String = self
            .channels
            .keys()
            .map(|channel| format!("LISTEN \"{channel}\";"))
            .collect();
        client
            .batch_execute(&listen)
            .await
            .map_err(|e| e.to_string())?;
        tracing::debug!(
            notified = triggered.len(),
            queues = self.channels.len(),
            "listening: queues whose every insert notifies peek only as a safety net"
        );
        for queue in triggered {
            self.sink.listening(&queue, true);
        }
        // What arrived while nobody listened.
        for queue in self.channels.values() {
            self.sink.arrived(queue);
        }
        tokio::select! {
            _ = self.stop.cancelled() => {
                driver.abort();
                Ok(())
            }
            ended = &mut driver => Err(match ended {
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(())) => "the server closed the connection".to_owned(),
                Err(e) => format!("the listening task ended: {e}"),
            }),
        }
    }

    /// The queues whose tables have the insert trigger: their every insert notifies. One
    /// statement for all of them.
    async fn triggered(&self, client: &Client) -> Result<Vec<QueueName>, String> {
        let rows = client
            .query(
                "SELECT n.nspname::text, c.relname::text FROM pg_trigger t \
                 JOIN pg_class c ON c.oid = t.tgrelid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE t.tgname = 'throttlehost_notify'",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?;
        let with_trigger: std::collections::HashSet<(String, String)> =
            rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        Ok(self
            .channels
            .values()
            .filter(|queue| {
                let parts = queue.parts();
                let schema = parts.schema.unwrap_or(&self.schema).to_string();
                with_trigger.contains(&(schema, parts.table.to_string()))
            })
            .cloned()
            .collect())
    }
}
