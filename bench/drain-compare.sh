#!/usr/bin/env bash
# The host's drain and bulk send next to PostgreSQL's raw limit, measured alternately in one
# run on this machine (the host and PostgreSQL share its cores, so only numbers taken side by
# side compare). Each round runs, in this order:
#
#   raw        bench/pgbench-receive.sh: one DELETE ... SKIP LOCKED per transaction, 8 clients
#   single     load/drain-postgres.toml: the host, one message per transaction, concurrency 8
#   peeking    the same with notify_on_insert = false (no insert trigger, no listening
#              connection): what the wake on arrival costs a drain, side by side
#   batch B    load/drain-postgres-batch.toml with receive_batch = B and max = 4 x B (at most
#              256: the delivery ceiling counts on at most about a thousand messages pending)
#   send       throttlehost send --count N (bulk send, wall time from process start)
#
# and prints each round, then the medians and the ratios to the raw limit:
#
#   median raw=12321 single=12449 (101%; per round 99.2%) batch8=... (x1.6) ... send=0.17s
#
# (the first ratio is of the medians, the second the median of each round's single / raw)
#
# Usage: bench/drain-compare.sh   (env: ROUNDS = 5, N = 20000, BATCHES = "8 32 128",
#        DATABASE_URL; builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${ROUNDS:-5}"
n="${N:-20000}"
batches="${BATCHES:-8 32 128}"
url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
bin=target/release/throttlehost
cargo build --release --quiet
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# shellcheck source=bench/lib.sh
source bench/lib.sh

scenario_for_batch() {
  local b="$1" file="$work/batch-$1.toml"
  sed -e "s/^receive_batch = .*/receive_batch = $b/" -e "s/^max = .*/max = $(( 4 * b < 256 ? 4 * b : 256 ))/" \
      -e "s/^prefill = .*/prefill = $n/" load/drain-postgres-batch.toml >"$file"
  echo "$file"
}

single="$work/single.toml"
sed -e "s/^prefill = .*/prefill = $n/" load/drain-postgres.toml >"$single"
peeking="$work/peeking.toml"
sed -e "s/^transaction_mode = .*/&\nnotify_on_insert = false/" -e "s/^schema = .*/schema = \"load_drain_peeking\"/" \
    "$single" >"$peeking"
send_config="$work/send.toml"
cat >"$send_config" <<TOML
[transport]
kind = "postgres"
connection_string = "$url"
schema = "bench_send"
TOML
"$bin" queues create --config "$send_config" bulk >/dev/null 2>&1 || true

declare -A results
for round in $(seq 1 "$rounds"); do
  raw="$(N="$n" C=8 DATABASE_URL="$url" bench/pgbench-receive.sh | sed -E 's/.*msgs_per_s=([0-9]+).*/\1/')"
  line="round $round: raw=$raw single=$(host_rate "$single")"
  results[raw]+="$raw "
  results[single]+="$(echo "$line" | sed -E 's/.*single=([0-9]+).*/\1/') "
  rate="$(host_rate "$peeking")"
  results[peeking]+="$rate "
  line="$line peeking=$rate"
  for b in $batches; do
    rate="$(host_rate "$(scenario_for_batch "$b")")"
    results[batch$b]+="$rate "
    line="$line batch$b=$rate"
  done
  "$bin" queues purge --config "$send_config" bulk >/dev/null 2>&1 || true
  t0="$(date +%s.%N)"
  "$bin" send --config "$send_config" --queue bulk --count "$n" >/dev/null 2>&1
  t1="$(date +%s.%N)"
  send_s="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')"
  results[send]+="$send_s "
  echo "$line send=${send_s}s"
done
"$bin" queues purge --config "$send_config" bulk >/dev/null 2>&1 || true
psql -X -q "$url" -c "DROP SCHEMA IF EXISTS bench_send CASCADE" -c "DROP SCHEMA IF EXISTS load_drain_peeking CASCADE" >/dev/null 2>&1 || true

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
raw_median="$(echo "${results[raw]}" | median)"
summary="median raw=$raw_median"
single_median="$(echo "${results[single]}" | median)"
# The median of each round's own ratio, single / raw: the pairs were measured side by side.
pair_ratios="$(paste -d' ' <(echo "${results[single]}" | tr ' ' '\n' | grep -v '^$') <(echo "${results[raw]}" | tr ' ' '\n' | grep -v '^$') | awk '{ printf "%.1f ", 100 * $1 / $2 }')"
summary="$summary single=$single_median ($(awk -v a="$single_median" -v r="$raw_median" 'BEGIN { printf "%.0f%%", 100 * a / r }'); per round $(echo "$pair_ratios" | median)%)"
summary="$summary peeking=$(echo "${results[peeking]}" | median)"
for b in $batches; do
  m="$(echo "${results[batch$b]}" | median)"
  summary="$summary batch$b=$m (x$(awk -v a="$m" -v r="$raw_median" 'BEGIN { printf "%.1f", a / r }'))"
done
summary="$summary send=$(echo "${results[send]}" | median)s"
echo "$summary"
