//! A headless Chromium driven over the DevTools protocol: launch, navigate, evaluate,
//! screenshot, and the page's console errors. Only the handful of protocol methods the
//! console tests use, over one WebSocket to the page.
//!
//! Chromium is Debian's `chromium` package (`scripts/test` installs it); `CHROMIUM` names
//! another binary.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tungstenite::WebSocket;

/// A running headless browser with one page.
pub struct Browser {
    child: Child,
    profile: PathBuf,
    socket: WebSocket<TcpStream>,
    next_id: u64,
    /// Console errors, uncaught exceptions and failed loads the page reported, in order.
    pub errors: Vec<String>,
}

fn chromium() -> String {
    let candidates = ["chromium", "/usr/bin/chromium", "chromium-browser"];
    if let Ok(path) = std::env::var("CHROMIUM") {
        return path;
    }
    for c in candidates {
        if Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return c.to_string();
        }
    }
    panic!(
        "no Chromium found (tried {candidates:?}); the README's test command installs Debian's \
         `chromium` package, or set CHROMIUM to a Chromium or Chrome binary"
    );
}

fn devtools_port(profile: &Path, deadline: Instant) -> u16 {
    let file = profile.join("DevToolsActivePort");
    loop {
        if let Ok(text) = std::fs::read_to_string(&file)
            && let Some(port) = text.lines().next().and_then(|l| l.trim().parse().ok())
        {
            return port;
        }
        assert!(
            Instant::now() < deadline,
            "Chromium did not open its DevTools port"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Browser {
    /// Starts Chromium headless with a `width` x `height` window and connects to its page.
    pub fn launch(width: u32, height: u32) -> Browser {
        let profile = std::env::temp_dir().join(format!(
            "throttlehost-chromium-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&profile).unwrap();
        let child = Command::new(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                &format!("--window-size={width},{height}"),
                &format!("--user-data-dir={}", profile.display()),
                "about:blank",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("Chromium starts");
        let deadline = Instant::now() + Duration::from_secs(30);
        let port = devtools_port(&profile, deadline);
        let url = loop {
            let targets: Option<Value> = ureq::get(format!("http://127.0.0.1:{port}/json/list"))
                .call()
                .ok()
                .and_then(|mut r| r.body_mut().read_to_string().ok())
                .and_then(|t| serde_json::from_str(&t).ok());
            let page = targets.as_ref().and_then(|t| {
                t.as_array()?
                    .iter()
                    .find(|t| t["type"] == "page")?
                    .get("webSocketDebuggerUrl")?
                    .as_str()
                    .map(str::to_string)
            });
            if let Some(url) = page {
                break url;
            }
            assert!(Instant::now() < deadline, "Chromium shows no page target");
            std::thread::sleep(Duration::from_millis(100));
        };
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (socket, _) = tungstenite::client(url.as_str(), stream).expect("DevTools WebSocket");
        let mut browser = Browser {
            child,
            profile,
            socket,
            next_id: 0,
            errors: Vec::new(),
        };
        browser.call("Runtime.enable", json!({}));
        browser.call("Log.enable", json!({}));
        browser.call("Page.enable", json!({}));
        browser.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
        );
        browser
    }

    /// Sends one command and waits for its result; events that arrive meanwhile are read for
    /// errors. Panics on a protocol error.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let message = json!({ "id": id, "method": method, "params": params }).to_string();
        self.socket
            .send(tungstenite::Message::text(message))
            .expect("DevTools command sent");
        loop {
            let frame = match self.socket.read() {
                Ok(f) => f,
                Err(tungstenite::Error::Io(e)) if e.kind() == ErrorKind::WouldBlock => continue,
                Err(e) => panic!("DevTools connection failed during {method}: {e}"),
            };
            let Ok(text) = frame.to_text() else { continue };
            let Ok(value) = serde_json::from_str::<Value>(text) else {
                continue;
            };
            if value["id"] == id {
                if let Some(error) = value.get("error") {
                    panic!("{method} failed: {error}");
                }
                return value["result"].clone();
            }
            self.note_event(&value);
        }
    }

    fn note_event(&mut self, event: &Value) {
        let params = &event["params"];
        match event["method"].as_str() {
            Some("Runtime.exceptionThrown") => self.errors.push(format!(
                "exception: {}",
                params["exceptionDetails"]["exception"]["description"]
                    .as_str()
                    .or(params["exceptionDetails"]["text"].as_str())
                    .unwrap_or("?")
            )),
            Some("Runtime.consoleAPICalled") if params["type"] == "error" => self
                .errors
                .push(format!("console.error: {}", params["args"])),
            Some("Log.entryAdded") if params["entry"]["level"] == "error" => {
                self.errors.push(format!(
                    "{}: {} {}",
                    params["entry"]["source"].as_str().unwrap_or("log"),
                    params["entry"]["text"].as_str().unwrap_or(""),
                    params["entry"]["url"].as_str().unwrap_or("")
                ))
            }
            _ => {}
        }
    }

    /// Opens `url` and waits for its load event.
    pub fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({ "url": url }));
        self.wait_for(
            "document.readyState === 'complete'",
            Duration::from_secs(20),
        );
    }

    /// Evaluates `expression` in the page (promises awaited) and returns its value.
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
        );
        if let Some(details) = result.get("exceptionDetails") {
            panic!("`{expression}` threw: {details}");
        }
        result["result"]["value"].clone()
    }

    /// Waits until `condition` (a JavaScript expression) is true; panics after `timeout`.
    pub fn wait_for(&mut self, condition: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.eval(&format!("Boolean({condition})")) == json!(true) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "waited {timeout:?} for `{condition}`; page errors: {:?}",
                self.errors
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A PNG of the whole page at the viewport's width.
    pub fn screenshot(&mut self) -> Vec<u8> {
        let size = self
            .eval("[document.documentElement.clientWidth, document.documentElement.scrollHeight]");
        let (width, height) = (
            size[0].as_f64().unwrap_or(1280.0),
            size[1].as_f64().unwrap_or(800.0),
        );
        let result = self.call(
            "Page.captureScreenshot",
            json!({
                "format": "png",
                "captureBeyondViewport": true,
                "clip": { "x": 0, "y": 0, "width": width, "height": height, "scale": 1 }
            }),
        );
        data_encoding::BASE64
            .decode(result["data"].as_str().unwrap_or_default().as_bytes())
            .expect("screenshot is base64")
    }

    /// Reads pending events (errors) without sending anything that changes the page.
    pub fn drain_events(&mut self) {
        self.eval("0");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
