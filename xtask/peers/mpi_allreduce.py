"""Open MPI peer: MPI_Allreduce of float32 with SUM, via mpi4py + numpy.

Launched by `cargo xtask bench-vs-peers` under mpirun, e.g.
  mpirun -np 2 VENV/bin/python mpi_allreduce.py --transport shm --plan 1048576:10:100
Per size: `warmup` untimed calls, then `iters` timed calls, each
Barrier -> t0 -> Allreduce -> t1. An iteration's time is the max over ranks; the
reported time is the median over iterations. Rank r contributes r+1, so every element
of the result must be n(n+1)/2; "wrong" counts elements that are not, over all ranks.
"""
import time

import numpy as np
from mpi4py import MPI

from common import parse_args, report


def main():
    args = parse_args(__doc__.splitlines()[0])
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    expect = np.float32(n * (n + 1) // 2)
    version = MPI.Get_library_version().replace("\x00", "").split(",")[0].strip()
    for nbytes, warmup, iters in args.plan:
        count = nbytes // 4
        send = np.full(count, rank + 1, dtype=np.float32)
        recv = np.empty(count, dtype=np.float32)
        for _ in range(warmup):
            comm.Allreduce(send, recv, op=MPI.SUM)
        times = np.empty(iters, dtype=np.float64)
        wrong = 0
        for i in range(iters):
            recv.fill(0)
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(send, recv, op=MPI.SUM)
            t1 = time.perf_counter()
            times[i] = t1 - t0
            if i == 0 or i == iters - 1:
                wrong += int(np.count_nonzero(recv != expect))
        worst = np.empty_like(times)
        comm.Allreduce(times, worst, op=MPI.MAX)
        wrong_all = comm.allreduce(wrong, op=MPI.SUM)
        if rank == 0:
            report("ompi", n, args.transport, nbytes, warmup, worst.tolist(), wrong_all,
                   {"version": version})
        del send, recv


if __name__ == "__main__":
    main()
