"""A data-parallel JAX program that Shoal runs as a job's own program (`train.command`).

Every worker runs this file. It finds the others from what Shoal sets (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID), reads a CSV table (numeric feature columns and an integer label column), and trains an MLP with
AdamW: each step every process computes the gradient of its share of one global batch, the gradients are summed
over the processes, and every process applies the same update. Each step it prints a JSON line with an integer
`step` (Shoal's metrics: the job's page, /metrics, diagnosis), and at the end the held-out loss and accuracy.

    python3 jax_mlp.py --data table.csv --features f0,f1,f2 --label label --classes 4 --steps 200
"""

import argparse
import json
import os
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    os.environ["JAX_COORDINATOR_ADDRESS"],
    int(os.environ["JAX_NUM_PROCESSES"]),
    int(os.environ["JAX_PROCESS_ID"]),
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a CSV file with a header row")
    p.add_argument("--features", required=True, help="comma-separated feature columns")
    p.add_argument("--label", required=True, help="the integer label column")
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eval-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load(path, features, label):
    with open(path) as f:
        header = f.readline().strip().split(",")
    missing = [c for c in features + [label] if c not in header]
    if missing:
        sys.exit(f"{path}: no column {missing[0]!r} (columns: {', '.join(header)})")
    cols = [header.index(c) for c in features] + [header.index(label)]
    table = np.loadtxt(path, delimiter=",", skiprows=1, usecols=cols, dtype=np.float64, ndmin=2)
    return table[:, :-1].astype(np.float32), table[:, -1].astype(np.int32)


def init(key, sizes):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        bound = 1.0 / np.sqrt(fan_in)
        w = jax.random.uniform(sub, (fan_in, fan_out), minval=-bound, maxval=bound)
        params.append((w, jnp.zeros(fan_out)))
    return params


def forward(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def summed_loss(params, x, y):
    """Cross-entropy summed over the rows (the global batch's mean is the sum over every process / its size)."""
    logp = jax.nn.log_softmax(forward(params, x))
    return -jnp.take_along_axis(logp, y[:, None], axis=1).sum()


def main():
    a = parse()
    rank, world = jax.process_index(), jax.process_count()
    x, y = load(a.data, a.features.split(","), a.label)
    held = max(1, int(len(x) * a.eval_fraction))
    (x_train, y_train), (x_eval, y_eval) = (x[:-held], y[:-held]), (x[-held:], y[-held:])
    params = init(jax.random.PRNGKey(a.seed), [x.shape[1], a.hidden, a.classes])
    flat, unravel = ravel_pytree(params)
    m, v = jnp.zeros_like(flat), jnp.zeros_like(flat)
    grad = jax.jit(jax.value_and_grad(lambda f, xb, yb: summed_loss(unravel(f), xb, yb)))
    order = np.random.default_rng(a.seed)
    perm, at = order.permutation(len(x_train)), 0
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        if at + a.global_batch > len(perm):
            perm, at = order.permutation(len(x_train)), 0
        batch = perm[at : at + a.global_batch]
        at += a.global_batch
        # This process's contiguous share of the global batch.
        lo, hi = rank * len(batch) // world, (rank + 1) * len(batch) // world
        mine = batch[lo:hi]
        loss, g = grad(flat, x_train[mine], y_train[mine])
        both = multihost_utils.process_allgather(jnp.concatenate([g, jnp.array([loss])]))
        total = both.sum(axis=0) / len(batch)
        g, loss = total[:-1], float(total[-1])
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**step), v / (1 - b2**step)
        flat = flat * (1 - a.lr * wd) - a.lr * mhat / (jnp.sqrt(vhat) + eps)
        line = {
            "step": step,
            "loss": loss,
            "samples": len(batch),
            "step_s": time.perf_counter() - t0,
            "param_norm": float(jnp.linalg.norm(flat)),
        }
        print(json.dumps(line), flush=True)
    logits = forward(unravel(flat), x_eval)
    eval_loss = float(summed_loss(unravel(flat), x_eval, y_eval)) / len(x_eval)
    accuracy = float((jnp.argmax(logits, axis=1) == y_eval).mean())
    print(json.dumps({"step": a.steps, "eval_loss": eval_loss, "eval_accuracy": accuracy}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
