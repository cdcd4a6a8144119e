//! The shipped load scenarios on the memory transport, each run in full through the load
//! runner and a real host, in paused tokio time: the host's throttling service, its queues,
//! the memory store and the simulated handlers all follow the paused clock, so a run's
//! verdicts (engaged within 2 samples, peaks, recovery within 10 s, flips, rates, latencies)
//! do not hang on how busy the machine is, and a minute of scenario takes well under a second.
//! Scenarios whose cause is a real resource of the process (its memory, its threads, the
//! machine's memory) and those on PostgreSQL run through the `throttlehost load` command on
//! the wall clock in tests/load_scenarios.rs.

mod common;

use std::path::PathBuf;

use serde_json::Value;
use throttlehost::load::{self, LoadOptions, RunResult, Scenario};

use common::load::*;

/// Runs `load/<name>.toml` at its full length in this test's paused runtime; returns its
/// summary and the run, whose timeline [`timeline_of`] writes for the tests that read it.
async fn run(name: &str) -> (Value, RunResult) {
    let path = format!("load/{name}.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let scenario = Scenario::parse(&text, &path).unwrap();
    let options = LoadOptions {
        // No admin endpoint: tests run side by side, and none of these reads it.
        admin_address: Some("off".into()),
        ..LoadOptions::default()
    };
    let result = load::run(&scenario, &options).await.unwrap();
    (
        serde_json::to_value(load::summarize(&result)).unwrap(),
        result,
    )
}

/// Runs `load/<name>.toml`, which must pass, and returns its summary.
async fn scenario(name: &str) -> Value {
    let (summary, _) = run(name).await;
    assert_passed(name, &summary);
    summary
}

/// Writes the run's `timeline.csv` as the command does, into a directory of its own that
/// [`timeline_columns`] reads and removes.
fn timeline_of(result: &RunResult) -> PathBuf {
    let out = std::env::temp_dir().join(format!("th-paused-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&out).unwrap();
    load::report::write_csv(result, &out.join("timeline.csv")).unwrap();
    out
}

#[tokio::test(start_paused = true)]
async fn in_process_messages() {
    let s = scenario("in-process").await;
    assert_appeared_and_cleared("in-process", &s, "delivery", 3);
    assert_controlled("in-process", &s, "in_process", 1.15);
    // The ceiling holds the count; the limit is never cut for it.
    assert_eq!(s["min_concurrency_limit"]["orders"], 200);
}

/// One busy queue and two idle ones, each of max 200, under one in-process threshold of 150:
/// the count is held for all of them together and every limit stays at its max.
#[tokio::test(start_paused = true)]
async fn queues_share_the_in_process_threshold_by_demand_with_limits_at_max() {
    let s = scenario("in-process-shared").await;
    assert_appeared_and_cleared("in-process-shared", &s, "delivery", 3);
    assert_controlled("in-process-shared", &s, "in_process", 1.15);
    for queue in ["orders", "invoices", "shipping"] {
        assert_eq!(s["min_concurrency_limit"][queue], 200, "{queue}: {s:#}");
    }
}

#[tokio::test(start_paused = true)]
async fn steady_loads_within_capacity_start_without_an_episode() {
    let s = scenario("steady-starts").await;
    for direction in ["delivery", "publishing"] {
        let states = s["states_observed"][direction].as_object().unwrap();
        assert_eq!(
            states.keys().collect::<Vec<_>>(),
            ["0"],
            "steady-starts: {direction} throttled: {s:#}"
        );
    }
    assert!(s["episodes"].as_array().is_none_or(Vec::is_empty), "{s:#}");
}

#[tokio::test(start_paused = true)]
async fn delivery_rate_imbalance() {
    let s = scenario("delivery-rate").await;
    assert_appeared_and_cleared("delivery-rate", &s, "delivery", 1);
}

#[tokio::test(start_paused = true)]
async fn publishing_rate_imbalance() {
    let s = scenario("publishing-rate").await;
    assert_appeared_and_cleared("publishing-rate", &s, "publishing", 2);
}

#[tokio::test(start_paused = true)]
async fn override_delivery() {
    let s = scenario("override-delivery").await;
    assert_appeared_and_cleared("override-delivery", &s, "delivery", 10);
    assert_eq!(seconds_in(&s, "publishing", 11), 0.0);
}

#[tokio::test(start_paused = true)]
async fn override_publishing() {
    let s = scenario("override-publishing").await;
    assert_appeared_and_cleared("override-publishing", &s, "publishing", 11);
    assert_eq!(seconds_in(&s, "delivery", 10), 0.0);
}

#[tokio::test(start_paused = true)]
async fn override_never() {
    let s = scenario("override-never").await;
    assert_eq!(
        s["states_observed"]["delivery"].as_object().unwrap().len(),
        1,
        "delivery stays at 0"
    );
}

/// Handler latency creeping from 10 ms to 1 s at a constant rate: in-process is held.
#[tokio::test(start_paused = true)]
async fn handler_latency_creeping_up_is_held_at_the_in_process_threshold() {
    let s = scenario("latency-creep").await;
    assert_appeared_and_cleared("latency-creep", &s, "delivery", 3);
    assert_controlled("latency-creep", &s, "in_process", 1.15);
}

/// Slow handlers switched on and off, two rounds far enough apart to be two causes (a
/// crossing within 10 s of the last cause's end is the same episode): every episode is
/// controlled on its own.
#[tokio::test(start_paused = true)]
async fn a_cause_switched_on_and_off_is_controlled_every_time() {
    let s = scenario("on-off").await;
    assert_appeared_and_cleared("on-off", &s, "delivery", 3);
    assert_controlled("on-off", &s, "in_process", 1.15);
    let episodes = s["episodes"].as_array().unwrap().len();
    assert_eq!(episodes, 2, "on-off: {episodes} episodes in 2 rounds");
}

/// Offered load hovering at the in-process threshold: one episode, held, not flipping with
/// every dip below the resume line.
#[tokio::test(start_paused = true)]
async fn a_load_hovering_at_the_threshold_is_one_steady_episode() {
    assert_one_held_in_process_episode("hovering").await;
}

/// Hovering with `resume_ratio = 1.0` (no band in value): still one episode of at most two
/// state changes, held by the band in time and the minimum time in a state.
#[tokio::test(start_paused = true)]
async fn without_hysteresis_a_hovering_load_does_not_flap() {
    assert_one_held_in_process_episode("no-hysteresis").await;
}

/// Offered load pinned 2 % above the in-process threshold: one episode, at most two flips.
#[tokio::test(start_paused = true)]
async fn a_load_pinned_just_above_the_threshold_is_one_episode() {
    assert_one_held_in_process_episode("pinned").await;
}

/// Ten times the sends for 2 s into 1 s handlers past their limit: delivery rate imbalance
/// is engaged and cleared within the bounds, once, for the burst (the start, the pipeline
/// filling below the limit, is none), and what the pace held back is not let in at once when
/// it ends.
#[tokio::test(start_paused = true)]
async fn a_tenfold_delivery_burst_is_paced_once_and_clears_without_a_release_burst() {
    let (s, result) = run("delivery-burst").await;
    assert_passed("delivery-burst", &s);
    // No release burst: once the burst's own sends are in (it ends at 27 s), messages in
    // process rise by at most 90 in one tick. A pace that ended with ~190 messages still
    // queued let them in within two ticks (+122 in one); opening over a few samples, the
    // largest rise was 48. (The burst itself adds 400/s x 0.25 s less what completes, about
    // 90 in its first tick, before anything can be paced.)
    let series: Vec<(f64, i64)> =
        timeline_columns(&timeline_of(&result), ["t_seconds", "in_process"])
            .into_iter()
            .map(|[t, in_process]| (t.parse().unwrap(), in_process.parse().unwrap()))
            .filter(|(at, _)| *at >= 27.0)
            .collect();
    let rise = series.windows(2).map(|w| w[1].1 - w[0].1).max().unwrap();
    assert!(rise <= 90, "in process rose by {rise} in one tick");
    assert_appeared_and_cleared("delivery-burst", &s, "delivery", 1);
    assert_controlled("delivery-burst", &s, "rate_imbalance", f64::INFINITY);
    let episodes = episodes_of(&s, "rate_imbalance").len();
    assert_eq!(episodes, 1, "the burst alone: {:#}", s["episodes"]);
}

/// A backlog at start into 2 s handlers: delivery's rate imbalance engages within 2 samples,
/// before the first message has completed, as one episode within the bounds.
#[tokio::test(start_paused = true)]
async fn a_backlog_at_start_engages_the_rate_imbalance_before_anything_completes() {
    let (s, result) = run("cold-start").await;
    assert_passed("cold-start", &s);
    let [_, done] = timeline_columns(&timeline_of(&result), ["delivery_state", "messages_done"])
        .into_iter()
        .find(|[state, _]| state == "1")
        .expect("state 1 appeared");
    assert_eq!(done, "0", "engaged before the first completion");
    assert_appeared_and_cleared("cold-start", &s, "delivery", 1);
    assert_controlled("cold-start", &s, "rate_imbalance", f64::INFINITY);
}

/// An in-process scenario: state 3 appears and clears, one episode within the
/// bounds.
async fn assert_one_held_in_process_episode(name: &str) {
    let s = scenario(name).await;
    assert_appeared_and_cleared(name, &s, "delivery", 3);
    assert_controlled(name, &s, "in_process", 1.15);
    assert_one_episode(name, &s, "in_process");
}

/// A 10x publish burst for 2 s against a slow store: publishing is paced (state 2) once,
/// without flapping, and lets go once the store has caught up.
#[tokio::test(start_paused = true)]
async fn a_publish_burst_is_paced_once_and_released() {
    let (s, result) = run("burst").await;
    assert_passed("burst", &s);
    assert_appeared_and_cleared("burst", &s, "publishing", 2);
    // The timeline shows the pace and the sends it holds, and neither once state 0 is back.
    let rows = timeline_columns(
        &timeline_of(&result),
        [
            "publishing_state",
            "publishing_pace_per_second",
            "publishing_waiting",
        ],
    );
    let paced = |row: &[String; 3]| row[1].parse::<f64>().unwrap() > 0.0;
    let waiting = |row: &[String; 3]| row[2].parse::<u64>().unwrap();
    assert!(
        rows.iter()
            .any(|r| r[0] == "2" && paced(r) && waiting(r) > 0),
        "no paced tick with sends waiting"
    );
    let last = rows.last().unwrap();
    assert_eq!(
        (last[0].as_str(), paced(last), waiting(last)),
        ("0", false, 0)
    );
    let rate: Vec<&Value> = episodes_of(&s, "rate_imbalance")
        .into_iter()
        .filter(|e| e["direction"] == "publishing")
        .collect();
    assert!(!rate.is_empty(), "burst: no publishing rate episode: {s:#}");
    for e in rate {
        assert!(e["engage_samples"].as_u64().unwrap() <= 2, "{e}");
        assert!(e["flips"].as_u64().unwrap() <= 2, "{e}");
        assert!(e["recovery_seconds"].as_f64().unwrap() <= 10.0, "{e}");
    }
}

/// Closed-loop producers against a consumer cut to 1: the backlog is held at its threshold.
#[tokio::test(start_paused = true)]
async fn closed_loop_producers_are_held_at_the_database_size() {
    let s = scenario("closed-loop").await;
    assert_appeared_and_cleared("closed-loop", &s, "publishing", 6);
    assert_controlled("closed-loop", &s, "database_size", 1.10);
}

#[tokio::test(start_paused = true)]
async fn a_downstream_outage_puts_nothing_in_the_error_queue_and_gets_at_most_a_call_a_second() {
    let s = scenario("outage").await;
    assert_appeared_and_cleared("outage", &s, "delivery", 12);
    assert_eq!(s["messages_in_error_queue"], 0, "{s:#}");
    let outage = phase(&s, "outage");
    assert!(number(outage, "outage_detected_after") <= 2.0, "{outage}");
    assert!(
        number(outage, "calls_per_second_in_outage") <= 2.0,
        "{outage}"
    );
    // The backlog and the delayed retries are handled within 60 s of the downstream's return.
    let recovered = number(phase(&s, "recovered"), "start");
    let last_done = number(&s, "busy_seconds") + number(phase(&s, "healthy"), "start");
    assert!(
        last_done - recovered <= 60.0,
        "{last_done} vs {recovered}: {s:#}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_poisoned_message_among_good_ones_reaches_the_error_queue_without_outage_mode() {
    let (s, _) = run("poison").await;
    assert_eq!(s["messages_lost"], 0, "{s:#}");
    assert_eq!(s["cleared"], true, "{s:#}");
    let sent = s["messages_sent"].as_u64().unwrap();
    let poisoned = s["messages_in_error_queue"].as_u64().unwrap();
    assert_eq!(
        poisoned,
        sent / 100,
        "one in 100, after its delayed retries: {s:#}"
    );
    assert_eq!(s["messages_processed"].as_u64().unwrap() + poisoned, sent);
    assert_eq!(seconds_in(&s, "delivery", 12), 0.0, "no outage mode: {s:#}");
}

#[tokio::test(start_paused = true)]
async fn the_latency_aware_limit_settles_near_the_best_concurrency_of_a_sweep() {
    let s = scenario("saturation").await;
    let sweep: Vec<(f64, f64)> = ["fixed 1", "fixed 4", "fixed 8", "fixed 16", "fixed 64"]
        .iter()
        .map(|name| {
            let p = phase(&s, name);
            (
                number(p, "mean_limit_second_half"),
                number(p, "done_per_second"),
            )
        })
        .collect();
    let top = sweep.iter().map(|(_, rate)| *rate).fold(0.0, f64::max);
    // The best concurrency: the lowest that reaches (nearly) the best throughput. The points
    // on the plateau differ by noise: a clean-clone run measured 354 msg/s at 8 and 376 at
    // 16 (94 %), and a 95 % line picked 16 there. 90 % still tells the plateau from the
    // slope (4 reaches about half of it).
    let (best, at_best) = sweep
        .iter()
        .find(|(_, rate)| *rate >= 0.9 * top)
        .copied()
        .unwrap();
    // The unloaded latency: the median at concurrency 1 (a p99 there would carry any hiccup
    // of the machine into the bound).
    let unloaded = number(phase(&s, "fixed 1"), "latency_p50_ms");
    let aware = phase(&s, "latency-aware");
    let limit = number(aware, "mean_limit_second_half");
    assert!(
        (limit - best).abs() <= 0.2 * best,
        "limit {limit} vs best {best} of the sweep {sweep:?}"
    );
    assert!(number(aware, "latency_p99_ms") <= 2.0 * unloaded, "{aware}");
    // Throughput is held against what the sweep's best concurrency does per slot, times the
    // slots the limit held on average: the limit's own cost (its cuts, its waits) shows there,
    // while how far the limit sat from the best is the bound above. A bound against the rate
    // at the best concurrency itself failed on a busy machine: a limit cut once (x0.9 from 8,
    // floored to 7, held 20 intervals by design) averaged 7.2 and did 311 msg/s, 84 % of 368.5
    // at 8 and 94 % of 7.2 slots' worth (a clean-clone CI run).
    let per_slot = at_best / best;
    let expected = per_slot * limit.min(best);
    assert!(
        number(aware, "done_per_second") >= 0.85 * expected,
        "{aware} against {expected:.1} msg/s ({per_slot:.1} per slot at {best} in the sweep \
         {sweep:?}, times the mean limit {limit})"
    );
    assert!(
        number(phase(&s, "fixed 64"), "latency_p50_ms") > 2.0 * unloaded,
        "a fixed 8x capacity queues: {s:#}"
    );
}
