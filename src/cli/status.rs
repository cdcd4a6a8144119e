//! `throttlehost status`: reads `/status` of a running host and prints a table. Exit code 0:
//! not throttling, 1: throttling, 2: unreachable or not a throttlehost, 3: receiving impaired
//! (a queue's receives are failing, so its circuit breaker is not closed, the host is
//! shutting down, or it answers 503 while `run` waits for the database at start); 3 wins
//! over 1, since a host that cannot receive throttles nothing.
//!
//! With `--fleet` it reads `/fleet` instead: every instance on the host's database, one line
//! each. Exit code 0: no instance seen throttling, 1: one is, 2: unreachable or no registry.

use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;

/// Reads `path` of the admin endpoint at `url`: the body as JSON and as text, or what to
/// say (already said) and exit with.
async fn fetch(url: &str, path: &str, what: &str) -> Result<(Value, String), ExitCode> {
    let url = format!("{}{path}", url.trim_end_matches('/'));
    let fetched = tokio::task::spawn_blocking({
        let url = url.clone();
        move || -> Result<String, (u16, String)> {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_global(Some(Duration::from_secs(5)))
                .build()
                .into();
            let mut response = agent
                .get(&url)
                .config()
                .http_status_as_error(false)
                .build()
                .call()
                .map_err(|e| (0, e.to_string()))?;
            let ok = response.status().is_success();
            let code = response.status().as_u16();
            let body = response
                .body_mut()
                .read_to_string()
                .map_err(|e| (code, e.to_string()))?;
            if ok {
                Ok(body)
            } else {
                // The admin endpoint says why in `{"error": ...}`.
                let why = serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(str::to_owned))
                    .unwrap_or(body);
                Err((code, format!("{} {why}", response.status())))
            }
        }
    })
    .await
    .unwrap_or_else(|e| Err((0, e.to_string())));
    let text = match fetched {
        Ok(t) => t,
        // The host answers but does not receive yet: `run` waiting for the database at start.
        Err((503, e)) if path == "/status" => {
            eprintln!("receiving impaired: {url}: {e}");
            return Err(ExitCode::from(3));
        }
        Err((_, e)) => {
            eprintln!("error: cannot read {url}: {e}");
            return Err(ExitCode::from(2));
        }
    };
    match serde_json::from_str(&text) {
        Ok(v) => Ok((v, text)),
        Err(e) => {
            eprintln!("error: {url} did not answer with a throttlehost {what}: {e}");
            Err(ExitCode::from(2))
        }
    }
}

/// Fetches and prints the status (`fleet`: every instance's; `all`: every queue).
pub async fn status(url: &str, raw: bool, fleet: bool, all: bool) -> ExitCode {
    if fleet {
        return fleet_status(url, raw).await;
    }
    let (status, text) = match fetch(url, "/status", "status document").await {
        Ok(got) => got,
        Err(code) => return code,
    };
    if raw {
        println!("{text}");
    } else {
        print!("{}", render(&status, all));
    }
    if let Some(why) = impaired(&status) {
        eprintln!("receiving impaired: {why}");
        return ExitCode::from(3);
    }
    throttling_code(throttles(&status["throttling"]))
}

/// Whether either direction of a `throttling` object (of `/status`, or of an instance's
/// summary in `/fleet`) is in a state other than 0.
fn throttles(throttling: &Value) -> bool {
    ["delivery", "publishing"]
        .iter()
        .any(|d| throttling[d]["state"].as_u64().unwrap_or(0) != 0)
}

/// Exit code 1 while throttling, else 0.
fn throttling_code(throttling: bool) -> ExitCode {
    if throttling {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Fetches and prints `/fleet`.
async fn fleet_status(url: &str, raw: bool) -> ExitCode {
    let (fleet, text) = match fetch(url, "/fleet", "fleet view").await {
        Ok(got) => got,
        Err(code) => return code,
    };
    if raw {
        println!("{text}");
    } else {
        print!("{}", render_fleet(&fleet));
    }
    let throttling = fleet["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["gone"] != true)
        .any(|i| throttles(&i["summary"]["throttling"]));
    throttling_code(throttling)
}

/// A value from the registry (rows anyone can write) as the terminal may show it: control
/// characters escaped, so no escape sequence reaches the terminal.
fn shown(value: &Value) -> String {
    value.as_str().unwrap_or("?").escape_debug().to_string()
}

/// One line per instance: who, state per direction with its cause, in process, processed/s,
/// last seen.
fn render_fleet(f: &Value) -> String {
    let mut out = format!(
        "{:<24} {:<26} {:<26} {:>10} {:>12} {:>10}\n",
        "instance", "delivery", "publishing", "in process", "processed/s", "seen"
    );
    for i in f["instances"].as_array().into_iter().flatten() {
        let t = &i["summary"]["throttling"];
        let direction = |d: &str| {
            let x = &t[d];
            let state = x["state"].as_u64().unwrap_or(0);
            match x["cause"].as_str() {
                Some(_) if state != 0 => format!("{state} {}", shown(&x["cause"])),
                _ => format!("{state} {}", shown(&x["state_name"])),
            }
        };
        let name = format!(
            "{}/{}{}",
            shown(&i["host_name"]),
            shown(&i["instance_id"]),
            if i["this"] == true { " *" } else { "" }
        );
        let seen = i["seen_seconds_ago"].as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "{:<24} {:<26} {:<26} {:>10} {:>12.1} {:>10}\n",
            name,
            direction("delivery"),
            direction("publishing"),
            i["summary"]["in_process"].as_u64().unwrap_or(0),
            t["delivery"]["outgoing_per_second"].as_f64().unwrap_or(0.0),
            if i["gone"] == true {
                format!("GONE {seen:.0}s")
            } else {
                format!("{seen:.1}s ago")
            },
        ));
    }
    for order in f["orders"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "fleet-wide override: {} {} (given on {})\n",
            shown(&order["direction"]),
            shown(&order["mode"]),
            shown(&order["set_by"]),
        ));
    }
    if f["heartbeat_error"].is_string() {
        out.push_str(&format!(
            "this host's heartbeat is failing: {}\n",
            shown(&f["heartbeat_error"])
        ));
    }
    out
}

/// Why the host is not receiving normally, from its status document.
fn impaired(s: &Value) -> Option<String> {
    if s["receiving"] == false {
        return Some("the host is shutting down".into());
    }
    if let Some(silent) = s["database_silent_seconds"].as_f64() {
        return Some(format!(
            "the database is not answering (statements have waited {silent:.0} s with no answer)"
        ));
    }
    let failing: Vec<String> = s["queues"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|q| q["circuit_breaker"].as_str().is_some_and(|b| b != "closed"))
        .map(|q| {
            format!(
                "queue {} (circuit breaker {})",
                q["name"].as_str().unwrap_or("?"),
                q["circuit_breaker"].as_str().unwrap_or("?")
            )
        })
        .collect();
    (!failing.is_empty()).then(|| format!("receives are failing for {}", failing.join(", ")))
}

/// Queue rows `status` shows without `--all`.
const QUEUE_ROWS: usize = 20;

/// The queues to show, and how many are left out: all of them in the host's order up to
/// [`QUEUE_ROWS`] (or with `all`); past that, the busiest first (in flight, depth, a breaker
/// not closed), and only [`QUEUE_ROWS`] of them without `all`.
fn queue_rows(s: &Value, all: bool) -> (Vec<&Value>, usize) {
    let mut queues: Vec<&Value> = s["queues"].as_array().into_iter().flatten().collect();
    if queues.len() <= QUEUE_ROWS {
        return (queues, 0);
    }
    let number = |q: &Value, field: &str| q[field].as_u64().unwrap_or(0);
    queues.sort_by_key(|q| {
        (
            std::cmp::Reverse(number(q, "in_flight")),
            std::cmp::Reverse(number(q, "depth")),
            q["circuit_breaker"].as_str() == Some("closed"),
        )
    });
    let left_out = if all { 0 } else { queues.len() - QUEUE_ROWS };
    queues.truncate(queues.len() - left_out);
    (queues, left_out)
}

fn render(s: &Value, all: bool) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "host {} ({})  transport {}  up {:.0}s  in process {}\n",
        s["host"].as_str().unwrap_or("?"),
        s["instance"].as_str().unwrap_or("?"),
        s["transport"].as_str().unwrap_or("?"),
        s["uptime_seconds"].as_f64().unwrap_or(0.0),
        s["in_process"].as_u64().unwrap_or(0),
    ));
    let t = &s["throttling"];
    if t.is_null() {
        out.push_str("throttling: no sample yet\n");
    } else {
        render_throttling(t, &mut out);
    }
    render_queues(s, all, &mut out);
    out
}

/// Each direction's state with why and what is done about it, then the resources.
fn render_throttling(t: &Value, out: &mut String) {
    out.push_str(&format!(
        "{:<11} {:<36} {:>9} {:>10} {:>14}\n",
        "direction", "state", "delay", "for", "in/out msg/s"
    ));
    for d in ["delivery", "publishing"] {
        let x = &t[d];
        let wait = x["delay_seconds"].as_f64().unwrap_or(0.0)
            + x["pacing_interval_seconds"].as_f64().unwrap_or(0.0);
        let recovering = if x["recovering"].as_bool().unwrap_or(false) {
            " (recovering)"
        } else {
            ""
        };
        out.push_str(&format!(
            "{:<11} {:<36} {:>8.3}s {:>9.0}s {:>14}\n",
            d,
            format!(
                "{} {}{recovering}",
                x["state"].as_u64().unwrap_or(0),
                x["state_name"].as_str().unwrap_or("")
            ),
            wait,
            x["state_duration_seconds"].as_f64().unwrap_or(0.0),
            format!(
                "{:.0}/{:.0}",
                x["incoming_per_second"].as_f64().unwrap_or(0.0),
                x["outgoing_per_second"].as_f64().unwrap_or(0.0)
            ),
        ));
        let e = &x["explanation"];
        if let Some(cause) = e["cause"].as_str() {
            out.push_str(&format!("  because  {cause}\n"));
            for action in e["actions"].as_array().into_iter().flatten() {
                out.push_str(&format!("  action   {}\n", action.as_str().unwrap_or("?")));
            }
            if let Some(clears) = e["clears_when"].as_str() {
                out.push_str(&format!("  ends     when {clears}\n"));
            }
        }
    }
    out.push_str("resources\n");
    for r in t["resources"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "  {} {}\n",
            if r["active"].as_bool().unwrap_or(false) {
                "*"
            } else {
                " "
            },
            r["text"].as_str().unwrap_or("?")
        ));
    }
}

/// The queues (the busiest first unless `all`), then the delayed tables nobody moves.
fn render_queues(s: &Value, all: bool, out: &mut String) {
    out.push_str(&format!(
        "{:<28} {:<9} {:>5} {:>6} {:>10} {:>8} {:>6}  breaker\n",
        "queue", "model", "max", "limit", "in-flight", "depth", "loops"
    ));
    let (shown, left_out) = queue_rows(s, all);
    for q in shown {
        out.push_str(&format!(
            "{:<28} {:<9} {:>5} {:>6} {:>10} {:>8} {:>6}  {}\n",
            q["name"].as_str().unwrap_or("?"),
            q["model"].as_str().unwrap_or("?"),
            q["max"].as_u64().unwrap_or(0),
            q["limit"].as_u64().unwrap_or(0),
            q["in_flight"].as_u64().unwrap_or(0),
            q["depth"].as_u64().unwrap_or(0),
            q["loops"].as_u64().unwrap_or(0),
            q["circuit_breaker"].as_str().unwrap_or("?"),
        ));
    }
    if left_out > 0 {
        out.push_str(&format!(
            "... and {left_out} more queues, none busier than those above (--all shows every one)\n"
        ));
    }
    for q in s["queues"].as_array().into_iter().flatten() {
        let name = q["name"].as_str().unwrap_or("?");
        match q["delayed_moves"].as_str() {
            Some("failing") => out.push_str(&format!(
                "delayed messages of {name}: this instance's moves fail (see its log); due ones wait\n"
            )),
            Some("nobody") => out.push_str(&format!(
                "delayed messages of {name}: no instance receiving from it moves its delayed table; they wait\n"
            )),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry row with terminal escape sequences in its names and order prints them
    /// escaped: nothing another writer of the table chose reaches the terminal raw.
    #[test]
    fn the_fleet_table_escapes_what_the_registry_rows_say() {
        let fleet = serde_json::json!({
            "instances": [{
                "host_name": "sales\u{1b}[2J",
                "instance_id": "n1\u{7}",
                "summary": { "throttling": { "delivery": { "state": 4, "cause": "memory\u{1b}]0;pwned\u{7}" } } },
                "seen_seconds_ago": 1.0
            }],
            "orders": [{ "direction": "delivery", "mode": "throttle", "set_by": "x\u{1b}[31m" }],
            "heartbeat_error": "down\u{1b}[0m"
        });
        let text = render_fleet(&fleet);
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:?}"
        );
        assert!(text.contains("sales\\u{1b}[2J/n1\\u{7}"), "{text}");
    }

    /// The queue rows of a rendered status (the test's queues are named q00, q01...).
    fn queue_lines(text: &str) -> Vec<&str> {
        text.lines()
            .filter(|l| l.starts_with('q') && !l.starts_with("queue"))
            .collect()
    }

    /// Past 20 queues, the busy ones come first and the rest are counted, not listed; with
    /// `--all` every queue is; up to 20 keep the host's order.
    #[test]
    fn many_queues_show_the_busy_ones_first_and_count_the_rest() {
        let queue = |i: usize, in_flight: u64, depth: u64| {
            serde_json::json!({
                "name": format!("q{i:02}"), "in_flight": in_flight, "depth": depth,
                "circuit_breaker": if i == 7 { "open" } else { "closed" }
            })
        };
        let mut queues: Vec<Value> = (0..25).map(|i| queue(i, 0, 0)).collect();
        queues[24] = queue(24, 3, 10);
        queues[23] = queue(23, 0, 50);
        let status = serde_json::json!({ "queues": queues });
        let text = render(&status, false);
        let rows = queue_lines(&text);
        assert_eq!(rows.len(), 20, "{text}");
        assert!(
            rows[0].starts_with("q24") && rows[1].starts_with("q23"),
            "{text}"
        );
        assert!(rows[2].starts_with("q07"), "an open breaker next: {text}");
        assert!(text.contains("... and 5 more queues"), "{text}");
        let every = render(&status, true);
        assert_eq!(queue_lines(&every).len(), 25);
        assert!(!every.contains("more queues"), "{every}");
        let few = serde_json::json!({ "queues": [queue(0, 0, 0), queue(1, 5, 5)] });
        let text = render(&few, false);
        let rows = queue_lines(&text);
        assert!(rows[0].starts_with("q00"), "the host's order: {text}");
    }

    /// A delayed table nobody moves, or whose moves fail here, gets a line of its own; a
    /// moved one none.
    #[test]
    fn a_delayed_table_that_is_not_moved_is_said_under_the_queues() {
        let status = serde_json::json!({
            "queues": [
                { "name": "orders", "delayed_moves": "moving" },
                { "name": "billing", "delayed_moves": "nobody" },
                { "name": "audit", "delayed_moves": "failing" }
            ]
        });
        let text = render(&status, false);
        assert!(!text.contains("delayed messages of orders"), "{text}");
        assert!(
            text.contains(
                "delayed messages of billing: no instance receiving from it moves its delayed table"
            ),
            "{text}"
        );
        assert!(
            text.contains("delayed messages of audit: this instance's moves fail"),
            "{text}"
        );
    }

    #[test]
    fn a_queue_whose_receives_fail_makes_the_host_impaired() {
        let healthy = serde_json::json!({
            "receiving": true,
            "queues": [{ "name": "in", "circuit_breaker": "closed" }]
        });
        assert_eq!(impaired(&healthy), None);
        let failing = serde_json::json!({
            "receiving": true,
            "queues": [
                { "name": "in", "circuit_breaker": "closed" },
                { "name": "orders", "circuit_breaker": "armed" }
            ]
        });
        assert_eq!(
            impaired(&failing).as_deref(),
            Some("receives are failing for queue orders (circuit breaker armed)")
        );
        let silent = serde_json::json!({
            "receiving": true,
            "database_silent_seconds": 6.2,
            "queues": [{ "name": "in", "circuit_breaker": "closed" }]
        });
        assert_eq!(
            impaired(&silent).as_deref(),
            Some("the database is not answering (statements have waited 6 s with no answer)"),
            "said while the breakers are still closed"
        );
        let stopping = serde_json::json!({ "receiving": false, "queues": [] });
        assert_eq!(
            impaired(&stopping).as_deref(),
            Some("the host is shutting down")
        );
    }
}
