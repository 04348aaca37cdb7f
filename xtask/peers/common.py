"""Shared pieces of the peer all-reduce benchmarks (imported by mpi_allreduce.py and
gloo_allreduce.py; see xtask/README.md). Standard library only."""
import argparse
import json
import statistics

MIB = 1 << 20


def default_counts(nbytes):
    """(warm-up, timed) iterations per message size; the xtask passes the same table
    explicitly through --plan, this is the fallback for running a script by hand."""
    if nbytes <= 64 << 10:
        return 20, 300
    if nbytes <= 1 * MIB:
        return 10, 100
    if nbytes <= 16 * MIB:
        return 3, 30
    if nbytes <= 64 * MIB:
        return 2, 12
    return 2, 7


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--sizes", default="1048576,16777216",
                   help="comma-separated message sizes in bytes (multiples of 4)")
    p.add_argument("--plan", default="",
                   help="bytes:warmup:iters,... (overrides --sizes and the default counts)")
    p.add_argument("--transport", default="tcp", help="label written into the output")
    a = p.parse_args()
    plan = []
    if a.plan:
        for item in a.plan.split(","):
            b, w, k = (int(x) for x in item.split(":"))
            plan.append((b, w, k))
    else:
        for s in a.sizes.split(","):
            b = int(s)
            plan.append((b,) + default_counts(b))
    for b, _, k in plan:
        if b <= 0 or b % 4:
            p.error(f"size {b} is not a positive multiple of 4 bytes")
        if k <= 0:
            p.error("iterations must be positive")
    a.plan = plan
    return a


def report(peer, ranks, transport, nbytes, warmup, per_iter_max, wrong, extra=None):
    """One JSON line: median over iterations of the per-iteration max over ranks."""
    t = statistics.median(per_iter_max)
    algbw = nbytes / t / 1e9
    row = {
        "peer": peer,
        "ranks": ranks,
        "transport": transport,
        "bytes": nbytes,
        "time_s": t,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (ranks - 1) / ranks,
        "wrong": int(wrong),
        "warmup": warmup,
        "iters": len(per_iter_max),
    }
    if extra:
        row.update(extra)
    print(json.dumps(row), flush=True)
