//! Faults at the process level, with the binary as an operator runs it, against the real
//! PostgreSQL: `kill -9` in the middle of a drain in each transaction mode, and hosts
//! competing for one queue. Each host forwards `in` to `out`; every message is accounted for
//! by its id (`NServiceBus.MessageId`, which forwarding keeps): lost = sent and found in
//! neither queue, duplicated = found in `out` more than once.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{PgSchema, fill, q};
use throttlehost::config::{ConnectionString, TransactionMode, TransportConfig, TransportKind};
use throttlehost::transport::Transport;
use throttlehost::transport::postgres::PostgresTransport;

/// The most messages a host has in flight: its queue's max concurrency.
const MAX_IN_FLIGHT: u32 = 8;

/// A running `throttlehost run`, killed (SIGKILL) if the test ends first.
struct HostProcess(Child);

impl HostProcess {
    fn start(config: &PathBuf) -> Self {
        Self::logging_to(config, Stdio::null())
    }

    /// Starts with the log (stderr) going to `log`.
    fn logging_to(config: &PathBuf, log: impl Into<Stdio>) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
            .args(["run", "--config"])
            .arg(config)
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the binary starts");
        HostProcess(child)
    }

    /// `kill -9`: no shutdown, no rollback by the host, connections just drop.
    fn kill_9(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }

    /// SIGTERM, then waits for the exit.
    fn stop(mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = self.0.wait().unwrap();
        assert!(exit.success(), "graceful stop: {exit}");
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A schema with `in` holding `messages` and an empty `out`, and a config that forwards one to
/// the other in `mode`.
struct Drain {
    /// Where the schema lives.
    url: String,
    schema: String,
    sent: HashSet<String>,
    config: PathBuf,
    /// The shared server's schema, dropped with the test.
    _shared: Option<PgSchema>,
}

impl Drain {
    /// On the shared server, in a schema of its own.
    async fn new(mode: TransactionMode, messages: usize) -> Self {
        let shared = PgSchema::new();
        let (url, schema) = (shared.connection_string(), shared.name.clone());
        Drain::on(&url, &schema, mode, messages, "", Some(shared)).await
    }

    /// On any server; `settings` are added to the `[transport]` table.
    async fn on(
        url: &str,
        schema: &str,
        mode: TransactionMode,
        messages: usize,
        settings: &str,
        shared: Option<PgSchema>,
    ) -> Self {
        let transport_config = TransportConfig {
            kind: TransportKind::Postgres,
            connection_string: ConnectionString::new(url.to_string()),
            schema: schema.to_string(),
            pool_size: 4,
            transaction_mode: mode,
            ..TransportConfig::default()
        };
        let transport: Arc<dyn Transport> =
            Arc::new(PostgresTransport::connect(&transport_config).await.unwrap());
        transport.admin().create_queue(&q("in")).await.unwrap();
        transport.admin().create_queue(&q("out")).await.unwrap();
        let sent = fill(&transport, &q("in"), messages)
            .await
            .into_iter()
            .collect();
        let mode = match mode {
            TransactionMode::None => "none",
            TransactionMode::ReceiveOnly => "receive_only",
            TransactionMode::SendsAtomicWithReceive => "sends_atomic_with_receive",
        };
        let config = std::env::temp_dir().join(format!("th-{}.toml", uuid::Uuid::new_v4()));
        std::fs::write(
            &config,
            format!(
                r#"[host]
name = "faults"
admin_address = "off"
shutdown_timeout = "5s"

[transport]
kind = "postgres"
connection_string = "{url}"
schema = "{schema}"
pool_size = 16
transaction_mode = "{mode}"
{settings}

[[queues]]
name = "in"
[queues.concurrency]
model = "monitor"
max = {MAX_IN_FLIGHT}
[queues.handler]
kind = "forward"
to = "out"
"#,
            ),
        )
        .unwrap();
        Drain {
            url: url.to_string(),
            schema: schema.to_string(),
            sent,
            config,
            _shared: shared,
        }
    }

    async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
            .await
            .expect("the database answers");
        tokio::spawn(connection);
        client
    }

    /// Message ids in one queue table, with repeats.
    async fn ids(&self, queue: &str) -> Vec<String> {
        let client = self.client().await;
        let rows = client
            .query(
                &format!("SELECT Headers FROM \"{}\".\"{queue}\"", self.schema),
                &[],
            )
            .await
            .unwrap();
        rows.iter()
            .map(|row| {
                let headers: String = row.get(0);
                let headers: HashMap<String, String> = serde_json::from_str(&headers).unwrap();
                headers["NServiceBus.MessageId"].clone()
            })
            .collect()
    }

    async fn count(&self, queue: &str) -> i64 {
        self.try_count(queue).await.expect("the database answers")
    }

    async fn try_count(&self, queue: &str) -> Result<i64, tokio_postgres::Error> {
        let (client, connection) =
            tokio_postgres::connect(&self.url, tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        let sql = format!("SELECT count(*) FROM \"{}\".\"{queue}\"", self.schema);
        Ok(client.query_one(&sql, &[]).await?.get(0))
    }

    async fn wait_for(&self, what: &str, timeout: Duration, done: impl Fn(i64, i64) -> bool) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (left, out) = (self.count("in").await, self.count("out").await);
            if done(left, out) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {left} left in `in`, {out} in `out`"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for every message to be forwarded, stops `host`, and requires each exactly once.
    async fn finish_exactly_once(&self, host: HostProcess) {
        let total = self.sent.len() as i64;
        self.wait_for("the drain ends", Duration::from_secs(120), |left, out| {
            left == 0 && out >= total
        })
        .await;
        host.stop();
        assert_eq!(self.account().await, (0, 0), "(lost, duplicated)");
    }

    /// (lost, duplicated) once everything has been forwarded.
    async fn account(&self) -> (usize, usize) {
        assert_eq!(self.count("in").await, 0, "everything was received");
        let out = self.ids("out").await;
        let distinct: HashSet<&String> = out.iter().collect();
        assert!(
            distinct.iter().all(|id| self.sent.contains(*id)),
            "only sent messages arrive"
        );
        (self.sent.len() - distinct.len(), out.len() - distinct.len())
    }

    /// Starts a host, kills it with SIGKILL once `out` holds `before_kill` messages, then
    /// lets a second host finish the drain; returns (lost, duplicated).
    async fn kill_9_mid_drain(&self, before_kill: i64) -> (usize, usize) {
        let first = HostProcess::start(&self.config);
        self.wait_for(
            "the first host drains",
            Duration::from_secs(60),
            |_, out| out >= before_kill,
        )
        .await;
        first.kill_9();
        let left = self.count("in").await;
        assert!(left > 0, "killed mid-drain, not after it");
        let second = HostProcess::start(&self.config);
        let total = self.sent.len() as i64;
        self.wait_for(
            "the second host drains",
            Duration::from_secs(60),
            |left, out| left == 0 && out >= total - i64::from(MAX_IN_FLIGHT),
        )
        .await;
        // What is in flight at the end lands within moments.
        tokio::time::sleep(Duration::from_millis(500)).await;
        second.stop();
        let (lost, duplicated) = self.account().await;
        eprintln!("kill -9 after {before_kill} forwarded: {lost} lost, {duplicated} duplicated");
        (lost, duplicated)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_drain_with_atomic_sends_loses_and_duplicates_nothing() {
    let drain = Drain::new(TransactionMode::SendsAtomicWithReceive, 5000).await;
    let (lost, duplicated) = drain.kill_9_mid_drain(1500).await;
    assert_eq!((lost, duplicated), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_drain_receive_only_loses_nothing_and_repeats_at_most_the_in_flight() {
    let drain = Drain::new(TransactionMode::ReceiveOnly, 5000).await;
    let (lost, duplicated) = drain.kill_9_mid_drain(1500).await;
    assert_eq!(lost, 0);
    assert!(
        duplicated <= MAX_IN_FLIGHT as usize,
        "{duplicated} duplicates"
    );
}

/// Mode `none` receives with an autocommitted DELETE (at most once): what was in flight at the
/// kill is gone, nothing else, and nothing arrives twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_drain_without_transactions_loses_at_most_the_in_flight() {
    let drain = Drain::new(TransactionMode::None, 5000).await;
    let (lost, duplicated) = drain.kill_9_mid_drain(1500).await;
    assert!(lost <= MAX_IN_FLIGHT as usize, "{lost} lost");
    assert_eq!(duplicated, 0);
}

/// Three host processes on one queue share it: each message is forwarded exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_competing_hosts_forward_each_message_exactly_once() {
    let drain = Drain::new(TransactionMode::SendsAtomicWithReceive, 9000).await;
    let hosts: Vec<HostProcess> = (0..3).map(|_| HostProcess::start(&drain.config)).collect();
    drain
        .wait_for("three hosts drain", Duration::from_secs(90), |left, out| {
            left == 0 && out >= 9000
        })
        .await;
    for host in hosts {
        host.stop();
    }
    assert_eq!(drain.account().await, (0, 0));
}

/// A PostgreSQL cluster of the test's own (initdb into a temporary directory, its own port),
/// so that it can be restarted, stopped for a while and frozen without touching the shared
/// server other tests use. As root, its programs run as the `postgres` user (initdb refuses
/// root).
struct OwnCluster {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
}

impl OwnCluster {
    fn start() -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's programs in /usr/lib/postgresql (Debian's postgresql package)")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|bin| bin.join("initdb").exists())
            .max_by_key(|bin| {
                let version = bin.parent().unwrap().file_name().unwrap().to_string_lossy();
                version.parse::<u32>().unwrap_or(0)
            })
            .expect("initdb");
        let dir = std::env::temp_dir().join(format!("th-cluster-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let cluster = OwnCluster {
            dir,
            bin,
            port: common::free_port(),
        };
        if is_root() {
            let id = |flag: &str| -> u32 {
                let out = Command::new("id")
                    .args([flag, "postgres"])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
            };
            std::os::unix::fs::chown(&cluster.dir, Some(id("-u")), Some(id("-g"))).unwrap();
        }
        let data = cluster.data();
        cluster.run(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        cluster.start_server();
        cluster
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// Runs one of PostgreSQL's programs as the cluster's owner.
    fn run(&self, program: &str, args: &[&str]) {
        let program = self.bin.join(program);
        let mut command = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        };
        let out = command.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{} {args:?}: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the server and returns once it accepts connections.
    fn start_server(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "start",
            ],
        );
    }

    /// Stops the server: `fast` rolls back and disconnects, `immediate` aborts.
    fn stop_server(&self, mode: &str) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", mode, "-w", "stop"]);
    }

    /// The server and every backend, as `/proc` lists them.
    fn processes(&self) -> Vec<u32> {
        let pid_file = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).unwrap();
        let postmaster: u32 = pid_file.lines().next().unwrap().trim().parse().unwrap();
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // The parent's pid is the second field after the command name in parentheses.
            let after_name = stat.rsplit_once(") ").map(|(_, rest)| rest).unwrap_or("");
            let parent = after_name
                .split(' ')
                .nth(1)
                .and_then(|p| p.parse::<u32>().ok());
            if parent == Some(postmaster) {
                pids.extend(
                    entry
                        .file_name()
                        .to_str()
                        .and_then(|p| p.parse::<u32>().ok()),
                );
            }
        }
        pids
    }

    fn signal(&self, signal: &str) {
        for pid in self.processes() {
            // A backend may have exited since the listing.
            let _ = Command::new("kill")
                .args([signal, &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// SIGSTOP to the server and its backends: connections stay open, nothing answers.
    fn freeze(&self) {
        self.signal("-STOP");
    }

    fn thaw(&self) {
        self.signal("-CONT");
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        if self.dir.join("data/postmaster.pid").exists() {
            self.thaw();
            let _ = std::panic::catch_unwind(|| self.stop_server("immediate"));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Forwarded messages so far, read until it changes: how long receiving took to resume.
async fn resumed_within(drain: &Drain, limit: Duration) -> Duration {
    let started = tokio::time::Instant::now();
    let before = loop {
        // The first connection after a restart may still be refused for a moment.
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_secs(1), drain.try_count("out")).await
        {
            break n;
        }
        assert!(started.elapsed() < limit, "the database answers again");
    };
    loop {
        let now = drain.count("out").await;
        if now > before {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "receiving did not resume within {limit:?} of the database answering"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn drain_on(cluster: &OwnCluster, messages: usize, settings: &str) -> Drain {
    let mode = TransactionMode::SendsAtomicWithReceive;
    Drain::on(&cluster.url(), "faults", mode, messages, settings, None).await
}

/// Stops the cluster mid-drain for `outage`, starts it again, and requires receiving to resume
/// within 10 s of the server answering, and every message forwarded exactly once.
async fn outage_mid_drain(stop_mode: &str, outage: Duration) {
    let cluster = OwnCluster::start();
    let drain = drain_on(&cluster, 20_000, "").await;
    let host = HostProcess::start(&drain.config);
    drain
        .wait_for("the host drains", Duration::from_secs(60), |_, out| {
            out >= 1000
        })
        .await;
    cluster.stop_server(stop_mode);
    tokio::time::sleep(outage).await;
    cluster.start_server();
    let resumed = resumed_within(&drain, Duration::from_secs(10)).await;
    eprintln!(
        "stop -m {stop_mode}, {outage:?} down: receiving resumed {resumed:?} after the server answered"
    );
    drain.finish_exactly_once(host).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_restart_mid_drain_resumes_within_10_s_and_loses_nothing() {
    outage_mid_drain("fast", Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_restart_mid_drain_resumes_within_10_s_and_loses_nothing() {
    outage_mid_drain("immediate", Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_30_s_outage_mid_drain_resumes_within_10_s_and_loses_nothing() {
    outage_mid_drain("fast", Duration::from_secs(30)).await;
}

/// A frozen server (SIGSTOP: connections stay open, the kernel acknowledges what is sent,
/// nothing answers) is noticed by the client within command_timeout and 2 s, logged, and
/// receiving resumes once it thaws. Before, receives waited forever and nothing was logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_is_noticed_within_the_command_timeout() {
    let cluster = OwnCluster::start();
    let drain = drain_on(&cluster, 20_000, "command_timeout = \"2s\"").await;
    let log_path = cluster.dir.join("host.log");
    let host = HostProcess::logging_to(&drain.config, std::fs::File::create(&log_path).unwrap());
    drain
        .wait_for("the host drains", Duration::from_secs(60), |_, out| {
            out >= 1000
        })
        .await;
    cluster.freeze();
    let frozen = std::time::Instant::now();
    let noticed = loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if log.contains("did not answer") {
            break frozen.elapsed();
        }
        assert!(
            frozen.elapsed() < Duration::from_secs(15),
            "the frozen server was not noticed: {log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("frozen server noticed after {noticed:?}");
    assert!(
        noticed <= Duration::from_millis(5500),
        "noticed after {noticed:?}; the limit is command_timeout (2 s) + 2 s"
    );
    cluster.thaw();
    let resumed = resumed_within(&drain, Duration::from_secs(10)).await;
    eprintln!("receiving resumed {resumed:?} after the server thawed");
    drain.finish_exactly_once(host).await;
}

/// Delayed messages survive `kill -9` of the host that moves them: stored in `in`'s delayed
/// table, due over 12 s, moved (100 per transaction) and forwarded to `out` by a host killed
/// mid-way; a second host finishes. (Due over 3 s, a host that took 3 s to start beside the
/// other fault tests' clusters found every message due and moved them all before the kill.) With atomic sends nothing is lost and nothing repeats (a
/// move commits whole or not at all, and a forward commits with its receive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_delayed_messages_move_loses_nothing() {
    let mut drain = Drain::new(TransactionMode::SendsAtomicWithReceive, 0).await;
    let transport_config = TransportConfig {
        kind: TransportKind::Postgres,
        connection_string: ConnectionString::new(drain.url.clone()),
        schema: drain.schema.clone(),
        pool_size: 4,
        ..TransportConfig::default()
    };
    let transport = PostgresTransport::connect(&transport_config).await.unwrap();
    let delayed = transport.delayed_delivery().unwrap();
    delayed.create_delayed(&q("in")).await.unwrap();
    let messages: Vec<throttlehost::OutgoingMessage> = (0..3000u64)
        .map(|i| {
            throttlehost::OutgoingMessage::new(format!("m{i}"))
                .with_delay(Duration::from_millis(4 * i))
        })
        .collect();
    for chunk in messages.chunks(500) {
        transport.send_batch(&q("in"), chunk).await.unwrap();
    }
    drain.sent = messages.iter().map(|m| m.logical_id()).collect();
    let waiting = || async { drain.count("in").await + drain.count("in.Delayed").await };

    let first = HostProcess::start(&drain.config);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while drain.count("out").await < 500 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first host moves"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.kill_9();
    let left = drain.count("in.Delayed").await;
    assert!(left > 0, "killed while delayed messages wait ({left} left)");

    let second = HostProcess::start(&drain.config);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while waiting().await > 0 || drain.count("out").await < 3000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second host finishes: {} waiting, {} in out",
            waiting().await,
            drain.count("out").await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    second.stop();
    let (lost, duplicated) = drain.account().await;
    eprintln!("kill -9 with {left} delayed messages waiting: {lost} lost, {duplicated} duplicated");
    assert_eq!((lost, duplicated), (0, 0), "(lost, duplicated)");
}
