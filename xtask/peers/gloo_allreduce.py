"""Gloo peer: torch.distributed.all_reduce (backend gloo, float32 SUM, in place).

Started as N processes by `cargo xtask bench-vs-peers`, each with MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE in its environment (init_method env://), e.g.
  RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 VENV/bin/python gloo_allreduce.py --plan 1048576:10:100
One torch thread per process. Per size: `warmup` untimed calls, then `iters` timed
calls; the buffer is refilled with rank+1 before each (untimed), then
barrier -> t0 -> all_reduce -> t1. An iteration's time is the max over ranks; the
reported time is the median over iterations. Every element must be n(n+1)/2.
"""
import time

import torch
import torch.distributed as dist

from common import parse_args, report


def main():
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, n = dist.get_rank(), dist.get_world_size()
    expect = float(n * (n + 1) // 2)
    for nbytes, warmup, iters in args.plan:
        buf = torch.empty(nbytes // 4, dtype=torch.float32)
        for _ in range(warmup):
            buf.fill_(rank + 1)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        times = torch.empty(iters, dtype=torch.float64)
        wrong = 0
        for i in range(iters):
            buf.fill_(rank + 1)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            t1 = time.perf_counter()
            times[i] = t1 - t0
            if i == 0 or i == iters - 1:
                wrong += int((buf != expect).sum().item())
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        wrong_t = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(wrong_t, op=dist.ReduceOp.SUM)
        if rank == 0:
            report("gloo", n, "tcp", nbytes, warmup, times.tolist(), wrong_t.item(),
                   {"version": torch.__version__})
        del buf
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
