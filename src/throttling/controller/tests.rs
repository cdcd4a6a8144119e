//! The controller's behaviour with fake readings and a fake clock: state codes, ranking, the
//! delay law's numbers, hysteresis, the min-samples gate, pacing, limits, recovery, overrides.
//! Control quality against a simulated host is in `src/throttling/simulation/`.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::config::{MemoryThreshold, OverrideMode, ThrottlingConfig};
use crate::throttling::law;

const MIB: u64 = 1 << 20;

fn q(name: &str) -> QueueName {
    QueueName::new(name).expect("a valid queue name")
}

fn config() -> ThrottlingConfig {
    ThrottlingConfig {
        process_memory: MemoryThreshold::Bytes(100 * MIB),
        system_memory: MemoryThreshold::Bytes(800 * MIB),
        in_process_per_cpu: 500,
        threads_per_cpu: 50,
        database_size: 50_000,
        database_sessions_per_cpu: 10,
        // The laws tick by tick: a condition clears at the first sample below its resume
        // line, and a direction shows a cause only while it acts. The time a cleared value
        // must stay below its line, and the time a cleared cause is still shown, have tests
        // of their own.
        resume_after: Duration::ZERO,
        min_dwell: Duration::ZERO,
        ..ThrottlingConfig::default()
    }
}

const MACHINE: MachineFacts = MachineFacts {
    total_memory: 1024 * MIB,
    cpus: 2,
};

fn controller_with(config: ThrottlingConfig) -> Controller {
    let thresholds = Thresholds::resolve(&config, MACHINE);
    Controller::new(config, thresholds)
}

fn controller() -> Controller {
    controller_with(config())
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

fn quiet() -> Readings {
    Readings {
        process_memory: 10 * MIB,
        system_memory_used: 100 * MIB,
        in_process: 0,
        threads: 10,
        database_size: 0,
        database_sessions: 1,
        ..Readings::default()
    }
}

/// [`quiet`], with the one queue's receives at its limit: evidence that receives wait for
/// handlers, which delivery's rate imbalance needs.
fn at_limit() -> Readings {
    Readings {
        in_process: 64,
        in_process_at_limit: 64,
        ..quiet()
    }
}

fn imbalanced(incoming: f64, outgoing: f64, samples: u64) -> RateReading {
    RateReading {
        incoming_per_sec: incoming,
        outgoing_per_sec: outgoing,
        samples,
        recent_incoming_per_sec: incoming,
        recent_outgoing_per_sec: outgoing,
        last_incoming_per_sec: incoming,
        waiting: 0,
    }
}

fn queues() -> Vec<QueueLoad> {
    vec![QueueLoad::idle(q("orders"), 16)]
}

/// The `orders` queue with a max of 64 and `in_flight` messages in its handlers.
fn orders_of_64(in_flight: u32) -> Vec<QueueLoad> {
    vec![QueueLoad {
        name: q("orders"),
        max: 64,
        in_flight,
    }]
}

fn states(c: &mut Controller, r: &Readings) -> (u8, u8) {
    let d = c.tick(secs(0.0), r, &queues());
    (d.delivery.state, d.publishing.state)
}

#[test]
fn quiet_host_is_not_throttling() {
    let d = controller().tick(secs(0.0), &quiet(), &queues());
    assert_eq!((d.delivery.state, d.publishing.state), (0, 0));
    assert_eq!(d.delivery.state_name, "not throttling");
    assert_eq!(d.delivery.delay, Duration::ZERO);
    assert_eq!(d.queue_limits["orders"], 16);
}

#[test]
fn every_state_code_of_both_directions() {
    let cases: Vec<(&str, Readings, (u8, u8))> = vec![
        (
            "process memory",
            Readings {
                process_memory: 200 * MIB,
                ..quiet()
            },
            (4, 4),
        ),
        (
            "system memory",
            Readings {
                system_memory_used: 900 * MIB,
                ..quiet()
            },
            (5, 5),
        ),
        (
            "in-process",
            Readings {
                in_process: 1001,
                ..quiet()
            },
            (3, 0),
        ),
        (
            "threads",
            Readings {
                threads: 101,
                ..quiet()
            },
            (9, 9),
        ),
        (
            "database size",
            Readings {
                database_size: 50_001,
                ..quiet()
            },
            (0, 6),
        ),
        (
            "database sessions",
            Readings {
                database_sessions: 21,
                ..quiet()
            },
            (8, 8),
        ),
        (
            "delivery rate",
            Readings {
                delivery: imbalanced(200.0, 100.0, 3000),
                ..at_limit()
            },
            (1, 0),
        ),
        (
            "publishing rate",
            Readings {
                publishing: imbalanced(200.0, 100.0, 3000),
                ..quiet()
            },
            (0, 2),
        ),
    ];
    for (name, readings, expected) in cases {
        assert_eq!(states(&mut controller(), &readings), expected, "{name}");
    }
    let mut c = controller();
    c.set_override(Direction::Delivery, OverrideMode::Throttle);
    c.set_override(Direction::Publishing, OverrideMode::Throttle);
    assert_eq!(states(&mut c, &quiet()), (10, 11), "override");
    let d = c.tick(secs(0.5), &quiet(), &queues());
    assert_eq!(d.delivery.state_name, "user override on delivery");
    assert_eq!(d.publishing.state_name, "user override on publishing");
}

#[test]
fn the_highest_ranked_active_condition_decides_and_all_stay_visible() {
    let everything = Readings {
        process_memory: 200 * MIB,
        system_memory_used: 900 * MIB,
        in_process: 5000,
        threads: 500,
        database_size: 100_000,
        database_sessions: 100,
        database_sessions_mean: Some(100.0),
        queued: 100_000,
        in_process_at_limit: 5000,
        delivery: imbalanced(500.0, 10.0, 5000),
        publishing: imbalanced(500.0, 10.0, 5000),
        database_drain_per_sec: None,
        held: CeilingHolds::default(),
        downstream: DownstreamGuards::default(),
    };
    let mut c = controller();
    c.set_override(Direction::Delivery, OverrideMode::Throttle);
    c.set_override(Direction::Publishing, OverrideMode::Throttle);
    let d = c.tick(secs(0.0), &everything, &queues());
    assert_eq!((d.delivery.state, d.publishing.state), (4, 4));
    assert_eq!(
        d.delivery.active().count(),
        7,
        "{:?}",
        d.delivery.conditions
    );
    assert_eq!(
        d.publishing.active().count(),
        7,
        "{:?}",
        d.publishing.conditions
    );

    // Peel conditions off one at a time, most severe first.
    type PeelOff = fn(&mut Readings);
    let ladder: [(PeelOff, (u8, u8)); 6] = [
        (|r| r.process_memory = 0, (3, 9)),
        (|r| r.in_process = 0, (9, 9)),
        (|r| r.threads = 0, (5, 6)),
        (|r| r.database_size = 0, (5, 5)),
        (|r| r.system_memory_used = 0, (8, 8)),
        (|r| r.database_sessions = 0, (10, 11)),
    ];
    let mut readings = everything;
    for (peel_off, expected) in ladder {
        peel_off(&mut readings);
        let mut c = controller();
        c.set_override(Direction::Delivery, OverrideMode::Throttle);
        c.set_override(Direction::Publishing, OverrideMode::Throttle);
        assert_eq!(states(&mut c, &readings), expected, "{readings:?}");
    }
}

#[test]
fn memory_delay_is_proportional_to_the_overage_and_grows_while_it_persists() {
    let mut c = controller();
    // 110 MiB against 100 MiB: 10 % over, severity 500.
    let hot = Readings {
        process_memory: 110 * MIB,
        ..quiet()
    };
    let d0 = c.tick(secs(0.0), &hot, &queues());
    assert_eq!(d0.delivery.state, 4);
    assert_eq!(
        d0.delivery.delay,
        Duration::from_millis(60),
        "10 ms + 5 x 100 ms x 0.1"
    );
    let d1 = c.tick(secs(1.0), &hot, &queues());
    assert_eq!(
        d1.delivery.delay,
        Duration::from_millis(110),
        "+ 5 x 100 ms x 0.1 x 1 s"
    );
    // Twice the threshold at once: larger, still well under a second.
    let mut c = controller();
    let d = c.tick(
        secs(0.0),
        &Readings {
            process_memory: 200 * MIB,
            ..quiet()
        },
        &queues(),
    );
    assert_eq!(d.delivery.delay, Duration::from_millis(510));
}

#[test]
fn database_size_paces_publishing_against_the_drain_rate() {
    let mut c = controller();
    // Sends offered faster than the backlog drains: the cause goes on.
    let big = Readings {
        database_size: 55_000,
        database_drain_per_sec: Some(300.0),
        publishing: imbalanced(400.0, 300.0, 50),
        ..quiet()
    };
    let d = c.tick(secs(0.0), &big, &queues());
    assert_eq!(d.publishing.state, 6);
    let rate = d.publishing.pace_rate.unwrap();
    assert!((rate - 240.0).abs() < 1e-9, "300 x (1 - 2 x 0.1): {rate}");
    assert_eq!(d.publishing.pace.unwrap().as_micros(), 4_166);
    assert_eq!(d.publishing.delay, Duration::ZERO, "paced, not delayed");
    assert_eq!(d.delivery.state, 0, "delivery keeps draining");
    // Offered below the drain: the cause has ended, and the sends still waiting are let in
    // while the depth falls below its resume line (nearly closed this far above it).
    let ended = Readings {
        publishing: imbalanced(100.0, 300.0, 50),
        ..big
    };
    let d = c.tick(secs(0.5), &ended, &queues());
    assert_eq!(d.publishing.state, 6);
    let rate = d.publishing.pace_rate.unwrap();
    assert!((rate - 15.0).abs() < 1e-9, "300 x 0.05: {rate}");
    // Without a measured drain the delay law applies (severity 1: small).
    let d = controller().tick(
        secs(0.0),
        &Readings {
            database_drain_per_sec: None,
            ..big
        },
        &queues(),
    );
    assert_eq!(d.publishing.pace, None);
    assert_eq!(d.publishing.delay.as_micros(), 10_100);
}

#[test]
fn delay_is_capped_and_relaxes_within_seconds_with_the_state_telling_the_truth() {
    let mut c = controller();
    let hot = Readings {
        process_memory: 400 * MIB,
        ..quiet()
    };
    let mut t = 0.0;
    let mut last = None;
    for _ in 0..400 {
        last = Some(c.tick(secs(t), &hot, &queues()));
        t += 0.5;
    }
    assert_eq!(last.unwrap().delivery.delay, Duration::from_secs(300));
    // The cause clears: the delay relaxes to a quarter per sample; the state stays 4,
    // flagged recovering, until no action is left, then 0.
    let mut trace = Vec::new();
    loop {
        let d = c.tick(secs(t), &quiet(), &queues());
        trace.push((d.delivery.state, d.delivery.recovering, d.delivery.delay));
        t += 0.5;
        if d.delivery.state == 0 || trace.len() > 40 {
            break;
        }
    }
    assert_eq!(trace[0], (4, true, Duration::from_secs(75)));
    assert!(
        trace[..trace.len() - 1]
            .iter()
            .all(|(s, r, _)| *s == 4 && *r)
    );
    assert_eq!(trace.last().unwrap(), &(0, false, Duration::ZERO));
    assert!(
        trace.len() <= 20,
        "state 0 within 10 s: {} samples",
        trace.len()
    );
}

#[test]
fn a_new_episode_starts_from_the_initial_delay() {
    let mut c = controller();
    let hot = Readings {
        process_memory: 150 * MIB,
        ..quiet()
    };
    for i in 0..20 {
        c.tick(secs(i as f64 * 0.5), &hot, &queues());
    }
    let mut t = 10.0;
    while c.tick(secs(t), &quiet(), &queues()).delivery.state != 0 {
        t += 0.5;
    }
    let d = c.tick(secs(t + 0.5), &hot, &queues());
    assert_eq!(
        d.delivery.delay,
        Duration::from_millis(385),
        "10 ms + 5 x (100 ms x 0.5 + 100 ms x 0.5 x 0.5 s): no leftover from the last episode"
    );
}

/// Ticks `c` every `every` seconds with `in_process` messages in process (and nothing else
/// going on); each call returns the delivery decision and whether the in-process condition
/// is active.
fn in_process_ticks(mut c: Controller, every: f64) -> impl FnMut(u64) -> (DirectionDecision, bool) {
    let mut t = 0.0;
    move |value| {
        let d = c.tick(
            secs(t),
            &Readings {
                in_process: value,
                ..quiet()
            },
            &queues(),
        );
        t += every;
        let active = d
            .delivery
            .active()
            .any(|c| c.condition == Condition::InProcess);
        (d.delivery, active)
    }
}

#[test]
fn hysteresis_prevents_flapping_between_90_and_100_percent() {
    // in-process threshold = 500 per CPU x 2 CPUs = 1000; resume below 900.
    let mut tick = in_process_ticks(controller(), 0.5);
    let mut step = |value: u64| tick(value).1;
    assert!(!step(1000), "equal is not above");
    assert!(step(1001));
    for v in [999, 950, 901, 900, 999, 920] {
        assert!(step(v), "still active at {v}");
    }
    assert!(!step(899), "clears below 90%");
    for v in [901, 950, 999, 1000] {
        assert!(!step(v), "stays clear at {v}");
    }
    assert!(step(1001));
}

/// With `resume_ratio = 1.0` there is no band in value: a value held at its threshold dips
/// under it and passes it again sample after sample. `resume_after` keeps that one episode:
/// the condition clears only once the value has stayed below the line for that long, and
/// then at once.
#[test]
fn a_condition_clears_only_after_its_value_stays_below_the_line_for_resume_after() {
    let mut cfg = config();
    cfg.resume_ratio = 1.0;
    cfg.resume_after = Duration::from_secs(1);
    let mut tick = in_process_ticks(controller_with(cfg), 0.25);
    // (state, the in-process condition is active, recovering) after one sample.
    let mut step = |value: u64| {
        let (d, active) = tick(value);
        (d.state, active, d.recovering)
    };
    for v in [1001, 990, 1002, 995, 999, 1001, 980, 1003] {
        assert_eq!(
            step(v),
            (3, true, false),
            "one episode while the value hovers: {v}"
        );
    }
    // Below the line: still active for 1 s (samples at 0, 0.25, 0.5, 0.75 s), clear at 1 s.
    for _ in 0..4 {
        assert_eq!(step(900), (3, true, false));
    }
    assert_eq!(
        step(900),
        (3, false, true),
        "cleared; the delay still relaxes"
    );
    let back = (0..40).position(|_| step(900) == (0, false, false));
    assert!(back.is_some(), "state 0 once the delay has relaxed");
}

/// The same hovering with no time hysteresis flips at every crossing: what `resume_after`
/// exists for.
#[test]
fn without_resume_after_a_value_at_a_line_with_no_band_flips_at_every_crossing() {
    let mut cfg = config();
    cfg.resume_ratio = 1.0;
    let mut tick = in_process_ticks(controller_with(cfg), 0.25);
    let actives: Vec<bool> = [1001, 990, 1002, 995].map(|v| tick(v).1).to_vec();
    assert_eq!(actives, vec![true, false, true, false]);
}

/// `min_dwell`: a cleared cause is still shown (recovering, nothing acting) until it has been
/// clear that long, so one that comes back within it goes on in the same state; after it,
/// state 0. An override ends at once.
#[test]
fn a_cleared_cause_is_shown_for_min_dwell_and_one_back_within_it_is_the_same_state() {
    let mut cfg = config();
    cfg.min_dwell = Duration::from_secs(2);
    let mut tick = in_process_ticks(controller_with(cfg), 0.25);
    assert_eq!(tick(1100).0.state, 3);
    // Clear (and nothing left to relax within a few samples); back 1.5 s later: still 3.
    let states: Vec<(u8, bool)> = (0..6)
        .map(|_| tick(100))
        .map(|(d, _)| (d.state, d.recovering))
        .collect();
    assert!(states.iter().all(|s| *s == (3, true)), "{states:?}");
    assert_eq!(tick(1100).0.state, 3);
    // Clear for good: state 0 once 2 s have passed since it cleared (8 samples).
    let back = (0..20).position(|_| tick(100).0.state == 0).unwrap();
    assert!((7..=8).contains(&back), "state 0 after {back} samples");

    let mut cfg = config();
    cfg.min_dwell = Duration::from_secs(2);
    let mut c = controller_with(cfg);
    c.set_override(Direction::Delivery, OverrideMode::Throttle);
    assert_eq!(c.tick(secs(0.0), &quiet(), &queues()).delivery.state, 10);
    c.set_override(Direction::Delivery, OverrideMode::None);
    let mut t = 0.0;
    let back = (0..20).position(|_| {
        t += 0.25;
        c.tick(secs(t), &quiet(), &queues()).delivery.state == 0
    });
    assert!(
        back.is_some_and(|n| n < 8),
        "an override is not dwelt on: {back:?}"
    );
}

#[test]
fn rate_throttling_needs_the_minimum_samples() {
    let mut c = controller();
    let few = Readings {
        delivery: imbalanced(1000.0, 10.0, 99),
        ..at_limit()
    };
    assert_eq!(c.tick(secs(0.0), &few, &queues()).delivery.state, 0);
    let enough = Readings {
        delivery: imbalanced(1000.0, 10.0, 100),
        ..at_limit()
    };
    assert_eq!(c.tick(secs(0.5), &enough, &queues()).delivery.state, 1);
}

#[test]
fn rate_imbalance_paces_at_outgoing_times_overdrive_and_relaxes_gradually() {
    let mut c = controller();
    let r = Readings {
        publishing: imbalanced(300.0, 80.0, 4500),
        ..quiet()
    };
    let d = c.tick(secs(0.0), &r, &queues());
    assert_eq!(d.publishing.state, 2);
    assert_eq!(
        d.publishing.pace,
        Some(Duration::from_millis(10)),
        "1 / (80 x 1.25)"
    );
    assert_eq!(
        d.publishing.delay,
        Duration::ZERO,
        "pacing, not a guessed delay"
    );
    let status = d
        .publishing
        .conditions
        .iter()
        .find(|c| c.condition == Condition::RateImbalance)
        .unwrap();
    assert_eq!((status.value, status.threshold), (300.0, 100.0));
    // Balanced again, with 60 sends waiting: they go in at the resume line (80 x 1.25 x 0.9
    // = 90 a second), not at a pace that opens by half per sample, and the state says so
    // until what is left (30) would pass within a sample (0.5 s) at that line.
    let mut rates = Vec::new();
    let mut t = 0.5;
    for waiting in [60, 30, 30] {
        let balanced = Readings {
            publishing: RateReading {
                waiting,
                ..imbalanced(85.0, 80.0, 4500)
            },
            ..quiet()
        };
        let d = c.tick(secs(t), &balanced, &queues());
        t += 0.5;
        match d.publishing.pace_rate {
            Some(rate) => {
                assert_eq!((d.publishing.state, d.publishing.recovering), (2, true));
                rates.push(rate);
            }
            None => {
                assert_eq!(d.publishing.state, 0);
                break;
            }
        }
    }
    assert_eq!(rates, vec![90.0], "60 waiting, then 30 pass within 0.5 s");
}

/// Receives over overdrive x completions with room below every limit are the handlers'
/// pipeline filling: not judged, so they read as off. With most of what is in process at its
/// queue's limit they engage, and a pace that then holds receives under the limits keeps the
/// state until the rates balance.
#[test]
fn delivery_rate_imbalance_needs_receives_held_by_a_limit() {
    let mut c = controller();
    let rate = |d: &Decision| {
        *d.delivery
            .conditions
            .iter()
            .find(|s| s.condition == Condition::RateImbalance)
            .unwrap()
    };
    let filling = Readings {
        delivery: imbalanced(40.0, 10.0, 200),
        in_process: 40,
        in_process_at_limit: 1,
        ..quiet()
    };
    for t in [0.0, 0.5, 1.0] {
        let d = c.tick(secs(t), &filling, &queues());
        assert_eq!(d.delivery.state, 0);
        assert_eq!(rate(&d).threshold, 0.0, "not judged: reads as off");
    }
    let held = Readings {
        in_process_at_limit: 40,
        ..filling
    };
    let d = c.tick(secs(1.5), &held, &queues());
    assert_eq!(d.delivery.state, 1);
    assert_eq!(rate(&d).threshold, 12.5, "10 x 1.25");
    let paced = c.tick(secs(2.0), &filling, &queues());
    assert_eq!(paced.delivery.state, 1, "still over its line");
}

/// After a delivery rate episode, the messages that queued up while the pace held receives
/// back are let in by the relaxing pace before it ends: receivers wait in the admission only
/// for messages they were started for, so counted from the admission alone the pace ended
/// with them still queued, and they were all received at once.
#[test]
fn a_relaxing_delivery_pace_lasts_until_what_it_held_back_would_pass_within_a_sample() {
    let mut c = controller();
    let engaged = Readings {
        delivery: imbalanced(300.0, 80.0, 4500),
        queued: 10,
        ..at_limit()
    };
    let d = c.tick(secs(0.0), &engaged, &queues());
    assert_eq!(d.delivery.state, 1);
    assert_eq!(d.delivery.pace_rate, Some(100.0), "80 x 1.25");
    // Balanced again, with 400 more queued than when the pace took hold, going down by what
    // the pace lets in (45 in 0.5 s at 90 a second) while none arrive.
    let balanced = |held_back: u64| Readings {
        delivery: imbalanced(85.0, 80.0, 4500),
        queued: 10 + held_back,
        ..quiet()
    };
    let mut rates = Vec::new();
    let mut held_back = 400;
    let mut t = 0.5;
    while let Some(rate) = c
        .tick(secs(t), &balanced(held_back), &queues())
        .delivery
        .pace_rate
    {
        rates.push(rate);
        held_back = held_back.saturating_sub(45);
        t += 0.5;
        assert!(t < 10.0, "the pace ends: {rates:?}");
    }
    assert_eq!(
        rates,
        vec![90.0; 8],
        "at the resume line (80 x 1.25 x 0.9) until 40 left pass within 0.5 s"
    );
    // With nothing completed lately there is no line: the pace holds where it was.
    let mut c = controller();
    c.tick(secs(0.0), &engaged, &queues());
    let stalled = Readings {
        delivery: imbalanced(10.0, 0.0, 4500),
        ..balanced(400)
    };
    let held = c.tick(secs(0.5), &stalled, &queues()).delivery.pace_rate;
    assert_eq!(held, Some(100.0));
    // Once nothing is held back, the pace ends at the first balanced sample.
    let mut c = controller();
    c.tick(secs(0.0), &engaged, &queues());
    let first = c
        .tick(secs(0.5), &balanced(0), &queues())
        .delivery
        .pace_rate;
    assert_eq!(first, None);
}

/// After a sessions episode, publishing lets the sends that waited it out in at what holds the
/// sessions' mean at 0.6 of their resume line (10.8 of 20 here), and its pace ends only once
/// no more wait than arrive within a sample. While delivery has another cause, the mean says
/// nothing of what publishing adds, and the pace relaxes as after any cause.
#[test]
fn sends_that_waited_out_a_sessions_episode_are_let_in_by_the_sessions_mean() {
    // 20 sends a second offered and stored.
    let waiting = |waiting| RateReading {
        waiting,
        ..imbalanced(20.0, 20.0, 50)
    };
    let episode = Readings {
        database_sessions: 25,
        database_sessions_mean: Some(25.0),
        in_process: 20,
        database_drain_per_sec: Some(100.0),
        publishing: waiting(500),
        ..quiet()
    };
    let cleared = |mean: f64, waiting_now: u64| Readings {
        database_sessions: mean as u64,
        database_sessions_mean: Some(mean),
        in_process: mean as u64,
        publishing: waiting(waiting_now),
        ..episode
    };
    let mut c = controller();
    let d = c.tick(secs(0.0), &episode, &queues());
    assert_eq!(d.publishing.state, 8);
    assert_eq!(d.publishing.pace_rate, Some(50.0), "100 x (1 - 2 x 0.25)");
    // Far below the setpoint the pace opens by the relaxing growth; at 1.5 x the setpoint it
    // closes to two thirds.
    let d = c.tick(secs(0.25), &cleared(2.0, 450), &queues());
    assert!(d.publishing.recovering);
    assert_eq!(d.publishing.pace_rate, Some(75.0));
    let d = c.tick(secs(0.5), &cleared(16.2, 400), &queues());
    assert!((d.publishing.pace_rate.unwrap() - 50.0).abs() < 1e-9);
    // Opened again until 20 waiting would pass within a sample at the pace (at 380/s): still
    // paced, since more wait than arrive within a sample (5 at 20/s). Then it ends.
    let mut t = 0.75;
    let mut rate = 0.0;
    while rate < 300.0 {
        rate = c
            .tick(secs(t), &cleared(2.0, 300), &queues())
            .publishing
            .pace_rate
            .unwrap();
        t += 0.25;
    }
    let d = c.tick(secs(t), &cleared(2.0, 20), &queues());
    assert!(d.publishing.pace_rate.is_some(), "20 still wait");
    let d = c.tick(secs(t + 0.25), &cleared(2.0, 4), &queues());
    assert_eq!(
        d.publishing.pace_rate, None,
        "no more wait than arrive in a sample"
    );
    // A load that keeps the mean over the setpoint closes the pace to no less than twice
    // what is offered (40/s): what waits goes in, and the pace ends.
    let mut c = controller();
    c.tick(secs(0.0), &episode, &queues());
    let mut rates = Vec::new();
    let mut t = 0.25;
    let mut waiting_now = 100u64;
    while let Some(rate) = c
        .tick(secs(t), &cleared(16.2, waiting_now), &queues())
        .publishing
        .pace_rate
    {
        rates.push(rate);
        waiting_now = waiting_now.saturating_sub((rate - 20.0) as u64 / 4);
        t += 0.25;
        assert!(t < 10.0, "the pace ends: {rates:?}");
    }
    assert!(rates.iter().all(|r| *r >= 40.0 - 1e-9), "{rates:?}");
    // With delivery held by the in-process count, the sessions' mean does not close the pace.
    let mut c = controller();
    c.tick(secs(0.0), &episode, &queues());
    let in_process = Readings {
        in_process: 1200,
        ..cleared(16.2, 400)
    };
    let d = c.tick(secs(0.25), &in_process, &queues());
    assert_eq!(d.delivery.cause, Some(Condition::InProcess));
    assert_eq!(
        d.publishing.pace_rate,
        Some(75.0),
        "opens as after any cause"
    );
}

/// Requests that waited out a database-size episode make incoming exceed outgoing; that is
/// not an imbalance of its own. The state stays on the cause while the pace opens, the
/// waiting requests are released over a few samples, and a rate imbalance can engage only on
/// a sampling window no other cause throttled.
#[test]
fn a_rate_imbalance_left_behind_by_another_cause_does_not_take_over() {
    let mut c = controller();
    let flood = Readings {
        database_size: 55_000,
        database_drain_per_sec: Some(40.0),
        publishing: imbalanced(300.0, 40.0, 4500),
        ..quiet()
    };
    let d = c.tick(secs(0.0), &flood, &queues());
    assert_eq!(d.publishing.state, 6, "the cause, not its side effect");
    // Database size clears (but stays near it); 1 000 requests wait; the 15 s window still
    // shows the flood.
    let mut after = Readings {
        database_size: 30_000,
        database_drain_per_sec: Some(400.0),
        publishing: imbalanced(300.0, 40.0, 4500),
        ..quiet()
    };
    after.publishing.recent_incoming_per_sec = 0.0;
    after.publishing.last_incoming_per_sec = 0.0;
    after.publishing.waiting = 1000;
    let mut t = 0.25;
    let mut seen = Vec::new();
    let mut released = Vec::new();
    while t < 15.0 {
        let d = c.tick(secs(t), &after, &queues());
        seen.push((d.publishing.state, d.publishing.recovering));
        // What the pace lets through in this sample leaves the waiting line.
        let passed = match d.publishing.pace_rate {
            Some(rate) => (rate * 0.25).min(after.publishing.waiting as f64) as u64,
            None => after.publishing.waiting,
        };
        released.push(passed);
        after.publishing.waiting -= passed;
        // What passes is stored; the drain takes 400/s.
        after.database_size = (after.database_size + passed).saturating_sub(100);
        t += 0.25;
    }
    let relaxing = seen.iter().take_while(|s| s.0 == 6).count();
    assert!(
        seen[..relaxing].iter().all(|s| s.1),
        "recovering while the pace opens: {seen:?}"
    );
    // The pace opens x1.5 per sample while the backlog does not grow, then no faster than the
    // drain law's 1.25 x 400/s, so 1 000 waiting requests pass over about 2.5 s, and none are
    // left for a burst when pacing ends.
    assert!((6..=14).contains(&relaxing), "{relaxing} samples: {seen:?}");
    assert!(
        released
            .iter()
            .all(|&n| n as f64 <= 125.0 * law::PACE_RELAX_GROWTH),
        "never more than one growth step above 500/s x 0.25 s at once: {released:?}"
    );
    let capped = released
        .windows(2)
        .skip_while(|w| w[0] <= 100)
        .skip(1)
        .all(|w| w[1] <= 125);
    assert!(capped, "drain law once the backlog grows: {released:?}");
    assert!(
        seen[relaxing..].iter().all(|s| s.0 == 0),
        "no state 2 within the sampling window after the episode: {seen:?}"
    );
    // A window later, a real imbalance engages again.
    let d = c.tick(secs(20.0), &after, &queues());
    assert_eq!(d.publishing.state, 2);
}

#[test]
fn before_anything_completes_delivery_engages_after_a_sample_unpaced_and_publishing_waits() {
    let mut c = controller();
    let r = Readings {
        delivery: imbalanced(50.0, 0.0, 500),
        publishing: imbalanced(50.0, 0.0, 500),
        ..at_limit()
    };
    let d = c.tick(secs(0.0), &r, &queues());
    assert_eq!(
        (d.delivery.state, d.publishing.state),
        (0, 0),
        "not yet a sample"
    );
    let rate = |d: &DirectionDecision| {
        *d.conditions
            .iter()
            .find(|s| s.condition == Condition::RateImbalance)
            .unwrap()
    };
    // Judged against under one completion per 15 s window, x 1.25 overdrive.
    assert!((rate(&d.delivery).threshold - 1.25 / 15.0).abs() < 1e-9);
    assert_eq!(
        rate(&d.publishing).threshold,
        0.0,
        "a bulk insert in progress"
    );
    let d = c.tick(secs(0.5), &r, &queues());
    assert_eq!((d.delivery.state, d.publishing.state), (1, 0));
    assert_eq!(d.delivery.pace, None, "no measured rate to pace at");
    assert_eq!(d.publishing.pace, None);
}

#[test]
fn a_batch_received_just_before_a_tick_is_no_imbalance_once_it_completes() {
    let mut c = controller();
    let received = Readings {
        delivery: imbalanced(200.0, 0.0, 100),
        ..quiet()
    };
    assert_eq!(c.tick(secs(0.0), &received, &queues()).delivery.state, 0);
    let completed = Readings {
        delivery: imbalanced(100.0, 100.0, 100),
        ..quiet()
    };
    for t in [0.5, 1.0, 1.5] {
        assert_eq!(c.tick(secs(t), &completed, &queues()).delivery.state, 0);
    }
}

#[test]
fn limits_are_cut_from_what_is_in_flight_held_and_grown_back() {
    let mut c = controller();
    let q = orders_of_64;
    let limit = |d: &Decision| d.queue_limits["orders"];
    // The messages in flight are in process: no reading here is an idle one.
    let memory = |mib: u64, in_process: u64| Readings {
        process_memory: mib * MIB,
        in_process,
        ..quiet()
    };
    // Memory at 1.9 x threshold with 40 in flight: cut to 40 x 0.95 / 1.9 = 20.
    assert_eq!(limit(&c.tick(secs(0.0), &memory(190, 40), &q(40))), 20);
    // Still over, but the cut has not drained yet (30 in flight > 20): hold.
    assert_eq!(limit(&c.tick(secs(0.5), &memory(190, 30), &q(30))), 20);
    // Drained to the limit and still over (1.2 x): cut again, 20 x 0.95 / 1.2 = 15.
    assert_eq!(limit(&c.tick(secs(1.0), &memory(120, 20), &q(20))), 15);
    // Between resume line (90) and threshold: held.
    assert_eq!(limit(&c.tick(secs(1.5), &memory(95, 15), &q(15))), 15);
    // Just below the resume line: grows by steps; far below: nearly doubles.
    assert_eq!(limit(&c.tick(secs(2.0), &memory(89, 15), &q(15))), 16);
    // Right after the pressure, growth from a dip is bounded by what is in flight.
    let mut probe = c.clone();
    assert_eq!(limit(&probe.tick(secs(2.5), &memory(9, 6), &q(6))), 16);
    assert_eq!(limit(&probe.tick(secs(3.0), &memory(9, 16), &q(16))), 29);
    let far = memory(9, 5);
    let mut t = 2.5;
    let mut grown = Vec::new();
    while grown.last() != Some(&64) {
        grown.push(limit(&c.tick(secs(t), &far, &q(5))));
        t += 0.5;
    }
    // For 2 s after the pressure a limit grows from what is in flight (2 x 5 + 1 = 11 < 16:
    // held); then by the headroom of the tightest resource (system memory, 100 of 800 MiB).
    assert_eq!(grown, vec![16, 16, 16, 29, 53, 64]);
}

/// Growth back from a cut is measured on what the messages add, not on what the machine's
/// other processes hold: system memory that sits at 600 of 800 MiB with nothing in process,
/// pushed over by messages and back to 650 (below the resume line of 720), leaves the
/// messages' part at 50 of its 120 MiB of room. The limit regrows to its max within a few
/// samples; measured on the whole value (headroom 1 - 650 / 720 = 0.1) it took a step a
/// sample, well over 10 s from a deep cut.
#[test]
fn limits_regrow_by_the_room_the_messages_have_not_the_machine() {
    let mut c = controller();
    let q = orders_of_64;
    let system = |mib: u64, in_process: u64| Readings {
        system_memory_used: mib * MIB,
        in_process,
        ..quiet()
    };
    // Idle: the machine's own use.
    c.tick(secs(0.0), &system(600, 0), &q(0));
    // Messages push it over: the limit is cut from what is in flight.
    let mut t = 0.5;
    let mut limit = 64;
    let mut in_flight = 40;
    for _ in 0..6 {
        limit = c
            .tick(secs(t), &system(900, in_flight), &q(in_flight as u32))
            .queue_limits["orders"];
        in_flight = limit as u64;
        t += 0.5;
    }
    assert!(limit <= 12, "cut deep under pressure: {limit}");
    // The cause ends: 650 MiB with the limit's worth of messages in flight.
    let mut samples = 0;
    while limit < 64 {
        limit = c
            .tick(secs(t), &system(650, limit as u64), &q(limit))
            .queue_limits["orders"];
        t += 0.5;
        samples += 1;
        assert!(
            samples <= 8,
            "limit {limit} after {samples} samples below the resume line"
        );
    }
}

#[test]
fn only_what_messages_hold_shrinks_limits() {
    for (readings, shrinks) in [
        // The delivery ceiling holds the in-process count; no limit gives up room for it.
        (
            Readings {
                in_process: 5000,
                ..quiet()
            },
            false,
        ),
        (
            Readings {
                threads: 5000,
                ..quiet()
            },
            true,
        ),
        (
            Readings {
                system_memory_used: 900 * MIB,
                ..quiet()
            },
            true,
        ),
        (
            Readings {
                database_size: 90_000,
                ..quiet()
            },
            false,
        ),
        (
            Readings {
                database_sessions: 90,
                ..quiet()
            },
            true,
        ),
        (
            Readings {
                delivery: imbalanced(500.0, 1.0, 900),
                ..quiet()
            },
            false,
        ),
    ] {
        let d = controller().tick(secs(0.0), &readings, &queues());
        assert_eq!(d.shrinking, shrinks, "{readings:?}");
        assert_eq!(d.queue_limits["orders"] < 16, shrinks);
    }
}

#[test]
fn a_lower_max_caps_the_limit_at_once() {
    let mut c = controller();
    c.tick(secs(0.0), &quiet(), &queues());
    let d = c.tick(secs(0.5), &quiet(), &[QueueLoad::idle(q("orders"), 4)]);
    assert_eq!(d.queue_limits["orders"], 4);
}

#[test]
fn override_throttle_uses_the_override_severity() {
    let mut cfg = config();
    cfg.delivery.override_mode = OverrideMode::Throttle;
    cfg.delivery.override_severity = 100;
    let mut c = controller_with(cfg);
    assert_eq!(
        c.tick(secs(0.0), &quiet(), &queues()).delivery.delay,
        Duration::from_millis(110),
        "a forced override counts as 100 % over: 10 ms + 100 ms"
    );
    let d = c.tick(secs(1.0), &quiet(), &queues());
    assert_eq!(
        d.delivery.delay,
        Duration::from_millis(210),
        "+ 100 ms per second it lasts at severity 100"
    );
    assert_eq!(d.delivery.state, 10);
    assert_eq!(d.publishing.state, 0, "the other direction is untouched");
    assert_eq!(
        d.queue_limits["orders"], 16,
        "override delays, it does not shrink"
    );
}

#[test]
fn override_never_disables_a_direction_but_keeps_conditions_visible() {
    let mut cfg = config();
    cfg.delivery.override_mode = OverrideMode::Never;
    let mut c = controller_with(cfg);
    let hot = Readings {
        process_memory: 200 * MIB,
        delivery: imbalanced(500.0, 1.0, 900),
        ..quiet()
    };
    let d = c.tick(secs(0.0), &hot, &queues());
    assert_eq!(d.delivery.state, 0);
    assert_eq!(d.delivery.delay, Duration::ZERO);
    assert_eq!(d.delivery.pace, None);
    assert_eq!(d.queue_limits["orders"], 16, "no shrinking either");
    assert!(
        d.delivery
            .active()
            .any(|c| c.condition == Condition::ProcessMemory)
    );
    assert_eq!(d.publishing.state, 4, "publishing still throttles");
}

#[test]
fn disabled_throttling_measures_but_never_acts() {
    let mut cfg = config();
    cfg.enabled = false;
    let d = controller_with(cfg).tick(
        secs(0.0),
        &Readings {
            process_memory: 200 * MIB,
            ..quiet()
        },
        &queues(),
    );
    assert_eq!((d.delivery.state, d.publishing.state), (0, 0));
    assert_eq!(d.delivery.delay, Duration::ZERO);
    assert!(d.delivery.active().count() > 0);
}

#[test]
fn state_duration_counts_from_the_last_state_change() {
    let mut c = controller();
    c.tick(secs(0.0), &quiet(), &queues());
    let hot = Readings {
        in_process: 5000,
        ..quiet()
    };
    c.tick(secs(1.0), &hot, &queues());
    let d = c.tick(secs(3.5), &hot, &queues());
    assert_eq!(d.delivery.state_duration, secs(2.5));
    let d = c.tick(
        secs(4.0),
        &Readings {
            process_memory: 200 * MIB,
            ..hot
        },
        &queues(),
    );
    assert_eq!(d.delivery.state, 4);
    assert_eq!(
        d.delivery.state_duration,
        Duration::ZERO,
        "a new state starts its own clock"
    );
    let mut t = 6.0;
    while c.tick(secs(t), &quiet(), &queues()).delivery.state != 0 {
        t += 0.5;
        assert!(t < 16.0, "recovered within 10 s");
    }
    let d = c.tick(secs(t + 10.0), &quiet(), &queues());
    assert_eq!(
        d.delivery.state_duration,
        secs(10.0),
        "time since throttling was last applied"
    );
}

#[test]
fn thresholds_resolve_per_cpu_and_share_of_memory() {
    let t = Thresholds::resolve(&ThrottlingConfig::default(), MACHINE);
    assert_eq!(t.process_memory, Some(256 * MIB), "25% of 1 GiB");
    assert_eq!(t.system_memory, None);
    assert_eq!(t.in_process, Some(2000), "1000 per CPU x 2");
    assert_eq!(t.threads, None);
    assert_eq!(t.database_size, Some(50_000));
    assert_eq!(t.database_sessions, None);
}

fn arb_readings() -> impl Strategy<Value = Readings> {
    (
        0u64..300,
        0u64..1200,
        0u64..3000,
        0u64..200,
        0u64..100_000,
        0u64..40,
        (0.0f64..500.0, 0.0f64..500.0, 0u64..300),
        (0.0f64..500.0, 0.0f64..500.0, 0u64..300),
    )
        .prop_map(|(pm, sm, ip, th, db, se, d, p)| Readings {
            process_memory: pm * MIB,
            system_memory_used: sm * MIB,
            in_process: ip,
            threads: th,
            database_size: db,
            database_sessions: se,
            database_sessions_mean: Some(se as f64),
            queued: db,
            in_process_at_limit: ip,
            delivery: imbalanced(d.0, d.1, d.2),
            publishing: imbalanced(p.0, p.1, p.2),
            database_drain_per_sec: None,
            held: CeilingHolds::default(),
            downstream: DownstreamGuards::default(),
        })
}

fn arb_override() -> impl Strategy<Value = OverrideMode> {
    prop_oneof![
        Just(OverrideMode::None),
        Just(OverrideMode::Throttle),
        Just(OverrideMode::Never)
    ]
}

proptest! {
    #[test]
    fn delay_never_exceeds_max_and_state_is_the_top_active_condition_or_the_recovering_cause(
        steps in proptest::collection::vec((arb_readings(), 1u64..5_000, 1u32..64), 1..60),
        max_delay_ms in 10u64..400_000,
        delivery_override in arb_override(),
        publishing_override in arb_override(),
    ) {
        let mut cfg = config();
        cfg.delivery.max_delay = Duration::from_millis(max_delay_ms);
        cfg.publishing.max_delay = Duration::from_millis(max_delay_ms);
        cfg.delivery.override_mode = delivery_override;
        cfg.publishing.override_mode = publishing_override;
        let mut c = controller_with(cfg);
        let mut now = Duration::ZERO;
        for (readings, dt_ms, max) in steps {
            now += Duration::from_millis(dt_ms);
            let d = c.tick(now, &readings, &[QueueLoad::idle(q("q"), max)]);
            for dir in [&d.delivery, &d.publishing] {
                prop_assert!(dir.delay <= Duration::from_millis(max_delay_ms));
                if let Some(p) = dir.pace {
                    prop_assert!(p <= Duration::from_millis(max_delay_ms));
                }
                let top = dir.active().max_by_key(|c| c.condition.rank()).map(|c| c.state);
                if dir.override_mode == OverrideMode::Never {
                    prop_assert_eq!(dir.state, 0);
                } else if let Some(top) = top {
                    prop_assert_eq!(dir.state, top);
                    prop_assert!(!dir.recovering);
                } else if dir.state != 0 {
                    // Recovering: some action is still in effect.
                    prop_assert!(dir.recovering);
                    let limited = dir.direction == Direction::Delivery && d.queue_limits["q"] < max;
                    prop_assert!(!dir.delay.is_zero() || dir.pace.is_some() || limited);
                }
            }
            let limit = d.queue_limits["q"];
            prop_assert!(limit >= 1 && limit <= max);
        }
    }
}

#[test]
fn an_idle_queue_is_not_pinned_by_a_resource_high_for_reasons_of_its_own() {
    // System memory sits at 85 % of its threshold, above half of it, with nothing in flight:
    // the limit still grows back to max after an episode.
    let mut c = controller();
    let q = |in_flight| {
        vec![QueueLoad {
            name: q("orders"),
            max: 16,
            in_flight,
        }]
    };
    c.tick(
        secs(0.0),
        &Readings {
            system_memory_used: 900 * MIB,
            ..quiet()
        },
        &q(8),
    );
    let high = Readings {
        system_memory_used: 680 * MIB,
        ..quiet()
    };
    let mut t = 0.5;
    let mut d = c.tick(secs(t), &high, &q(0));
    while d.delivery.state != 0 && t < 20.0 {
        t += 0.5;
        d = c.tick(secs(t), &high, &q(0));
    }
    assert_eq!(d.queue_limits["orders"], 16, "{d:?}");
    assert_eq!(d.delivery.state, 0);
}

/// The ceiling held receives back on process memory, which had room for `room` messages.
fn memory_held(room: u64) -> CeilingHolds {
    CeilingHolds {
        process_memory: Some(room),
        ..CeilingHolds::default()
    }
}

#[test]
fn receives_held_by_the_memory_ceiling_show_as_memory_pressure_below_the_line() {
    let mut c = controller();
    let threshold = c.thresholds().process_memory.unwrap();
    // 95 % of the threshold: below the line, but the ceiling held receives back.
    let held = Readings {
        process_memory: threshold / 100 * 95,
        in_process: 10,
        held: memory_held(10),
        ..quiet()
    };
    let d = c.tick(secs(0.5), &held, &queues());
    assert_eq!(d.delivery.state, 4, "acting on memory is never state 0");
    assert!(
        d.delivery
            .active()
            .any(|s| s.condition == Condition::ProcessMemory)
    );
    // Still above the resume line, no longer held: stays active (hysteresis).
    let after = Readings {
        held: CeilingHolds::default(),
        ..held
    };
    assert_eq!(c.tick(secs(1.0), &after, &queues()).delivery.state, 4);
    // Below the resume line: the condition clears like any other.
    let d = c.tick(secs(1.5), &quiet(), &queues());
    assert!(
        !d.delivery
            .active()
            .any(|s| s.condition == Condition::ProcessMemory)
    );
}

#[test]
fn a_rate_not_yet_judged_reads_as_off() {
    let mut c = controller();
    let early = Readings {
        delivery: imbalanced(500.0, 10.0, 1),
        ..quiet()
    };
    let d = c.tick(secs(0.5), &early, &queues());
    let rate = d
        .delivery
        .conditions
        .iter()
        .find(|s| s.condition == Condition::RateImbalance)
        .unwrap();
    assert!(!rate.active);
    assert_eq!(rate.threshold, 0.0, "too few samples: off, not over a line");
}

#[test]
fn the_memory_ceilings_room_becomes_the_limit_shared_by_max_and_lasts_while_it_holds() {
    let mut c = controller();
    let threshold = c.thresholds().process_memory.unwrap();
    let load = |orders, audit| {
        vec![
            QueueLoad {
                name: q("orders"),
                max: 48,
                in_flight: orders,
            },
            QueueLoad {
                name: q("audit"),
                max: 16,
                in_flight: audit,
            },
        ]
    };
    // Below the threshold, the ceiling held receives back: memory has room for 12 messages.
    let held = Readings {
        process_memory: threshold / 100 * 97,
        in_process: 14,
        held: memory_held(12),
        ..quiet()
    };
    let d = c.tick(secs(0.5), &held, &load(11, 3));
    assert_eq!(
        d.queue_limits["orders"], 9,
        "three quarters of 12 by max: {d:?}"
    );
    assert_eq!(d.queue_limits["audit"], 3, "a quarter of 12 by max: {d:?}");
    assert_eq!(d.delivery.state, 4);
    // More room measured (smaller messages): the limit does not grow while memory holds...
    let roomier = Readings {
        held: memory_held(40),
        ..held
    };
    let d = c.tick(secs(1.0), &roomier, &load(9, 3));
    assert_eq!((d.queue_limits["orders"], d.queue_limits["audit"]), (9, 3));
    // ... and grows back once memory is below its resume line and nothing is held.
    let mut t = 1.0;
    let mut d = d;
    while d.queue_limits["orders"] < 48 && t < 10.0 {
        t += 0.5;
        d = c.tick(secs(t), &quiet(), &load(0, 0));
    }
    assert_eq!(
        (d.queue_limits["orders"], d.queue_limits["audit"]),
        (48, 16)
    );
    assert_eq!(d.delivery.state, 0);
}

/// Publishing paced against the drain under memory pressure: when the cause clears far below
/// its threshold, the requests that waited are let in at a pace that opens by half per
/// sample, and pacing ends within seconds. (It used to stay capped at 1.25 x a drain measured
/// from what the pace let in, which hardly grew: 900 waiting requests took 10 s and more.)
#[test]
fn publishing_pacing_ends_soon_after_a_memory_cause_clears_far_below_its_threshold() {
    let mut c = controller();
    let threshold = c.thresholds().process_memory.unwrap();
    let mut steady = imbalanced(100.0, 100.0, 100);
    steady.recent_incoming_per_sec = 100.0;
    let pressure = Readings {
        process_memory: threshold / 100 * 105,
        in_process: 10,
        database_drain_per_sec: Some(60.0),
        publishing: steady,
        ..quiet()
    };
    let d = c.tick(secs(0.0), &pressure, &queues());
    assert_eq!(d.publishing.state, 4);
    assert!(
        d.publishing.pace.is_some(),
        "paced against the drain: {d:?}"
    );
    let cleared = Readings {
        database_drain_per_sec: Some(100.0),
        ..quiet()
    };
    let cleared = Readings {
        publishing: steady,
        ..cleared
    };
    let mut cleared = cleared;
    cleared.publishing.waiting = 900;
    let mut t = 0.0;
    let mut last_rate = 0.0;
    loop {
        t += 0.25;
        let d = c.tick(secs(t), &cleared, &queues());
        if d.publishing.pace.is_none() && d.publishing.delay.is_zero() {
            assert_eq!(d.publishing.state, 0);
            assert!(
                cleared.publishing.waiting as f64 <= last_rate * law::PACE_RELAX_GROWTH * 0.25,
                "no burst at the end: {} left at {last_rate}/s",
                cleared.publishing.waiting
            );
            break;
        }
        assert!(t < 3.0, "still paced after {t} s: {d:?}");
        // What the pace lets through in this sample leaves the waiting line.
        last_rate = d.publishing.pace_rate.unwrap_or(0.0);
        let passed = (last_rate * 0.25) as u64;
        cleared.publishing.waiting = cleared.publishing.waiting.saturating_sub(passed);
    }
}

/// A permanent backlog on a queue whose max is above the in-process threshold: the delivery
/// ceiling holds the count at the threshold (here: in flight never above it, and each tick
/// hears of the hold). The state shows in-process pressure in one episode, the limit stays at
/// the queue's max (the count, not the limit, is what is held).
#[test]
fn a_backlog_at_the_in_process_bound_is_held_at_the_threshold_in_one_episode() {
    let mut c = controller();
    let threshold = c.thresholds().in_process.unwrap();
    let max = 2 * threshold as u32;
    let mut in_flight = 0u32;
    let mut states = Vec::new();
    for tick in 0..60 {
        let load = vec![QueueLoad {
            name: q("orders"),
            max,
            in_flight,
        }];
        let mut readings = Readings {
            in_process: u64::from(in_flight),
            ..quiet()
        };
        if u64::from(in_flight) >= threshold {
            readings.held.record(Condition::InProcess, threshold);
        }
        let d = c.tick(secs(f64::from(tick) * 0.5), &readings, &load);
        states.push(d.delivery.state);
        assert_eq!(
            d.queue_limits["orders"], max,
            "tick {tick}: the limit stays at max"
        );
        // The backlog fills every slot the ceiling lets through before the next tick.
        in_flight = d.queue_limits["orders"].min(threshold as u32);
    }
    let episodes = states.windows(2).filter(|w| w[0] == 0 && w[1] != 0).count();
    assert_eq!(episodes, 1, "one episode: {states:?}");
    assert_eq!(
        states.last(),
        Some(&3),
        "in-process pressure shows: {states:?}"
    );
}

/// Queues whose maxes add up to far more than the in-process threshold, one busy and two
/// idle: state 0 means every limit at its max. (Shared by max, each limit was a third of the
/// threshold, in state 0, and the busy queue could not use what the idle ones left.)
#[test]
fn state_0_means_every_limit_at_its_max_whatever_the_in_process_threshold() {
    let mut c = controller();
    let threshold = c.thresholds().in_process.unwrap() as u32;
    let busy = threshold / 2;
    let load = vec![
        QueueLoad {
            name: q("busy"),
            max: threshold,
            in_flight: busy,
        },
        QueueLoad::idle(q("idle-a"), threshold),
        QueueLoad::idle(q("idle-b"), threshold),
    ];
    let readings = Readings {
        in_process: u64::from(busy),
        ..quiet()
    };
    for tick in 0..4 {
        let d = c.tick(secs(f64::from(tick) * 0.5), &readings, &load);
        assert_eq!(d.delivery.state, 0);
        assert!(!d.delivery.recovering);
        for q in &load {
            assert_eq!(d.queue_limits[&q.name], threshold, "{}", q.name);
        }
    }
}

/// A queue in outage mode shows as delivery state 12 with its failures and threshold, and the
/// controller adds nothing of its own: no delay, no pace, full limits, publishing untouched.
/// Host pressure outranks it; when the queue leaves outage mode the state is 0 at once.
#[test]
fn a_queue_in_outage_mode_shows_as_state_12_and_the_controller_takes_no_action() {
    let mut c = controller();
    let mut r = Readings::default();
    r.downstream.outage = GuardCondition {
        active: true,
        value: 25.0,
        threshold: 20.0,
    };
    let queues = [QueueLoad::idle(q("orders"), 16)];
    let d = c.tick(Duration::from_secs(1), &r, &queues);
    assert_eq!(d.delivery.state, 12);
    assert_eq!(d.delivery.state_name, "downstream outage");
    assert_eq!(d.delivery.cause, Some(Condition::DownstreamOutage));
    assert_eq!((d.delivery.delay, d.delivery.pace), (Duration::ZERO, None));
    assert_eq!(d.queue_limits.get("orders"), Some(&16));
    assert_eq!(d.publishing.state, 0);
    let shown = d
        .delivery
        .conditions
        .iter()
        .find(|c| c.condition == Condition::DownstreamOutage)
        .unwrap();
    assert_eq!(
        (shown.active, shown.value, shown.threshold),
        (true, 25.0, 20.0)
    );
    // Host pressure outranks it.
    let pressed = Readings {
        process_memory: 200 * MIB,
        ..r
    };
    let d = c.tick(Duration::from_millis(1500), &pressed, &queues);
    assert_eq!(d.delivery.state, 4);
    // Over: state 0 at the next tick with nothing to relax (no delay was ever set by it).
    let mut c = controller();
    c.tick(Duration::from_secs(1), &r, &queues);
    let d = c.tick(Duration::from_millis(1500), &Readings::default(), &queues);
    assert_eq!((d.delivery.state, d.delivery.recovering), (0, false));
}
