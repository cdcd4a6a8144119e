//! `throttlehost demo`: the built-in scenario `load/demo.toml` on the memory transport,
//! repeated until `--duration` ends or Ctrl-C, with a live table and the admin endpoint.

use std::process::ExitCode;
use std::time::Duration;

use throttlehost::load::{self, Display, LoadOptions, Scenario};

/// The demo scenario, compiled in so the demo needs no files.
const DEMO: &str = include_str!("../../load/demo.toml");

/// Runs the demo.
pub async fn demo(duration: Option<Duration>, admin: String) -> ExitCode {
    // The demo's endpoint has no token: like `run`, it listens on loopback only.
    match admin.parse::<std::net::SocketAddr>() {
        Ok(address) if address.ip().is_loopback() => {}
        Ok(_) => {
            eprintln!(
                "error: --admin {admin} is not a loopback address, and the demo's admin endpoint has no token (anyone who reaches it could send messages and override throttling); use 127.0.0.1:PORT, or `run` with [admin] token"
            );
            return ExitCode::from(2);
        }
        Err(_) => {
            eprintln!("error: --admin `{admin}` is not an address like 127.0.0.1:9464");
            return ExitCode::from(2);
        }
    }
    let scenario = match Scenario::parse(DEMO, "load/demo.toml") {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: the built-in demo scenario is invalid: {e}");
            return ExitCode::from(1);
        }
    };
    let options = LoadOptions {
        admin_address: Some(admin.clone()),
        display: Display::Table,
        repeat_for: duration,
        repeat_forever: duration.is_none(),
        track_ids: false,
        drain: false,
        ..LoadOptions::default()
    };
    let stop = options.stop.clone();
    tokio::spawn(async move {
        super::shutdown_signal().await;
        stop.cancel();
    });
    println!(
        "throttlehost demo: {} (memory transport; messages live only in this process)",
        scenario.description.trim()
    );
    println!(
        "console: http://{admin}/ (live throttling in a browser); also http://{admin}/status and http://{admin}/metrics; stop with Ctrl-C"
    );
    match load::run(&scenario, &options).await {
        Ok(run) => {
            let s = load::summarize(&run);
            println!();
            println!(
                "demo finished after {:.0}s; states seen:",
                s.duration_seconds
            );
            print!("{}", load::report::states_summary(&s));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
