"""Benchmark the small-M matmul (``small_m_matmul``) of the decode projections on one GPU: our
Pallas kernel against XLA's ``jnp.dot`` (the reference, ``small_m_matmul_ref``).

Nemotron-Nano-9B-v2 shapes, bf16 x and W, float32 accumulation, bf16 out: Mamba in_proj
[4480 -> 22656], out_proj [10240 -> 4480], MLP up [4480 -> 15680] and down [15680 -> 4480]
at M = 1, 4, 16, and the lm_head [4480 -> 131072] at M = 1. Each is checked against XLA's
dot on the device first. A program makes ``calls`` back-to-back matmuls of the same x with
as many different weight buffers (at least ``--min-program-bytes`` of weights, so no call
finds its W in the 60 MB L2 and no two calls merge); a call's time is the program's over
``calls`` (launch gaps included, as in a decode step). Roofline: W, x and y moved once.

    python scripts/bench_matmul.py [--matmul-rows 1,4,16] [--sweep] [--reps 30]
    python scripts/bench_matmul.py --smoke      # CPU: interpret mode, toy shapes

Setup and the timing method: see ``bench_common.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels import small_m_matmul_ref
from jaxmamba.kernels.matmul.gpu import GpuBlockSizes, small_m_matmul_gpu

PROJECTIONS = {  # name: (K, N)
    "mamba in_proj": (4480, 22656),
    "mamba out_proj": (10240, 4480),
    "mlp up": (4480, 15680),
    "mlp down": (15680, 4480),
}
LM_HEAD = ("lm_head", 4480, 131072)
# Sweep: changes to the plain ``GpuBlockSizes()`` (not the tuned ones); ``single_row_fma``
# ones at M = 1 only (with more rows the kernel takes the dot path again).
SWEEP = [
    dict(block_n=64),
    dict(block_n=256, num_warps=8),
    dict(block_k=128),
    dict(block_k=128, num_stages=3),
    dict(block_k=32, num_stages=6),
    dict(num_warps=8),
    dict(num_stages=3),
    dict(num_stages=6),
    dict(split_k=1),
    dict(min_programs=528),
    dict(block_n=64, min_programs=528),
    dict(block_n=256, block_k=32, num_warps=8, num_stages=5),
    dict(single_row_fma=True),
    dict(single_row_fma=True, block_k=32, num_stages=3),
    dict(single_row_fma=True, block_n=256, block_k=32, num_warps=8),
    dict(block_n=32),
    dict(block_n=64, num_stages=3),
    dict(block_n=64, num_stages=6),
    dict(block_n=64, block_k=128),
    dict(block_n=64, split_k=1),
    dict(split_k=1, num_stages=3),
]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matmul-rows", default="1,4,16", help="matmul: rows of x (M)")
    parser.add_argument(
        "--min-program-bytes", type=float, default=1e9, help="matmul: weights a timed program"
    )


def shapes(args) -> list[tuple[str, int, int, int]]:
    """(name, K, N, M) of every case."""
    if args.smoke:
        return [("toy", 200, 333, m) for m in (1, 3)] + [("toy wide", 96, 1000, 16)]
    rows = [int(m) for m in args.matmul_rows.split(",")]
    out = [(name, k, n, m) for m in rows for name, (k, n) in PROJECTIONS.items()]
    return out + ([(*LM_HEAD, 1)] if 1 in rows else [])


def bench_case(name: str, k: int, n: int, m: int, args, table: bc.Table, rng) -> None:
    min_bytes = 0 if args.smoke else args.min_program_bytes
    calls = max(4, min(16, math.ceil(min_bytes / (2 * k * n))))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    keys = jax.random.split(jax.random.key(k * n + m), calls)
    weights = [jax.random.normal(key, (k, n), jnp.bfloat16) * k**-0.5 for key in keys]
    want = small_m_matmul_ref(x, weights[0]).astype(jnp.float32)
    label = f"matmul {name} M={m}"

    def program(matmul):
        return jax.jit(lambda x, weights: [matmul(x, w) for w in weights])

    def timed(fn):
        return bc.median_time(lambda: fn(x, weights), args.reps) / calls

    def measure(what, matmul):
        fn = program(matmul)
        bc.check(f"{label} {what}", fn(x, weights)[0].astype(jnp.float32), want, 2e-2)
        return timed(fn)

    def kernel(sizes):
        return functools.partial(small_m_matmul_gpu, interpret=args.smoke, block_sizes=sizes)

    row = bc.Row(
        label,
        ours=measure("ours", kernel(None)),  # the kernel's own sizes for this shape (TUNED)
        xla=timed(program(small_m_matmul_ref)),
        roof=bc.roofline(2 * (k * n + m * k + m * n)),
    )
    variants = [v for v in SWEEP if m == 1 or not v.get("single_row_fma")] if args.sweep else []
    names = [",".join(f"{f}={v}" for f, v in changes.items()) for changes in variants]
    plain = GpuBlockSizes()  # the sweep's variants change these, not the tuned sizes
    measures = {
        what: functools.partial(measure, what, kernel(dataclasses.replace(plain, **changes)))
        for what, changes in zip(names, variants, strict=True)
    }
    bc.time_variants(row, measures)
    table.add(row)


def run(args, table: bc.Table) -> None:
    rng = np.random.default_rng(0)
    for name, k, n, m in shapes(args):
        bench_case(name, k, n, m, args, table, rng)


CASES = {"matmul": run}

if __name__ == "__main__":
    bc.main_for(__doc__, CASES, add_args)
