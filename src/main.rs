//! The `throttlehost` command line. Each subcommand lives in `src/cli/`.

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

/// `--version`: the version and the commit it was built from, so hosts of a fleet can be told
/// apart (the same pair is the `throttlehost_build_info` metric).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("THROTTLEHOST_COMMIT"),
    ")"
);

/// A message-processing host for SQL Server queue tables (NServiceBus SQL transport layout)
/// with BizTalk-style host throttling.
#[derive(Debug, Parser)]
#[command(
    name = "throttlehost",
    version = VERSION,
    propagate_version = true,
    after_help = "The guide, by task: docs/guide/src/SUMMARY.md (or `mdbook serve docs/guide`); every setting: config/host.toml"
)]
struct Cli {
    /// Log line format (filter with RUST_LOG, e.g. RUST_LOG=throttlehost=debug).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the host: receive from the configured queues until SIGTERM or Ctrl-C. SIGHUP or an
    /// edit of the file reloads the settings.
    #[command(after_help = "Guide: \"Install and run as a service\", docs/guide/src/install.md")]
    Run {
        /// Configuration file.
        #[arg(
            long,
            short,
            env = "THROTTLEHOST_CONFIG",
            default_value = "config/host.toml"
        )]
        config: PathBuf,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Run the built-in demo: in-memory queues, simulated handlers and a load that walks
    /// through the throttling states, with a live table and /metrics. No database needed.
    #[command(after_help = "Guide: \"What throttlehost does\", docs/guide/src/introduction.md")]
    Demo {
        /// Stop after this long (seconds, or e.g. 90s, 5m); default: until Ctrl-C.
        #[arg(long, value_parser = parse_duration)]
        duration: Option<Duration>,
        /// Address of the admin endpoint (/metrics, /status).
        #[arg(long, default_value = "127.0.0.1:9464")]
        admin: String,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// See, retry, delete, export and import failed messages (an error queue's).
    #[command(after_help = "Guide: \"When messages fail\", docs/guide/src/failed-messages.md")]
    Errors {
        /// Configuration file naming the transport and the host.
        #[arg(
            long,
            short,
            env = "THROTTLEHOST_CONFIG",
            default_value = "config/host.toml",
            global = true
        )]
        config: PathBuf,
        /// The error queue (default: the first queue's error_queue).
        #[arg(long, global = true)]
        queue: Option<String>,
        #[command(subcommand)]
        action: cli::errors::ErrorsCommand,
    },
    /// Configuration tools.
    #[command(
        after_help = "Guide: \"Connect to SQL Server, Babelfish or PostgreSQL\", docs/guide/src/connect.md"
    )]
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Create, list, measure and purge queue tables.
    #[command(
        after_help = "Guide: \"Connect to SQL Server, Babelfish or PostgreSQL\", docs/guide/src/connect.md"
    )]
    Queues {
        /// Configuration file naming the transport (and, for create, the queues).
        #[arg(
            long,
            short,
            env = "THROTTLEHOST_CONFIG",
            default_value = "config/host.toml",
            global = true
        )]
        config: PathBuf,
        #[command(subcommand)]
        action: QueuesAction,
    },
    /// Send messages to a queue.
    #[command(
        after_help = "Guide: \"Working with NServiceBus endpoints\", docs/guide/src/nservicebus.md"
    )]
    Send {
        /// Configuration file naming the transport.
        #[arg(
            long,
            short,
            env = "THROTTLEHOST_CONFIG",
            default_value = "config/host.toml"
        )]
        config: PathBuf,
        /// What to send.
        #[command(flatten)]
        message: SendOptions,
    },
    /// Show a running host's throttling and queues. Exit code 0: not throttling,
    /// 1: throttling, 2: unreachable, 3: receiving impaired.
    #[command(after_help = "Guide: \"Watching it\", docs/guide/src/watching.md")]
    Status {
        /// The host's admin address.
        #[arg(long, default_value = "http://127.0.0.1:9464")]
        url: String,
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
        /// Every instance on the host's database instead (its `/fleet`): exit code 1 when
        /// any instance still seen is throttling.
        #[arg(long)]
        fleet: bool,
        /// Every queue. Without it a host with more than 20 queues shows 20, the busy ones
        /// first (in flight, then depth, then an open breaker), and counts the rest.
        #[arg(long)]
        all: bool,
    },
    /// Run a load-test scenario: writes timeline.csv, timeline.svg and summary.json and
    /// prints a summary. Exit code 0 when the expected states appeared and cleared and no
    /// message was lost.
    #[command(after_help = "Guide: \"Load testing\", docs/guide/src/load-testing.md")]
    Load {
        /// Scenario file (see load/).
        file: PathBuf,
        /// Multiply every phase duration by this.
        #[arg(long, default_value_t = 1.0)]
        duration_scale: f64,
        /// Directory for the output files.
        #[arg(long, default_value = "out")]
        out: PathBuf,
        /// Use this schema for the scenario's queue tables (isolates parallel runs).
        #[arg(long)]
        schema: Option<String>,
        /// Use this connection string instead of the scenario's.
        #[arg(long, env = "THROTTLEHOST_LOAD_CONNECTION_STRING")]
        connection_string: Option<String>,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// A peer host of a load run, started by `throttlehost load` when a scenario sets
    /// `processes` above 1: runs the scenario's host (the scenario's text comes in
    /// THROTTLEHOST_LOAD_PEER_SCENARIO) and reports its dispatcher's events on standard
    /// output until standard input closes.
    #[command(hide = true)]
    LoadPeer {
        /// The run's schema.
        #[arg(long)]
        schema: Option<String>,
        /// The run's connection string.
        #[arg(long, env = "THROTTLEHOST_LOAD_CONNECTION_STRING")]
        connection_string: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// Validate a configuration file and print it with every default filled in.
    /// Exit code 2 when it is invalid.
    Check {
        /// Configuration file.
        #[arg(
            long,
            short,
            env = "THROTTLEHOST_CONFIG",
            default_value = "config/host.toml"
        )]
        config: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum QueuesAction {
    /// Create queue tables (idempotent): the named ones, or every queue of the configuration
    /// with its error and instance queues.
    Create {
        /// Queue names.
        names: Vec<String>,
    },
    /// List the queue tables in the transport's schema.
    List,
    /// Print the estimated depth of queues (default: the configured ones).
    Depth {
        /// Queue names.
        names: Vec<String>,
    },
    /// Delete messages from queues.
    Purge {
        /// Queue names.
        #[arg(required = true)]
        names: Vec<String>,
        /// Delete only expired messages.
        #[arg(long, conflicts_with = "all")]
        expired: bool,
        /// Delete every message.
        #[arg(long)]
        all: bool,
    },
    /// List the keys held by a failed message on ordered queues with `failed_key = "hold"`
    /// (default: the configured queues): key, message id, since when, and why.
    Held {
        /// Queue names.
        names: Vec<String>,
    },
    /// List the subscription table (who receives which events): topic, subscribing endpoint,
    /// the queue address its copies go to.
    Subscriptions,
    /// Remove a subscription: ENDPOINT no longer receives TOPIC's events (a host queue that
    /// subscribes in its configuration subscribes again at its next start).
    Unsubscribe {
        /// The subscribing endpoint (a host queue subscribes under its table name).
        endpoint: String,
        /// The topic (an event type's full name).
        topic: String,
    },
    /// Lift holds: the held message is the next of its key again and is tried afresh.
    Release {
        /// The queue.
        name: String,
        /// The key to release.
        #[arg(long, conflicts_with = "all")]
        key: Option<String>,
        /// Release every held key of the queue.
        #[arg(long)]
        all: bool,
    },
}

/// Options every command that runs a host shares.
#[derive(Debug, Clone, Copy, clap::Args)]
struct RuntimeArgs {
    /// Async worker threads (default: `[host] worker_threads` for `run`, else one per CPU).
    /// Fewer workers cost less CPU per message when the host shares its cores with the database.
    #[arg(long, value_parser = parse_worker_threads)]
    worker_threads: Option<usize>,
}

fn parse_worker_threads(s: &str) -> Result<usize, String> {
    let max = throttlehost::config::MAX_WORKER_THREADS as usize;
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("`{s}` is not a number of threads from 1 to {max}")),
    }
}

/// A duration: a plain number of seconds or a humantime duration such as `500ms` or `5m`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    if let Ok(secs) = s.trim().parse::<f64>() {
        return Duration::try_from_secs_f64(secs)
            .map_err(|_| format!("`{s}` is not a duration >= 0 that fits in 64-bit seconds"));
    }
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("`{s}` is not a duration ({e}); write for example 20, 20s or 5m"))
}

/// A time to be received: a duration no longer than the transports can store.
fn parse_delay(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > throttlehost::message::MAX_DELIVERY_DELAY {
        return Err("a delay longer than 50 years cannot be stored".into());
    }
    Ok(d)
}

/// What `send` writes.
#[derive(Debug, clap::Args)]
struct SendOptions {
    /// Destination queue.
    #[arg(long, short, required_unless_present = "publish")]
    queue: Option<String>,
    /// Publish an event instead: a copy in the queue of every subscriber of its topics (the
    /// subscription table). The event's type's full name, its base types after it separated
    /// by ';', as NServiceBus.EnclosedMessageTypes writes them, e.g.
    /// "Sales.OrderAccepted, Sales;Sales.IOrderEvent, Sales". Not with --queue, --delay or
    /// --type.
    #[arg(long, value_name = "TYPES", conflicts_with_all = ["queue", "delay", "message_type"])]
    publish: Option<String>,
    /// Message body text.
    #[arg(long, conflicts_with = "body_file")]
    body: Option<String>,
    /// Read the body from this file.
    #[arg(long)]
    body_file: Option<PathBuf>,
    /// A header, as NAME=VALUE (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE")]
    headers: Vec<String>,
    /// How many copies to send (each with its own id).
    #[arg(long, default_value_t = 1)]
    count: u64,
    /// Time to be received (seconds, or e.g. 30s, 5m); the message expires after it.
    #[arg(long, value_parser = parse_ttbr)]
    ttbr: Option<Duration>,
    /// Deliver no sooner than this from now (e.g. 30s, 5m): stored in the queue's delayed
    /// table until due. Not with --ttbr.
    #[arg(long, value_parser = parse_delay, conflicts_with = "ttbr")]
    delay: Option<Duration>,
    /// The message type, written as NServiceBus.EnclosedMessageTypes (NServiceBus's
    /// serializers need it to read the body): the type's full name, its base types after
    /// it separated by ';', e.g. "Sales.Messages.PlaceOrder, Sales.Messages".
    #[arg(long = "type", value_name = "TYPE")]
    message_type: Option<String>,
    /// Where replies go (NServiceBus.ReplyToAddress), a transport address such as
    /// Sales@[dbo]@[Shop] or "public"."Sales"; none by default (nobody listens for them).
    #[arg(long, value_name = "ADDRESS")]
    reply_to: Option<String>,
}

impl From<SendOptions> for cli::send::SendArgs {
    fn from(o: SendOptions) -> Self {
        cli::send::SendArgs {
            queue: o.queue,
            publish: o.publish,
            body: o.body,
            body_file: o.body_file,
            headers: o.headers,
            count: o.count,
            ttbr: o.ttbr,
            delay: o.delay,
            message_type: o.message_type,
            reply_to: o.reply_to,
        }
    }
}

fn parse_ttbr(s: &str) -> Result<Duration, String> {
    parse_duration(s).and_then(throttlehost::message::check_time_to_be_received)
}

impl Cli {
    /// The worker threads asked for: the flag, else (for `run`) the configuration file.
    fn worker_threads(&self) -> Option<usize> {
        let (flag, config) = match &self.command {
            Command::Run { runtime, config } => (runtime.worker_threads, Some(config)),
            Command::Demo { runtime, .. } | Command::Load { runtime, .. } => {
                (runtime.worker_threads, None)
            }
            _ => (None, None),
        };
        flag.or_else(|| {
            let config = throttlehost::config::load_file(config?).ok()?;
            // Out of range is reported by the configuration check once the runtime runs.
            let n = config.host.worker_threads;
            (n > 0 && n <= throttlehost::config::MAX_WORKER_THREADS).then_some(n as usize)
        })
        .filter(|n| *n > 0)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let quiet_default = matches!(
        cli.command,
        Command::Demo { .. } | Command::Load { .. } | Command::LoadPeer { .. }
    );
    cli::init_logging(cli.log_format == LogFormat::Json, quiet_default);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // Blocking handlers run on the blocking pool, whose idle threads live 10 s by default:
    // the thread count (a throttling condition) then stayed over its resume line for 10 s
    // after blocking handlers were done, and state 9 outlasted its cause by 14 s. Idle for a
    // second, a thread goes; a burst of blocking calls starts new ones in microseconds.
    builder.thread_keep_alive(std::time::Duration::from_secs(1));
    if let Some(workers) = cli.worker_threads() {
        builder.worker_threads(workers);
    }
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Run { config, .. } => cli::run::run(&config).await,
            Command::Demo {
                duration, admin, ..
            } => cli::demo::demo(duration, admin).await,
            Command::Config {
                action: ConfigAction::Check { config },
            } => cli::config_check(&config),
            Command::Errors {
                config,
                queue,
                action,
            } => cli::errors::errors(&config, queue, action.into()).await,
            Command::Queues { config, action } => {
                let action = match action {
                    QueuesAction::Create { names } => cli::queues::Action::Create(names),
                    QueuesAction::List => cli::queues::Action::List,
                    QueuesAction::Depth { names } => cli::queues::Action::Depth(names),
                    QueuesAction::Purge {
                        names,
                        expired,
                        all,
                    } => cli::queues::Action::Purge {
                        names,
                        expired,
                        all,
                    },
                    QueuesAction::Held { names } => cli::queues::Action::Held(names),
                    QueuesAction::Subscriptions => cli::queues::Action::Subscriptions,
                    QueuesAction::Unsubscribe { endpoint, topic } => {
                        cli::queues::Action::Unsubscribe { endpoint, topic }
                    }
                    QueuesAction::Release { name, key, all } => {
                        cli::queues::Action::Release { name, key, all }
                    }
                };
                cli::queues::queues(&config, action).await
            }
            Command::Send { config, message } => cli::send::send(&config, message.into()).await,
            Command::Status {
                url,
                json,
                fleet,
                all,
            } => cli::status::status(&url, json, fleet, all).await,
            Command::Load {
                file,
                duration_scale,
                out,
                schema,
                connection_string,
                ..
            } => cli::load::load(&file, duration_scale, &out, schema, connection_string).await,
            Command::LoadPeer {
                schema,
                connection_string,
            } => cli::load::load_peer(schema, connection_string).await,
        }
    });
    // Work the host already gave up on (a blocking handler past the shutdown timeout) must not
    // keep the process alive: dropping the runtime would wait for blocking threads forever.
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}
