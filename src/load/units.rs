//! How the load tool writes quantities in its tables, reports and chart labels.

use std::time::Duration;

/// A wait as a person reads it.
pub fn format_wait(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s == 0.0 {
        "0".into()
    } else if s < 1.0 {
        format!("{:.0}ms", s * 1000.0)
    } else {
        format!("{s:.1}s")
    }
}
