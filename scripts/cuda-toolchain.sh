#!/usr/bin/env bash
# A CUDA toolchain from PyPI for building Shoal with `--features cuda` (and `nccl`) on a machine without the
# CUDA toolkit: NVIDIA's compiler, headers and the libraries candle links against, as wheels, installed once
# into a cache outside the checkout and reused.
#
#   eval "$(scripts/cuda-toolchain.sh)"     installs (first time), then prints the exports to build with:
#   cargo build --release -p shoal --features cuda,nccl,nvml
#
# The cache is ${XDG_CACHE_HOME:-$HOME/.cache}/shoal/cuda-VERSION, keyed by the pinned CUDA version (13.0: what
# the device machines' driver and PyTorch are built for; PTX from a newer nvcc would not load on an older
# driver). The wheels lay out `nvidia/cu13/{bin,include,lib}`; CUDA_ROOT/CUDA_PATH point there. libcuda itself
# comes with the driver, not a wheel: for linking on a machine without a driver a stub `libcuda.so` (no code; the
# real one is loaded at run time) is made in the cache's `stubs/` from the driver API's symbol names, which the
# build only links against. Concurrent callers are serialised by flock. Everything but the exports goes to stderr.
#
# CUDA_COMPUTE_CAP defaults to 90 (H100/H200): candle's kernels are compiled for it, and without nvidia-smi
# candle-kernels' build cannot ask the device.
set -euo pipefail

readonly CUDA_VERSION=13.0
readonly PACKAGES=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14
  nvidia-curand==10.4.0.35
  nvidia-nccl-cu13==2.27.7
)
readonly CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/shoal"
readonly DIR="$CACHE/cuda-$CUDA_VERSION"
readonly ROOT="$DIR/nvidia/cu13"
readonly LOCK=/tmp/shoal-cuda-install.lock
# What a complete install has (an older cache without it is installed again).
readonly STAMP="$DIR/.complete-$(printf '%s\n' "${PACKAGES[@]}" | sha256sum | cut -c1-16)"

log() { printf 'cuda-toolchain: %s\n' "$*" >&2; }

install() {
  mkdir -p "$CACHE"
  local tmp="$DIR.tmp-$$"
  rm -rf "$tmp"
  log "installing CUDA $CUDA_VERSION wheels into $DIR (1.4 GB; once)"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$tmp" "${PACKAGES[@]}" >&2
  rm -rf "$DIR"
  mv "$tmp" "$DIR"
  touch "$STAMP"
}

# Links every versioned library (libfoo.so.13) under its plain name (libfoo.so), as the linker looks for it.
plain_names() {
  local lib
  for lib in "$ROOT"/lib/lib*.so.* "$DIR"/nvidia/nccl/lib/lib*.so.*; do
    [ -e "$lib" ] || continue
    local base="${lib%%.so.*}.so"
    [ -e "$base" ] || ln -s "$(basename "$lib")" "$base"
  done
}

# A libcuda.so that defines the driver API's names and nothing behind them: enough to link (candle links the
# driver), and safe to load: every call answers CUDA_ERROR_NO_DEVICE (100), and `shoal_cuda_stub` marks it, so
# a binary run against it (tests on a machine without a GPU: LD_LIBRARY_PATH=.../stubs) says there is no driver.
# On a machine with a GPU the driver's own libcuda.so.1 is what the loader finds.
stub_libcuda() {
  local stubs="$DIR/stubs"
  [ -e "$stubs/libcuda.so" ] && return 0
  mkdir -p "$stubs"
  local src="$stubs/cuda_stub.c"
  {
    echo 'int shoal_cuda_stub = 1;'
    grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$ROOT/include/cuda.h" | sort -u |
      awk '{ printf "int %s(void) { return 100; }\n", $1 }'
  } > "$src"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$src"
  ln -sf libcuda.so "$stubs/libcuda.so.1"
}

exec 9>"$LOCK"
flock 9
if [ ! -e "$STAMP" ]; then
  install
fi
plain_names
if [ -e "$ROOT/include/cuda.h" ]; then
  stub_libcuda
else
  log "no cuda.h under $ROOT/include: the runtime wheel's layout changed"
  exit 1
fi
flock -u 9

lib="$ROOT/lib:$DIR/stubs"
# NCCL's wheel keeps its library and header apart from the toolkit's.
nccl="$DIR/nvidia/nccl"
[ -d "$nccl/lib" ] && lib="$lib:$nccl/lib"
cat <<EOF
export CUDA_ROOT="$ROOT"
export CUDA_PATH="$ROOT"
export CUDA_HOME="$ROOT"
export PATH="$ROOT/bin:\$PATH"
export LIBRARY_PATH="$lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export CPATH="$ROOT/include${nccl:+:$nccl/include}\${CPATH:+:\$CPATH}"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
EOF
