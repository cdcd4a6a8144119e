//! `throttlehost run` under a service manager speaking systemd's notify protocol, played by
//! the test: a datagram socket named by `NOTIFY_SOCKET` (and `WATCHDOG_USEC`, as systemd sets
//! for `WatchdogSec=`). The host says READY=1 with a status once it receives, feeds the
//! watchdog with every controller sample (0.5 s), reports RELOADING=1 then READY=1 around a
//! SIGHUP and STOPPING=1 on SIGTERM; while its database does not answer it is not ready, says
//! why in STATUS= and extends its start.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, signal};

/// The service manager's side: a socket in a directory of its own.
struct Manager {
    socket: UnixDatagram,
    dir: PathBuf,
}

impl Manager {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("th-notify-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = UnixDatagram::bind(dir.join("notify")).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        Manager { socket, dir }
    }

    /// Starts `throttlehost run` with `config` (a TOML text) as a notify service with a watchdog.
    fn start(&self, config: &str) -> Child {
        let path = self.dir.join("host.toml");
        std::fs::write(&path, config).unwrap();
        Command::new(env!("CARGO_BIN_EXE_throttlehost"))
            .args(["run", "--config"])
            .arg(&path)
            .env("NOTIFY_SOCKET", self.dir.join("notify"))
            .env("WATCHDOG_USEC", "30000000")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Datagrams in order until `done` says so of one or `timeout` passes; whether `done` did.
    fn collect(&self, timeout: Duration, done: impl Fn(&str) -> bool) -> (Vec<String>, bool) {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        let mut buffer = [0u8; 4096];
        while Instant::now() < deadline {
            if let Ok(n) = self.socket.recv(&mut buffer) {
                got.push(String::from_utf8_lossy(&buffer[..n]).into_owned());
                if done(got.last().unwrap()) {
                    return (got, true);
                }
            }
        }
        (got, false)
    }

    /// Every datagram received within `window`, in order.
    fn received(&self, window: Duration) -> Vec<String> {
        self.collect(window, |_| false).0
    }

    /// Datagrams until one contains `line` (within `timeout`); panics with what came otherwise.
    fn until(&self, line: &str, timeout: Duration) -> Vec<String> {
        let (got, found) = self.collect(timeout, |d| d.lines().any(|l| l == line));
        assert!(found, "no {line} within {timeout:?}; received {got:?}");
        got
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits for the host to exit (it owns its child: no one else waits for it).
fn wait_for_exit(mut child: Child, timeout: Duration) -> std::process::ExitStatus {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(timeout) {
        Ok(status) => status.unwrap(),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("the host did not exit within {timeout:?}");
        }
    }
}

fn count(datagrams: &[String], line: &str) -> usize {
    datagrams
        .iter()
        .filter(|d| d.lines().any(|l| l == line))
        .count()
}

const MEMORY_HOST: &str = "[host]\nadmin_address = \"off\"\n[transport]\nkind = \"memory\"\n\
                           [[queues]]\nname = \"orders\"\n[queues.handler]\nkind = \"noop\"\n";

#[test]
fn a_running_host_is_ready_fed_by_its_controller_reloads_and_stops() {
    let manager = Manager::new();
    let host = manager.start(MEMORY_HOST);
    let start = manager.until("READY=1", Duration::from_secs(20));
    let ready = start.last().unwrap();
    assert!(
        ready.lines().any(|l| l.starts_with("STATUS=")),
        "READY=1 comes with a status: {ready:?}"
    );

    // The controller samples every 0.5 s: about 6 pings in 3 s, the first with the states.
    let fed = manager.received(Duration::from_secs(3));
    let pings = count(&fed, "WATCHDOG=1");
    assert!(
        (4..=8).contains(&pings),
        "{pings} watchdog pings in 3 s: {fed:?}"
    );
    assert!(
        fed.iter()
            .flat_map(|d| d.lines())
            .any(|l| l == "STATUS=delivery 0 (not throttling); publishing 0 (not throttling)"),
        "the states per direction: {fed:?}"
    );

    signal(&host, "HUP");
    let reload = manager.until("RELOADING=1", Duration::from_secs(5));
    assert!(
        reload.last().unwrap().contains("STATUS=reloading"),
        "{reload:?}"
    );
    let reloaded = manager.until("READY=1", Duration::from_secs(5));
    assert!(
        reloaded
            .last()
            .unwrap()
            .contains("STATUS=configuration reloaded"),
        "{reloaded:?}"
    );

    signal(&host, "TERM");
    manager.until("STOPPING=1", Duration::from_secs(5));
    assert!(wait_for_exit(host, Duration::from_secs(20)).success());
}

/// A database that does not answer: no READY=1, the reason in STATUS=, and the start
/// extended each time it tries again, so systemd's start timeout does not kill a host that is
/// only waiting.
#[test]
fn a_host_waiting_for_its_database_is_not_ready_and_says_why() {
    let manager = Manager::new();
    // A port nothing listens on.
    let port = free_port();
    let host = manager.start(&format!(
        "[host]\nadmin_address = \"off\"\n[transport]\nkind = \"postgres\"\n\
         connection_string = \"host=127.0.0.1 port={port} user=postgres dbname=test connect_timeout=1\"\nconnect_timeout = \"1s\"\n\
         [[queues]]\nname = \"orders\"\n[queues.handler]\nkind = \"noop\"\n"
    ));
    let said = manager.received(Duration::from_secs(4));
    signal(&host, "TERM");
    assert!(wait_for_exit(host, Duration::from_secs(20)).success());
    assert_eq!(count(&said, "READY=1"), 0, "not ready: {said:?}");
    let waiting = said
        .iter()
        .filter(|d| d.contains("STATUS=waiting for the database"))
        .count();
    assert!(waiting >= 2, "says why at every try: {said:?}");
    // Each try extends the start past the next: within 1 s, plus twice the connect timeout
    // (`transport.connect_timeout`, 1 s here), plus 10 s for the start itself.
    assert!(
        said.iter()
            .filter(|d| d.contains("STATUS=waiting"))
            .all(|d| d.contains("EXTEND_TIMEOUT_USEC=13000000")),
        "each extends the start: {said:?}"
    );
}
