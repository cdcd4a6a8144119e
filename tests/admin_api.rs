//! The admin HTTP endpoint: status, health, ingest (throttled, limited, authorised), override,
//! and 4xx JSON errors for bad requests. Also `throttlehost status` against a running host.
//!
//! In paused time: on a single-threaded runtime the host runs its controller and endpoint on
//! the test's runtime, and each request is made on a blocking thread, during which tokio does
//! not move a paused clock; waits for a sample or a state take no wall time. Two tests stay on
//! the wall clock with two workers: their subject is real threads blocked by handlers, and
//! real sockets held open by slow clients against the endpoint's timeouts.

mod common;

use std::time::Duration;

use serde_json::Value;
use throttlehost::config::{ByteSize, HandlerConfig, MemoryThreshold, OverrideMode, Secret};
use throttlehost::{Host, HostBuilder};

use common::http;

async fn start(token: &str) -> (Host, String) {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Noop);
    config.admin.token = Secret::new(token);
    config.admin.max_body_size = ByteSize(1024);
    config.admin.ingest_reject_after = Duration::from_millis(5);
    let host = HostBuilder::new(config).start().await.unwrap();
    let base = format!("http://{}", host.admin_address().unwrap());
    (host, base)
}

async fn call(
    method: &'static str,
    url: String,
    body: Vec<u8>,
    headers: Vec<(&'static str, &'static str)>,
) -> (u16, Value, Option<String>) {
    tokio::task::spawn_blocking(move || {
        let (status, text, retry) = http(method, &url, &body, &headers);
        let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, json, retry)
    })
    .await
    .unwrap()
}

/// Posts one message (body `x`) to the `orders` queue.
async fn ingest(
    base: &str,
    headers: Vec<(&'static str, &'static str)>,
) -> (u16, Value, Option<String>) {
    call(
        "POST",
        format!("{base}/queues/orders/messages"),
        b"x".to_vec(),
        headers,
    )
    .await
}

#[tokio::test(start_paused = true)]
async fn status_health_and_readiness() {
    let (host, base) = start("").await;
    first_sample(&host).await;
    let (status, body, _) = call("GET", format!("{base}/status"), vec![], vec![]).await;
    assert_eq!(status, 200);
    assert_eq!(body["queues"][0]["name"], "orders");
    assert_eq!(body["queues"][0]["model"], "monitor");
    assert_eq!(body["queues"][0]["max"], 8);
    assert_eq!(body["throttling"]["delivery"]["state"], 0);
    assert_eq!(
        body["throttling"]["delivery"]["state_name"],
        "not throttling"
    );
    let resources = body["throttling"]["resources"].as_array().unwrap();
    assert!(
        resources
            .iter()
            .any(|r| r["condition"] == "process_memory" && r["threshold"].as_f64().unwrap() > 0.0)
    );
    let system = resources
        .iter()
        .find(|r| r["condition"] == "system_memory")
        .unwrap();
    assert!(system["threshold"].is_null(), "off is null: {system}");
    assert!(
        system["text"]
            .as_str()
            .unwrap()
            .ends_with("(threshold off)")
    );
    assert!(body["throttling"]["delivery"]["explanation"].is_null());
    assert_eq!(
        call("GET", format!("{base}/healthz"), vec![], vec![])
            .await
            .0,
        200
    );
    assert_eq!(
        call("GET", format!("{base}/readyz"), vec![], vec![])
            .await
            .0,
        200
    );
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn ingest_accepts_rejects_and_explains() {
    let (host, base) = start("").await;
    let (status, body, _) = call(
        "POST",
        format!("{base}/queues/orders/messages?ttbr=30s"),
        b"hello".to_vec(),
        vec![("X-Header-Customer", "42")],
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert!(body["id"].as_str().unwrap().len() == 36);
    common::wait_until(Duration::from_secs(5), "ingested message processed", || {
        host.handle().metrics_text().contains(
            "throttlehost_messages_processed_total{queue=\"orders\",outcome=\"success\"} 1",
        )
    })
    .await;

    let (status, body, _) = call(
        "POST",
        format!("{base}/queues/nowhere/messages"),
        b"x".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 404);
    assert!(body["error"].as_str().unwrap().contains("nowhere"));

    let (status, body, _) = call(
        "POST",
        format!("{base}/queues/bad;name/messages"),
        b"x".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 400, "{body}");

    let (status, body, _) = call(
        "POST",
        format!("{base}/queues/orders/messages"),
        vec![b'x'; 2048],
        vec![],
    )
    .await;
    assert_eq!(status, 413);
    assert!(body["error"].as_str().unwrap().contains("max_body_size"));

    let (status, body, _) = call(
        "POST",
        format!("{base}/queues/orders/messages?ttbr=soon"),
        b"x".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 400);
    assert!(body["error"].as_str().unwrap().contains("soon"));

    // An expiry no queue table can hold: refused, not written (it used to stall the queue).
    let (status, body, _) = call(
        "POST",
        format!("{base}/queues/orders/messages?ttbr=270000y"),
        b"x".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("50 years"),
        "{body}"
    );

    // Publishing throttled beyond ingest_reject_after: 503 with Retry-After.
    host.handle().set_override(
        throttlehost::throttling::Direction::Publishing,
        OverrideMode::Throttle,
    );
    common::wait_until(Duration::from_secs(5), "publishing delay", || {
        host.handle().publishing_wait() > Duration::from_millis(5)
    })
    .await;
    let (status, body, retry) = ingest(&base, vec![]).await;
    assert_eq!(status, 503, "{body}");
    assert!(retry.unwrap().parse::<u64>().unwrap() >= 1);
    assert!(body["error"].as_str().unwrap().contains("throttled"));
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn override_is_set_through_the_api_and_bad_requests_get_json_errors() {
    let (host, base) = start("").await;
    let (status, body, _) = call(
        "PUT",
        format!("{base}/throttling/delivery/override"),
        b"throttle".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    common::wait_until(Duration::from_secs(5), "delivery state 10", || {
        host.handle()
            .throttling()
            .is_some_and(|s| s.decision.delivery.state == 10)
    })
    .await;
    let (status, _, _) = call(
        "PUT",
        format!("{base}/throttling/delivery/override"),
        br#"{"mode": "none"}"#.to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 200);
    let (status, body, _) = call(
        "PUT",
        format!("{base}/throttling/delivery/override"),
        b"sometimes".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 400);
    assert!(body["error"].as_str().unwrap().contains("sometimes"));
    let (status, body, _) = call(
        "PUT",
        format!("{base}/throttling/sideways/override"),
        b"never".to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 404);
    assert!(body["error"].as_str().unwrap().contains("sideways"));
    let (status, body, _) = call("GET", format!("{base}/nothing-here"), vec![], vec![]).await;
    assert_eq!(status, 404);
    assert!(body["error"].is_string());
    let (status, body, _) = call("POST", format!("{base}/status"), b"x".to_vec(), vec![]).await;
    assert_eq!(status, 405);
    assert!(body["error"].is_string());
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn mutating_routes_need_the_bearer_token() {
    let (host, base) = start("s3cret").await;
    let (status, body, _) = ingest(&base, vec![]).await;
    assert_eq!(status, 401, "{body}");
    let (status, _, _) = call(
        "PUT",
        format!("{base}/throttling/publishing/override"),
        b"never".to_vec(),
        vec![("Authorization", "Bearer wrong")],
    )
    .await;
    assert_eq!(status, 401);
    let (status, _, _) = call(
        "PUT",
        format!("{base}/throttling/publishing/override"),
        b"never".to_vec(),
        vec![("Authorization", "Bearer s3cret")],
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, _) = call("GET", format!("{base}/status"), vec![], vec![]).await;
    assert_eq!(status, 200, "reading needs no token");
    assert!(
        !call("GET", format!("{base}/status"), vec![], vec![])
            .await
            .1
            .to_string()
            .contains("s3cret")
    );
    host.shutdown().await;
}

/// Waits for the controller's first sample (until then /status has no throttling section).
async fn first_sample(host: &Host) {
    common::wait_until(Duration::from_secs(5), "a first throttling sample", || {
        host.status().throttling.is_some()
    })
    .await;
}

/// The machine's readings, except the first, which shows an empty process: a host refuses to
/// start with a threshold it is already over, and this test wants the host over it once
/// running.
struct OverOnceRunning {
    system: throttlehost::throttling::sensors::SystemSensor,
    started: bool,
}

impl throttlehost::throttling::sensors::ResourceSensor for OverOnceRunning {
    fn read(&mut self) -> throttlehost::throttling::sensors::ResourceReadings {
        let mut r = self.system.read();
        if !std::mem::replace(&mut self.started, true) {
            r.process_memory = 0;
        }
        r
    }

    fn machine(&self) -> throttlehost::throttling::controller::MachineFacts {
        self.system.machine()
    }
}

/// A process memory threshold far below what the process uses: the state, its cause in units,
/// the action and the resume line all show in /status.
#[tokio::test(start_paused = true)]
async fn a_throttled_direction_is_explained_in_words_and_units() {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Noop);
    config.throttling.process_memory = MemoryThreshold::Bytes(1024 * 1024);
    let host = HostBuilder::new(config)
        .resource_sensor(OverOnceRunning {
            system: throttlehost::throttling::sensors::SystemSensor::new(),
            started: false,
        })
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", host.admin_address().unwrap());
    common::wait_until(Duration::from_secs(10), "state 4", || {
        host.status()
            .throttling
            .is_some_and(|t| t.delivery.state == 4)
    })
    .await;
    let (_, body, _) = call("GET", format!("{base}/status"), vec![], vec![]).await;
    let e = &body["throttling"]["delivery"]["explanation"];
    let cause = e["cause"].as_str().unwrap();
    assert!(
        cause.starts_with("process memory ")
            && cause.contains("of its 1MiB threshold; resumes below 921.6KiB (90 %)"),
        "{e}"
    );
    assert!(
        e["actions"][0]
            .as_str()
            .unwrap()
            .starts_with("each receive waits "),
        "{e}"
    );
    assert_eq!(
        e["clears_when"],
        "process memory falls below 921.6KiB, then the actions relax"
    );
    host.shutdown().await;
}

fn status_cli(url: &str) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["status", "--url", url])
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(start_paused = true)]
async fn the_status_command_prints_a_table_and_says_by_exit_code_whether_throttling() {
    let (host, base) = start("").await;
    first_sample(&host).await;
    let b = base.clone();
    let (code, text) = tokio::task::spawn_blocking(move || status_cli(&b))
        .await
        .unwrap();
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("orders") && text.contains("not throttling"),
        "{text}"
    );
    host.handle().set_override(
        throttlehost::throttling::Direction::Delivery,
        OverrideMode::Throttle,
    );
    common::wait_until(Duration::from_secs(5), "state 10", || {
        host.status().is_throttling()
    })
    .await;
    let b = base.clone();
    let (code, text) = tokio::task::spawn_blocking(move || status_cli(&b))
        .await
        .unwrap();
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("10 user override on delivery"), "{text}");
    assert!(
        text.contains("because  the throttling override is set to throttle")
            && text.contains("ends     when the override is set back to none"),
        "{text}"
    );
    host.shutdown().await;
    let (code, _) = tokio::task::spawn_blocking(move || status_cli(&base))
        .await
        .unwrap();
    assert_eq!(code, 2, "unreachable");
}

/// Occupies the worker thread it runs on for a while: a handler doing blocking work.
struct BlockingHandler(Duration);

#[async_trait::async_trait]
impl throttlehost::handlers::Handler for BlockingHandler {
    async fn handle(
        &self,
        _ctx: &mut throttlehost::handlers::Context<'_>,
    ) -> Result<(), throttlehost::handlers::HandlerError> {
        // Blocking on purpose: this handler stands for CPU-bound or blocking user code.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(self.0);
        Ok(())
    }
}

/// The admin endpoint has a thread of its own: with both worker threads blocked by handlers,
/// /status still answers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_answers_while_handlers_block_every_worker() {
    let mut config = common::memory_config("orders");
    config.queues[0].concurrency.max = 2;
    use throttlehost::transport::{QueueAdmin, Transport};
    // Both messages wait before the host starts, so its first peek starts both handlers. Sent
    // one by one to a running host, the first message's wake-up started its handler alone,
    // and the receiver's next step could wait behind that handler on its blocked worker.
    let memory = std::sync::Arc::new(throttlehost::transport::memory::MemoryTransport::new(
        config.transport.transaction_mode,
    ));
    let queue = throttlehost::transport::QueueName::new("orders").unwrap();
    memory.create_queue(&queue).await.unwrap();
    for _ in 0..2 {
        memory
            .send(
                &queue,
                &throttlehost::message::OutgoingMessage::new("block"),
            )
            .await
            .unwrap();
    }
    let host = HostBuilder::new(config)
        .transport(memory)
        .handler("orders", BlockingHandler(Duration::from_secs(4)))
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", host.admin_address().unwrap());
    // From a plain thread: with every worker blocked, the test's runtime cannot run timers.
    let inner = host.handle();
    let answers = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while inner.in_process() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "both handlers running"
            );
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut answers = Vec::new();
        for _ in 0..3 {
            let started = std::time::Instant::now();
            let (status, text, _) = common::http("GET", &format!("{base}/status"), &[], &[]);
            let body: Value = serde_json::from_str(&text).unwrap();
            answers.push((status, started.elapsed(), body["in_process"].as_u64()));
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(300));
        }
        answers
    })
    .join()
    .unwrap();
    for (status, took, in_process) in &answers {
        assert_eq!(*status, 200);
        assert!(
            *took < Duration::from_secs(1),
            "/status took {took:?} with every worker blocked: {answers:?}"
        );
        assert_eq!(*in_process, Some(2), "{answers:?}");
    }
    host.shutdown().await;
}

/// Server-side connections the admin endpoint holds open: established sockets whose local
/// port is the endpoint's (a connection the server closed no longer counts, whatever its
/// client does). Read from the kernel's table, so other tests in this binary do not count.
fn established_on(port: u16) -> usize {
    let port = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| t.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 3 && fields[1].ends_with(&port) && fields[3] == "01"
        })
        .count()
}

/// Slow clients that never finish their headers are closed after the header-read timeout, and
/// a flood of them holds at most `MAX_CONNECTIONS` server-side descriptors (before: every one
/// was held for 60 s, and under a 200-descriptor limit the endpoint and new database
/// connections failed) while /healthz still answers.
/// The soft limit on open files of this process.
fn open_files_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            limits
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_flooding_clients_cannot_exhaust_the_admin_endpoint() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (host, base) = start("").await;
    let address = host.admin_address().unwrap();
    // A thousand slow clients, as many as the descriptor limit leaves room for.
    let flood = 1000.min(open_files_limit().saturating_sub(300));
    assert!(
        flood > throttlehost::host::MAX_CONNECTIONS,
        "room for a flood"
    );
    let mut slow = Vec::new();
    for _ in 0..flood {
        let mut s = tokio::net::TcpStream::connect(address).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    // The kernel finishes handshakes before the endpoint accepts them: give it a moment.
    common::wait_until(
        Duration::from_secs(3),
        "the endpoint to hold at most MAX_CONNECTIONS",
        || established_on(address.port()) <= throttlehost::host::MAX_CONNECTIONS,
    )
    .await;
    let asked = std::time::Instant::now();
    let (status, _, _) = call("GET", format!("{base}/healthz"), vec![], vec![]).await;
    assert_eq!(status, 200, "health answers during the flood");
    eprintln!(
        "/healthz answered in {:?} with {flood} slow clients connected",
        asked.elapsed()
    );
    // Receiving goes on: ingested messages are handled during the flood.
    for _ in 0..20 {
        let (status, body, _) = ingest(&base, vec![]).await;
        assert_eq!(status, 202, "{body}");
    }
    common::wait_until(
        Duration::from_secs(5),
        "20 messages handled during the flood",
        || {
            host.handle().metrics_text().contains(
                "throttlehost_messages_processed_total{queue=\"orders\",outcome=\"success\"} 20",
            )
        },
    )
    .await;
    // The newest slow client is closed once the header-read timeout passes.
    let mut last = slow.pop().unwrap();
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(
        throttlehost::host::HEADER_READ_TIMEOUT + Duration::from_secs(3),
        async {
            loop {
                match last.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        },
    )
    .await;
    assert!(
        closed.is_ok(),
        "a client that never finishes its headers is closed"
    );
    drop(slow);
    host.shutdown().await;
}

/// The console: the page and its assets come from the admin address with a CSP that allows
/// no inline script; `/console/data` answers the status document and the history samples
/// after the one asked for; a bad `after` is refused by name.
#[tokio::test(start_paused = true)]
async fn the_console_page_and_its_data() {
    let (host, base) = start("").await;
    first_sample(&host).await;
    let page = base.clone();
    let (status, csp, html) = tokio::task::spawn_blocking(move || {
        let mut response = ureq::get(format!("{page}/")).call().unwrap();
        let csp = response
            .headers()
            .get("content-security-policy")
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .unwrap_or_default();
        let status = response.status().as_u16();
        (status, csp, response.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    assert!(
        html.contains("<script src=\"/console/console.js\""),
        "{html}"
    );
    assert!(!html.contains("<script>"), "no inline script");
    for asset in [
        "/console/console.js",
        "/console/console.css",
        "/console/icon.svg",
    ] {
        let (status, text, _) = call("GET", format!("{base}{asset}"), vec![], vec![]).await;
        assert_eq!(status, 200, "{asset}");
        assert!(!text.to_string().is_empty(), "{asset}");
    }

    // The recorder samples once a second: asked until it holds two (or the deadline).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (status, data) = loop {
        let (status, data, _) = call("GET", format!("{base}/console/data"), vec![], vec![]).await;
        let enough = data["samples"].as_array().is_some_and(|s| s.len() >= 2);
        if status != 200 || enough || std::time::Instant::now() > deadline {
            break (status, data);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status, 200);
    assert_eq!(data["status"]["queues"][0]["name"], "orders");
    assert_eq!(data["history_seconds"], 600);
    let samples = data["samples"].as_array().unwrap();
    assert!(samples.len() >= 2, "{data}");
    assert_eq!(samples[0]["seq"], 1, "the whole ring for after=0");
    assert_eq!(samples[0]["queues"][0]["name"], "orders");
    assert!(samples[0]["delivery"]["state"].is_u64());
    let last = samples.last().unwrap()["seq"].as_u64().unwrap();
    let (_, newer, _) = call(
        "GET",
        format!("{base}/console/data?after={last}"),
        vec![],
        vec![],
    )
    .await;
    assert!(
        newer["samples"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["seq"].as_u64().unwrap() > last),
        "only samples after {last}: {newer}"
    );

    let (status, body, _) = call(
        "GET",
        format!("{base}/console/data?after=soon"),
        vec![],
        vec![],
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body["error"].as_str().unwrap().contains("`after`"),
        "{body}"
    );
    host.shutdown().await;
}

/// `POST /queues/{name}/batch`: a JSON array stored in order with each message's expiry and
/// headers; a bad element refuses the whole request, naming where, and stores nothing.
#[tokio::test(start_paused = true)]
async fn a_json_array_is_ingested_as_one_batch() {
    use throttlehost::transport::{Payload, QueueName};
    let (host, base) = start("").await;
    // The error queue is accepted but not received from, so what is stored stays to be read.
    let error = QueueName::new("error").unwrap();
    let transport = host.handle().transport().clone();
    let depth = async || transport.peek_depth(&error).await.unwrap();
    for (body, reason) in [
        (r#"[{"body": "a"}, {"bdy": "x"}]"#, "[1]"),
        (r#"[]"#, "1 to 100000"),
        (r#"[{"body": "a", "ttbr": "soon"}]"#, "[0].ttbr"),
        (r#"{"body": "a"}"#, "JSON array"),
    ] {
        let (status, answer, _) = call(
            "POST",
            format!("{base}/queues/error/batch"),
            body.as_bytes().to_vec(),
            vec![],
        )
        .await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(
            answer["error"].as_str().unwrap().contains(reason),
            "{body}: {answer}"
        );
    }
    assert_eq!(depth().await, 0, "nothing stored from a refused request");

    let batch = r#"[{"body": "a"}, {"body": {"k": 1}, "ttbr": "1h"}, {"body": "c", "headers": {"Customer": "7"}}]"#;
    let (status, answer, _) = call(
        "POST",
        format!("{base}/queues/error/batch"),
        batch.as_bytes().to_vec(),
        vec![],
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    assert_eq!(answer["count"], 3);
    assert_eq!(answer["ids"].as_array().unwrap().len(), 3);
    assert_eq!(depth().await, 3);
    let mut stored = Vec::new();
    while let Some(r) = transport.receive(&error).await.unwrap() {
        let Payload::Message(m) = r.payload() else {
            panic!("{:?}", r.payload())
        };
        stored.push(m.clone());
        r.commit().await.unwrap();
    }
    let bodies: Vec<&[u8]> = stored.iter().map(|m| m.body.as_slice()).collect();
    assert_eq!(bodies, vec![&b"a"[..], br#"{"k":1}"#, b"c"], "in order");
    assert_eq!(
        stored[1].header("NServiceBus.ContentType"),
        Some("application/json")
    );
    assert!(stored[1].expires.is_some(), "ttbr kept");
    assert_eq!(stored[2].header("Customer"), Some("7"));
    assert_eq!(
        stored[2].header("NServiceBus.ContentType"),
        None,
        "text body"
    );
    host.shutdown().await;
}

/// Records the headers of every message it handles.
#[derive(Default, Clone)]
struct Headers(std::sync::Arc<std::sync::Mutex<Vec<throttlehost::Headers>>>);

#[throttlehost::async_trait]
impl throttlehost::Handler for Headers {
    async fn handle(
        &self,
        ctx: &mut throttlehost::Context<'_>,
    ) -> Result<(), throttlehost::HandlerError> {
        self.0.lock().unwrap().push(ctx.headers().clone());
        Ok(())
    }
}

/// HTTP lowercases header names on the wire; ingest stores them in their case: NServiceBus's
/// names, the configured ordering key, and the names a request declares in `X-Header-Names`.
#[tokio::test(start_paused = true)]
async fn ingest_keeps_header_names_in_their_case() {
    let mut config = common::memory_config("orders");
    config.queues[0].ordering.key_header = "Sales.OrderId".into();
    let seen = Headers::default();
    let host = HostBuilder::new(config)
        .handler("orders", seen.clone())
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", host.admin_address().unwrap());
    let (status, body, _) = ingest(
        &base,
        vec![
            ("X-Header-NServiceBus.MessageId", "order-1"),
            ("X-Header-Sales.OrderId", "42"),
            ("X-Header-Tenant.Region", "eu"),
            ("X-Header-Names", "Tenant.Region"),
            ("X-Header-other", "kept lowercase"),
        ],
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        body["id"], "order-1",
        "the message id set by header is the id"
    );
    common::wait_until(Duration::from_secs(5), "the message handled", || {
        !seen.0.lock().unwrap().is_empty()
    })
    .await;
    let headers = seen.0.lock().unwrap()[0].clone();
    host.shutdown().await;
    let get = |name: &str| headers.get(name).cloned().flatten();
    assert_eq!(get("NServiceBus.MessageId").as_deref(), Some("order-1"));
    assert_eq!(get("Sales.OrderId").as_deref(), Some("42"));
    assert_eq!(get("Tenant.Region").as_deref(), Some("eu"));
    assert_eq!(get("other").as_deref(), Some("kept lowercase"));
    assert!(
        !headers.contains_key("names") && !headers.contains_key("nservicebus.messageid"),
        "{headers:?}"
    );
}

/// One request written by hand (the `Host` and `Origin` a browser would send): the status
/// code and the body.
async fn raw(address: std::net::SocketAddr, request: String) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

/// DNS rebinding and cross-site forgery: a request naming a host the endpoint is not is
/// refused, reads included; a POST from another site's page is refused and stores nothing; the
/// console's own page, a tool without `Origin`, and a name listed in `admin.allowed_hosts`
/// pass.
#[tokio::test(start_paused = true)]
async fn a_foreign_host_name_and_a_cross_site_post_are_refused() {
    let mut config = common::memory_config("orders");
    config.queues[0].handler = Some(HandlerConfig::Noop);
    config.admin.allowed_hosts = vec!["throttle01.example".into()];
    let host = HostBuilder::new(config).start().await.unwrap();
    let address = host.admin_address().unwrap();
    let get = |host_header: &str| {
        format!("GET /status HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n")
    };
    let (status, body) = raw(address, get("evil.example:9464")).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("admin.allowed_hosts"), "{body}");
    assert_eq!(raw(address, get(&address.to_string())).await.0, 200);
    assert_eq!(raw(address, get("throttle01.example:9464")).await.0, 200);
    assert_eq!(raw(address, get("localhost")).await.0, 200);

    let post = |extra: &str| {
        format!(
            "POST /queues/orders/messages HTTP/1.1\r\nHost: {address}\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n{extra}Connection: close\r\n\r\nhello"
        )
    };
    let (status, body) = raw(address, post("Origin: http://evil.example\r\n")).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = raw(address, post("Sec-Fetch-Site: cross-site\r\n")).await;
    assert_eq!(status, 403, "{body}");
    let own_page = format!("Origin: http://{address}\r\nSec-Fetch-Site: same-origin\r\n");
    assert_eq!(raw(address, post(&own_page)).await.0, 202);
    assert_eq!(raw(address, post("")).await.0, 202, "a tool without Origin");
    common::wait_until(Duration::from_secs(10), "the two handled", || {
        host.status().queues[0].succeeded_total >= 2
    })
    .await;
    // The refused posts were sent first: had they been stored, they would have been handled.
    let handle = host.handle();
    host.shutdown().await;
    assert_eq!(handle.status().queues[0].succeeded_total, 2);
}
