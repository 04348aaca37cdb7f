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
#   nvml           nvidia-smi samples (utilisation, memory) taken every 500 ms through the runs
#   gpu_memory     the fractional-GPU memory limit (resources.gpu_memory) enforced: reported as not built yet
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

small_job() {  # $1 name, $2 gpus
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
every = 20
[resources]
gpus = $2
EOF
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
    put ddp_shared "$(python3 - "$work/one/checkpoints/step-000020/model.safetensors" \
        "$work/two/checkpoints/step-000020/model.safetensors" <<'EOF'
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
diff = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
print(json.dumps({"tensors": len(a), "same_names": sorted(a) == sorted(b), "max_abs_diff": diff,
                  "within_1e-5": diff <= 1e-5}))
EOF
)"
  else
    put ddp_shared "\"failed: see ddp_one.log / ddp_two.log\""
  fi

  kill "$sampler" 2>/dev/null
  put nvml "$(python3 - "$out/nvml.csv" <<'EOF'
import sys
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l[:1].isdigit()]
util = [float(r[1].split()[0]) for r in rows if len(r) > 2 and r[1].split()[0].replace('.', '').isdigit()]
mem = [float(r[2].split()[0]) for r in rows if len(r) > 2 and r[2].split()[0].replace('.', '').isdigit()]
print('{"samples": %d, "util_max_pct": %s, "memory_max_mib": %s}' % (len(rows), max(util, default="null"), max(mem, default="null")))
EOF
)"
  put gpu_memory "\"not checked: enforcement of resources.gpu_memory through NVML is not built yet\""
  cat "$results"
  rm -rf "$work"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [OUT]" >&2; exit 2 ;;
esac
