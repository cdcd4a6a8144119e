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
        "[transport]\nkind = \"sqlserver\"\nconnection_string = \"Server=tcp:127.0.0.1,1;Database=q;User Id=sa;Password=Sup3rS3cret;Encrypt=false\"\nconnect_timeout = \"2s\"\n[[queues]]\nname = \"Sales\"\n[queues.handler]\nkind = \"noop\"\n",
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
