#!/usr/bin/env python3
"""Ray actor parameter-server baseline, for comparison with Shoal's own parameter server.

Follows the pattern of Ray's parameter-server example: S server actors each hold a contiguous float32 slice of the
N parameters and apply plain SGD (p -= lr * g) when a gradient is pushed with `apply_gradients.remote(g)`; W worker
actors each loop for T seconds doing one round at a time: push a gradient to every server, then pull every server's
parameters with `get_weights.remote()` and ray.get them all. The gradients are random arrays made once and pushed
unchanged every round, so what is measured is the system (serialisation, object store, scheduling), not compute.

    python3 scripts/ps-ray.py --params N --servers S --workers W --seconds T [--json]
    (defaults N=10000000, S=2, W=2, T=10; ray must be importable by the python it runs under:
     PY=$(scripts/setup-ray.sh | tail -n1) && "$PY" scripts/ps-ray.py --json)

Prints the payload rate, (bytes pushed + bytes pulled by all workers) / elapsed seconds in GB/s (1 GB = 1e9 bytes),
and the rounds per second of all workers together; with --json, exactly one JSON line on stdout.
"""
import argparse
import json
import os
import sys
import time

try:
    import ray  # first, so that a python without either names ray
    import numpy as np
except ImportError as e:
    sys.exit(
        f"ps-ray.py: {e.name or 'ray'} is not importable from {sys.executable} ({e}).\n"
        "scripts/ps-ray.py expects ray (and numpy) in the python it runs under: either `pip install ray numpy` "
        "there, or make the pinned venv and run under it:\n"
        '  PY=$(scripts/setup-ray.sh | tail -n1) && "$PY" scripts/ps-ray.py'
    )

WARMUP_S = 1.0  # rounds run but not counted before the timed window
LR = 0.01


def split(n, parts):
    """Sizes of `parts` contiguous slices of n items, as even as possible (the first n % parts get one more)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# Actors use Ray's defaults: one CPU to be placed, none held while they run, so S + W actors fit on any core count.
@ray.remote
class ParamServer:
    """Holds one contiguous slice of the parameters."""

    def __init__(self, size, lr):
        self.params = np.zeros(size, dtype=np.float32)
        self.lr = np.float32(lr)

    def apply_gradients(self, grad):
        # grad arrives as a read-only view into the object store; plain SGD in place.
        self.params -= self.lr * grad

    def get_weights(self):
        return self.params


@ray.remote
class Worker:
    """Pushes a fixed gradient to every server, then pulls every server's slice, round after round."""

    def __init__(self, servers, sizes, seed):
        self.servers = servers
        rng = np.random.default_rng(seed)
        self.grads = [rng.standard_normal(n, dtype=np.float32) for n in sizes]

    def ready(self):
        return True

    def one_round(self):
        # A server actor runs one call at a time in submission order, so each pull sees this round's push.
        pushed = [ps.apply_gradients.remote(g) for ps, g in zip(self.servers, self.grads)]
        pulled = [ps.get_weights.remote() for ps in self.servers]
        ray.get(pushed)
        weights = ray.get(pulled)
        assert sum(w.size for w in weights) == sum(g.size for g in self.grads)

    def run(self, start_at, seconds):
        """Rounds until the wall-clock time start_at (warm-up), then count rounds for `seconds` more.
        Returns (rounds, time the timed window began, time the last counted round ended)."""
        while time.time() < start_at:
            self.one_round()
        begin = time.time()
        deadline = start_at + seconds
        rounds = 0
        while time.time() < deadline:
            self.one_round()
            rounds += 1
        return rounds, begin, time.time()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=10_000_000, help="float32 parameters in all (default 10000000)")
    ap.add_argument("--servers", type=int, default=2, help="parameter-server actors (default 2)")
    ap.add_argument("--workers", type=int, default=2, help="worker actors (default 2)")
    ap.add_argument("--seconds", type=float, default=10.0, help="timed window in seconds (default 10)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON line")
    a = ap.parse_args()
    if a.servers < 1 or a.workers < 1 or a.params < a.servers or a.seconds <= 0:
        ap.error("need --servers >= 1, --workers >= 1, --params >= --servers and --seconds > 0")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        sizes = split(a.params, a.servers)
        servers = [ParamServer.remote(n, LR) for n in sizes]
        workers = [Worker.remote(servers, sizes, seed) for seed in range(a.workers)]
        ray.get([w.ready.remote() for w in workers])  # all actors up and gradients made before the clock starts

        # Every worker warms up until the same instant, then counts rounds for the same window.
        start_at = time.time() + WARMUP_S
        results = ray.get([w.run.remote(start_at, a.seconds) for w in workers])
    finally:
        ray.shutdown()

    rounds = sum(r for r, _, _ in results)
    elapsed = max(end for _, _, end in results) - min(begin for _, begin, _ in results)
    payload = rounds * a.params * 4 * 2  # each round pushes and pulls every parameter once, 4 bytes each
    gb_s = payload / elapsed / 1e9
    rounds_s = rounds / elapsed
    if a.json:
        print(json.dumps({
            "system": "ray", "params": a.params, "servers": a.servers, "workers": a.workers,
            "seconds": round(elapsed, 3), "rounds": rounds, "payload_gb_s": round(gb_s, 4),
            "rounds_per_s": round(rounds_s, 3), "ray_version": ray.__version__,
        }))
    else:
        print(f"ray {ray.__version__}: {a.params} params over {a.servers} server(s), {a.workers} worker(s): "
              f"{rounds} push+pull rounds in {elapsed:.2f} s = {rounds_s:.2f} rounds/s, "
              f"payload {gb_s:.3f} GB/s (pushed + pulled)")


if __name__ == "__main__":
    main()
