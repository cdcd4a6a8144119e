//! `throttlehost send`: writes messages straight to a queue table.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use throttlehost::EventTypes;
use throttlehost::config::TransportKind;
use throttlehost::message::{
    ENCLOSED_MESSAGE_TYPES_HEADER, MessageIntent, Origin, OutgoingMessage, REPLY_TO_ADDRESS_HEADER,
};
use throttlehost::transport::{self, QueueName, Transport};

/// Arguments of `send`.
pub struct SendArgs {
    /// Destination (None: `publish` names the event).
    pub queue: Option<String>,
    /// The event's types, when publishing.
    pub publish: Option<String>,
    /// Body text.
    pub body: Option<String>,
    /// Body file.
    pub body_file: Option<PathBuf>,
    /// NAME=VALUE headers.
    pub headers: Vec<String>,
    /// Copies.
    pub count: u64,
    /// Time to be received.
    pub ttbr: Option<Duration>,
    /// Delivery delay.
    pub delay: Option<Duration>,
    /// `NServiceBus.EnclosedMessageTypes`.
    pub message_type: Option<String>,
    /// `NServiceBus.ReplyToAddress`.
    pub reply_to: Option<String>,
}

/// Concurrent writers for `--count` above one.
const WRITERS: u64 = 4;
/// Messages per statement: PostgreSQL stores a batch with one INSERT.
const BATCH: u64 = 1000;

/// What every message of a `send` holds.
struct Template {
    body: Vec<u8>,
    headers: Vec<(String, String)>,
    ttbr: Option<Duration>,
    delay: Option<Duration>,
    /// The configured endpoint, as the sender NServiceBus's headers name.
    origin: Origin,
}

impl Template {
    /// A message with the headers NServiceBus's outgoing pipeline writes on a send (intent,
    /// a conversation of its own, the originating endpoint): `--header` values win.
    fn message(&self) -> OutgoingMessage {
        let mut m = OutgoingMessage::new(self.body.clone());
        for (name, value) in &self.headers {
            m = m.with_header(name.clone(), value.clone());
        }
        m = m.sent_by(&self.origin);
        if let Some(t) = self.ttbr {
            m = m.with_time_to_be_received(t);
        }
        if let Some(d) = self.delay {
            m = m.with_delay(d);
        }
        m
    }
}

/// Stores `count` copies of the template in batches of [`BATCH`], [`WRITERS`] at a time;
/// prints the id when there is one message.
async fn store(
    transport: Arc<dyn Transport>,
    queue: QueueName,
    template: Arc<Template>,
    count: u64,
) -> Result<String, String> {
    let mut writers = Vec::new();
    for w in 0..WRITERS.min(count.div_ceil(BATCH)) {
        let (transport, queue, template) = (transport.clone(), queue.clone(), template.clone());
        writers.push(tokio::spawn(async move {
            // Writer w stores batches w, w + WRITERS, ...
            let mut batch = w;
            while batch * BATCH < count {
                let size = BATCH.min(count - batch * BATCH);
                let messages: Vec<OutgoingMessage> =
                    (0..size).map(|_| template.message()).collect();
                transport.send_batch(&queue, &messages).await?;
                if count == 1 {
                    println!("{}", messages[0].logical_id());
                }
                batch += WRITERS;
            }
            Ok::<(), throttlehost::transport::TransportError>(())
        }));
    }
    for w in writers {
        match w.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.to_string()),
            Err(e) => return Err(format!("a sender failed: {e}")),
        }
    }
    Ok(format!("sent {count} message(s) to {queue}"))
}

/// Sends `count` messages.
pub async fn send(path: &Path, args: SendArgs) -> ExitCode {
    let invalid = |message: String| {
        eprintln!("error: {message}");
        ExitCode::from(super::INVALID)
    };
    let config = match super::read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if config.transport.kind == TransportKind::Memory {
        return invalid(format!(
            "{} uses the memory transport; `send` needs a postgres or sqlserver configuration (or POST to a running host's /queues/{{name}}/messages)",
            path.display()
        ));
    }
    let Request {
        destination,
        body,
        headers,
    } = match what_to_send(&args) {
        Ok(request) => request,
        Err(message) => return invalid(message),
    };
    let transport = match transport::connect(&config.transport).await {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let template = Arc::new(Template {
        body,
        headers,
        ttbr: args.ttbr,
        delay: args.delay,
        origin: Origin::new(&config.host.name, &config.host.effective_instance_id()),
    });
    let started = Instant::now();
    let done = match &destination {
        Destination::Queue(queue) => store(transport, queue.clone(), template, args.count).await,
        Destination::Subscribers(types) => publish(&*transport, types, &template, args.count).await,
    };
    let what = match done {
        Ok(what) => what,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "{what} in {secs:.2}s ({:.0}/s)",
        args.count as f64 / secs.max(1e-9)
    );
    ExitCode::SUCCESS
}

/// What the command line asks to send.
struct Request {
    destination: Destination,
    body: Vec<u8>,
    /// The headers named on the command line, `--type` and `--reply-to` among them.
    headers: Vec<(String, String)>,
}

/// What `args` asks to send, or what is wrong with them, naming the flag.
fn what_to_send(args: &SendArgs) -> Result<Request, String> {
    let destination = match (&args.queue, &args.publish) {
        (_, Some(types)) => Destination::Subscribers(
            EventTypes::parse(types).map_err(|e| format!("--publish: {e}"))?,
        ),
        (Some(queue), None) => {
            Destination::Queue(QueueName::new(queue).map_err(|e| e.to_string())?)
        }
        (None, None) => return Err("name a --queue, or an event to --publish".into()),
    };
    if args.count == 0 {
        return Err("--count must be at least 1".into());
    }
    let body = match (&args.body, &args.body_file) {
        (Some(text), _) => text.clone().into_bytes(),
        (None, Some(file)) => std::fs::read(file)
            .map_err(|e| format!("cannot read --body-file {}: {e}", file.display()))?,
        (None, None) => Vec::new(),
    };
    let mut headers = Vec::new();
    for h in &args.headers {
        match h.split_once('=') {
            Some((name, value)) if !name.trim().is_empty() => {
                headers.push((name.trim().to_string(), value.to_string()))
            }
            _ => return Err(format!("--header `{h}` is not NAME=VALUE")),
        }
    }
    for (flag, name, value) in [
        ("--type", ENCLOSED_MESSAGE_TYPES_HEADER, &args.message_type),
        ("--reply-to", REPLY_TO_ADDRESS_HEADER, &args.reply_to),
    ] {
        match value.as_deref().map(str::trim) {
            Some("") => return Err(format!("{flag} must not be empty")),
            Some(v) => headers.push((name.to_string(), v.to_string())),
            None => {}
        }
    }
    Ok(Request {
        destination,
        body,
        headers,
    })
}

/// Where `send` writes.
enum Destination {
    /// One queue.
    Queue(QueueName),
    /// Every subscriber of an event's topics.
    Subscribers(EventTypes),
}

/// Publishes `count` events of `types`: each a copy per subscriber, stored in one
/// transaction, read from the subscription table once. Prints the id of a single event.
async fn publish(
    transport: &dyn Transport,
    types: &EventTypes,
    template: &Template,
    count: u64,
) -> Result<String, String> {
    let store = transport
        .subscriptions()
        .ok_or("this transport keeps no subscription table")?;
    let addresses = store
        .subscribers(&types.topics())
        .await
        .map_err(|e| e.to_string())?;
    let mut queues: Vec<QueueName> = Vec::new();
    for address in &addresses {
        match transport.resolve_address(address) {
            Some(q) if !queues.contains(&q) => queues.push(q),
            Some(_) => {}
            None => eprintln!(
                "warning: subscriber address `{address}` is not one this transport reaches; skipped"
            ),
        }
    }
    for _ in 0..count {
        let event = template
            .message()
            .with_intent(MessageIntent::Publish)
            .with_enclosed_message_types(types.header());
        let copies: Vec<(QueueName, OutgoingMessage)> =
            queues.iter().map(|q| (q.clone(), event.clone())).collect();
        store.deliver(&copies).await.map_err(|e| e.to_string())?;
        if count == 1 {
            println!("{}", event.logical_id());
        }
    }
    let names: Vec<String> = queues.iter().map(|q| q.to_string()).collect();
    Ok(match names.is_empty() {
        true => format!(
            "published {count} {} event(s): nobody subscribes to {}, nothing stored",
            types.topic(),
            types.topics().join(", ")
        ),
        false => format!(
            "published {count} {} event(s) to {} subscriber(s) ({})",
            types.topic(),
            names.len(),
            names.join(", ")
        ),
    })
}
