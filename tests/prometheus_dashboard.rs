//! The Grafana dashboard works against real data: a host is scraped by a real Prometheus
//! (Debian's `prometheus` package; `.ci/run` installs it), then every PromQL expression of
//! `dashboards/throttlehost.json` (and its variable query) runs through Prometheus' HTTP API
//! and must return data without an error.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use throttlehost::HostBuilder;
use throttlehost::config::{FailedKey, HandlerConfig, SimulateConfig};
use throttlehost::message::OutgoingMessage;

struct Prometheus {
    child: Child,
    dir: std::path::PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_prometheus(target: &str) -> (Prometheus, String) {
    let dir = std::env::temp_dir().join(format!("th-prometheus-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: throttlehost\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let port = common::free_port();
    let binary = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
    let child = Command::new(&binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start `{binary}` ({e}): install Debian's prometheus package (`apt-get install prometheus`, as .ci/run does) or set PROMETHEUS")
        });
    (
        Prometheus { child, dir },
        format!("http://127.0.0.1:{port}"),
    )
}

fn query(base: &str, expr: &str) -> Value {
    try_query(base, expr).unwrap()
}

/// A query, or the error when Prometheus does not answer (yet).
fn try_query(base: &str, expr: &str) -> Result<Value, ureq::Error> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut response = agent
        .get(&format!("{base}/api/v1/query"))
        .query("query", expr)
        .call()?;
    Ok(serde_json::from_str(&response.body_mut().read_to_string()?).unwrap())
}

fn dashboard_expressions() -> Vec<String> {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string("dashboards/throttlehost.json").unwrap())
            .unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(
        exprs.len() >= 25,
        "the dashboard has its panels ({})",
        exprs.len()
    );
    exprs
}

/// Grafana's variables, as Grafana would expand them for "All" instances.
fn expand(expr: &str) -> String {
    expr.replace("$instance", ".+")
        .replace("$__rate_interval", "20s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Simulate(SimulateConfig {
        latency: Duration::from_millis(3),
        failure_rate: 0.2,
        ..SimulateConfig::default()
    }));
    config.queues[0].immediate_retries = 1;
    // An ordered queue beside it: its panels chart series only ordered queues export.
    let mut ledger = config.queues[0].clone();
    ledger.name = "ledger".into();
    ledger.ordering.key_header = "Ledger.Account".into();
    ledger.ordering.failed_key = FailedKey::Hold;
    config.queues.push(ledger);
    let host = HostBuilder::new(config).start().await.unwrap();
    let target = host.admin_address().unwrap().to_string();
    let (prometheus, base) = start_prometheus(&target);

    // Traffic only: no reload, no throttling episode. Every series a panel queries must exist
    // on a host that has seen neither (counters at 0), or the panel would say "No data".
    let publisher = {
        let handle = host.handle();
        tokio::spawn(async move {
            loop {
                let _ = handle.send("orders", OutgoingMessage::new("load")).await;
                let keyed = OutgoingMessage::new("load").with_header("Ledger.Account", "7");
                let _ = handle.send("ledger", keyed).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    let b = base.clone();
    tokio::task::spawn_blocking(move || {
        for _ in 0..60 {
            // Prometheus may still be starting: connection refused means ask again.
            let up = try_query(&b, "up{job=\"throttlehost\"}");
            if up.is_ok_and(|up| up["data"]["result"][0]["value"][1] == "1") {
                return;
            }
            // Inside spawn_blocking: a blocking pause is what this thread is for.
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("Prometheus never scraped the host");
    })
    .await
    .unwrap();
    // Enough scrapes for rate() over 20s windows.
    tokio::time::sleep(Duration::from_secs(12)).await;

    let b = base.clone();
    let failures = tokio::task::spawn_blocking(move || {
        let mut failures = Vec::new();
        for expr in dashboard_expressions() {
            let expanded = expand(&expr);
            let answer = query(&b, &expanded);
            let results = answer["data"]["result"]
                .as_array()
                .map(|r| r.len())
                .unwrap_or(0);
            if answer["status"] != "success" || results == 0 {
                failures.push(format!("{expanded} -> {answer}"));
            }
        }
        let agent = ureq::agent();
        let mut r = agent
            .get(&format!("{b}/api/v1/label/instance/values"))
            .query("match[]", "throttlehost_host_info")
            .call()
            .unwrap();
        let values: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        if values["data"].as_array().is_none_or(|a| a.is_empty()) {
            failures.push(format!("instance variable query -> {values}"));
        }
        failures
    })
    .await
    .unwrap();
    publisher.abort();
    host.shutdown().await;
    drop(prometheus);
    assert!(
        failures.is_empty(),
        "dashboard queries without data:\n{}",
        failures.join("\n")
    );
}
