//! `throttlehost run` started before its database answers, as a supervisor starts hosts and
//! databases in any order: the admin endpoint says why it is not up from the first seconds,
//! SIGHUP reloads instead of killing it, SIGTERM stops it cleanly, and it starts within about
//! 2 s of the database answering. The database "comes up" as a TCP proxy to the real server
//! opened on the port the host was told to use.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{PgSchema, free_port, http, signal, wait_until};

/// Forwards every connection to `listener` to `to`, both ways, until the process ends.
fn proxy(listener: TcpListener, to: &'static str) {
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(to) else {
                continue;
            };
            for (mut from, mut into) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || into.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = into.shutdown(std::net::Shutdown::Both);
                });
            }
        }
    });
}

/// Writes a `run` configuration for PostgreSQL on `db_port` (nothing listens there yet) with
/// `admin` as its admin address, and starts `throttlehost run` with it.
fn start_run(name: &str, db_port: u16, admin: &str, schema: &str) -> (Child, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("th-startup-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("host.toml");
    std::fs::write(
        &config,
        format!(
            "[host]\nadmin_address = \"{admin}\"\n[transport]\nkind = \"postgres\"\n\
             connection_string = \"host=127.0.0.1 port={db_port} user=postgres dbname=test connect_timeout=2\"\n\
             schema = \"{schema}\"\n[[queues]]\nname = \"orders\"\n[queues.handler]\nkind = \"noop\"\n"
        ),
    )
    .unwrap();
    let host = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["run", "--config"])
        .arg(&config)
        // Each later try while waiting says so at debug, which tests wait on.
        .env("RUST_LOG", "info,throttlehost::cli::run=debug")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    (host, dir)
}

fn ready(admin: &str) -> (u16, String) {
    let (status, body, _) = http("GET", &format!("http://{admin}/readyz"), b"", &[]);
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_started_before_its_database_says_so_survives_sighup_and_starts_promptly() {
    let schema = PgSchema::new();
    let db_port = free_port();
    let admin = format!("127.0.0.1:{}", free_port());
    let (mut host, dir) = start_run(&schema.name, db_port, &admin, &schema.name);

    // The admin endpoint answers while the database does not.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, body) = loop {
        let (status, body) = ready(&admin);
        if status != 0 || Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("waiting for the database"), "{body}");
    // `status` says so with exit code 3 (receiving impaired), not 2 (unreachable).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["status", "--url", &format!("http://{admin}")])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{said}");
    assert!(said.contains("waiting for the database"), "{said}");

    // SIGHUP while waiting reloads (or is ignored), never kills.
    for _ in 0..3 {
        signal(&host, "HUP");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(host.try_wait().unwrap().is_none(), "SIGHUP killed the host");

    // The database answers: the host is up within about 2 s.
    proxy(
        TcpListener::bind(("127.0.0.1", db_port)).unwrap(),
        "127.0.0.1:5432",
    );
    let answered = Instant::now();
    let deadline = answered + Duration::from_secs(15);
    while ready(&admin).0 != 200 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = answered.elapsed();
    assert_eq!(ready(&admin).0, 200, "not ready after {took:?}");
    assert!(
        took <= Duration::from_secs(4),
        "started {took:?} after the database answered (retries 1-2 s apart)"
    );
    eprintln!("ready {took:?} after the database answered");

    signal(&host, "TERM");
    let exit = host.wait().unwrap();
    assert!(exit.success(), "SIGTERM stops cleanly: {exit}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_for_the_database_stops_cleanly() {
    let db_port = free_port();
    let (mut host, dir) = start_run(&format!("term-{db_port}"), db_port, "off", "public");
    let log = dir.join("stderr.log");
    let tries = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("database still not reachable")
            .count()
    };
    wait_until(Duration::from_secs(30), "waiting for the database", || {
        tries() >= 1
    })
    .await;
    signal(&host, "HUP");
    let before = tries();
    wait_until(
        Duration::from_secs(30),
        "two more tries after SIGHUP",
        || tries() >= before + 2,
    )
    .await;
    assert!(host.try_wait().unwrap().is_none(), "SIGHUP killed the host");
    signal(&host, "TERM");
    let exit = host.wait().unwrap();
    assert!(exit.success(), "{exit}");
    // Several tries a second apart, one warning: the same reason is said again after a minute.
    let log = std::fs::read_to_string(dir.join("stderr.log")).unwrap();
    let warned = log.matches("database not reachable").count();
    assert_eq!(warned, 1, "{log}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A process memory threshold below the host's own idle memory would never let a message
/// through: the start is refused, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_memory_threshold_below_the_idle_process_is_refused_at_start() {
    let mut config = common::memory_config("orders");
    config.host.admin_address = "off".into();
    config.throttling.process_memory = "1MiB".parse().unwrap();
    config.queues[0].handler = Some(throttlehost::config::HandlerConfig::Noop);
    let e = throttlehost::HostBuilder::new(config)
        .start()
        .await
        .err()
        .expect("refused");
    let text = e.to_string();
    assert!(text.contains("throttling.process_memory"), "{text}");
    assert!(text.contains("never start"), "{text}");
}
