//! `throttlehost config check` and the shipped configuration files.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use throttlehost::config::{self, Config, HandlerConfig, QueueConfig, SimulateConfig};

fn throttlehost(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(args)
        .output()
        .unwrap()
}

fn write_temp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("th-config-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn shipped_configurations_pass_config_check() {
    for file in [
        "config/host.toml",
        "config/examples/sqlserver.toml",
        "config/examples/postgres.toml",
    ] {
        let out = throttlehost(&["config", "check", "--config", file]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("[throttling.delivery]"),
            "{file}: prints the effective configuration"
        );
        assert!(
            !stdout.contains("change-me"),
            "{file}: secrets are redacted"
        );
    }
}

#[test]
fn an_unknown_key_is_rejected_with_its_name_and_line() {
    let path = write_temp(
        "bad.toml",
        "[host]\nname = \"x\"\n\n[throttling]\nproces_memory = \"25%\"\n",
    );
    let out = throttlehost(&["config", "check", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(":5:"), "names the line: {stderr}");
    assert!(stderr.contains("proces_memory"), "names the key: {stderr}");
    assert!(
        stderr.contains("process_memory"),
        "suggests the right one: {stderr}"
    );
}

#[test]
fn a_wrong_type_is_rejected_with_key_value_and_line() {
    let path = write_temp(
        "bad.toml",
        "[[queues]]\nname = \"orders\"\n[queues.concurrency]\nmax = \"lots\"\n",
    );
    let out = throttlehost(&["config", "check", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(":4:"), "{stderr}");
    assert!(stderr.contains("queues[0].concurrency.max"), "{stderr}");
    assert!(stderr.contains("\"lots\""), "{stderr}");
}

#[test]
fn a_missing_file_is_a_clear_error() {
    let out = throttlehost(&["config", "check", "--config", "/nonexistent/host.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/host.toml"));
}

/// Every key path of a TOML value, e.g. `throttling.delivery.max_delay`.
fn key_paths(value: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(path.clone());
                key_paths(v, &path, out);
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                key_paths(item, prefix, out);
            }
        }
        _ => {}
    }
}

#[test]
fn host_toml_lists_every_setting_with_the_default_the_code_uses() {
    let text = std::fs::read_to_string(Path::new("config/host.toml")).unwrap();
    let shipped = config::parse_str(&text, "config/host.toml").unwrap();
    // The documented queue shows the queue defaults, with a simulate handler at its defaults.
    let expected = Config {
        queues: vec![QueueConfig {
            name: "orders".into(),
            handler: Some(HandlerConfig::Simulate(SimulateConfig::default())),
            ..QueueConfig::default()
        }],
        ..Config::default()
    };
    assert_eq!(
        shipped, expected,
        "config/host.toml and the code disagree on a default"
    );

    let mut in_code = BTreeSet::new();
    key_paths(&toml::Value::try_from(&expected).unwrap(), "", &mut in_code);
    let mut in_file = BTreeSet::new();
    key_paths(
        &toml::from_str::<toml::Value>(&text).unwrap(),
        "",
        &mut in_file,
    );
    let missing: Vec<_> = in_code.difference(&in_file).collect();
    assert!(
        missing.is_empty(),
        "settings missing from config/host.toml: {missing:?}"
    );
}

#[test]
fn a_sqlserver_configuration_is_accepted_and_an_unreachable_server_is_a_clear_error() {
    let path = write_temp(
        "mssql.toml",
        "[host]\nwait_for_database = false\n[transport]\nkind = \"sqlserver\"\nconnection_string = \"Server=tcp:127.0.0.1,1;Database=q;User Id=sa;Password=Sup3rS3cret;Encrypt=false\"\nconnect_timeout = \"2s\"\n[[queues]]\nname = \"Sales\"\n[queues.handler]\nkind = \"noop\"\n",
    );
    let p = path.to_str().unwrap();
    let check = throttlehost(&["config", "check", "--config", p]);
    assert!(check.status.success());
    for args in [
        vec!["queues", "create", "--config", p],
        vec!["run", "--config", p],
    ] {
        let out = throttlehost(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            all.contains("cannot connect to SQL Server") || all.contains("connection"),
            "{args:?}: {all}"
        );
        assert!(
            !all.contains("Sup3rS3cret"),
            "the password never appears: {all}"
        );
    }
}

/// Writes `text` to a file and runs `config check` on it; returns (exit code, stderr).
fn check(text: &str) -> (Option<i32>, String) {
    let path = write_temp("host.toml", text);
    let out = throttlehost(&["config", "check", "--config", path.to_str().unwrap()]);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn values_the_host_cannot_use_are_refused_by_config_check_naming_the_key() {
    let long_name = "q".repeat(60);
    let cases = [
        (
            "[host]\nworker_threads = 1000000000\n",
            "host.worker_threads",
        ),
        (
            "[throttling.delivery]\nmax_delay = \"18446744073709551615s\"\noverride = \"throttle\"\n",
            "max_delay",
        ),
        (
            "[transport]\ncommand_timeout = \"30days\"\n",
            "transport.command_timeout",
        ),
        (
            "[[queues]]\nname = \"orders\"\n[queues.handler]\nkind = \"simulate\"\nlatency = \"18446744073709551615s\"\n",
            "queues[0].handler",
        ),
        ("[host]\nadmin_address = \"0.0.0.0:9464\"\n", "admin.token"),
        // `run` refuses it at start (at or below its own memory): so does the check.
        (
            "[throttling]\nprocess_memory = \"1MiB\"\n",
            "throttling.process_memory",
        ),
        (
            "[host]\nadmin_address = \"127.0.0.1:9464\"\n[admin]\ntoken = \"change-me\"\n",
            "admin.token",
        ),
        (
            "[host]\nadmin_address = \"0.0.0.0:9464\"\n[admin]\ntoken = \"8d1f0c2b7e5a4f3c9b6d2e1a0f7c5b3e\"\n",
            "admin.token",
        ),
    ];
    for (text, key) in cases {
        let (code, stderr) = check(text);
        assert_eq!(code, Some(2), "{text}: {stderr}");
        assert!(stderr.contains(key), "{text}: names {key}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let postgres = format!(
        "[transport]\nkind = \"postgres\"\nconnection_string = \"host=127.0.0.1\"\n[[queues]]\nname = \"{long_name}\"\n"
    );
    let (code, stderr) = check(&postgres);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("queues[0].name") && stderr.contains("55"),
        "names the PostgreSQL limit: {stderr}"
    );
    // One connection, held by the receive, while the forward handler waits for a second.
    let (code, stderr) = check(
        "[transport]\nkind = \"postgres\"\nconnection_string = \"host=127.0.0.1\"\npool_size = 1\n[[queues]]\nname = \"a\"\n[queues.handler]\nkind = \"forward\"\nto = \"b\"\n",
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("transport.pool_size"), "{stderr}");
    // The same name is fine on SQL Server (128 characters).
    let (code, stderr) = check(&postgres.replace("postgres", "sqlserver").replace(
        "host=127.0.0.1",
        "Server=tcp:127.0.0.1,1;User Id=x;Password=y",
    ));
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn out_of_range_command_line_values_are_refused_before_anything_runs() {
    let out = throttlehost(&["demo", "--worker-threads", "1000000000"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("1024"), "{stderr}");
    let out = throttlehost(&[
        "send",
        "--config",
        "config/host.toml",
        "--queue",
        "x",
        "--ttbr",
        "270000y",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("50 years"), "{stderr}");
    let out = throttlehost(&["send", "--queue", "x", "--ttbr", "1e30"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// By default `run` waits for a database that is down at start (supervisors start hosts and
/// databases in any order), says so naming the database without its password, and stops on
/// SIGTERM. Before: it exited at once with "error connecting to server" and no address.
#[test]
fn run_waits_for_a_database_that_is_down_and_names_it() {
    use std::io::BufRead;
    let path = write_temp(
        "host.toml",
        "[host]\nadmin_address = \"off\"\n[transport]\nkind = \"postgres\"\nconnection_string = \"postgres://app:Sekr1t@127.0.0.1:1/test?connect_timeout=1\"\n[[queues]]\nname = \"orders\"\n[queues.handler]\nkind = \"noop\"\n",
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["run", "--config", path.to_str().unwrap()])
        // Each later try says so at debug: the test waits on those, not on the clock.
        .env("RUST_LOG", "info,throttlehost::cli::run=debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Every line the host writes, from either stream.
    let (lines, seen) = std::sync::mpsc::channel::<String>();
    let readers: Vec<_> = [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ]
    .into_iter()
    .map(|stream| {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stream)
                .lines()
                .map_while(Result::ok)
            {
                let _ = lines.send(line);
            }
        })
    })
    .collect();
    drop(lines);
    let mut log = String::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    // Said once, then tried again twice (said again at WARN only after a minute).
    let (mut said, mut tried_again) = (false, 0);
    while !said || tried_again < 2 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = seen
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("not said and tried twice more within 15 s: {log}"));
        said |= line.contains("database not reachable");
        tried_again += usize::from(line.contains("database still not reachable"));
        log.push_str(&line);
        log.push('\n');
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "still running after more tries: {log}"
    );
    // SIGTERM, as a supervisor sends it.
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = child.wait().unwrap();
    for r in readers {
        r.join().unwrap();
    }
    log.extend(seen.try_iter().map(|l| l + "\n"));
    assert_eq!(status.code(), Some(0), "a clean stop: {log}");
    assert!(log.contains("127.0.0.1:1"), "names the database: {log}");
    assert!(!log.contains("Sekr1t"), "{log}");
}

/// A file that holds a password or the admin token and that every user may read (or change)
/// is said in a warning naming the mode; the same file readable by its owner only is not.
#[cfg(unix)]
#[test]
fn a_config_with_secrets_that_others_can_read_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let path = write_temp(
        "host.toml",
        "[transport]\nkind = \"postgres\"\nconnection_string = \"host=127.0.0.1 user=app password=s3cret\"\n",
    );
    let run = |mode: u32| {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = throttlehost(&["config", "check", "--config", path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr)
    };
    let (code, stderr) = run(0o644);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("warning")
            && stderr.contains("database password")
            && stderr.contains("644"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cret"),
        "the password is never shown: {stderr}"
    );
    let (code, stderr) = run(0o600);
    assert_eq!((code, stderr.as_str()), (Some(0), ""));
}
