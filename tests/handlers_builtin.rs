//! The built-in handlers of the binary: forward, command, http, simulate failures.

mod common;

use std::time::Duration;

use throttlehost::HostBuilder;
use throttlehost::config::{
    CommandConfig, ForwardConfig, HandlerConfig, HttpConfig, SimulateConfig,
};
use throttlehost::message::OutgoingMessage;
use throttlehost::transport::Payload;

use common::q;

fn processed(host: &throttlehost::Host, outcome: &str) -> bool {
    host.handle().metrics_text().contains(&format!(
        "throttlehost_messages_processed_total{{queue=\"in\",outcome=\"{outcome}\"}} 1"
    ))
}

#[tokio::test(start_paused = true)]
async fn forward_sends_on_with_the_same_headers_and_body() {
    let mut config = common::memory_config("in");
    config.host.admin_address = "off".into();
    config.queues[0].handler = Some(HandlerConfig::Forward(ForwardConfig { to: "out".into() }));
    let host = HostBuilder::new(config).start().await.unwrap();
    let sent = OutgoingMessage::new("payload").with_header("Custom", "v");
    host.send("in", sent.clone()).await.unwrap();
    common::wait_until(Duration::from_secs(5), "forwarded", || {
        processed(&host, "success")
    })
    .await;
    let r = host
        .handle()
        .transport()
        .receive(&q("out"))
        .await
        .unwrap()
        .unwrap();
    match r.payload() {
        Payload::Message(m) => {
            assert_eq!(m.body, b"payload");
            assert_eq!(m.header("Custom"), Some("v"));
            assert_eq!(m.logical_id(), sent.logical_id(), "same logical id");
            assert_ne!(m.id, sent.id, "fresh row id");
        }
        other => panic!("{other:?}"),
    }
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_gets_the_body_on_stdin_and_fails_on_a_nonzero_exit() {
    let dir = std::env::temp_dir().join(format!("th-cmd-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out.txt");
    let mut config = common::memory_config("in");
    config.host.admin_address = "off".into();
    config.queues[0].immediate_retries = 0;
    config.queues[0].handler = Some(HandlerConfig::Command(CommandConfig {
        program: "sh".into(),
        args: vec![
            "-c".into(),
            format!(
                "body=$(cat); echo \"$THROTTLEHOST_QUEUE:$body\" >> {}; [ \"$body\" != fail ] || {{ echo broken >&2; exit 3; }}",
                out.display()
            ),
        ],
    }));
    let host = HostBuilder::new(config).start().await.unwrap();
    host.send("in", OutgoingMessage::new("hello"))
        .await
        .unwrap();
    common::wait_until(Duration::from_secs(10), "command ran", || {
        processed(&host, "success")
    })
    .await;
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "in:hello\n");
    host.send("in", OutgoingMessage::new("fail")).await.unwrap();
    common::wait_until(Duration::from_secs(10), "moved to error", || {
        processed(&host, "error")
    })
    .await;
    let r = host
        .handle()
        .transport()
        .receive(&q("error"))
        .await
        .unwrap()
        .unwrap();
    match r.payload() {
        Payload::Message(m) => {
            let message = m.header("NServiceBus.ExceptionInfo.Message").unwrap();
            assert!(
                message.contains("exit status: 3") && message.contains("broken"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    host.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_posts_the_body_and_treats_non_2xx_as_failure() {
    use axum::routing::post;
    let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let app = {
        let received = received.clone();
        axum::Router::new().route(
            "/hook",
            post(move |headers: axum::http::HeaderMap, body: String| {
                let received = received.clone();
                async move {
                    let tenant = headers
                        .get("x-header-tenant")
                        .map(|v| v.to_str().unwrap().to_string())
                        .unwrap_or_default();
                    received.lock().unwrap().push((tenant, body.clone()));
                    if body == "reject" {
                        axum::http::StatusCode::BAD_REQUEST
                    } else {
                        axum::http::StatusCode::NO_CONTENT
                    }
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let mut config = common::memory_config("in");
    config.host.admin_address = "off".into();
    config.queues[0].immediate_retries = 0;
    config.queues[0].handler = Some(HandlerConfig::Http(HttpConfig {
        url: format!("http://{addr}/hook"),
    }));
    let host = HostBuilder::new(config).start().await.unwrap();
    host.send(
        "in",
        OutgoingMessage::new("accept").with_header("Tenant", "acme"),
    )
    .await
    .unwrap();
    common::wait_until(Duration::from_secs(10), "posted", || {
        processed(&host, "success")
    })
    .await;
    assert_eq!(
        received.lock().unwrap()[0],
        ("acme".to_string(), "accept".to_string())
    );
    host.send("in", OutgoingMessage::new("reject"))
        .await
        .unwrap();
    common::wait_until(Duration::from_secs(10), "rejected", || {
        processed(&host, "error")
    })
    .await;
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn simulate_fails_at_its_failure_rate() {
    let mut config = common::memory_config("in");
    config.host.admin_address = "off".into();
    config.queues[0].immediate_retries = 0;
    config.queues[0].handler = Some(HandlerConfig::Simulate(SimulateConfig {
        latency: Duration::ZERO,
        failure_rate: 0.5,
        ..SimulateConfig::default()
    }));
    let host = HostBuilder::new(config).start().await.unwrap();
    for _ in 0..400 {
        host.send("in", OutgoingMessage::new("x")).await.unwrap();
    }
    common::wait_until(Duration::from_secs(10), "all done", || {
        host.handle().transport().connections_in_use() == 0
            && host.status().queues[0].depth == 0
            && host.handle().in_process() == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let errors = host
        .handle()
        .transport()
        .peek_depth(&q("error"))
        .await
        .unwrap();
    assert!(
        (140..=260).contains(&errors),
        "about half of 400 failed: {errors}"
    );
    host.shutdown().await;
}
