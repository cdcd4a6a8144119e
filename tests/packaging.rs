//! The Debian package (`packaging/build-deb.sh`): built from this repository around the test
//! binary, installed into a throwaway root with dpkg (its own database there, maintainer
//! scripts run without chroot and told the root by DPKG_ROOT), checked, and purged leaving
//! nothing behind; and the systemd unit it installs, checked by `systemd-analyze verify`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("th-{what}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(program: &str, args: &[&str]) -> Output {
    let output = Command::new(program)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {}:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Builds the package around the test binary, uncompressed (the debug binary is large).
fn build_package(out: &Path) -> PathBuf {
    let output = run(
        "packaging/build-deb.sh",
        &[
            "--binary",
            env!("CARGO_BIN_EXE_throttlehost"),
            "--out",
            out.to_str().unwrap(),
            "--compression",
            "none",
        ],
    );
    let printed = String::from_utf8(output.stdout).unwrap();
    PathBuf::from(printed.lines().last().expect("the package's path").trim())
}

/// dpkg acting on `root` only: its own database, no root privileges needed for the
/// database, scripts run outside a chroot with DPKG_ROOT set, dependencies not looked up
/// (the throwaway root has no libc6 package).
fn dpkg(root: &Path, args: &[&str]) -> Output {
    let root_arg = format!("--root={}", root.display());
    let mut all = vec![
        root_arg.as_str(),
        "--force-not-root",
        "--force-script-chrootless",
        "--force-depends",
        "--log=/dev/null",
    ];
    all.extend_from_slice(args);
    run("dpkg", &all)
}

/// An empty dpkg database under `root`.
fn empty_root(root: &Path) {
    for dir in ["var/lib/dpkg/updates", "var/lib/dpkg/info"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
}

/// Every file below `dir` (relative), outside dpkg's own database.
fn files_below(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            let relative = path.strip_prefix(dir).unwrap().display().to_string();
            if relative.starts_with("var/lib/dpkg") {
                continue;
            }
            if path.is_dir() {
                pending.push(path);
            } else {
                found.push(relative);
            }
        }
    }
    found
}

#[test]
fn the_package_installs_and_purges_cleanly() {
    let work = TempDir::new("deb");
    let package = build_package(&work.0.join("out"));
    let info =
        String::from_utf8(run("dpkg-deb", &["--info", package.to_str().unwrap()]).stdout).unwrap();
    assert!(info.contains("Package: throttlehost"), "{info}");
    assert!(info.contains("Depends: adduser, libc6"), "{info}");

    let root = work.0.join("root");
    empty_root(&root);
    dpkg(&root, &["--install", package.to_str().unwrap()]);
    for file in [
        "usr/bin/throttlehost",
        "lib/systemd/system/throttlehost.service",
        "etc/throttlehost/host.toml",
        "usr/share/throttlehost/config/examples/postgres.toml",
        "usr/share/throttlehost/sql/postgres/queue.sql",
        "usr/share/throttlehost/sql/sqlserver/queue.sql",
        "usr/share/throttlehost/dashboards/throttlehost.json",
        "usr/share/throttlehost/dashboards/alerts.yml",
        "usr/share/doc/throttlehost/copyright",
    ] {
        assert!(root.join(file).is_file(), "{file} installed");
    }
    // The configuration holds secrets: nobody outside root and the host's group reads it.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &str| root.join(p).metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode("etc/throttlehost"), 0o750);
        assert_eq!(mode("etc/throttlehost/host.toml"), 0o640);
    }
    let conffiles = String::from_utf8(
        run(
            "dpkg-query",
            &[
                &format!("--admindir={}", root.join("var/lib/dpkg").display()),
                "--showformat=${Conffiles}",
                "--show",
                "throttlehost",
            ],
        )
        .stdout,
    )
    .unwrap();
    assert!(
        conffiles.contains("/etc/throttlehost/host.toml"),
        "the configuration is a conffile: {conffiles}"
    );
    // The installed binary runs, and the installed configuration is one it accepts.
    let binary = root.join("usr/bin/throttlehost");
    let version = run(binary.to_str().unwrap(), &["--version"]);
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("throttlehost "));
    let config = root.join("etc/throttlehost/host.toml");
    run(
        binary.to_str().unwrap(),
        &["config", "check", "--config", config.to_str().unwrap()],
    );

    dpkg(&root, &["--purge", "throttlehost"]);
    let left = files_below(&root);
    assert!(left.is_empty(), "left behind after a purge: {left:?}");
    assert!(
        !root.join("etc/throttlehost").exists(),
        "the configuration directory is gone"
    );
}

/// The unit passes systemd's own checks (unknown keys, bad values, a missing binary all
/// print warnings), pointed at the test binary.
#[test]
fn the_service_unit_passes_systemd_analyze_verify() {
    let work = TempDir::new("unit");
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/throttlehost.service"),
    )
    .unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/throttlehost run"));
    let checked = work.0.join("throttlehost.service");
    std::fs::write(
        &checked,
        unit.replace("/usr/bin/throttlehost", env!("CARGO_BIN_EXE_throttlehost")),
    )
    .unwrap();
    let output = Command::new("systemd-analyze")
        .args(["verify", checked.to_str().unwrap()])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run systemd-analyze ({e}): install Debian's systemd package (scripts/test does)")
        });
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{said}");
    assert!(said.trim().is_empty(), "systemd-analyze warns:\n{said}");
    for setting in [
        "Type=notify",
        "WatchdogSec=",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ] {
        assert!(unit.contains(setting), "the unit sets {setting}");
    }
}
