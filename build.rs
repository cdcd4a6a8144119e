//! Records the commit the binary is built from, for `--version` and the `build_info` metric:
//! `THROTTLEHOST_COMMIT` from the environment when a packager sets it, else `git rev-parse`
//! of this checkout, else "unknown" (a source tarball).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=THROTTLEHOST_COMMIT");
    // A new commit or checkout changes HEAD or the branch it points to.
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let commit = std::env::var("THROTTLEHOST_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=THROTTLEHOST_COMMIT={}", commit.trim());
}

fn git_commit() -> Option<String> {
    let output = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
        .filter(|c| !c.is_empty())
}
