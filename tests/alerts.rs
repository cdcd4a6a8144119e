//! The Prometheus alert rules (`dashboards/alerts.yml`): valid for Prometheus (`promtool check
//! rules`), behaving as their unit tests say (`promtool test rules dashboards/alerts.test.yml`,
//! a case that fires and one that does not per rule), and naming only metrics the host exports.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use throttlehost::catalogue::{METRICS, PREFIX};

const RULES: &str = "dashboards/alerts.yml";
const RULE_TESTS: &str = "dashboards/alerts.test.yml";

/// Runs promtool with `args` in the repository; panics with its output unless it succeeds.
fn promtool(args: &[&str]) {
    let binary = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let output = Command::new(&binary)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `{binary}` ({e}): install Debian's prometheus package, which ships promtool (scripts/test does), or set PROMTOOL")
        });
    assert!(
        output.status.success(),
        "promtool {}:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// The values of `key: value` lines, in order.
fn values_of(text: &str, key: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.trim().strip_prefix(key))
        .map(|value| value.trim().to_string())
        .collect()
}

#[test]
fn the_rules_are_valid_prometheus_rules() {
    promtool(&["check", "rules", RULES]);
}

#[test]
fn the_rules_pass_their_unit_tests() {
    promtool(&["test", "rules", RULE_TESTS]);
}

/// Every rule has a case that fires (`exp_alerts:` with labels) and one that does not
/// (`exp_alerts: []`) in the unit tests.
#[test]
fn every_rule_has_a_firing_and_a_quiet_case() {
    let rules: Vec<String> = values_of(&read(RULES), "- alert:");
    assert!(rules.len() >= 7, "the rules: {rules:?}");
    let tests = read(RULE_TESTS);
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for rule in &rules {
        let (mut fires, mut quiet) = (false, false);
        for (i, line) in lines.iter().enumerate() {
            if line.strip_prefix("alertname:").map(str::trim) != Some(rule.as_str()) {
                continue;
            }
            match lines.get(i + 1) {
                Some(&"exp_alerts: []") => quiet = true,
                Some(&"exp_alerts:") => fires = true,
                other => panic!("{rule}: expected exp_alerts after alertname, found {other:?}"),
            }
        }
        assert!(fires, "{rule} has no case that fires");
        assert!(quiet, "{rule} has no case that stays quiet");
    }
}

/// A metric renamed in the catalogue would leave a rule that never fires: every
/// `throttlehost_` name in an expression is one the host exports.
#[test]
fn the_rules_name_only_exported_metrics() {
    let exported: BTreeSet<String> = METRICS
        .iter()
        .map(|m| format!("{PREFIX}{}", m.name))
        .collect();
    let named: BTreeSet<String> = values_of(&read(RULES), "expr:")
        .iter()
        .flat_map(|expr| {
            expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|word| word.starts_with(PREFIX))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(named.len() >= 5, "metrics named: {named:?}");
    let unknown: Vec<&String> = named.difference(&exported).collect();
    assert!(unknown.is_empty(), "not exported by the host: {unknown:?}");
}
