#!/usr/bin/env bash
# All-reduce across two real hosts on this machine: two network namespaces, each with its own address and
# hostname, joined through a bridge by links shaped to RATE (tc tbf, both directions). Runs `shoal bench allreduce`
# with 2 ranks per host twice in one go — hierarchical (shared memory inside a host, TCP across) and a flat ring
# over the same 4 ranks — and prints each size's bus bandwidth, the ratio hier/ring, and hier's share of the link.
#
#   scripts/bench-hosts.sh [SHOAL_BINARY] [RATE_MBIT] [SIZES]
#   defaults: target/release/shoal, 1000 (1 Gbit/s), 16MiB,64MiB
#
# With COMPRESS=1 it runs `shoal bench compress` instead, one rank a host (PER_HOST to change it), ITERS timed
# iterations (default 5) after one warm-up, and prints node 0's table: each gradient codec's all-reduce over the
# shaped link against a plain one.
#
# Needs root, iproute2 and util-linux (`unshare`). Everything it makes is removed when it ends.
set -euo pipefail

SHOAL=$(realpath "${1:-target/release/shoal}")
RATE_MBIT=${2:-1000}
SIZES=${3:-16MiB,64MiB}
TAG=$$
NET=10.217.$((TAG % 200 + 20))
PORT=29433
export SHOAL_JOB_SECRET=bench-hosts-secret-$TAG-0123456789

[ -x "$SHOAL" ] || { echo "no shoal binary at $SHOAL (cargo build --release -p shoal)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }

HOSTS=b$((TAG % 100000))
. "$(dirname "$0")/hosts.sh"
trap 'hosts_down "$HOSTS" 2' EXIT
hosts_up "$HOSTS" "$NET" "$RATE_MBIT" 2

# One run of the benchmark on both hosts; prints node 0's JSON lines.
bench() {
    local algo=$1 out
    out=$(mktemp)
    for i in 1 0; do
        on_host "$HOSTS" "$i" "bench-host$i" "$SHOAL" bench allreduce --nnodes 2 --node-rank "$i" --rdzv "$NET.1:$PORT" \
            --algo "$algo" --ranks "${PER_HOST:-2}" --sizes "$SIZES" --iters 10 --warmup 3 --timeout 120s --json \
            >"$out.$i" 2>"$out.$i.err" &
    done
    wait
    if ! grep -q busbw "$out.0"; then
        echo "the $algo run failed:" >&2
        cat "$out.0.err" "$out.1.err" >&2
        exit 1
    fi
    cat "$out.0"
    rm -f "$out".*
}

if [ -n "${COMPRESS:-}" ]; then
    out=$(mktemp)
    for i in 1 0; do
        on_host "$HOSTS" "$i" "bench-host$i" "$SHOAL" bench compress --nnodes 2 --node-rank "$i" --rdzv "$NET.1:$PORT" \
            --ranks "${PER_HOST:-1}" --sizes "$SIZES" --iters "${ITERS:-5}" --warmup 1 --timeout 120s \
            >"$out.$i" 2>"$out.$i.err" &
    done
    wait
    if ! grep -q speedup "$out.0"; then
        echo "the compression benchmark failed:" >&2
        cat "$out.0.err" "$out.1.err" >&2
        exit 1
    fi
    echo "# link shaped to $RATE_MBIT Mbit/s each way"
    cat "$out.0"
    rm -f "$out" "$out".*
    exit 0
fi

HIER=$(bench hier)
RING=$(bench ring)
python3 - "$RATE_MBIT" "$HIER" "$RING" <<'PY'
import json, sys
rate = float(sys.argv[1]) * 1e6 / 8  # bytes/s of the shaped link
hier = {r["bytes"]: r for r in map(json.loads, sys.argv[2].split("\n")) if r}
ring = {r["bytes"]: r for r in map(json.loads, sys.argv[3].split("\n")) if r}
print(f"# all-reduce, 2 hosts x 2 ranks, link shaped to {rate * 8 / 1e6:.0f} Mbit/s each way")
print(f"# {'bytes':>10} {'hier busbw':>12} {'ring busbw':>12} {'hier/ring':>10} {'hier/link':>10}")
for b in sorted(hier):
    h, r = hier[b]["busbw_GBps"] * 1e9, ring[b]["busbw_GBps"] * 1e9
    # Hierarchical sends each host's reduced buffer across the link: 2(h-1)/h of it per direction with h = 2
    # hosts, i.e. the buffer itself; its bus bandwidth over 4 ranks counts 2(n-1)/n = 1.5 of it, so the link's
    # share is the algorithm bandwidth (bytes / time) against the link's rate.
    link_share = hier[b]["algbw_GBps"] * 1e9 / rate
    print(f"  {b:>10} {h / 1e6:>9.1f} MB/s {r / 1e6:>9.1f} MB/s {h / r:>9.2f}x {link_share:>9.0%}")
PY
