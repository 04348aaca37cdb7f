#!/usr/bin/env bash
# The step loop's cost of in-memory checkpoints: a job runs with `checkpoint.memory_every = EVERY` and without, one
# after the other (ROUNDS times each, alternating), through `shoal run -n 2`. Prints, for each run, the step time,
# the copies taken and the step loop's part of each (`memory_stall_s / memory_copies` from summary.json) as a share
# of a step, and the throughput ratio of the runs with copies to the runs without.
#
#   scripts/measure-memory-stall.sh [SHOAL_BINARY] [SPEC] [EVERY] [STEPS] [ROUNDS]
#   (default target/debug/shoal, examples/gpt_cicero.toml, 5, 200, 2)
set -euo pipefail
BIN=$(realpath "${1:-target/debug/shoal}")
SPEC=$(realpath "${2:-examples/gpt_cicero.toml}")
EVERY=${3:-5}
STEPS=${4:-200}
ROUNDS=${5:-2}
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
for m in 0 "$EVERY"; do
    # No evaluation and no storage checkpoint but the last: only the in-memory copies differ.
    sed -E -e "s/^steps = .*/steps = $STEPS/" -e "s/^eval_every = .*/eval_every = 0/" -e "s/^every = .*/every = 0/" \
        "$SPEC" >"$D/m$m.toml"
    grep -q '^\[checkpoint\]' "$D/m$m.toml" || printf '\n[checkpoint]\n' >>"$D/m$m.toml"
    sed -i "s/^\[checkpoint\]/[checkpoint]\nmemory_every = $m/" "$D/m$m.toml"
done
for r in $(seq "$ROUNDS"); do
    for m in "$EVERY" 0; do
        "$BIN" run -n 2 --output "$D/out-$m-$r" --json "$D/m$m.toml" >/dev/null 2>"$D/log-$m-$r" \
            || { cat "$D/log-$m-$r" >&2; exit 1; }
    done
done
python3 - "$D" "$EVERY" "$ROUNDS" <<'PY'
import json, sys
d, every, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
rate = {"0": [], every: []}
for r in range(1, rounds + 1):
    for m in (every, "0"):
        s = json.load(open(f"{d}/out-{m}-{r}/summary.json"))
        step = s["elapsed_s"] / s["steps"]
        c = s["memory_copies"]
        per = s["memory_stall_s"] / c if c else 0.0
        rate[m].append(s["samples_per_s"])
        print(f"memory_every={m:>3} run {r}: step {step*1e3:.2f} ms, {c} copies, "
              f"{per*1e3:.3f} ms of the step loop each = {100*per/step:.2f}% of a step, "
              f"{s['samples_per_s']:.0f} samples/s ({s['parameters']} parameters)")
ratio = (sum(rate[every]) / len(rate[every])) / (sum(rate["0"]) / len(rate["0"]))
print(f"throughput with copies / without: {ratio:.3f}")
PY
