#!/usr/bin/env bash
# What an open console costs the host: the host's CPU time (user + system, from
# /proc/PID/stat) over the same interval with no page open and with the console open in
# headless Chromium (which polls once a second), alternating, on one host process.
#
#   closed 1: 0.41% of one core   open 1: 0.52% ...
#   median closed 0.40%  open 0.53%  page costs 0.13% of one core
#
# The host is `throttlehost demo` (busy: a load walks through the throttling states) unless
# HOST=idle, which runs `throttlehost run` on the memory transport with nothing to do.
# Usage: bench/console-cpu.sh   (env: ROUNDS = 3, SECONDS_EACH = 30, HOST = demo | idle;
#        needs chromium; builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${ROUNDS:-3}"
each="${SECONDS_EACH:-30}"
bin=target/release/throttlehost
cargo build --release --quiet
work="$(mktemp -d)"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
cleanup() { kill "$host" ${browser:-} 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

if [ "${HOST:-demo}" = idle ]; then
  cat > "$work/host.toml" <<EOF
[host]
admin_address = "127.0.0.1:$port"
[transport]
kind = "memory"
[[queues]]
name = "orders"
[queues.handler]
kind = "noop"
EOF
  "$bin" run --config "$work/host.toml" >/dev/null 2>&1 &
else
  "$bin" demo --admin "127.0.0.1:$port" >/dev/null 2>&1 &
fi
host=$!
for _ in $(seq 1 50); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.2; done
ticks="$(getconf CLK_TCK)"

# CPU seconds of the host so far.
cpu() { awk -v t="$ticks" '{ print ($14 + $15) / t }' "/proc/$host/stat"; }

# Percent of one core the host used over the next $each seconds.
measure() {
  local a b
  a="$(cpu)"; sleep "$each"; b="$(cpu)"
  awk -v a="$a" -v b="$b" -v s="$each" 'BEGIN { printf "%.2f", 100 * (b - a) / s }'
}

closed=(); open=()
sleep 3
for round in $(seq 1 "$rounds"); do
  c="$(measure)"; closed+=("$c")
  chromium --headless --no-sandbox --disable-gpu --user-data-dir="$work/profile" \
    --remote-debugging-port=0 "http://127.0.0.1:$port/" >/dev/null 2>&1 &
  browser=$!
  sleep 3
  o="$(measure)"; open+=("$o")
  kill "$browser"; wait "$browser" 2>/dev/null || true; browser=
  echo "round $round: closed $c% of one core   open $o%"
done
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
mc="$(median "${closed[@]}")"; mo="$(median "${open[@]}")"
awk -v c="$mc" -v o="$mo" 'BEGIN { printf "median closed %.2f%%  open %.2f%%  page costs %.2f%% of one core\n", c, o, o - c }'
