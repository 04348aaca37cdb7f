#!/usr/bin/env bash
# Goodput under chaos: the platform's digits example (2 workers; STEPS steps, a checkpoint every CKPT) runs
# undisturbed, then while `shoal chaos --kill-every EVERY` kills a random worker, then undisturbed again, one run
# after the other on one server. Prints each run's steps per second of wall time (first start to success, by the server's events), the
# restarts, and the ratio: the goodput.
#
#   scripts/measure-goodput.sh [SHOAL_BINARY] [STEPS] [EVERY] [CKPT] [POLICY] [BACKOFF]
#   (default target/debug/shoal, 40000, 10s, 200, restart, 0s; SHOAL_GOODPUT_EVENTS=1 prints each run's events)
#   POLICY elastic runs the job with [workers] min = 1, max = 2: a lost worker's survivor goes on in place and a
#   newcomer joins it when the CPU is free again.
set -euo pipefail
BIN=$(realpath "${1:-target/debug/shoal}")
STEPS=${2:-40000}
EVERY=${3:-10s}
CKPT=${4:-200}
POLICY=${5:-restart}
BACKOFF=${6:-0s}
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
CLI=(--addr "127.0.0.1:$PORT" --token "$TOK")
python3 - "$ROOT/examples/platform_digits.toml" "$D/job.toml" "$STEPS" "$CKPT" "$POLICY" "$BACKOFF" <<'PY'
import re, sys
src, dst, steps, ckpt, policy, backoff = sys.argv[1:]
t = open(src).read()
t = re.sub(r"(?m)^steps = .*", f"steps = {steps}", t)
t = re.sub(r"(?m)^every = .*", f"every = {ckpt}", t)
t = re.sub(r"(?m)^eval_every = .*", "eval_every = 0", t)
t = re.sub(r"(?m)^log_every = .*", "log_every = 1000", t)
t = re.sub(r"(?s)\[fault_tolerance\].*?\n\n",
           f'[fault_tolerance]\npolicy = "{policy}"\nmax_restarts = 1000\nbackoff = "{backoff}"\n\n', t)
if policy == "elastic":
    # Elastic: down to one worker while one is lost, back to two when its CPU is free again.
    t = t.replace("[workers]\ncount = 2\n", "[workers]\nmin = 1\nmax = 2\n")
open(dst, "w").write(t)
PY

run() {  # $1: with chaos (1) or not (0); prints "steps_per_s restarts"
    local id state
    id=$("$BIN" submit --json "${CLI[@]}" "$D/job.toml" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
    until [ "$(curl -sf -H "Authorization: Bearer $TOK" "$API/jobs/$id" | jq -r .state)" = running ]; do sleep 0.1; done
    if [ "$1" = 1 ]; then
        "$BIN" chaos "$id" --kill-every "$EVERY" --seed 1 --json "${CLI[@]}" >"$D/chaos-$id.jsonl" &
    fi
    while :; do
        state=$(curl -sf -H "Authorization: Bearer $TOK" "$API/jobs/$id" | jq -r .state)
        case $state in succeeded) break ;; failed|cancelled) echo "job $id $state" >&2; exit 1 ;; esac
        sleep 0.5
    done
    wait
    if [ -n "${SHOAL_GOODPUT_EVENTS:-}" ]; then
        curl -sf -H "Authorization: Bearer $TOK" "$API/jobs/$id/events" |
            jq -r '.events[] | "\(.time_ms) \(.kind) \(.message)"' | cut -c1-220 >&2
    fi
    curl -sf -H "Authorization: Bearer $TOK" "$API/jobs/$id" | python3 -c '
import json, sys
v = json.load(sys.stdin)
ev = v["events"]
t0 = next(e["time_ms"] for e in ev if e["kind"] == "started")
t1 = next(e["time_ms"] for e in ev if e["kind"] == "succeeded")
kills = sum(1 for e in ev if e["kind"] == "chaos")
regroups = sum(1 for e in ev if e["kind"] == "regrouped")
steps, restarts, secs = v["summary"]["steps"], v["restarts"], (t1 - t0) / 1000
print(f"{steps / secs:.1f} {restarts} {kills} {secs:.1f} {regroups}")'
}

# Undisturbed before and after the run under chaos: on a shared machine the two tell how much the load moved.
read -r base1 _ _ base1_s _ < <(run 0)
echo "undisturbed: $base1 steps/s ($STEPS steps in $base1_s s)"
read -r chaos restarts kills chaos_s regroups < <(run 1)
echo "chaos (a worker killed every $EVERY, policy $POLICY, backoff $BACKOFF, checkpoint every $CKPT): $chaos steps/s ($STEPS steps in $chaos_s s, $kills kills, $restarts restarts, $regroups regroupings in place)"
read -r base2 _ _ base2_s _ < <(run 0)
echo "undisturbed again: $base2 steps/s ($STEPS steps in $base2_s s)"
python3 -c "print(f'goodput: {100 * $chaos / (($base1 + $base2) / 2):.1f}% of the mean undisturbed rate')"
