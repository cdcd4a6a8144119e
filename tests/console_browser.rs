//! The live console in a real browser (headless Chromium over the DevTools protocol):
//! it follows the demo from state 0 to a throttled state and back without a console error,
//! fits 1280x800, shows the same numbers as `/status`, sets overrides with and without a
//! token, and says "disconnected" while the host is gone and recovers when it returns.
//!
//! Needs Debian's `chromium` (the README's test command installs it).
// Plain (non-async) tests driving processes and a browser: blocking sleeps are what they want.
#![allow(clippy::disallowed_methods)]

#[path = "support/cdp.rs"]
mod cdp;
mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cdp::Browser;
use serde_json::Value;

fn get_json(url: &str) -> Option<Value> {
    let text = ureq::get(url)
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()?;
    serde_json::from_str(&text).ok()
}

/// A child process killed when dropped (a failing test leaves nothing running).
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_healthy(base: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while get_json(&format!("{base}/healthz")).is_none() {
        assert!(
            Instant::now() < deadline,
            "{base}/healthz did not answer in 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn delivery_state(browser: &mut Browser) -> Option<u64> {
    browser
        .eval("document.querySelector('#dir-delivery [data-role=state]')?.dataset.state ?? null")
        .as_str()
        .and_then(|s| s.parse().ok())
}

#[test]
fn the_console_follows_the_demo_into_a_throttled_state_and_back() {
    // The browser first: a first start on a fresh machine (font caches) must not eat into
    // the demo's walk.
    let mut browser = Browser::launch(1280, 800);
    let port = common::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _demo = Process(
        Command::new(env!("CARGO_BIN_EXE_throttlehost"))
            .args([
                "demo",
                "--duration",
                "200",
                "--admin",
                &format!("127.0.0.1:{port}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_healthy(&base);
    browser.navigate(&format!("{base}/"));
    browser.wait_for(
        "document.body.dataset.connection === 'live'",
        Duration::from_secs(10),
    );
    assert_eq!(
        delivery_state(&mut browser),
        Some(0),
        "the demo starts steady"
    );

    // At 1280x800 nothing runs off the side and both directions' states are in view.
    let layout = browser.eval(
        "(() => { const r = (s) => document.querySelector(s).getBoundingClientRect(); \
           const d = r('#dir-delivery [data-role=state]'), p = r('#dir-publishing [data-role=state]'); \
           return { scroll: document.documentElement.scrollWidth, d: [d.left, d.right, d.bottom], p: [p.left, p.right, p.bottom] }; })()",
    );
    assert!(layout["scroll"].as_f64().unwrap() <= 1280.0, "{layout}");
    for side in ["d", "p"] {
        let [left, right, bottom] = [0, 1, 2].map(|i| layout[side][i].as_f64().unwrap());
        assert!(
            left >= 0.0 && right <= 1280.0 && bottom <= 800.0,
            "state box in view: {layout}"
        );
    }

    // The demo walks into in-process pressure (3) and memory pressure (4), then recovers.
    // The screenshot shows memory pressure when the page shows it for 3 s, else in-process
    // pressure (a run whose memory phase stays under its threshold).
    let walk = Instant::now();
    let deadline = walk + Duration::from_secs(190);
    let mut seen = vec![0u64];
    let mut screenshot: Option<(u64, Vec<u8>)> = None;
    loop {
        let state = delivery_state(&mut browser).unwrap_or(0);
        if seen.last() != Some(&state) {
            seen.push(state);
        }
        let explained = browser.eval(
            "document.querySelector('#dir-delivery [data-role=explanation]').textContent.includes('Cause')",
        ) == Value::Bool(true);
        let better = match &screenshot {
            None => state == 3 || state == 4,
            Some((shown, _)) => *shown == 3 && state == 4,
        };
        if better && explained {
            std::thread::sleep(Duration::from_secs(3));
            if delivery_state(&mut browser) == Some(state) {
                screenshot = Some((state, browser.screenshot()));
            }
        }
        // Back to 0 after memory pressure, or after the demo's recovery phase (60 s in).
        let walked = screenshot.as_ref().is_some_and(|(shown, _)| *shown == 4)
            || walk.elapsed() > Duration::from_secs(70);
        if screenshot.is_some() && state == 0 && walked {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the console did not show throttling and recovery; states seen {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(
        seen.iter().any(|s| *s == 3 || *s == 4),
        "a throttled state was shown: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&0), "and then state 0: {seen:?}");
    let text = browser.eval("document.querySelector('#sensors').textContent");
    assert!(text.as_str().unwrap().contains("process memory"), "{text}");
    let bands = browser.eval("document.querySelectorAll('#chart-states rect').length");
    assert!(
        bands.as_u64().unwrap() > 60,
        "the state chart draws the history: {bands}"
    );
    browser.drain_events();
    assert!(
        browser.errors.is_empty(),
        "no console errors: {:?}",
        browser.errors
    );

    let (_, png) = screenshot.expect("a screenshot in a throttled state");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-demo.png");
    std::fs::write(&path, png).unwrap();
    println!("screenshot: {}", path.display());
}

/// A host with the memory transport, an idle monitor queue and a slow sample, so a sample's
/// numbers stay put long enough to compare the page with /status.
fn start_host(port: u16, token: &str, dir: &std::path::Path) -> Process {
    let config = dir.join(format!("host-{}.toml", token.len()));
    std::fs::write(
        &config,
        format!(
            r#"[host]
name = "console-test"
admin_address = "127.0.0.1:{port}"
[admin]
token = "{token}"
[transport]
kind = "memory"
[[queues]]
name = "orders"
[queues.concurrency]
model = "monitor"
max = 4
[queues.handler]
kind = "noop"
[throttling]
sample_interval = "4s"
"#
        ),
    )
    .unwrap();
    run_host(&config, port)
}

/// Runs `throttlehost run` on the configuration at `config`, whose admin endpoint listens on
/// `port`; returns once it answers.
fn run_host(config: &std::path::Path, port: u16) -> Process {
    let child = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
        .args(["run", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_healthy(&format!("http://127.0.0.1:{port}"));
    Process(child)
}

/// The value at a dotted path (`queues.0.limit`) of a JSON document.
fn at<'a>(doc: &'a Value, path: &str) -> &'a Value {
    path.split('.')
        .fold(doc, |v, key| match key.parse::<usize>() {
            Ok(i) if v.is_array() => &v[i],
            _ => &v[key],
        })
}

/// Pauses the page, reads every number it shows with the /status of the same sample, and
/// compares them. Returns how many numbers were compared.
fn compare_page_with_status(browser: &mut Browser, base: &str) -> usize {
    for _ in 0..10 {
        browser.eval("document.getElementById('pause').click()");
        let shown = browser.eval(
            "({ at: document.body.dataset.sampledAt, fields: [...document.querySelectorAll('[data-path]')].map(e => [e.dataset.path, e.dataset.value, e.textContent]) })",
        );
        let status = get_json(&format!("{base}/status")).expect("/status");
        browser.eval("document.getElementById('pause').click()");
        let same_sample = shown["at"].as_str().and_then(|s| s.parse::<f64>().ok())
            == status["throttling"]["sampled_at_seconds"].as_f64();
        if !same_sample {
            std::thread::sleep(Duration::from_millis(700));
            continue;
        }
        let fields = shown["fields"].as_array().unwrap();
        for field in fields {
            let [path, value, text] = [0, 1, 2].map(|i| field[i].as_str().unwrap().to_string());
            assert!(!text.is_empty(), "{path} is shown");
            let expected = at(&status, &path);
            if path == "uptime_seconds" {
                let shown: f64 = value.parse().unwrap();
                assert!((shown - expected.as_f64().unwrap()).abs() < 3.0, "{path}");
                continue;
            }
            match expected {
                Value::Null => assert_eq!(value, "null", "{path}"),
                // serde_json's default float parsing may differ from JavaScript's in the
                // last bit; anything more is a different number.
                Value::Number(n) => {
                    let (page, status) = (value.parse::<f64>().unwrap(), n.as_f64().unwrap());
                    assert!(
                        (page - status).abs() <= 1e-12 * status.abs().max(1.0),
                        "{path}: page {value}, /status {n}"
                    )
                }
                Value::String(s) => assert_eq!(&value, s, "{path}"),
                other => panic!("{path}: page shows {value}, /status has {other}"),
            }
        }
        return fields.len();
    }
    panic!("the page never showed the sample /status showed");
}

fn override_message(browser: &mut Browser) -> String {
    browser
        .eval("document.getElementById('override-message').textContent")
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn apply_override(browser: &mut Browser, direction: &str, mode: &str) {
    browser.eval(&format!(
        "(() => {{ document.getElementById('override-message').textContent = ''; \
           const card = document.getElementById('dir-{direction}'); \
           card.querySelector('[data-role=override-mode]').value = '{mode}'; \
           card.querySelector('[data-role=override-apply]').click(); }})()"
    ));
    browser.wait_for(
        "document.getElementById('override-message').textContent !== ''",
        Duration::from_secs(5),
    );
}

#[test]
fn the_page_agrees_with_status_sets_overrides_and_survives_a_restart() {
    let dir = std::env::temp_dir().join(format!("throttlehost-console-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = common::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut host = start_host(port, "s3cret-token", &dir);
    let mut browser = Browser::launch(1280, 800);
    browser.navigate(&format!("{base}/"));
    browser.wait_for(
        "document.body.dataset.connection === 'live' && document.body.dataset.sampledAt",
        Duration::from_secs(15),
    );

    let compared = compare_page_with_status(&mut browser, &base);
    assert!(
        compared >= 30,
        "states, delays, rates, sensors and queue numbers: {compared}"
    );

    // With a token set: refused without it (and nothing changes), accepted with it.
    apply_override(&mut browser, "delivery", "throttle");
    let refused = override_message(&mut browser);
    assert!(refused.contains("Refused (401)"), "{refused}");
    assert!(refused.contains("token"), "says what to do: {refused}");
    let status = get_json(&format!("{base}/status")).unwrap();
    assert_eq!(status["throttling"]["delivery"]["override"], "none");
    // The browser logs the refused call itself; that one line is expected, nothing else.
    browser.drain_events();
    let logged: Vec<String> = browser.errors.drain(..).collect();
    assert!(
        logged
            .iter()
            .all(|e| e.contains("401") && e.contains("/throttling/delivery/override")),
        "{logged:?}"
    );
    browser.eval("document.getElementById('token').value = 's3cret-token'");
    apply_override(&mut browser, "delivery", "throttle");
    let accepted = override_message(&mut browser);
    assert!(
        accepted.contains("delivery override set to throttle"),
        "{accepted}"
    );
    browser.wait_for(
        "document.querySelector('#dir-delivery [data-role=state]').dataset.state === '10'",
        Duration::from_secs(10),
    );
    assert_eq!(
        get_json(&format!("{base}/status")).unwrap()["throttling"]["delivery"]["override"],
        "throttle"
    );
    // The fleet panel lists this instance, as /fleet does, with the state its heartbeat
    // wrote (every 5 s; the panel asks every 5 s).
    let fleet = get_json(&format!("{base}/fleet")).unwrap();
    let me = fleet["this_process"].as_str().unwrap().to_string();
    browser.wait_for(
        &format!(
            "(() => {{ const r = document.querySelector('#fleet tr[data-process=\"{me}\"]'); \
               return r !== null && r.textContent.includes('(this)') && r.textContent.includes('this page') \
                 && r.querySelector('[data-state=\"10\"]') !== null; }})()"
        ),
        Duration::from_secs(15),
    );
    let note = browser.eval("document.getElementById('fleet-note').textContent");
    assert!(note.as_str().unwrap().contains("1 instance(s)"), "{note}");
    browser.drain_events();
    let before_restart: Vec<String> = browser.errors.drain(..).collect();
    assert!(
        before_restart.is_empty(),
        "no console errors: {before_restart:?}"
    );

    // The host goes away: the page says so and keeps what it showed.
    drop(std::mem::replace(
        &mut host,
        Process(Command::new("true").spawn().unwrap()),
    ));
    browser.wait_for(
        "document.body.dataset.connection === 'disconnected' && document.getElementById('connection').textContent.includes('disconnected')",
        Duration::from_secs(10),
    );
    assert_eq!(delivery_state(&mut browser), Some(10), "last state kept");

    // A host with another token returns on the same address: the page recovers by itself,
    // and a fleet-wide override (sealed with the token, so it needs one) works with that one.
    let _host = start_host(port, "another-s3cret-token", &dir);
    browser.wait_for(
        "document.body.dataset.connection === 'live'",
        Duration::from_secs(10),
    );
    browser.wait_for(
        "document.querySelector('#dir-delivery [data-role=state]').dataset.state === '0'",
        Duration::from_secs(15),
    );
    browser.eval("document.getElementById('token').value = 'another-s3cret-token'");
    // For the whole fleet this time (a fleet of one: the memory transport's registry).
    browser.eval(
        "document.querySelector('#dir-publishing [data-role=override-fleet]').checked = true",
    );
    apply_override(&mut browser, "publishing", "throttle");
    let accepted = override_message(&mut browser);
    assert!(
        accepted.contains("publishing override set to throttle on every instance"),
        "{accepted}"
    );
    browser.wait_for(
        "document.querySelector('#dir-publishing [data-role=state]').dataset.state === '11' \
           && document.querySelector('#dir-publishing [data-path=\"throttling.publishing.override\"]').textContent === 'throttle (fleet-wide)'",
        Duration::from_secs(10),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn failed_host_config(port: u16, failure_rate: f64) -> String {
    format!(
        r#"[host]
name = "console-failed"
admin_address = "127.0.0.1:{port}"
[admin]
token = "failed-token"
[transport]
kind = "memory"
[[queues]]
name = "orders"
immediate_retries = 0
[queues.recoverability]
delayed_retries = 0
[queues.handler]
kind = "simulate"
latency = "1ms"
failure_rate = {failure_rate}
"#
    )
}

/// The failed-messages panel: groups with counts, a group's messages, one message shown as
/// text (a body with script in it never runs), delete of a selection and retry of a group
/// once the handler is mended (the file reloads).
#[test]
fn the_console_shows_retries_and_deletes_failed_messages() {
    let dir = std::env::temp_dir().join(format!("throttlehost-failed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = common::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let config = dir.join("host.toml");
    std::fs::write(&config, failed_host_config(port, 1.0)).unwrap();
    let _host = run_host(&config, port);
    for _ in 0..6 {
        let (status, _, _) = common::http(
            "POST",
            &format!("{base}/queues/orders/messages"),
            b"<script>window.pwned = 1</script>",
            &[("Authorization", "Bearer failed-token")],
        );
        assert_eq!(status, 202);
    }
    let mut browser = Browser::launch(1280, 800);
    browser.navigate(&format!("{base}/"));
    browser.eval("document.getElementById('token').value = 'failed-token'");
    browser.wait_for(
        "document.querySelector('#failed-groups tr[data-count=\"6\"]') !== null",
        Duration::from_secs(20),
    );
    browser.eval("document.querySelector('#failed-groups [data-role=show]').click()");
    browser.wait_for(
        "document.querySelectorAll('#failed-messages tbody tr').length === 6",
        Duration::from_secs(10),
    );
    browser.eval("document.querySelector('#failed-messages [data-role=view]').click()");
    browser.wait_for(
        "document.getElementById('failed-view').textContent.includes('<script>window.pwned')",
        Duration::from_secs(10),
    );
    assert_eq!(
        browser.eval("typeof window.pwned").as_str(),
        Some("undefined"),
        "the body is shown as text, not run"
    );
    browser.eval(
        "(() => { const boxes = document.querySelectorAll('#failed-messages tbody input'); \
           boxes[0].checked = true; boxes[1].checked = true; \
           document.getElementById('failed-delete-selected').click(); })()",
    );
    browser.wait_for(
        "document.querySelector('#failed-groups tr[data-count=\"4\"]') !== null",
        Duration::from_secs(10),
    );
    std::fs::write(&config, failed_host_config(port, 0.0)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let reloaded = "throttlehost_config_reloads_total{result=\"success\"} 1";
    while !common::http("GET", &format!("{base}/metrics"), b"", &[])
        .1
        .contains(reloaded)
    {
        assert!(
            Instant::now() < deadline,
            "the mended handler was never reloaded"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    browser.eval("document.querySelector('#failed-groups [data-role=retry]').click()");
    browser.wait_for(
        "document.body.dataset.failedGroups === '0'",
        Duration::from_secs(20),
    );
    let status = get_json(&format!("{base}/status")).unwrap();
    assert_eq!(status["queues"][0]["succeeded_total"], 4, "{status:#}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Thirty queues, configured through `[queue_defaults]`: the table shows twenty, the busy
/// queue first although the host lists it last, and counts the rest; a filter shows the
/// queues whose names hold it, and "all" shows every queue. Only the queues shown first are
/// charted.
#[test]
fn with_many_queues_the_console_shows_the_busy_ones_first_and_filters() {
    let dir = std::env::temp_dir().join(format!("throttlehost-many-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = common::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut text = format!(
        "[host]\nname = \"console-many\"\nadmin_address = \"127.0.0.1:{port}\"\n\
         [admin]\ntoken = \"many-token\"\n[transport]\nkind = \"memory\"\n\
         [queue_defaults.handler]\nkind = \"noop\"\n"
    );
    for i in 0..29 {
        text.push_str(&format!("[[queues]]\nname = \"quiet{i:02}\"\n"));
    }
    text.push_str(
        "[[queues]]\nname = \"busy\"\n[queues.handler]\nkind = \"simulate\"\nlatency = \"60s\"\n",
    );
    let config = dir.join("host.toml");
    std::fs::write(&config, text).unwrap();
    let _host = run_host(&config, port);
    for _ in 0..2 {
        let (status, _, _) = common::http(
            "POST",
            &format!("{base}/queues/busy/messages"),
            b"slow",
            &[("Authorization", "Bearer many-token")],
        );
        assert_eq!(status, 202);
    }
    let mut browser = Browser::launch(1280, 800);
    browser.navigate(&format!("{base}/"));
    let first_row = "document.querySelector('#queues tbody tr td')?.textContent";
    browser.wait_for(&format!("{first_row} === 'busy'"), Duration::from_secs(20));
    let rows = "document.querySelectorAll('#queues tbody tr').length";
    assert_eq!(browser.eval(rows).as_u64(), Some(20));
    let note = browser.eval("document.getElementById('queue-note').textContent");
    assert!(
        note.as_str()
            .is_some_and(|n| n.contains("30 queues") && n.contains("10 quieter")),
        "{note}"
    );
    assert_eq!(
        browser
            .eval("document.querySelectorAll('#queue-charts figure').length")
            .as_u64(),
        Some(6),
        "charts for the first six shown"
    );
    browser.eval(
        "{ const f = document.getElementById('queue-filter'); f.value = 'quiet1'; \
         f.dispatchEvent(new Event('input')); }",
    );
    assert_eq!(browser.eval(rows).as_u64(), Some(10), "quiet10 to quiet19");
    browser.eval(
        "{ const f = document.getElementById('queue-filter'); f.value = ''; \
         f.dispatchEvent(new Event('input')); document.getElementById('queue-all').click(); }",
    );
    assert_eq!(browser.eval(rows).as_u64(), Some(30));
    let _ = std::fs::remove_dir_all(&dir);
}
