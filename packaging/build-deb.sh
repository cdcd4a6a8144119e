#!/usr/bin/env bash
# Builds the Debian package of throttlehost with dpkg-deb, from this repository:
#
#   packaging/build-deb.sh [--binary PATH] [--out DIR] [--compression xz|gzip|zstd|none]
#
# Without --binary it builds the release binary first (cargo build --release). The package
# goes to DIR (default target/debian) as throttlehost_<version>_<arch>.deb; its path is the
# last line printed. It holds:
#
#   /usr/bin/throttlehost
#   /lib/systemd/system/throttlehost.service       (packaging/throttlehost.service)
#   /etc/throttlehost/host.toml                    (config/host.toml; a conffile, 0640 root:throttlehost, in a 0750 directory)
#   /usr/share/throttlehost/config/examples/       (config/examples)
#   /usr/share/throttlehost/sql/                   (sql/, for DBAs who create the tables themselves)
#   /usr/share/throttlehost/dashboards/            (Grafana dashboard, Prometheus scrape config, alert rules and their tests)
#   /usr/share/doc/throttlehost/                   (README.md, docs/, copyright)
#
# The maintainer scripts (packaging/debian/) add a system user `throttlehost`, reload systemd
# and stop the service on removal; they change nothing outside the package when dpkg installs
# into another root (DPKG_ROOT set, as tests/packaging.rs does).
set -euo pipefail
cd "$(dirname "$0")/.."

binary=""
out="target/debian"
compression="xz"
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary="${2:?--binary needs a path}"; shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --compression) compression="${2:?--compression needs xz, gzip, zstd or none}"; shift 2 ;;
    *) echo "build-deb.sh: unknown argument '$1' (expected --binary PATH, --out DIR or --compression KIND)" >&2; exit 2 ;;
  esac
done
if [ -z "$binary" ]; then
  cargo build --release --quiet
  binary="target/release/throttlehost"
fi
[ -x "$binary" ] || { echo "build-deb.sh: '$binary' is not an executable" >&2; exit 2; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
arch="$(dpkg --print-architecture)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
root="$stage/throttlehost_${version}_${arch}"

install -D -m 0755 "$binary" "$root/usr/bin/throttlehost"
install -D -m 0644 packaging/throttlehost.service "$root/lib/systemd/system/throttlehost.service"
install -d -m 0750 "$root/etc/throttlehost"
install -D -m 0640 config/host.toml "$root/etc/throttlehost/host.toml"
share="$root/usr/share/throttlehost"
mkdir -p "$share/config" "$share/dashboards"
cp -r config/examples "$share/config/"
cp -r sql "$share/"
cp -r dashboards/. "$share/dashboards/"
doc="$root/usr/share/doc/throttlehost"
mkdir -p "$doc"
cp README.md "$doc/"
cp -r docs "$doc/"
cat >"$doc/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: throttlehost

Files: *
License: $(sed -n 's/^license = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
COPYRIGHT
find "$share" "$doc" -type d -exec chmod 0755 {} +
find "$share" "$doc" -type f -exec chmod 0644 {} +

# Shared libraries the binary links, as the packages that ship them (libc6, libssl3, ...).
depends="$(ldd "$binary" | awk '/=>/ { print $3 }' | while read -r lib; do
  dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true
done | cut -d: -f1 | sort -u | paste -sd, | sed 's/,/, /g')"

mkdir -p "$root/DEBIAN"
cat >"$root/DEBIAN/control" <<CONTROL
Package: throttlehost
Version: $version
Architecture: $arch
Maintainer: throttlehost developers <throttlehost@localhost>
Depends: adduser${depends:+, $depends}
Section: net
Priority: optional
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Description: message-processing host with BizTalk-style throttling
 Receives from SQL Server (NServiceBus SQL transport layout) and PostgreSQL queue
 tables with per-queue concurrency, recoverability and host throttling, runs as a
 systemd service (Type=notify, watchdog) and serves Prometheus metrics, a live
 console and alert rules.
CONTROL
echo "/etc/throttlehost/host.toml" >"$root/DEBIAN/conffiles"
for script in postinst prerm postrm; do
  install -m 0755 "packaging/debian/$script" "$root/DEBIAN/$script"
done

mkdir -p "$out"
dpkg-deb --root-owner-group -Z"$compression" --build "$root" "$out/" >/dev/null
echo "$out/throttlehost_${version}_${arch}.deb"
