//! `throttlehost errors list|show|retry|delete|export|import`: the failed messages of an
//! error queue. Reads and deletes go to the database; a retry goes through the running host
//! (its publishing admission paces it, and its /status shows it) unless `--direct` says to
//! move without one.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use throttlehost::config::{Config, TransportKind};
use throttlehost::failed::{FailedMessages, Filter, Group, Page, RetryRun};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::{self, QueueName, Transport};
use uuid::Uuid;

mod args;
pub use args::ErrorsCommand;

/// What selects failed messages on the command line.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Native ids.
    pub ids: Vec<String>,
    /// A group id.
    pub group: Option<String>,
    /// The queue they failed in.
    pub source: Option<String>,
    /// Failed at or after: RFC 3339, or a duration ago (`2h`).
    pub since: Option<String>,
    /// Failed before: likewise.
    pub until: Option<String>,
    /// Every message (needed when nothing else selects).
    pub all: bool,
}

/// What to do.
pub enum Action {
    /// Groups, or with `messages` a page of messages.
    List {
        /// The selection.
        selection: Selection,
        /// Messages instead of groups.
        messages: bool,
        /// JSON instead of a table.
        json: bool,
        /// Page.
        offset: usize,
        /// Page size.
        limit: usize,
    },
    /// One message.
    Show {
        /// Its native id.
        id: String,
        /// JSON instead of text.
        json: bool,
    },
    /// Send back.
    Retry {
        /// The selection.
        selection: Selection,
        /// Send here instead of where each failed.
        to: Option<String>,
        /// Confirmed for more than one message.
        yes: bool,
        /// Move without a running host (unpaced).
        direct: bool,
        /// The host's admin URL (default: from the configuration).
        url: Option<String>,
    },
    /// Remove.
    Delete {
        /// The selection.
        selection: Selection,
        /// Confirmed for more than one message.
        yes: bool,
    },
    /// Write JSON lines.
    Export {
        /// The selection.
        selection: Selection,
        /// The file ("-": standard output).
        out: PathBuf,
    },
    /// Read JSON lines into a queue.
    Import {
        /// The file.
        file: PathBuf,
        /// The queue.
        to: String,
    },
}

fn invalid(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(super::INVALID)
}

fn failed(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(1)
}

/// A time filter: RFC 3339, or a duration ago.
fn parse_time(flag: &str, text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    humantime::parse_duration(text.trim())
        .ok()
        .and_then(|ago| chrono::Duration::from_std(ago).ok())
        .map(|ago| Utc::now() - ago)
        .ok_or_else(|| {
            format!("{flag} `{text}`: write a time (2026-11-27T10:00:00Z) or how long ago (2h)")
        })
}

impl Selection {
    fn filter(&self) -> Result<Filter, String> {
        let ids = self
            .ids
            .iter()
            .map(|id| {
                Uuid::parse_str(id.trim())
                    .map_err(|_| format!("`{id}` is not a message id (the row's Id, a UUID)"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let filter = Filter {
            ids,
            group: self.group.clone(),
            source: self.source.clone(),
            since: self
                .since
                .as_deref()
                .map(|t| parse_time("--since", t))
                .transpose()?,
            until: self
                .until
                .as_deref()
                .map(|t| parse_time("--until", t))
                .transpose()?,
        };
        Ok(filter)
    }

    /// The filter of a mutating command: an empty one only with `--all`.
    fn chosen(&self) -> Result<Filter, String> {
        let filter = self.filter()?;
        if filter.is_all() && !self.all {
            return Err(
                "name what to select: message ids, --group, --source, --since/--until, or --all"
                    .into(),
            );
        }
        Ok(filter)
    }
}

/// Runs an errors action against the error queue `queue` (default: the first configured
/// queue's error queue).
pub async fn errors(path: &Path, queue: Option<String>, action: Action) -> ExitCode {
    let config = match super::read_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let queue = match error_queue(&config, queue) {
        Ok(q) => q,
        Err(code) => return code,
    };
    if let Action::Retry {
        selection,
        to,
        yes,
        direct: false,
        url,
    } = &action
    {
        if config.transport.kind != TransportKind::Memory {
            // Counted first, so --yes is asked for before anything moves.
            let tool = match open(&config).await {
                Ok(t) => t,
                Err(code) => return code,
            };
            if let Err(code) = confirm(&tool, &queue, selection, *yes, "retry").await {
                return code;
            }
        }
        return retry_through_host(&config, &queue, selection, to.as_deref(), url.as_deref()).await;
    }
    if config.transport.kind == TransportKind::Memory {
        return invalid(format!(
            "{} uses the memory transport, whose error queue lives inside a running host: use its /errors routes (GET /errors/groups)",
            path.display()
        ));
    }
    let tool = match open(&config).await {
        Ok(t) => t,
        Err(code) => return code,
    };
    match on_the_table(&tool, &queue, action).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// `--queue`, else the first queue's error queue, else `error`.
fn error_queue(config: &Config, queue: Option<String>) -> Result<QueueName, ExitCode> {
    let queue = queue
        .or_else(|| config.queues.first().map(|q| q.error_queue.clone()))
        .unwrap_or_else(|| "error".into());
    QueueName::new(&queue).map_err(|e| invalid(format!("--queue: {e}")))
}

/// Runs `action` on the error queue's table directly.
async fn on_the_table(
    tool: &(FailedMessages, Arc<dyn Transport>),
    queue: &QueueName,
    action: Action,
) -> Result<(), ExitCode> {
    match action {
        Action::List {
            selection,
            messages,
            json,
            offset,
            limit,
        } => list(tool, queue, &selection, messages, json, offset, limit).await,
        Action::Show { id, json } => show(tool, queue, &id, json).await,
        Action::Retry {
            selection, to, yes, ..
        } => retry_direct(tool, queue, &selection, to.as_deref(), yes).await,
        Action::Delete { selection, yes } => delete(tool, queue, &selection, yes).await,
        Action::Export { selection, out } => export(tool, queue, &selection, &out).await,
        Action::Import { file, to } => import(tool.1.as_ref(), &file, &to).await,
    }
}

async fn open(config: &Config) -> Result<(FailedMessages, Arc<dyn Transport>), ExitCode> {
    let transport = transport::connect(&config.transport)
        .await
        .map_err(failed)?;
    let tool = FailedMessages::new(transport.clone()).map_err(failed)?;
    Ok((tool, transport))
}

type Tool = (FailedMessages, Arc<dyn Transport>);

fn short(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".into(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string())
}

async fn list(
    (tool, _): &Tool,
    queue: &QueueName,
    selection: &Selection,
    messages: bool,
    as_json: bool,
    offset: usize,
    limit: usize,
) -> Result<(), ExitCode> {
    let filter = selection.filter().map_err(invalid)?;
    if messages {
        let page = tool
            .list(queue, &filter, offset, limit)
            .await
            .map_err(failed)?;
        print_page(queue, &page, as_json);
    } else {
        let groups = tool.groups(queue, &filter).await.map_err(failed)?;
        print_groups(queue, &groups, as_json);
    }
    Ok(())
}

/// A page of failed messages, one line each (or as JSON).
fn print_page(queue: &QueueName, page: &Page, as_json: bool) {
    if as_json {
        println!(
            "{}",
            json!({ "queue": queue.as_str(), "total": page.total, "messages": page.messages })
        );
        return;
    }
    println!(
        "{:<36}  {:<12}  {:<19}  {:<20}  CAUSE",
        "ID", "GROUP", "FAILED", "SOURCE"
    );
    for m in &page.messages {
        println!(
            "{:<36}  {:<12}  {:<19}  {:<20}  {}: {}",
            m.id,
            m.group,
            short(m.failed_at),
            m.cause.source.as_deref().unwrap_or("-"),
            m.cause.exception_type,
            m.cause.message
        );
    }
    eprintln!(
        "{} of {} failed message(s) in {queue}",
        page.messages.len(),
        page.total
    );
}

/// The failed messages grouped by cause, one line a group (or as JSON).
fn print_groups(queue: &QueueName, groups: &[Group], as_json: bool) {
    if as_json {
        println!("{}", json!({ "queue": queue.as_str(), "groups": groups }));
        return;
    }
    println!(
        "{:<12}  {:>7}  {:<19}  {:<19}  {:<20}  CAUSE",
        "GROUP", "COUNT", "FIRST", "LAST", "SOURCE"
    );
    for g in groups {
        println!(
            "{:<12}  {:>7}  {:<19}  {:<19}  {:<20}  {}: {}",
            g.id,
            g.count,
            short(g.first),
            short(g.last),
            g.cause.source.as_deref().unwrap_or("-"),
            g.cause.exception_type,
            g.cause.message
        );
    }
    let total: u64 = groups.iter().map(|g| g.count).sum();
    eprintln!(
        "{total} failed message(s) in {} group(s) in {queue}",
        groups.len()
    );
}

async fn show(
    (tool, _): &Tool,
    queue: &QueueName,
    id: &str,
    as_json: bool,
) -> Result<(), ExitCode> {
    let id = Uuid::parse_str(id.trim())
        .map_err(|_| invalid(format!("`{id}` is not a message id (the row's Id, a UUID)")))?;
    let Some(view) = tool.show(queue, id, 64 * 1024).await.map_err(failed)? else {
        return Err(failed(format!("no message {id} in error queue {queue}")));
    };
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&view).unwrap_or_default()
        );
        return Ok(());
    }
    println!("id          {}", view.id);
    println!(
        "message id  {}",
        view.cause.message_id.as_deref().unwrap_or("-")
    );
    println!("group       {}", view.group);
    println!(
        "failed in   {}",
        view.cause.source.as_deref().unwrap_or("-")
    );
    println!("failed at   {}", short(view.cause.failed_at));
    println!(
        "exception   {}: {}",
        view.cause.exception_type, view.cause.message
    );
    if let Some(n) = &view.delayed_retries {
        println!("retries     {n} delayed");
    }
    println!("headers");
    match (&view.headers, &view.raw_headers) {
        (Some(h), _) => {
            for (k, v) in h {
                println!("  {k}: {}", v.as_deref().unwrap_or("null").escape_debug());
            }
        }
        (None, Some(raw)) => println!("  (not a JSON object) {}", raw.escape_debug()),
        (None, None) => {}
    }
    println!(
        "body        {} bytes, {}{}",
        view.body.size,
        view.body.kind,
        if view.body.cut { ", cut" } else { "" }
    );
    println!("{}", view.body.shown.escape_debug());
    if let Some(trace) = &view.stack_trace {
        println!("stack trace\n{trace}");
    }
    Ok(())
}

/// Selects what `selection` names, and refuses to go on past one message without `--yes`;
/// the ids selected are what the command then acts on (no second scan).
async fn confirm(
    (tool, _): &Tool,
    queue: &QueueName,
    selection: &Selection,
    yes: bool,
    verb: &str,
) -> Result<Vec<Uuid>, ExitCode> {
    let filter = selection.chosen().map_err(invalid)?;
    let ids = tool.select(queue, &filter).await.map_err(failed)?;
    if ids.len() > 1 && !yes {
        return Err(invalid(format!(
            "{} messages selected in {queue}: add --yes to {verb} them all",
            ids.len()
        )));
    }
    Ok(ids)
}

async fn delete(
    tool: &Tool,
    queue: &QueueName,
    selection: &Selection,
    yes: bool,
) -> Result<(), ExitCode> {
    let ids = confirm(tool, queue, selection, yes, "delete").await?;
    let deleted = tool.0.delete_ids(queue, &ids).await.map_err(failed)?;
    println!("deleted {deleted} failed message(s) from {queue}");
    Ok(())
}

async fn retry_direct(
    tool: &Tool,
    queue: &QueueName,
    selection: &Selection,
    to: Option<&str>,
    yes: bool,
) -> Result<(), ExitCode> {
    let to = to
        .map(QueueName::new)
        .transpose()
        .map_err(|e| invalid(format!("--to: {e}")))?;
    let ids = confirm(tool, queue, selection, yes, "retry").await?;
    eprintln!(
        "retrying {} message(s) from {queue} without a host: not paced by throttling",
        ids.len()
    );
    let progress = |moved: u64| eprint!("\rmoved {moved}");
    let stored = |_: &QueueName, _: &OutgoingMessage| {};
    let run = RetryRun {
        admit: None,
        progress: &progress,
        stored: &stored,
        stop: tokio_util::sync::CancellationToken::new(),
    };
    let done = tool
        .0
        .retry(queue, &ids, to.as_ref(), 100, &run)
        .await
        .map_err(failed)?;
    eprintln!();
    say_retried(&serde_json::to_value(&done).unwrap_or_default());
    Ok(())
}

fn say_retried(result: &Value) {
    println!(
        "retried {} message(s); left: {} with no queue to go back to (name one with --to), {} unreadable, {} gone or held by a receive{}",
        result["moved"],
        result["no_source"],
        result["unreadable"],
        result["gone"],
        if result["stopped"] == true {
            "; stopped before the end (run it again to go on)"
        } else {
            ""
        }
    );
}

/// One HTTP call to the admin endpoint: status and JSON body.
async fn call(
    method: &'static str,
    url: String,
    token: String,
    body: Option<Value>,
) -> Result<(u16, Value), String> {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(30)))
            .http_status_as_error(false)
            .build()
            .into();
        let auth = format!("Bearer {token}");
        let response = match (method, body) {
            ("POST", Some(body)) => agent
                .post(&url)
                .header("Authorization", &auth)
                .header("Content-Type", "application/json")
                .send(body.to_string().as_bytes()),
            _ => agent.get(&url).header("Authorization", &auth).call(),
        };
        let mut response = response.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| e.to_string())?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Starts the retry on the running host and follows its progress.
async fn retry_through_host(
    config: &Config,
    queue: &QueueName,
    selection: &Selection,
    to: Option<&str>,
    url: Option<&str>,
) -> ExitCode {
    let filter = match selection.chosen() {
        Ok(f) => f,
        Err(e) => return invalid(e),
    };
    let base = url
        .map(str::to_string)
        .unwrap_or_else(|| format!("http://{}", config.host.admin_address));
    let base = base.trim_end_matches('/').to_string();
    let token = config.admin.token.expose().to_string();
    let body = json!({
        "queue": queue.as_str(),
        "filter": {
            "ids": filter.ids,
            "group": filter.group,
            "source": filter.source,
            "since": filter.since,
            "until": filter.until,
        },
        "all": selection.all,
        "to": to,
    });
    match call(
        "POST",
        format!("{base}/errors/retry"),
        token.clone(),
        Some(body),
    )
    .await
    {
        Ok((202, _)) => {}
        Ok((status, answer)) => {
            return failed(format!(
                "the host at {base} refused the retry ({status}): {}",
                answer["error"].as_str().unwrap_or(&answer.to_string())
            ));
        }
        Err(e) => {
            return failed(format!(
                "no host answers at {base} ({e}): start it, name it with --url, or move without one (unpaced) with --direct"
            ));
        }
    }
    eprintln!("retry started on the host at {base}, paced by its publishing throttling");
    follow_retry(&base, &token).await
}

/// Shows the host's retry moving, once a second, until it ends; then what it did.
async fn follow_retry(base: &str, token: &str) -> ExitCode {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok((200, progress)) = call(
            "GET",
            format!("{base}/errors/retry"),
            token.to_string(),
            None,
        )
        .await
        else {
            return failed(format!(
                "lost the host at {base}; GET /errors/retry shows how far it got"
            ));
        };
        let job = &progress["job"];
        eprint!("\rmoved {} of {}", job["moved"], job["selected"]);
        if progress["running"] == false {
            eprintln!();
            if let Some(e) = job["error"].as_str() {
                return failed(format!("the retry stopped: {e}"));
            }
            say_retried(&job["result"]);
            return ExitCode::SUCCESS;
        }
    }
}

async fn export(
    (tool, _): &Tool,
    queue: &QueueName,
    selection: &Selection,
    out: &Path,
) -> Result<(), ExitCode> {
    let filter = selection.filter().map_err(invalid)?;
    let rows = tool.rows(queue, &filter).await.map_err(failed)?;
    let mut writer: Box<dyn Write> = if out == Path::new("-") {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(std::io::BufWriter::new(
            std::fs::File::create(out)
                .map_err(|e| failed(format!("cannot write {}: {e}", out.display())))?,
        ))
    };
    for (row, cause) in &rows {
        let headers: Option<Value> = serde_json::from_str(&row.headers).ok();
        let line = json!({
            "id": row.id,
            "headers": headers,
            "raw_headers": if headers.is_none() { Some(&row.headers) } else { None },
            "body_base64": data_encoding::BASE64.encode(&row.body),
            "failure": cause,
        });
        writeln!(writer, "{line}")
            .map_err(|e| failed(format!("writing {}: {e}", out.display())))?;
    }
    writer
        .flush()
        .map_err(|e| failed(format!("writing {}: {e}", out.display())))?;
    eprintln!("exported {} failed message(s) from {queue}", rows.len());
    Ok(())
}

/// One exported line as a message to store: its headers and body as they were, a new row id.
fn imported(line: &str) -> Result<OutgoingMessage, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let headers: throttlehost::Headers =
        serde_json::from_value(v["headers"].clone()).map_err(|_| {
            "no headers object (a row whose headers could not be read is not imported)".to_string()
        })?;
    let body = data_encoding::BASE64
        .decode(v["body_base64"].as_str().unwrap_or_default().as_bytes())
        .map_err(|e| format!("body_base64: {e}"))?;
    let mut message = OutgoingMessage::new(body);
    message.headers = headers;
    Ok(message)
}

async fn import(transport: &dyn Transport, file: &Path, to: &str) -> Result<(), ExitCode> {
    let to = QueueName::new(to).map_err(|e| invalid(format!("--to: {e}")))?;
    let reader = std::io::BufReader::new(
        std::fs::File::open(file)
            .map_err(|e| invalid(format!("cannot read {}: {e}", file.display())))?,
    );
    let mut batch = Vec::new();
    let (mut stored, mut skipped) = (0usize, 0usize);
    for (n, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| failed(format!("{}: {e}", file.display())))?;
        if line.trim().is_empty() {
            continue;
        }
        match imported(&line) {
            Ok(m) => batch.push(m),
            Err(e) => {
                eprintln!("{}:{}: skipped: {e}", file.display(), n + 1);
                skipped += 1;
            }
        }
        if batch.len() == 1000 {
            transport.send_batch(&to, &batch).await.map_err(failed)?;
            stored += batch.len();
            batch.clear();
        }
    }
    transport.send_batch(&to, &batch).await.map_err(failed)?;
    stored += batch.len();
    println!("imported {stored} message(s) into {to}; {skipped} line(s) skipped");
    Ok(())
}
