#!/usr/bin/env bash
# Robust aggregation, rule against attack: trains examples/mlp_digits_robust.toml (the digits MLP on 5 workers,
# `shoal run -n 5` on this host) once per rule and attack, its [robust] and [chaos] tables replaced in a copy of the
# spec, and prints each run's final held-out accuracy and loss and its wall time.
#
#   scripts/measure-robust.sh [SHOAL_BINARY]      (default target/release/shoal)
#   env: RULES (default "mean median trimmed_mean krum multi_krum geomed"), ATTACKS (default "none signflip noise
#     alie ipm"; none: no attacker), F (default 1; the mean always runs with 0), LIARS (default "4"), JSON=1 (one
#     JSON object per run on stdout, the table on stderr).
#
# Everything it makes (a temporary directory) is removed when it ends.
set -euo pipefail

SHOAL=$(realpath "${1:-target/release/shoal}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SPEC=$ROOT/examples/mlp_digits_robust.toml
RULES=${RULES:-mean median trimmed_mean krum multi_krum geomed}
ATTACKS=${ATTACKS:-none signflip noise alie ipm}
F=${F:-1}
LIARS=${LIARS:-4}
[ -x "$SHOAL" ] || { echo "no shoal binary at $SHOAL (cargo build --release -p shoal)" >&2; exit 1; }
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT

for rule in $RULES; do
    for attack in $ATTACKS; do
        dir=$D/$rule-$attack
        mkdir -p "$dir"
        python3 - "$SPEC" "$dir/job.toml" "$rule" "$attack" "$F" "$LIARS" <<'PY'
import re, sys
src, dst, rule, attack, f, liars = sys.argv[1:]
t = open(src).read()
t = re.sub(r"(?ms)^\[(robust|chaos)\]\n.*?(?=^\[|\Z)", "", t).rstrip("\n") + "\n"
t += f'\n[robust]\nrule = "{rule}"\nf = {0 if rule == "mean" else int(f)}\n'
if attack != "none":
    ranks = ", ".join(liars.split(","))
    t += f'\n[chaos]\nbyzantine_ranks = [{ranks}]\nattack = "{attack}"\n'
open(dst, "w").write(t)
PY
        echo "measure-robust: $rule under $attack" >&2
        if ! "$SHOAL" run -n 5 --output "$dir/out" "$dir/job.toml" >"$dir/run.log" 2>&1; then
            echo "the $rule / $attack run failed:" >&2
            tail -n 20 "$dir/run.log" >&2
            echo failed >"$dir/failed"
        fi
    done
done

python3 - "$D" "${JSON:-0}" "$F" "$LIARS" "$RULES" "$ATTACKS" <<'PY'
import json, os, sys
d, as_json, f, liars, rules, attacks = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5].split(), sys.argv[6].split()
rows = []
for rule in rules:
    for attack in attacks:
        out = os.path.join(d, f"{rule}-{attack}", "out", "summary.json")
        if not os.path.exists(out):
            rows.append({"rule": rule, "attack": attack, "failed": True})
            continue
        s = json.load(open(out))
        rows.append({"rule": rule, "attack": attack, "f": 0 if rule == "mean" else int(f), "byzantine_ranks": liars,
                     "eval_accuracy": s.get("eval_accuracy"), "eval_loss": s.get("eval_loss"),
                     "elapsed_s": s.get("elapsed_s")})
if as_json:
    for r in rows:
        print(json.dumps(r))
    sys.stdout.flush()
    sys.stdout = sys.stderr
print(f"# RULES=\"{' '.join(rules)}\" ATTACKS=\"{' '.join(attacks)}\" F={f} LIARS={liars} scripts/measure-robust.sh")
print(f"# examples/mlp_digits_robust.toml, 5 workers on one host (shoal run -n 5), ranks {liars} lying; "
      "accuracy: held-out, at the end")
print("# rule          " + "".join(f"{a:>11}" for a in attacks) + "   (wall s, median over attacks)")
for rule in rules:
    cells, walls = [], []
    for attack in attacks:
        r = next(x for x in rows if x["rule"] == rule and x["attack"] == attack)
        if r.get("failed"):
            cells.append(f"{'failed':>11}")
            continue
        acc = r["eval_accuracy"]
        cells.append(f"{acc:>10.2%} " if acc is not None else f"{'-':>11}")
        walls.append(r["elapsed_s"] or 0)
    walls.sort()
    wall = walls[len(walls) // 2] if walls else 0
    print(f"  {rule:<14}" + "".join(cells) + f"   {wall:.1f}")
PY
