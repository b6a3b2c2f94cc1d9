#!/bin/bash
# Seconds from `chatengine serve` to its first GET /health answering 200, on a new data dir each
# run (the README's start-time figures). Usage: bash scripts/start_time.sh [runs] [serve flags...]
# Runs from this checkout (PYTHONPATH), on the default model unless a --model flag is given.
set -u
runs=${1:-3}
shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
for run in $(seq 1 "$runs"); do
  dir=$(mktemp -d)
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  t0=$(date +%s.%N)
  PYTHONPATH=$root chatengine serve --port "$port" --data-dir "$dir" --log-level warning "$@" > "$dir/log" 2>&1 &
  pid=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "run $run: the server exited:"; tail -5 "$dir/log"; exit 1; fi
    sleep 0.1
  done
  t1=$(date +%s.%N)
  printf 'run %d: %.1f s (load average %s)\n' "$run" "$(echo "$t1 - $t0" | bc)" "$(cut -d' ' -f1 /proc/loadavg)"
  kill "$pid"
  wait "$pid" 2>/dev/null
  rm -rf "$dir"
done
