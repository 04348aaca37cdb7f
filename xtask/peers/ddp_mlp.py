"""PyTorch peer of `cargo xtask bench-ddp`: training-step throughput of the MLP
784-1024-1024-10 (ReLU), cross-entropy, SGD(lr, momentum 0.9), batch B per process.

One process (WORLD_SIZE unset or 1): a plain model, no process group.
N processes (started by the xtask with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
DistributedDataParallel over Gloo (init_method env://), default 25 MiB buckets.

The synthetic batch (784 features, 10 classes, random normal inputs, seeded by rank) is
generated once before the loop, so data costs nothing, as in our synthetic dataset where
it is a small share of the step. `--warmup` steps run first and are not timed; then
`--steps` timed steps. Reported, one JSON line on rank 0's stdout:
  samples_per_s         world * batch * steps / wall time of the timed steps (the
                        ranks start together after a barrier and end with one)
  median_step_s         median over steps of the slowest rank's step time
  samples_per_s_median  world * batch / median_step_s
Example: RANK=0 WORLD_SIZE=1 VENV/bin/python ddp_mlp.py --threads 2 --steps 60
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


def build_model():
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--batch", type=int, default=256, help="samples per process and step")
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--lr", type=float, default=0.01)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dist = None
    torch.manual_seed(1234)  # same initial parameters everywhere (DDP broadcasts anyway)
    model = build_model()
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)

    gen = torch.Generator().manual_seed(100 + rank)
    inputs = torch.randn(a.batch, 784, generator=gen)
    labels = torch.randint(0, 10, (a.batch,), generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    if dist is not None:
        dist.barrier()
    per_step = []
    start = time.perf_counter()
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        per_step.append(time.perf_counter() - t0)
    if dist is not None:
        dist.barrier()
    wall = time.perf_counter() - start

    if dist is not None:
        everyone = [None] * world
        dist.all_gather_object(everyone, per_step)
        per_step = [max(col) for col in zip(*everyone)]
        walls = [None] * world
        dist.all_gather_object(walls, wall)
        wall = max(walls)
    if rank == 0:
        med = statistics.median(per_step)
        print(json.dumps({
            "peer": "torch",
            "version": torch.__version__,
            "mode": "ddp-gloo" if world > 1 else "single",
            "procs": world,
            "threads": a.threads,
            "batch_per_proc": a.batch,
            "params": sum(t.numel() for t in model.parameters()),
            "warmup": a.warmup,
            "steps": a.steps,
            "wall_s": wall,
            "samples_per_s": world * a.batch * a.steps / wall,
            "median_step_s": med,
            "samples_per_s_median": world * a.batch / med,
            "final_loss": float(loss.detach()),
        }), flush=True)
    if dist is not None:
        # Without this barrier one rank sometimes tears Gloo down while the other still
        # talks to it, and aborts ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
