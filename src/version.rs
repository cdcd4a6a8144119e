//! What this build is, for `--version`, the `build_info` and `host_info` metrics and the
//! instance registry. A module of its own, below everything that reports it: the metrics,
//! the fleet and the host read it here, not from the crate root above them.

/// The version of this build.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit this build was made from: `git rev-parse --short=12 HEAD` at build time, the
/// `THROTTLEHOST_COMMIT` environment variable when a packager sets it, or "unknown".
pub const COMMIT: &str = env!("THROTTLEHOST_COMMIT");
