#!/usr/bin/env bash
# From `shoal submit` to every rank running, on the local executor: starts a server, submits the platform's demo
# job (300 steps) N times one after another, and prints for each the wall time until the API shows both workers
# running with a PID, and the server's own timestamps (submitted -> placed -> started events). Cancels each job.
#
#   scripts/measure-submit-latency.sh [SHOAL_BINARY] [N]      (default target/debug/shoal, 5)
set -euo pipefail
BIN=$(realpath "${1:-target/debug/shoal}")
N=${2:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
D=$(mktemp -d)
chmod 755 "$D"   # the task user must reach the data directory
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" server --listen "127.0.0.1:$PORT" --data-dir "$D/data" >"$D/server.log" 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null; wait 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 300); do
    [ -s "$D/data/admin.token" ] && curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break
    sleep 0.2
done
TOK=$(cat "$D/data/admin.token")
API="http://127.0.0.1:$PORT/api/v1"
sed -e 's/^steps = .*/steps = 300/' "$ROOT/examples/platform_digits.toml" >"$D/job.toml"
for _ in $(seq "$N"); do
    t0=$(date +%s%N)
    ID=$("$BIN" submit --json --addr "127.0.0.1:$PORT" --token "$TOK" "$D/job.toml" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
    until curl -sf -H "Authorization: Bearer $TOK" "$API/jobs/$ID" | python3 -c '
import json, sys
w = json.load(sys.stdin).get("workers", [])
sys.exit(0 if len(w) == 2 and all(x.get("state") == "running" and x.get("pid") for x in w) else 1)'; do
        sleep 0.01
    done
    t1=$(date +%s%N)
    echo "submit -> 2 ranks running: $(( (t1 - t0) / 1000000 )) ms (wall, as a polling client sees it)"
    curl -sf -H "Authorization: Bearer $TOK" "$API/jobs/$ID/events" | python3 -c '
import json, sys
v = json.load(sys.stdin)
ev = v["events"] if isinstance(v, dict) else v
t = [(e.get("time_ms") or 0, e["kind"]) for e in ev][:3]
print("   server:", ", ".join(f"{k} +{ms - t[0][0]} ms" for ms, k in t))'
    "$BIN" cancel --addr "127.0.0.1:$PORT" --token "$TOK" "$ID" >/dev/null
    sleep 1
done
