#!/usr/bin/env bash
# The GPU check: what a machine without a GPU cannot verify, measured in one run of a few minutes on one that has
# one. Two halves, because the GPU machine has CUDA, PyTorch and NVIDIA's tools but no Rust toolchain:
#
#   scripts/gpu-check.sh build        here: builds `shoal` and the shoal-train GPU tests with
#                                     `--features cuda,nccl,nvml` (toolchain from scripts/cuda-toolchain.sh),
#                                     strips and compresses them into gpu-carry/ (under 64 MiB in all)
#   scripts/gpu-check.sh run [OUT]    there: unpacks gpu-carry/, runs every check, writes OUT/gpu-check.json
#                                     (default OUT: $OUT, else ./gpu-check-out) and each step's log
#
# The checks (each a key of gpu-check.json; a failed one does not stop the others):
#   gpu_tests      the shoal-train tests that need a device: device selection, a small GPT on the GPU following the
#                  CPU (f32) and learning in bf16, NCCL at world size 1 (all_reduce, broadcast, all_gather,
#                  reduce_scatter)
#   gpt2_shoal     a GPT-2-small-shaped model (12 layers, width 768, 12 heads, context 1024, vocab 50304) trained
#                  in bf16 by `shoal run` on the GPU: tokens/s (median step), MFU against PEAK_TFLOPS (bf16 dense)
#   gpt2_torch     the same model in PyTorch eager with bf16 autocast (scripts/gpt2_reference.py)
#   ddp_shared     two processes sharing the GPU (resources.gpus = 0.5) in DDP over the host-staged path against
#                  one process at the same global batch, f32: the final parameters' largest difference (≤ 1e-5)
#   resume         a GPU run's checkpoint at step 10 resumed to step 20 on the GPU (compared bit for bit with the
#                  run that went through) and on the CPU (the largest difference)
#   gpu_memory     a `shoal server` (NVML) running two jobs of resources.gpus = 0.5 on the one GPU: the one over its
#                  resources.gpu_memory is killed with a reason naming it, its neighbour succeeds
#   nvml           nvidia-smi samples (utilisation, memory) taken every 500 ms through the runs
set -uo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
carry="$here/gpu-carry"
PEAK_TFLOPS="${PEAK_TFLOPS:-790}"
STEPS="${GPT2_STEPS:-12}"
BATCH="${GPT2_BATCH:-8}"

log() { printf 'gpu-check: %s\n' "$*" >&2; }

build() {
  eval "$("$here/scripts/cuda-toolchain.sh")"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/target}"
  local t0=$SECONDS
  cargo build --locked --release -p shoal --features cuda,nccl,nvml || return 1
  log "shoal built in $((SECONDS - t0)) s"
  t0=$SECONDS
  local tests
  tests="$(cargo test --locked --release -p shoal-train --features cuda,nccl --lib --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "shoal_train":
        print(m["executable"])' | tail -1)"
  [ -x "$tests" ] || { log "the shoal-train test binary was not built"; return 1; }
  log "shoal-train tests built in $((SECONDS - t0)) s"
  rm -rf "$carry" && mkdir -p "$carry"
  strip -o "$carry/shoal" "$CARGO_TARGET_DIR/release/shoal"
  strip -o "$carry/shoal-train-tests" "$tests"
  xz -T0 -6 "$carry/shoal" "$carry/shoal-train-tests"
  cp "$here/scripts/gpt2_reference.py" "$carry/"
  du -ch "$carry"/* >&2
  local total
  total=$(du -cb "$carry"/* | tail -1 | cut -f1)
  [ "$total" -le $((64 << 20)) ] || { log "gpu-carry/ is $total bytes, over 64 MiB"; return 1; }
}

# The CUDA libraries candle and NCCL link against, from PyTorch's wheels (the driver's libcuda is the system's).
torch_libs() {
  python3 - <<'EOF'
import glob, os, site
dirs = set()
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for pat in ("nvidia/*/lib", "nvidia/cu*/lib", "torch/lib"):
        for d in glob.glob(os.path.join(sp, pat)):
            dirs.add(d)
print(":".join(sorted(dirs)))
EOF
}

# Median step time over the steps after the first 3 of a run's metrics.jsonl, and the tokens a step.
median_step() {
  python3 - "$1" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
rows = [r for r in rows if "step_s" in r and r.get("rank", 0) == 0]
steady = [r["step_s"] for r in rows[3:]] or [r["step_s"] for r in rows]
print(json.dumps({"steps": len(rows), "step_s_median": statistics.median(steady), "samples": rows[-1]["samples"],
                  "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}))
EOF
}

gpt2_job() {  # $1 name, $2 precision, $3 gpus
  cat <<EOF
name = "$1"
[train]
dataset = "cicero"
global_batch = $BATCH
steps = $STEPS
seed = 0
optimizer = "adamw"
lr = 3e-4
precision = "$2"
bucket_mb = 100
eval_batches = 1
[train.model]
kind = "gpt"
layers = 12
heads = 12
width = 768
context = 1024
vocab = 50304
[resources]
gpus = $3
memory = "32GiB"
EOF
}

small_job() {  # $1 name, $2 gpus, [$3 checkpoint every, $4 resume_from, $5 gpu_memory]
  local resume="" limit=""
  [ -n "${4:-}" ] && resume="resume_from = \"$4\""
  [ -n "${5:-}" ] && limit="gpu_memory = \"$5\""
  cat <<EOF
name = "$1"
[train]
dataset = "cicero"
global_batch = 16
steps = 20
seed = 1
optimizer = "adamw"
lr = 1e-3
eval_batches = 1
[train.model]
kind = "gpt"
layers = 2
heads = 4
width = 128
context = 64
[checkpoint]
every = ${3:-20}
$resume
[resources]
gpus = $2
$limit
EOF
}

# Two checkpoints' tensors compared: {"tensors", "same_names", "max_abs_diff", "identical"}.
compare() {  # $1 $2 model.safetensors
  python3 - "$1" "$2" <<'EOF'
import json, struct, sys
def read(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n]); body = b[8 + n:]
    out = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        out[k] = struct.unpack("<%df" % ((e - s) // 4), body[s:e])
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
diff = max(abs(x - y) for k in a if k in b for x, y in zip(a[k], b[k]))
print(json.dumps({"tensors": len(a), "same_names": sorted(a) == sorted(b), "max_abs_diff": diff,
                  "identical": sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)}))
EOF
}

# A server on this machine (its GPUs found through NVML) runs a job held to 1 GiB of GPU memory that needs more,
# beside one with room; the first must be killed naming resources.gpu_memory, the second succeed.
gpu_memory_check() {  # $1 out, $2 work
  local out="$1" work="$2" port=7799 data="$2/server"
  "$work/shoal" server --listen "127.0.0.1:$port" --data-dir "$data" --task-user root > "$out/server.log" 2>&1 &
  local server=$!
  if ! python3 - "$port" <<'EOF'
import sys, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen("http://127.0.0.1:%s/healthz" % sys.argv[1], timeout=1); sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
EOF
  then
    put gpu_memory "\"failed: the server did not answer (server.log)\""
    kill "$server" 2>/dev/null
    return 1
  fi
  local cli=("$work/shoal" --addr "127.0.0.1:$port" --token "$(cat "$data/admin.token")")
  gpt2_job over-limit bf16 0.5 | sed 's/^steps = .*/steps = 400/' > "$work/over.toml"
  printf 'gpu_memory = "1GiB"\n' >> "$work/over.toml"
  small_job under-limit 0.5 20 "" 40GiB | sed 's/^steps = .*/steps = 200/' > "$work/under.toml"
  local over under
  over="$("${cli[@]}" submit --json "$work/over.toml" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
  under="$("${cli[@]}" submit --json "$work/under.toml" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
  local t0=$SECONDS so="" su=""
  while [ $((SECONDS - t0)) -lt 240 ]; do
    so="$("${cli[@]}" status "$over" --json 2>/dev/null)"
    su="$("${cli[@]}" status "$under" --json 2>/dev/null)"
    if python3 -c 'import json,sys; sys.exit(0 if all(json.loads(a).get("state") in ("succeeded","failed","cancelled") for a in sys.argv[1:]) else 1)' "$so" "$su" 2>/dev/null; then
      break
    fi
    sleep 2
  done
  "${cli[@]}" logs "$over" --rank 0 > "$out/over_limit.log" 2>&1
  put gpu_memory "$(python3 - "$so" "$su" <<'EOF'
import json, sys
def view(s):
    try:
        v = json.loads(s)
    except ValueError:
        return {"state": "unknown", "raw": s[-400:]}
    return {"state": v.get("state"), "reason": v.get("reason")}
o, u = view(sys.argv[1]), view(sys.argv[2])
print(json.dumps({"over_limit": o, "under_limit": u,
                  "enforced": o["state"] == "failed" and "resources.gpu_memory" in str(o.get("reason"))
                  and u["state"] == "succeeded"}))
EOF
)"
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
}

run() {
  local out="${1:-${OUT:-$here/gpu-check-out}}"
  mkdir -p "$out"
  local work
  work="$(mktemp -d)"
  for f in shoal shoal-train-tests; do
    xz -dc "$carry/$f.xz" > "$work/$f" && chmod +x "$work/$f"
  done
  export LD_LIBRARY_PATH="$(torch_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local shoal="$work/shoal" results="$out/gpu-check.json"
  echo '{}' > "$results"
  put() {  # $1 key, $2 JSON value
    python3 - "$results" "$1" "$2" <<'EOF'
import json, sys
p, k, v = sys.argv[1:]
d = json.load(open(p))
try:
    d[k] = json.loads(v)
except ValueError:
    d[k] = v
json.dump(d, open(p, "w"), indent=2)
EOF
  }
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  put device "\"$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)\""
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -lms 500 > "$out/nvml.csv" 2>&1 &
  local sampler=$!

  log "gpu_tests"
  if "$work/shoal-train-tests" --test-threads 1 --nocapture gpu_ > "$out/gpu_tests.log" 2>&1; then
    put gpu_tests "\"passed\""
  else
    put gpu_tests "\"failed: see gpu_tests.log\""
  fi
  put gpu_tests_skipped "$(grep -c "skipped: no CUDA device" "$out/gpu_tests.log")"

  log "gpt2_shoal"
  gpt2_job gpt2-shoal bf16 1 > "$work/gpt2.toml"
  if timeout 300 "$shoal" run -n 1 --output "$work/gpt2" "$work/gpt2.toml" > "$out/gpt2_shoal.log" 2>&1; then
    local m
    m="$(median_step "$work/gpt2/metrics.jsonl")"
    put gpt2_shoal "$(python3 - "$m" "$PEAK_TFLOPS" <<'EOF'
import json, sys
m = json.loads(sys.argv[1]); peak = float(sys.argv[2])
L, d, T, V = 12, 768, 1024, 50304
n_no_emb = L * (12 * d * d + 13 * d) + 2 * d + d * V + V
fpt = 6 * n_no_emb + 12 * L * T * d
tok = m["samples"] * T / m["step_s_median"]
m.update(tokens_per_s=tok, flops_per_token=fpt, mfu=tok * fpt / (peak * 1e12))
print(json.dumps(m))
EOF
)"
  else
    put gpt2_shoal "\"failed: see gpt2_shoal.log\""
  fi

  log "gpt2_torch"
  if timeout 300 python3 "$carry/gpt2_reference.py" --steps "$STEPS" --batch "$BATCH" --peak-tflops "$PEAK_TFLOPS" \
      > "$out/gpt2_torch.log" 2>&1; then
    put gpt2_torch "$(tail -1 "$out/gpt2_torch.log")"
  else
    put gpt2_torch "\"failed: see gpt2_torch.log\""
  fi

  log "ddp_shared"
  small_job ddp-one 1 > "$work/one.toml"
  small_job ddp-two 0.5 > "$work/two.toml"
  if timeout 240 "$shoal" run -n 1 --output "$work/one" "$work/one.toml" > "$out/ddp_one.log" 2>&1 &&
     timeout 240 "$shoal" run -n 2 --output "$work/two" "$work/two.toml" > "$out/ddp_two.log" 2>&1; then
    local d
    d="$(compare "$work/one/checkpoints/step-000020/model.safetensors" "$work/two/checkpoints/step-000020/model.safetensors")"
    put ddp_shared "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["within_1e-5"]=d["max_abs_diff"]<=1e-5; print(json.dumps(d))' "$d")"
  else
    put ddp_shared "\"failed: see ddp_one.log / ddp_two.log\""
  fi

  log "resume"
  small_job resume-a 1 10 > "$work/ra.toml"
  small_job resume-b 1 10 "$work/ra/checkpoints/step-000010" > "$work/rb.toml"
  small_job resume-c 0 10 "$work/ra/checkpoints/step-000010" > "$work/rc.toml"
  if timeout 120 "$shoal" run -n 1 --output "$work/ra" "$work/ra.toml" > "$out/resume_a.log" 2>&1 &&
     timeout 120 "$shoal" run -n 1 --output "$work/rb" "$work/rb.toml" > "$out/resume_b.log" 2>&1 &&
     timeout 120 "$shoal" run -n 1 --output "$work/rc" "$work/rc.toml" > "$out/resume_c.log" 2>&1; then
    put resume "{\"on_gpu\": $(compare "$work/ra/checkpoints/step-000020/model.safetensors" \
        "$work/rb/checkpoints/step-000020/model.safetensors"), \"on_cpu\": $(compare \
        "$work/ra/checkpoints/step-000020/model.safetensors" "$work/rc/checkpoints/step-000020/model.safetensors")}"
  else
    put resume "\"failed: see resume_a.log / resume_b.log / resume_c.log\""
  fi

  log "gpu_memory"
  gpu_memory_check "$out" "$work" || log "gpu_memory: see server.log"

  kill "$sampler" 2>/dev/null
  put nvml "$(python3 - "$out/nvml.csv" <<'EOF'
import sys
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l[:1].isdigit()]
util = [float(r[1].split()[0]) for r in rows if len(r) > 2 and r[1].split()[0].replace('.', '').isdigit()]
mem = [float(r[2].split()[0]) for r in rows if len(r) > 2 and r[2].split()[0].replace('.', '').isdigit()]
print('{"samples": %d, "util_max_pct": %s, "memory_max_mib": %s}' % (len(rows), max(util, default="null"), max(mem, default="null")))
EOF
)"
  cat "$results"
  rm -rf "$work"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [OUT]" >&2; exit 2 ;;
esac
