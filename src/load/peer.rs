//! Peer processes of a load run (`processes = N` in a scenario): N - 1 more hosts, each its
//! own `throttlehost load-peer` process with its own pool, receivers and controller, on the
//! same queues. Nothing but the database is shared with them, so a run shows what holds
//! between processes (key order, stage barriers, nothing lost or doubled).
//!
//! A peer reports what its dispatcher sees as one line per event on its standard output,
//! stamped with the wall clock (the same clock in every process of the machine), and the run
//! enters the lines in its ledger. A peer stops when its standard input closes: it stops
//! receiving, lets its messages in flight finish, reports them, and exits.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use uuid::Uuid;

use crate::dispatch::{DispatchObserver, Outcome};
use crate::host::HostBuilder;
use crate::throttling::sensors::SystemSensor;
use crate::transport::QueueName;

use super::options::{LoadError, LoadOptions, host_config};
use super::scenario::Scenario;

/// The environment variable that carries the scenario's text to a peer.
pub const SCENARIO_ENV: &str = "THROTTLEHOST_LOAD_PEER_SCENARIO";

/// How long a stopping peer may take to finish its messages in flight and exit.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// Now, in nanoseconds of the wall clock: comparable between processes of one machine.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// What a dispatcher saw, at a time from [`now_ns`].
#[derive(Debug, Clone, PartialEq)]
pub enum PeerEvent {
    /// A message's handling began.
    Started(Seen),
    /// A message's last attempt ended.
    Handled(Seen),
    /// A message left its queue for good.
    Completed(Seen, Outcome),
}

/// One message at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// Nanoseconds of the wall clock.
    pub at: u64,
    /// The row's id.
    pub id: Uuid,
    /// The logical id (`NServiceBus.MessageId`) when the dispatcher knew it.
    pub logical_id: Option<String>,
}

impl PeerEvent {
    /// The event as one line: `kind at id outcome logical-id`, the logical id last (`-` when
    /// unknown), since it is the only field that may hold spaces.
    pub fn line(&self) -> String {
        let (kind, seen, outcome) = match self {
            PeerEvent::Started(s) => ("started", s, "-"),
            PeerEvent::Handled(s) => ("handled", s, "-"),
            PeerEvent::Completed(s, o) => ("completed", s, outcome_word(*o)),
        };
        let logical = seen.logical_id.as_deref().unwrap_or("-");
        format!("{kind} {} {} {outcome} {logical}", seen.at, seen.id)
    }

    /// Reads a line [`PeerEvent::line`] wrote; None for anything else (a peer's other output).
    pub fn parse(line: &str) -> Option<PeerEvent> {
        let mut parts = line.splitn(5, ' ');
        let kind = parts.next()?;
        let at = parts.next()?.parse().ok()?;
        let id = Uuid::parse_str(parts.next()?).ok()?;
        let outcome = parts.next()?;
        let logical = parts.next()?;
        let seen = Seen {
            at,
            id,
            logical_id: (logical != "-").then(|| logical.to_string()),
        };
        match kind {
            "started" => Some(PeerEvent::Started(seen)),
            "handled" => Some(PeerEvent::Handled(seen)),
            "completed" => Some(PeerEvent::Completed(seen, outcome_from_word(outcome)?)),
            _ => None,
        }
    }
}

fn outcome_word(o: Outcome) -> &'static str {
    match o {
        Outcome::Success => "success",
        Outcome::Error => "error",
        Outcome::Expired => "expired",
        Outcome::Poison => "poison",
    }
}

fn outcome_from_word(word: &str) -> Option<Outcome> {
    Some(match word {
        "success" => Outcome::Success,
        "error" => Outcome::Error,
        "expired" => Outcome::Expired,
        "poison" => Outcome::Poison,
        _ => return None,
    })
}

/// A peer's observer: every event as a line on standard output.
struct EventWriter;

impl EventWriter {
    fn write(&self, event: PeerEvent) {
        use std::io::Write;
        // Standard output is line-buffered: each event leaves at once, whole.
        let _ = writeln!(std::io::stdout().lock(), "{}", event.line());
    }
}

fn seen(id: Uuid, logical_id: Option<&str>) -> Seen {
    Seen {
        at: now_ns(),
        id,
        logical_id: logical_id.map(str::to_string),
    }
}

impl DispatchObserver for EventWriter {
    fn completed(&self, _queue: &QueueName, id: Uuid, logical_id: Option<&str>, outcome: Outcome) {
        self.write(PeerEvent::Completed(seen(id, logical_id), outcome));
    }

    fn started(&self, _queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        self.write(PeerEvent::Started(seen(id, logical_id)));
    }

    fn handled(&self, _queue: &QueueName, id: Uuid, logical_id: Option<&str>) {
        self.write(PeerEvent::Handled(seen(id, logical_id)));
    }
}

/// Runs as a peer (`throttlehost load-peer`): the scenario's host, without an admin endpoint,
/// reporting its events on standard output until standard input closes.
pub async fn serve(scenario: &Scenario, options: &LoadOptions) -> Result<(), LoadError> {
    let mut config = host_config(scenario, options, &mut SystemSensor::new());
    config.host.admin_address = "off".into();
    config.host.instance_id = format!("load-peer-{}", std::process::id());
    let host = HostBuilder::new(config)
        .observer(Arc::new(EventWriter))
        .start()
        .await?;
    // Until the run closes our standard input (or ends, which closes it too).
    let _ = tokio::task::spawn_blocking(|| {
        use std::io::Read;
        let mut stdin = std::io::stdin();
        let mut sink = [0u8; 64];
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    })
    .await;
    host.shutdown().await;
    Ok(())
}

/// The peers of a run, each reporting into `sink` with its number (1 and up; the run itself
/// is 0).
pub struct Peers {
    children: Vec<(Child, Option<ChildStdin>)>,
    readers: Vec<tokio::task::JoinHandle<()>>,
    /// The peers killed on purpose (a phase's `kill_peer`), by number.
    killed: Vec<usize>,
}

impl Peers {
    /// Starts `count` peers of `scenario` (the program is this one, or `options.peer_program`).
    pub fn spawn(
        count: u32,
        scenario: &Scenario,
        options: &LoadOptions,
        sink: Arc<dyn Fn(usize, PeerEvent) + Send + Sync>,
    ) -> Result<Peers, LoadError> {
        let program = match &options.peer_program {
            Some(p) => p.clone(),
            None => std::env::current_exe().map_err(LoadError::Peer)?,
        };
        let mut peers = Peers {
            children: Vec::new(),
            readers: Vec::new(),
            killed: Vec::new(),
        };
        for number in 1..=count as usize {
            let mut command = Command::new(&program);
            command
                .arg("load-peer")
                .env(SCENARIO_ENV, &scenario.source)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true);
            if let Some(schema) = &options.schema {
                command.args(["--schema", schema]);
            }
            if let Some(cs) = &options.connection_string {
                command.env("THROTTLEHOST_LOAD_CONNECTION_STRING", cs);
            }
            let mut child = command.spawn().map_err(LoadError::Peer)?;
            let stdin = child.stdin.take();
            let stdout = child.stdout.take().expect("piped");
            let sink = sink.clone();
            peers.readers.push(tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(event) = PeerEvent::parse(&line) {
                        sink(number, event);
                    }
                }
            }));
            peers.children.push((child, stdin));
        }
        Ok(peers)
    }

    /// Kills peer `number` (1 and up) with SIGKILL, as `kill -9` would: it finishes nothing,
    /// and the database rolls back what it held.
    pub fn kill(&mut self, number: usize) -> Result<(), String> {
        let (child, _) = number
            .checked_sub(1)
            .and_then(|i| self.children.get_mut(i))
            .ok_or_else(|| format!("there is no peer {number}"))?;
        child
            .start_kill()
            .map_err(|e| format!("peer {number} could not be killed: {e}"))?;
        self.killed.push(number);
        Ok(())
    }

    /// Pauses peer `number` (SIGSTOP: `paused`) or resumes it (SIGCONT), through kill(1).
    pub fn pause(&mut self, number: usize, paused: bool) -> Result<(), String> {
        let (child, _) = number
            .checked_sub(1)
            .and_then(|i| self.children.get(i))
            .ok_or_else(|| format!("there is no peer {number}"))?;
        let pid = child
            .id()
            .ok_or_else(|| format!("peer {number} has already exited"))?;
        let signal = if paused { "-STOP" } else { "-CONT" };
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .map_err(|e| format!("kill {signal} of peer {number}: {e}"))?;
        match status.success() {
            true => Ok(()),
            false => Err(format!(
                "kill {signal} of peer {number} exited with {status}"
            )),
        }
    }

    /// Stops every peer: closes its standard input, waits for it to finish its messages in
    /// flight and exit (killing it after `STOP_TIMEOUT`), and reads the last of its events.
    /// Returns the peers that did not exit cleanly, in words.
    pub async fn stop(mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for (_, stdin) in &mut self.children {
            stdin.take();
        }
        for (number, (mut child, _)) in self.children.into_iter().enumerate() {
            let number = number + 1;
            if self.killed.contains(&number) {
                let _ = child.wait().await;
                continue;
            }
            match tokio::time::timeout(STOP_TIMEOUT, child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(Ok(status)) => problems.push(format!("peer {number} exited with {status}")),
                Ok(Err(e)) => problems.push(format!("peer {number}: {e}")),
                Err(_) => {
                    let _ = child.kill().await;
                    problems.push(format!(
                        "peer {number} did not stop within {} s and was killed",
                        STOP_TIMEOUT.as_secs()
                    ));
                }
            }
        }
        for reader in self.readers {
            let _ = reader.await;
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_line_reads_back_as_the_same_event() {
        let id = Uuid::new_v4();
        let events = [
            PeerEvent::Started(Seen {
                at: 17,
                id,
                logical_id: None,
            }),
            PeerEvent::Handled(Seen {
                at: u64::MAX,
                id,
                logical_id: Some("order 17 with spaces".into()),
            }),
            PeerEvent::Completed(
                Seen {
                    at: 1,
                    id,
                    logical_id: Some(Uuid::new_v4().to_string()),
                },
                Outcome::Error,
            ),
        ];
        for event in events {
            assert_eq!(PeerEvent::parse(&event.line()), Some(event));
        }
        assert_eq!(PeerEvent::parse("peer log line"), None);
        assert_eq!(PeerEvent::parse(&format!("completed 5 {id} maybe -")), None);
    }
}
