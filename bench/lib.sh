# Shared by the comparison scripts in bench/ (sourced, not run). Expects $bin (the release
# binary) and $work (a scratch directory).

# The host's drain rate from a scenario's summary (from the drain's start to its last
# message); stops the script when the run lost a message or broke a key's order.
host_rate() {
  local scenario="$1" out="$work/out"
  rm -rf "$out"
  "$bin" load "$scenario" --out "$out" >"$work/load.log" 2>&1 || {
    cat "$work/load.log" >&2
    echo "scenario $scenario failed" >&2
    exit 1
  }
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['messages_lost']==0, 'lost messages'; assert d['key_order_violations']==0, 'key order broken'; print(round(d['throughput_per_second']))" "$out/summary.json"
}
