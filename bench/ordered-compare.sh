#!/usr/bin/env bash
# An ordered queue's drain next to the same backlog unordered, measured alternately in one
# run on this machine. Each round runs, in this order:
#
#   unordered  load/drain-postgres.toml with a 10 000-message backlog (no keys)
#   ordered    load/drain-postgres-ordered.toml: 10 000 messages over 1 000 keys, key order
#
# both with a no-op handler at concurrency 8, and prints each round, then the medians and
# the ratio:
#
#   median unordered=5210 ordered=4768 (92%)
#
# Usage: bench/ordered-compare.sh   (env: ROUNDS = 5; builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${ROUNDS:-5}"
bin=target/release/throttlehost
cargo build --release --quiet
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# shellcheck source=bench/lib.sh
source bench/lib.sh

unordered="$work/unordered.toml"
sed -e "s/^prefill = .*/prefill = 10000/" load/drain-postgres.toml >"$unordered"
u_all=""
o_all=""
for round in $(seq 1 "$rounds"); do
  u="$(host_rate "$unordered")"
  o="$(host_rate load/drain-postgres-ordered.toml)"
  u_all+="$u "
  o_all+="$o "
  echo "round $round: unordered=$u ordered=$o"
done
python3 - "$u_all" "$o_all" <<'PY'
import statistics, sys
u = statistics.median(int(x) for x in sys.argv[1].split())
o = statistics.median(int(x) for x in sys.argv[2].split())
print(f"median unordered={u:.0f} ordered={o:.0f} ({100 * o / u:.0f}%)")
PY
