//! `throttlehost load`: scenario files that drive a host through throttling states, with a
//! timeline, a chart and an account of every message. `throttlehost demo` runs the built-in
//! scenario `load/demo.toml` the same way, with a live table instead of files.

pub mod chart;
pub mod in_flight;
pub(crate) mod live_table;
pub mod options;
pub mod peer;
pub mod record;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod units;

pub use options::{Display, LoadError, LoadOptions};
pub use record::RunResult;
pub use report::{Summary, summarize, text_summary, write_outputs};
pub use runner::run;
pub use scenario::Scenario;
