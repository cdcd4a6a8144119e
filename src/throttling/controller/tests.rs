//! The controller's behaviour with fake readings and a fake clock: state codes, ranking, the
//! delay law's numbers, hysteresis, the min-samples gate, pacing, AIMD and overrides.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::config::{MemoryThreshold, OverrideMode, ThrottlingConfig};

const MIB: u64 = 1 << 20;

fn config() -> ThrottlingConfig {
    ThrottlingConfig {
        process_memory: MemoryThreshold::Bytes(100 * MIB),
        system_memory: MemoryThreshold::Bytes(800 * MIB),
        in_process_per_cpu: 500,
        threads_per_cpu: 50,
        database_size: 50_000,
        database_sessions_per_cpu: 10,
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

fn imbalanced(incoming: f64, outgoing: f64, samples: u64) -> RateReading {
    RateReading {
        incoming_per_sec: incoming,
        outgoing_per_sec: outgoing,
        samples,
    }
}

fn queues() -> Vec<(String, u32)> {
    vec![("orders".to_string(), 16)]
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
            (0, 8),
        ),
        (
            "delivery rate",
            Readings {
                delivery: imbalanced(200.0, 100.0, 3000),
                ..quiet()
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
        delivery: imbalanced(500.0, 10.0, 5000),
        publishing: imbalanced(500.0, 10.0, 5000),
    };
    let mut c = controller();
    c.set_override(Direction::Delivery, OverrideMode::Throttle);
    c.set_override(Direction::Publishing, OverrideMode::Throttle);
    let d = c.tick(secs(0.0), &everything, &queues());
    assert_eq!((d.delivery.state, d.publishing.state), (4, 4));
    assert_eq!(
        d.delivery.active().count(),
        6,
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
    let ladder: Vec<(Readings, (u8, u8))> = vec![
        (
            Readings {
                process_memory: 0,
                ..everything
            },
            (3, 9),
        ),
        (
            Readings {
                process_memory: 0,
                in_process: 0,
                ..everything
            },
            (9, 9),
        ),
        (
            Readings {
                process_memory: 0,
                in_process: 0,
                threads: 0,
                ..everything
            },
            (5, 6),
        ),
        (
            Readings {
                process_memory: 0,
                in_process: 0,
                threads: 0,
                database_size: 0,
                ..everything
            },
            (5, 5),
        ),
        (
            Readings {
                process_memory: 0,
                in_process: 0,
                threads: 0,
                database_size: 0,
                system_memory_used: 0,
                ..everything
            },
            (10, 8),
        ),
    ];
    for (readings, expected) in ladder {
        let mut c = controller();
        c.set_override(Direction::Delivery, OverrideMode::Throttle);
        c.set_override(Direction::Publishing, OverrideMode::Throttle);
        assert_eq!(states(&mut c, &readings), expected, "{readings:?}");
    }
}

#[test]
fn memory_delay_starts_at_10ms_and_doubles_every_200ms() {
    let mut c = controller();
    let hot = Readings {
        process_memory: 200 * MIB,
        ..quiet()
    };
    let d0 = c.tick(secs(0.0), &hot, &queues());
    assert_eq!(d0.delivery.delay, Duration::from_millis(10));
    assert_eq!(d0.publishing.delay, Duration::from_millis(10));
    let d1 = c.tick(secs(0.2), &hot, &queues());
    assert_eq!(d1.delivery.delay.as_micros(), 20_000);
    let d2 = c.tick(secs(0.4), &hot, &queues());
    assert_eq!(d2.delivery.delay.as_micros(), 40_000);
    let d3 = c.tick(secs(0.9), &hot, &queues());
    assert_eq!(
        d3.delivery.delay.as_micros(),
        226_274,
        "x 2^2.5 over half a second"
    );
}

#[test]
fn database_size_delay_doubles_every_100_seconds() {
    let mut c = controller();
    let big = Readings {
        database_size: 60_000,
        ..quiet()
    };
    assert_eq!(
        c.tick(secs(0.0), &big, &queues()).publishing.delay,
        Duration::from_millis(10)
    );
    let mut d = None;
    for i in 1..=200 {
        d = Some(c.tick(secs(i as f64 * 0.5), &big, &queues()));
    }
    assert_eq!(d.unwrap().publishing.delay.as_micros(), 20_000);
}

#[test]
fn in_process_delay_doubles_every_four_thirds_of_a_second() {
    let mut c = controller();
    let busy = Readings {
        in_process: 2000,
        ..quiet()
    };
    c.tick(secs(0.0), &busy, &queues());
    let d = c.tick(secs(4.0), &busy, &queues());
    assert_eq!(
        d.delivery.delay.as_micros(),
        80_000,
        "three doublings in 4 s at severity 75"
    );
}

#[test]
fn delay_is_capped_by_max_delay_and_decays_to_zero() {
    let mut c = controller();
    let hot = Readings {
        process_memory: 200 * MIB,
        ..quiet()
    };
    let mut t = 0.0;
    let mut last = None;
    for _ in 0..40 {
        last = Some(c.tick(secs(t), &hot, &queues()));
        t += 0.5;
    }
    assert_eq!(last.unwrap().delivery.delay, Duration::from_secs(300));
    // Clear: halves per sample, 300 s / 2^19 < 1 ms -> 0 on the 19th sample.
    let mut delays = Vec::new();
    for _ in 0..19 {
        delays.push(c.tick(secs(t), &quiet(), &queues()).delivery.delay);
        t += 0.5;
    }
    assert_eq!(delays[0], Duration::from_secs(150));
    assert_eq!(delays[1], Duration::from_secs(75));
    assert!(delays[17] > Duration::ZERO && delays[17] < Duration::from_millis(2));
    assert_eq!(delays[18], Duration::ZERO);
}

#[test]
fn hysteresis_prevents_flapping_between_90_and_100_percent() {
    // in-process threshold = 500 per CPU x 2 CPUs = 1000; resume below 900.
    let mut c = controller();
    let mut t = 0.0;
    let mut step = |value: u64| {
        let d = c.tick(
            secs(t),
            &Readings {
                in_process: value,
                ..quiet()
            },
            &queues(),
        );
        t += 0.5;
        d.delivery.state
    };
    assert_eq!(step(1000), 0, "equal is not above");
    assert_eq!(step(1001), 3);
    for v in [999, 950, 901, 900, 999, 920] {
        assert_eq!(step(v), 3, "still active at {v}");
    }
    assert_eq!(step(899), 0, "clears below 90%");
    for v in [901, 950, 999, 1000] {
        assert_eq!(step(v), 0, "stays clear at {v}");
    }
    assert_eq!(step(1001), 3);
}

#[test]
fn rate_throttling_needs_the_minimum_samples() {
    let mut c = controller();
    let few = Readings {
        delivery: imbalanced(1000.0, 10.0, 99),
        ..quiet()
    };
    assert_eq!(c.tick(secs(0.0), &few, &queues()).delivery.state, 0);
    let enough = Readings {
        delivery: imbalanced(1000.0, 10.0, 100),
        ..quiet()
    };
    assert_eq!(c.tick(secs(0.5), &enough, &queues()).delivery.state, 1);
}

#[test]
fn rate_imbalance_paces_at_outgoing_times_overdrive() {
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
    assert_eq!(d.publishing.effective_wait(), Duration::from_millis(10));
    let status = d
        .publishing
        .conditions
        .iter()
        .find(|c| c.condition == Condition::RateImbalance)
        .unwrap();
    assert_eq!((status.value, status.threshold), (300.0, 100.0));
    // Balanced again (within overdrive x resume): pacing stops.
    let d = c.tick(
        secs(0.5),
        &Readings {
            publishing: imbalanced(85.0, 80.0, 4500),
            ..quiet()
        },
        &queues(),
    );
    assert_eq!(d.publishing.pace, None);
    assert_eq!(d.publishing.state, 0);
}

#[test]
fn stalled_outgoing_paces_at_max_delay() {
    let mut c = controller();
    let r = Readings {
        delivery: imbalanced(50.0, 0.0, 500),
        ..quiet()
    };
    let d = c.tick(secs(0.0), &r, &queues());
    assert_eq!(d.delivery.pace, Some(Duration::from_secs(300)));
}

#[test]
fn aimd_shrinks_limits_under_memory_pressure_and_grows_them_back() {
    let mut c = controller();
    let hot = Readings {
        process_memory: 200 * MIB,
        ..quiet()
    };
    let mut t = 0.0;
    let mut shrink = Vec::new();
    for _ in 0..9 {
        shrink.push(c.tick(secs(t), &hot, &queues()).queue_limits["orders"]);
        t += 0.5;
    }
    assert_eq!(shrink, vec![12, 9, 6, 4, 3, 2, 1, 1, 1]);
    let mut grow = Vec::new();
    for _ in 0..17 {
        grow.push(c.tick(secs(t), &quiet(), &queues()).queue_limits["orders"]);
        t += 0.5;
    }
    assert_eq!(grow[..4], [2, 3, 4, 5]);
    assert_eq!(grow[14..], [16, 16, 16]);
}

#[test]
fn only_memory_in_process_and_thread_pressure_shrink_limits() {
    for (readings, shrinks) in [
        (
            Readings {
                in_process: 5000,
                ..quiet()
            },
            true,
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
            false,
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
    let d = c.tick(secs(0.5), &quiet(), &[("orders".to_string(), 4)]);
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
        Duration::from_millis(10)
    );
    let d = c.tick(secs(1.0), &quiet(), &queues());
    assert_eq!(
        d.delivery.delay.as_micros(),
        20_000,
        "severity 100 doubles every second"
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
    let d = c.tick(secs(6.0), &quiet(), &queues());
    assert_eq!(d.delivery.state, 0);
    let d = c.tick(secs(16.0), &quiet(), &queues());
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
            delivery: imbalanced(d.0, d.1, d.2),
            publishing: imbalanced(p.0, p.1, p.2),
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
    fn delay_never_exceeds_max_and_state_is_the_top_active_condition(
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
            let d = c.tick(now, &readings, &[("q".to_string(), max)]);
            for dir in [&d.delivery, &d.publishing] {
                prop_assert!(dir.delay <= Duration::from_millis(max_delay_ms));
                if let Some(p) = dir.pace {
                    prop_assert!(p <= Duration::from_millis(max_delay_ms));
                }
                let expected = if dir.override_mode == OverrideMode::Never {
                    0
                } else {
                    dir.active().max_by_key(|c| c.condition.rank()).map(|c| c.state).unwrap_or(0)
                };
                prop_assert_eq!(dir.state, expected);
            }
            let limit = d.queue_limits["q"];
            prop_assert!(limit >= 1 && limit <= max);
        }
    }
}
