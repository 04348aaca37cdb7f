#!/usr/bin/env bash
# Parameter-server modes with a slow worker: trains examples/mlp_digits_ps.toml on 4 workers and 2 servers
# (`shoal run -n 4` on this host) once per mode (sync, async, ssp with staleness 3), while worker 3 is slowed from
# outside — stopped (SIGSTOP) STOP_MS of every STOP_MS + RUN_MS, 3× slower by default — and prints, per mode:
# the rate at which the workers together completed steps while all four ran (steps/s, from each worker's metrics
# lines, up to the moment the first worker finished), that rate against sync's, the held-out accuracy and loss,
# and the run's wall time.
#
#   scripts/measure-ps-modes.sh [SHOAL_BINARY]      (default target/release/shoal)
#   env: MODES (default "sync async ssp"), STEPS (default 3000), STOP_MS (default 40), RUN_MS (default 20),
#     JSON=1 (one JSON object per mode on stdout, the table on stderr).
#
# Everything it makes (a temporary directory) is removed when it ends.
set -euo pipefail

SHOAL=$(realpath "${1:-target/release/shoal}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SPEC=$ROOT/examples/mlp_digits_ps.toml
MODES=${MODES:-sync async ssp}
STEPS=${STEPS:-3000}
STOP_MS=${STOP_MS:-40}
RUN_MS=${RUN_MS:-20}
[ -x "$SHOAL" ] || { echo "no shoal binary at $SHOAL (cargo build --release -p shoal)" >&2; exit 1; }
D=$(mktemp -d)
trap 'rm -rf "$D"; [ -n "${SLOWER:-}" ] && kill "$SLOWER" 2>/dev/null || true' EXIT

# The pid of the process of `shoal worker --output OUT` whose SHOAL_RANK is RANK (empty until it runs).
pid_of_rank() {
    local out=$1 rank=$2 p
    for p in $(pgrep -f -- "worker --output $out" || true); do
        if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "SHOAL_RANK=$rank"; then
            echo "$p"
            return
        fi
    done
}

for mode in $MODES; do
    dir=$D/$mode
    mkdir -p "$dir"
    python3 - "$SPEC" "$dir/job.toml" "$mode" "$STEPS" <<'PY'
import re, sys
src, dst, mode, steps = sys.argv[1:]
t = open(src).read()
t = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", t)
t = re.sub(r"(?m)^eval_every = \d+", "eval_every = 0", t)
t = re.sub(r"(?m)^every = \d+", "every = 0", t)
t = re.sub(r'(?m)^mode = "\w+"', f'mode = "{mode}"' + ("\nstaleness = 3" if mode == "ssp" else ""), t)
open(dst, "w").write(t)
PY
    echo "measure-ps-modes: $mode" >&2
    "$SHOAL" run -n 4 --json --output "$dir/out" "$dir/job.toml" > "$dir/summary.json" 2> "$dir/log" &
    RUN=$!
    # Slow worker 3: stopped STOP_MS of every STOP_MS + RUN_MS while it lives.
    (
        p=""
        while [ -z "$p" ] && kill -0 "$RUN" 2>/dev/null; do p=$(pid_of_rank "$dir/out" 3); sleep 0.01; done
        while [ -n "$p" ] && kill -STOP "$p" 2>/dev/null; do
            sleep "$(awk "BEGIN{print $STOP_MS/1000}")"
            kill -CONT "$p" 2>/dev/null || break
            sleep "$(awk "BEGIN{print $RUN_MS/1000}")"
        done
    ) &
    SLOWER=$!
    wait "$RUN" || { echo "measure-ps-modes: $mode failed; its log:" >&2; cat "$dir/log" >&2; exit 1; }
    kill "$SLOWER" 2>/dev/null || true
    wait "$SLOWER" 2>/dev/null || true
done

python3 - "$D" "$MODES" "${JSON:-0}" <<'PY'
import glob, json, os, sys
d, modes, as_json = sys.argv[1], sys.argv[2].split(), sys.argv[3] == "1"
rows = []
for mode in modes:
    out = os.path.join(d, mode, "out")
    s = json.load(open(os.path.join(d, mode, "summary.json")))
    per = []
    for f in [os.path.join(out, "metrics.jsonl")] + sorted(glob.glob(os.path.join(out, "metrics.rank-*.jsonl"))):
        lines = [json.loads(l) for l in open(f)]
        per.append([l["unix_ms"] for l in lines if "step" in l and "unix_ms" in l])
    start = max(ms[0] for ms in per)
    end = min(ms[-1] for ms in per)
    steps = sum(sum(1 for t in ms if start < t <= end) for ms in per)
    rate = steps / max((end - start) / 1000, 1e-9)
    rows.append({"mode": mode, "steps_per_s_all_running": rate, "eval_accuracy": s["eval_accuracy"],
                 "eval_loss": s["eval_loss"], "elapsed_s": s["elapsed_s"]})
base = rows[0]["steps_per_s_all_running"] if rows else 1.0
print(f"{'mode':<6} {'steps/s (all 4 running)':>24} {'vs ' + rows[0]['mode'] if rows else '':>9} "
      f"{'accuracy':>9} {'eval loss':>10} {'wall s':>7}", file=sys.stderr)
for r in rows:
    r["vs_first"] = r["steps_per_s_all_running"] / base
    print(f"{r['mode']:<6} {r['steps_per_s_all_running']:>24.1f} {r['vs_first']:>9.2f} "
          f"{100 * r['eval_accuracy']:>8.2f}% {r['eval_loss']:>10.4f} {r['elapsed_s']:>7.1f}", file=sys.stderr)
    if as_json:
        print(json.dumps(r))
PY
