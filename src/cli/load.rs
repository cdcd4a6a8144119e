//! `throttlehost load FILE`: runs a scenario and writes its timeline, chart and summary.

use std::path::Path;
use std::process::ExitCode;

use throttlehost::load::{self, Display, LoadOptions, Scenario};

/// Runs one scenario.
pub async fn load(
    file: &Path,
    duration_scale: f64,
    out: &Path,
    schema: Option<String>,
    connection_string: Option<String>,
) -> ExitCode {
    if !(duration_scale > 0.0 && duration_scale.is_finite()) {
        eprintln!("error: --duration-scale {duration_scale} must be a number above 0");
        return ExitCode::from(super::INVALID);
    }
    let scenario = match Scenario::load(file) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(super::INVALID);
        }
    };
    let options = LoadOptions {
        duration_scale,
        schema,
        connection_string,
        display: Display::Progress,
        ..LoadOptions::default()
    };
    let stop = options.stop.clone();
    tokio::spawn(async move {
        super::shutdown_signal().await;
        stop.cancel();
    });
    let run = match load::run(&scenario, &options).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let summary = load::summarize(&run);
    if let Err(e) = load::write_outputs(&run, &summary, out) {
        eprintln!("error: cannot write the results to {}: {e}", out.display());
        return ExitCode::from(1);
    }
    print!("{}", load::text_summary(&summary));
    println!(
        "  wrote {0}/timeline.csv, {0}/timeline.svg, {0}/summary.json",
        out.display()
    );
    if summary.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Runs as a peer of a load run (`throttlehost load-peer`, started by the run itself).
pub async fn load_peer(schema: Option<String>, connection_string: Option<String>) -> ExitCode {
    let Ok(text) = std::env::var(load::peer::SCENARIO_ENV) else {
        eprintln!(
            "error: load-peer is started by `throttlehost load` for scenarios with processes above 1; {} is not set",
            load::peer::SCENARIO_ENV
        );
        return ExitCode::from(super::INVALID);
    };
    let scenario = match Scenario::parse(&text, load::peer::SCENARIO_ENV) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(super::INVALID);
        }
    };
    let options = LoadOptions {
        schema,
        connection_string,
        ..LoadOptions::default()
    };
    match load::peer::serve(&scenario, &options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: load peer: {e}");
            ExitCode::from(1)
        }
    }
}
