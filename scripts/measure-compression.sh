#!/usr/bin/env bash
# Gradient compression, codec against codec: trains examples/mlp_digits_compressed.toml (or $SPEC) on 2 workers once
# per codec (its [compression] table replaced in a copy of the spec) and prints, per codec, the bytes rank 0 sent per step and
# in all, how many times fewer than plain DDP (`none`), the final held-out loss and accuracy, the run's wall time,
# and the time from the start of the first step to the end of the first step whose evaluation reached the `none`
# run's final accuracy (eval.jsonl, with rank 0's `unix_ms` of that step in metrics.jsonl), with its ratio to
# the `none` run's own time to it ("-" when never reached).
#
#   scripts/measure-compression.sh [SHOAL_BINARY] [MODE] [STEPS]
#   defaults: target/release/shoal, loopback, the example's steps
#   MODE loopback: `shoal run -n 2` on this host, the ranks talking through shared memory (SHOAL_TRANSPORT=tcp: TCP
#     over loopback).
#   MODE hosts: two hosts made of network namespaces (own address and hostname each) joined through a bridge by
#     links shaped to RATE_MBIT (default 100) Mbit/s each way with `tc tbf`, one worker per host
#     (`shoal run --nnodes 2 --node-rank R -n 1`). Needs root, iproute2 and util-linux (`unshare`).
#   env: RATE_MBIT (hosts), CODECS (default "none fp16 int8 topk:0.01 randk:0.01 sign powersgd:4"; NAME:X sets
#     topk's and randk's ratio or powersgd's rank; ",KEY=VALUE" after it sets another key of [compression] and
#     ",momentum" sets momentum = true, e.g. topk:0.01,warmup_steps=30,warmup_codec=int8,momentum), SPEC (the job,
#     default examples/mlp_digits_compressed.toml; examples/gpt_cicero.toml for the GPT, which has no accuracy: its
#     rows compare the held-out loss), JSON=1 (one JSON object per codec on stdout, with its evaluations over time,
#     and the table on stderr).
#
# Everything it makes (temporary directory, namespaces, bridge, the runs it started) is removed when it ends.
set -euo pipefail

SHOAL=$(realpath "${1:-target/release/shoal}")
MODE=${2:-loopback}
STEPS=${3:-}
RATE_MBIT=${RATE_MBIT:-100}
CODECS_GIVEN=${CODECS:-}
CODECS=${CODECS:-none fp16 int8 topk:0.01 randk:0.01 sign powersgd:4}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SPEC_GIVEN=${SPEC:-}
SPEC=$(realpath "${SPEC:-$ROOT/examples/mlp_digits_compressed.toml}")
TAG=$$
NET=10.219.$((TAG % 200 + 20))
HOSTS=c$((TAG % 100000))
. "$(dirname "$0")/hosts.sh"
PORT=29533
COMMAND="$0 $*"
[ "$MODE" = hosts ] && COMMAND="RATE_MBIT=$RATE_MBIT $COMMAND"
[ -z "$CODECS_GIVEN" ] || COMMAND="CODECS=\"$CODECS\" $COMMAND"
[ -z "${SHOAL_TRANSPORT:-}" ] || COMMAND="SHOAL_TRANSPORT=$SHOAL_TRANSPORT $COMMAND"
[ -z "$SPEC_GIVEN" ] || COMMAND="SPEC=$SPEC_GIVEN $COMMAND"
export SHOAL_JOB_SECRET=measure-compression-secret-$TAG-0123456789

[ -x "$SHOAL" ] || { echo "no shoal binary at $SHOAL (cargo build --release -p shoal)" >&2; exit 1; }
case $MODE in
    loopback) ;;
    hosts) [ "$(id -u)" = 0 ] || { echo "MODE hosts needs root (network namespaces)" >&2; exit 1; } ;;
    *) echo "MODE is loopback or hosts, not $MODE" >&2; exit 1 ;;
esac
[[ -z "$STEPS" || "$STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "STEPS must be a positive number, not $STEPS" >&2; exit 1; }

D=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ "$MODE" != hosts ] || hosts_down "$HOSTS" 2
    rm -rf "$D"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[ "$MODE" != hosts ] || hosts_up "$HOSTS" "$NET" "$RATE_MBIT" 2

# The example with its [compression] table replaced (and its steps, when given): spec_for CODEC[:X] OUT.
spec_for() {
    python3 - "$SPEC" "$2" "$1" "$STEPS" <<'PY'
import re, sys
src, dst, codec, steps = sys.argv[1:]
head, *extra = codec.split(",")
name, _, x = head.partition(":")
t = open(src).read()
t = re.sub(r"(?ms)^\[compression\]\n.*?(?=^\[|\Z)", "", t).rstrip("\n") + "\n"
if steps:
    t = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", t, count=1)
t += f'\n[compression]\ncodec = "{name}"\n'
if x and name in ("topk", "randk"):
    t += f"ratio = {float(x)}\n"
elif x and name == "powersgd":
    t += f"rank = {int(x)}\n"
elif x:
    sys.exit(f"codec {name} takes no parameter (got {codec})")
for kv in extra:
    key, eq, value = kv.partition("=")
    if not eq:
        value = "true"
    elif not re.fullmatch(r"-?[0-9.e]+|true|false", value):
        value = f'"{value}"'
    t += f"{key} = {value}\n"
open(dst, "w").write(t)
PY
}

# One run of the job with codec $1; its rank 0's output directory is $D/$1/out.
train() {
    local codec=$1 i=$2 dir=$D/$1 rc=0
    mkdir -p "$dir"
    spec_for "$codec" "$dir/job.toml"
    if [ "$MODE" = loopback ]; then
        "$SHOAL" run -n 2 --output "$dir/out" "$dir/job.toml" >"$dir/run.log" 2>&1 &
        PIDS=($!)
        wait "${PIDS[0]}" || rc=$?
    else
        # A port of its own per run, so that no run waits on the last one's sockets.
        local port=$((PORT + 2 * i))
        PIDS=()
        for n in 1 0; do
            local out=$dir/out
            [ "$n" = 1 ] && out=$dir/node1
            on_host "$HOSTS" "$n" "shoal-host$n" "$SHOAL" run --nnodes 2 --node-rank "$n" --rdzv "$NET.1:$port" -n 1 --output "$out" "$dir/job.toml" \
                >"$dir/node$n.log" 2>&1 &
            PIDS+=($!)
        done
        for p in "${PIDS[@]}"; do wait "$p" || rc=$?; done
    fi
    PIDS=()
    if [ "$rc" != 0 ] || [ ! -s "$dir/out/summary.json" ]; then
        echo "the $codec run failed (exit $rc):" >&2
        tail -n 20 "$dir"/*.log >&2
        echo "$rc" >"$dir/failed"
    fi
}

i=0
for c in $CODECS; do
    echo "measure-compression: $c ($MODE)" >&2
    train "$c" "$i"
    i=$((i + 1))
done

HEADER="# $COMMAND
# $(basename "$SPEC"), 2 workers, $(case $MODE in
    loopback) echo "one host, no link: shoal run -n 2, $([ "${SHOAL_TRANSPORT:-auto}" = tcp ] \
        && echo "TCP over loopback" || echo "shared memory between the ranks")" ;;
    hosts) echo "2 hosts x 1 worker, link shaped to $RATE_MBIT Mbit/s each way: shoal run --nnodes 2 -n 1" ;;
esac)"
python3 - "$D" "$HEADER" "${JSON:-0}" "$MODE" "$RATE_MBIT" $CODECS <<'PY'
import json, os, sys
d, header, as_json, mode, rate, codecs = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], sys.argv[5], sys.argv[6:]

def lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except FileNotFoundError:
        return []

runs = {}
for c in codecs:
    out = os.path.join(d, c, "out")
    if os.path.exists(os.path.join(d, c, "failed")):
        runs[c] = None
        continue
    s = json.load(open(os.path.join(out, "summary.json")))
    steps = {m["step"]: m for m in lines(os.path.join(out, "metrics.jsonl")) if m.get("rank", 0) == 0}
    first = steps[min(steps)]
    t0 = first["unix_ms"] - first["step_s"] * 1e3  # the first step's start
    evals = [(e["step"], e.get("eval_accuracy"), (steps[e["step"]]["unix_ms"] - t0) / 1e3)
             for e in lines(os.path.join(out, "eval.jsonl")) if e["step"] in steps]
    runs[c] = {"summary": s, "evals": evals}

base = runs.get("none")
target = base["summary"].get("eval_accuracy") if base else None

def reach(r):
    """Seconds from the first step's start to the end of the first evaluated step at the target accuracy."""
    if target is None:
        return None
    return next((t for _, a, t in r["evals"] if a >= target - 1e-9), None)

t_base = reach(base) if base else None

def label(c):
    head, *extra = c.split(",")
    name, _, x = head.partition(":")
    if x and name in ("topk", "randk"):
        name = f"{name} {float(x) * 100:g}%"
    elif x:
        name = f"{name} r{x}"
    short = {"warmup_steps": "w", "warmup_codec": "", "momentum": "m"}
    return " ".join([name] + [short.get(k, k) + v for k, _, v in (e.partition("=") for e in extra)])

rows = []
for c in codecs:
    r = runs[c]
    if r is None:
        rows.append({"codec": c, "label": label(c), "failed": True})
        continue
    s = r["summary"]
    t = reach(r)
    rows.append({
        "codec": c,
        "label": label(c),
        "mode": mode,
        "rate_mbit": float(rate) if mode == "hosts" else None,
        "steps": s["steps"],
        "bytes_per_step": s["comm_bytes_per_step"],
        "bytes_total": s["comm_bytes"],
        "fewer_than_none": (base["summary"]["comm_bytes_per_step"] / s["comm_bytes_per_step"]
                            if base and s["comm_bytes_per_step"] > 0 else None),
        "eval_loss": s["eval_loss"],
        "eval_accuracy": s.get("eval_accuracy"),
        "elapsed_s": s["elapsed_s"],
        "step_s_median": s["step_time"]["step_s"],
        "comm_s_median": s["step_time"]["comm_s"],
        "target_accuracy": target,
        "time_to_target_s": t,
        "time_to_target_vs_none": t / t_base if t is not None and t_base else None,
        "evals": [{"step": st, "eval_accuracy": a, "t_s": round(ts, 3)} for st, a, ts in r["evals"]],
    })

if as_json:
    for row in rows:
        print(json.dumps(row))
    sys.stdout.flush()
    sys.stdout = sys.stderr  # the table too, on stderr

def mb(b):
    return f"{b / 1e6:.3f} MB" if b < 1e7 else f"{b / 1e6:.0f} MB"

print(header)
if target is not None:
    print(f"# target: the none run's final held-out accuracy, {target:.2%}; 'to target': from the start of the first "
          f"step to the end of the first evaluated step at it; 'vs none': that over none's")
print("# bytes: what rank 0 sent, per training step and over the run (also the parameters' first broadcast, the "
      "evaluations and, with a codec, the error feedback gathered for the last checkpoint); 'fewer': none's bytes "
      "per step over the codec's; wall: the run's elapsed_s")
print("# labels: wN warm-up steps (then the warm-up's codec), m the AdamW moment sent (compression.momentum); "
      "'loss +': the held-out loss over none's")
width = max([12] + [len(r["label"]) for r in rows])
print(f"# {'codec':<{width}} {'bytes/step':>12} {'total':>10} {'fewer':>8} {'eval loss':>9} {'loss +':>7} "
      f"{'accuracy':>8} {'wall':>7} {'to target':>9} {'vs none':>7}")
for row in rows:
    if row.get("failed"):
        print(f"  {row['label']:<{width}} failed")
        continue
    f = row["fewer_than_none"]
    fewer = "-" if not f else f"{f:.2f}x" if f < 10 else f"{f:.1f}x"
    t = row["time_to_target_s"]
    v = row["time_to_target_vs_none"]
    more = f"{row['eval_loss'] / base['summary']['eval_loss'] - 1:+.1%}" if base else "-"
    acc = row["eval_accuracy"]
    print(f"  {row['label']:<{width}} {mb(row['bytes_per_step']):>12} {mb(row['bytes_total']):>10} {fewer:>8} "
          f"{row['eval_loss']:>9.4f} {more:>7} {(f'{acc:.2%}' if acc is not None else '-'):>8} "
          f"{row['elapsed_s']:>6.1f}s {(f'{t:.1f}s' if t is not None else '-'):>9} "
          f"{(f'{v:.2f}' if v is not None else '-'):>7}")
PY
for c in $CODECS; do [ ! -e "$D/$c/failed" ] || exit 1; done
