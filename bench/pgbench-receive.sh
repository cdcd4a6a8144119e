#!/usr/bin/env bash
# Raw PostgreSQL limit for receiving one message per transaction, to compare the host's drain
# rate against on the same machine and in the same run.
#
# It creates a throw-away schema with a queue table in the NServiceBus PostgreSQL layout,
# fills it with N messages of about 200 bytes, and drains it with pgbench: C clients, each
# transaction a single `DELETE ... WHERE Seq = (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING`,
# the statement the host's receive runs. It prints one line:
#
#   pgbench_receive n=20000 c=8 drain_s=2.41 msgs_per_s=8299 left=0
#
# Usage: bench/pgbench-receive.sh   (env: DATABASE_URL, N = 20000, C = 8)
# Compare with: cargo run --release -- load load/drain-postgres.toml  (same N and C).
set -euo pipefail
url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
n="${N:-20000}"
c="${C:-8}"
schema="raw_receive_$$"
run_sql() { psql -X -q -v ON_ERROR_STOP=1 "$url" "$@"; }
cleanup() { run_sql -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true; rm -f "${tx_file:-}"; }
trap cleanup EXIT

run_sql <<SQL
CREATE SCHEMA $schema;
CREATE TABLE $schema.queue (
  Id uuid NOT NULL PRIMARY KEY,
  Expires timestamp,
  Headers text NOT NULL,
  Body bytea,
  Seq serial NOT NULL UNIQUE
);
INSERT INTO $schema.queue (Id, Expires, Headers, Body)
SELECT gen_random_uuid(), NULL,
       json_build_object('NServiceBus.MessageId', gen_random_uuid(),
                         'NServiceBus.EnclosedMessageTypes', 'Bench.OrderPlaced, Bench',
                         'NServiceBus.ContentType', 'application/json')::text,
       convert_to(rpad(json_build_object('seq', i)::text, 200), 'UTF8')
FROM generate_series(1, $n) AS i;
VACUUM ANALYZE $schema.queue;
SQL

tx_file="$(mktemp)"
cat >"$tx_file" <<SQL
DELETE FROM $schema.queue
WHERE Seq = (SELECT Seq FROM $schema.queue ORDER BY Seq LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING Id, Expires, Headers, Body;
SQL

per_client=$(( (n + c - 1) / c ))
threads=$(( c < 2 ? c : 2 ))
t0="$(date +%s.%N)"
pgbench -n -M prepared -c "$c" -j "$threads" -t "$per_client" -f "$tx_file" "$url" >/dev/null 2>&1
t1="$(date +%s.%N)"
left="$(psql -X -At "$url" -c "SELECT count(*) FROM $schema.queue")"
awk -v n="$n" -v left="$left" -v c="$c" -v t0="$t0" -v t1="$t1" 'BEGIN {
  s = t1 - t0
  printf "pgbench_receive n=%d c=%d drain_s=%.2f msgs_per_s=%.0f left=%d\n", n, c, s, (n - left) / s, left
}'
