#!/usr/bin/env bash
# Checks the planner (`shoal plan`, `train.strategy = "auto"`) against real runs: for a job spec on N workers,
# `shoal plan --json` lists the layouts with their estimated memory per device and step time; every runnable one is
# then run for STEPS steps (`shoal run -n N --json --output DIR`), and the table compares the estimates with what
# `DIR/summary.json` measured:
#   - step time: the median step (`step_time.step_s`), the least of REPEAT runs taken in turn (on a host shared
#     with other work, the run least disturbed), and `elapsed_s / steps` beside it (which includes start-up and the
#     final evaluation);
#   - memory: the most any rank held, `params + grads + optimizer + activations_peak` of `memory_bytes`.
# It ends saying whether the planner's first choice (the fastest runnable layout that fits, as "auto" picks) is
# the fastest measured, or within 10% of it.
#
# Usage: scripts/check-planner.sh [SPEC] [N ...]   (default: examples/gpt_cicero.toml on 2 and 4 workers)
# Environment: SHOAL (default target/debug/shoal), STEPS (default 40), REPEAT (default 2: runs of each layout, in
#              turn), OUT (default a temporary directory),
#              PLAN_ARGS (extra `shoal plan` flags, e.g. "--flops 2e9 --bandwidth 5e9").
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${1:-examples/gpt_cicero.toml}
shift || true
WORLDS=("$@")
[ ${#WORLDS[@]} -gt 0 ] || WORLDS=(2 4)
SHOAL=${SHOAL:-target/debug/shoal}
STEPS=${STEPS:-40}
REPEAT=${REPEAT:-2}
OUT=${OUT:-$(mktemp -d -t check-planner.XXXXXX)}
[ -x "$SHOAL" ] || { echo "no $SHOAL: build it first (cargo build -p shoal)" >&2; exit 2; }
mkdir -p "$OUT"
echo "spec $SPEC, $STEPS steps a run, outputs under $OUT"

status=0
for n in "${WORLDS[@]}"; do
    plan="$OUT/plan-$n.json"
    # shellcheck disable=SC2086
    "$SHOAL" plan --json --top 1000 --devices "$n" ${PLAN_ARGS:-} "$SPEC" >"$plan"
    python3 - "$SPEC" "$plan" "$OUT/n$n" "$STEPS" <<'PY' >"$OUT/layouts-$n.txt"
# Writes one job spec per runnable layout (the spec with its strategy, its [parallel] table, STEPS steps and no
# checkpoint but the last) and prints "INDEX PATH" for each.
import json, os, sys, tomllib
spec_path, plan_path, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
spec = tomllib.load(open(spec_path, "rb"))
plan = json.load(open(plan_path))

def value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    return repr(v)

def table(name, d, lines):
    scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
    if name:
        lines.append(f"[{name}]")
    lines += [f"{k} = {value(v)}" for k, v in scalars.items()]
    for k, v in d.items():
        if isinstance(v, dict):
            table(f"{name}.{k}" if name else k, v, lines)

os.makedirs(out, exist_ok=True)
for i, l in enumerate(plan["layouts"]):
    if not l["runnable"]:
        continue
    s = json.loads(json.dumps(spec))
    s["train"]["steps"] = steps
    s["train"]["strategy"] = l["strategy"]
    s["train"]["eval_every"] = 0
    s["train"]["eval_batches"] = 1
    s["checkpoint"] = {"every": 0, "keep": 1}
    s.pop("parallel", None)
    if l.get("parallel"):
        s["parallel"] = {k: v for k, v in l["parallel"].items() if v is not None}
    lines = []
    table("", s, lines)
    path = os.path.join(out, f"layout-{i}.toml")
    open(path, "w").write("\n".join(lines) + "\n")
    print(i, path)
PY
    for r in $(seq "$REPEAT"); do
        while read -r i job; do
            dir="$OUT/n$n/run-$i-$r"
            rm -rf "$dir"
            if ! "$SHOAL" run -n "$n" --json --output "$dir" "$job" >"$dir.json" 2>"$dir.log"; then
                echo "layout $i on $n workers failed: see $dir.log" >&2
                status=1
            fi
        done <"$OUT/layouts-$n.txt"
    done
    python3 - "$plan" "$OUT/n$n" <<'PY' || status=1
import json, os, sys
plan = json.load(open(sys.argv[1]))
out = sys.argv[2]
rows = []
for i, l in enumerate(plan["layouts"]):
    runs = []
    for d in sorted(os.listdir(out)):
        path = os.path.join(out, d, "summary.json")
        if l["runnable"] and d.startswith(f"run-{i}-") and os.path.exists(path):
            runs.append(json.load(open(path)))
    if not runs:
        continue
    s = min(runs, key=lambda s: s["step_time"]["step_s"])
    s["spread"] = max(r["step_time"]["step_s"] for r in runs) / s["step_time"]["step_s"]
    mem = max(m["params"] + m["grads"] + m["optimizer"] + m["activations_peak"] for m in s["memory_bytes"])
    rows.append((i, l, s, mem))
if not rows:
    sys.exit("no runnable layout ran")
gib = 1 << 20
print(f"\n{plan['model']} of {plan['parameters']} parameters on {plan['devices']} workers "
      f"({plan['flops_per_s'] / 1e9:.2f} GFLOP/s, {plan['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s a device)")
print(f"{'#':>3} {'layout':<44} {'est s':>8} {'step s':>8} {'ratio':>6} {'spread':>6} {'elap/st':>8} "
      f"{'est MiB':>8} {'meas MiB':>8} {'ratio':>6}")
for i, l, s, mem in rows:
    shape = f"{l['strategy']} {l['data']}x{l['tensor']}x{l['pipeline']}"
    if l["pipeline"] > 1:
        shape += f" m={l['micro_batches']}"
    step = s["step_time"]["step_s"]
    per = s["elapsed_s"] / max(s["steps"], 1)
    est_mem = l["memory_per_device_bytes"]
    print(f"{i + 1:>3} {shape:<44} {l['step_time_s']:>8.4f} {step:>8.4f} {l['step_time_s'] / step:>6.2f} "
          f"{s['spread']:>6.2f} {per:>8.4f} {est_mem / gib:>8.2f} {mem / gib:>8.2f} {est_mem / mem:>6.3f}")
first = next((r for r in rows if r[1]["fits"]), rows[0])
fastest = min(rows, key=lambda r: r[2]["step_time"]["step_s"])
a, b = first[2]["step_time"]["step_s"], fastest[2]["step_time"]["step_s"]
ok = a <= 1.10 * b
print(f"first choice: #{first[0] + 1} {first[1]['strategy']} at {a:.4f} s a step; fastest measured: "
      f"#{fastest[0] + 1} {fastest[1]['strategy']} at {b:.4f} s ({100 * (a / b - 1):+.1f}%): "
      f"{'the fastest or within 10%' if ok else 'MORE THAN 10% SLOWER'}")
worst = max(abs(r[1]["memory_per_device_bytes"] / r[3] - 1) for r in rows)
print(f"memory estimates within {100 * worst:.1f}% of measured")
sys.exit(0 if ok else 1)
PY
done
exit $status
