//! Generated configurations: the documented `config/host.toml` with one to four settings
//! replaced by hostile values (huge and negative numbers, durations and sizes at the top of
//! their range, empty and odd strings, wrong types). Parsing and validating never panics, and
//! whatever `config check` accepts the throttling controller can run with (before, a
//! `max_delay` of 2^64-1 seconds passed the check and panicked the controller later).

use std::time::Duration;

use proptest::prelude::*;
use throttlehost::config;
use throttlehost::throttling::Direction;
use throttlehost::throttling::controller::{
    Controller, MachineFacts, QueueLoad, Readings, Thresholds,
};
use throttlehost::transport::QueueName;

/// One step into a TOML document.
#[derive(Debug, Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// Every scalar value's path.
fn leaves(value: &toml::Value, path: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                path.push(Step::Key(k.clone()));
                leaves(v, path, out);
                path.pop();
            }
        }
        toml::Value::Array(items) if items.iter().any(|i| i.is_table()) => {
            for (i, item) in items.iter().enumerate() {
                path.push(Step::Index(i));
                leaves(item, path, out);
                path.pop();
            }
        }
        _ => out.push(path.clone()),
    }
}

fn set(value: &mut toml::Value, path: &[Step], new: toml::Value) {
    let mut at = value;
    for step in path {
        at = match (step, at) {
            (Step::Key(k), toml::Value::Table(t)) => t.get_mut(k).unwrap(),
            (Step::Index(i), toml::Value::Array(a)) => &mut a[*i],
            _ => unreachable!("paths come from the same document"),
        };
    }
    *at = new;
}

fn hostile_value() -> impl Strategy<Value = toml::Value> {
    prop_oneof![
        prop_oneof![
            Just(0i64),
            Just(-1),
            Just(i64::MAX),
            Just(i64::MIN),
            Just(1 << 40),
            Just(4_294_967_296),
            any::<i64>(),
        ]
        .prop_map(toml::Value::Integer),
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(-0.0),
            Just(1e308),
            Just(-1e-9),
            any::<f64>(),
        ]
        .prop_map(toml::Value::Float),
        prop_oneof![
            Just("".to_string()),
            Just("18446744073709551615s".to_string()),
            Just("1e30s".to_string()),
            Just("99999999999PiB".to_string()),
            Just("-5s".to_string()),
            Just("0s".to_string()),
            Just("0.0000001ns".to_string()),
            Just("\u{0}".to_string()),
            Just("∞".to_string()),
            Just("throttle".to_string()),
            Just("0.0.0.0:9464".to_string()),
            "[a-z0-9 .:_-]{0,12}",
            "\\PC{0,8}",
        ]
        .prop_map(toml::Value::String),
        any::<bool>().prop_map(toml::Value::Boolean),
        Just(toml::Value::Array(vec![])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    #[test]
    fn generated_configurations_never_panic(
        picks in prop::collection::vec((any::<prop::sample::Index>(), hostile_value()), 1..=4)
    ) {
        let text = std::fs::read_to_string("config/host.toml").unwrap();
        let mut doc: toml::Value = toml::from_str(&text).unwrap();
        let mut paths = Vec::new();
        leaves(&doc, &mut Vec::new(), &mut paths);
        for (index, value) in picks {
            let path = index.get(&paths).clone();
            set(&mut doc, &path, value);
        }
        let Ok(text) = toml::to_string(&doc) else {
            // A value TOML cannot write (none today): nothing to check.
            return Ok(());
        };
        let Ok(config) = config::load::parse_str(&text, "generated") else {
            return Ok(());
        };
        // Accepted: the controller runs with it, the override forcing the delay law to its
        // largest values, for ten simulated minutes.
        let machine = MachineFacts { total_memory: 8 << 30, cpus: 2 };
        let thresholds = Thresholds::resolve(&config.throttling, machine);
        let mut controller = Controller::new(config.throttling.clone(), thresholds);
        controller.set_override(Direction::Delivery, config::OverrideMode::Throttle);
        controller.set_override(Direction::Publishing, config::OverrideMode::Throttle);
        let queues = [QueueLoad::idle(QueueName::new("in").unwrap(), 8)];
        let readings = Readings { process_memory: u64::MAX / 2, in_process: 1 << 40, ..Readings::default() };
        for second in 0..600u64 {
            controller.tick(Duration::from_secs(second), &readings, &queues);
        }
    }
}
