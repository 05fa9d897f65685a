"""Benchmark the Mamba2 mixer's gated group RMSNorm (``gated_group_rmsnorm``) on one GPU: our
Pallas kernel against XLA's fusion of the same math (the reference, ``impl="ref"``).

Nemotron-Nano-9B-v2 shapes: y bf16[T, 10240], z the first 10240 columns of the in_proj
output bf16[T, 22656] (read in place by the kernel; XLA fuses the slice), 8 groups of 1280,
eps 1e-5, a float32 scale, bf16 out; T = 1, 32, 256, 2048 and 8 x 2048 tokens. Each is
checked against the reference on the device first. A program makes ``calls`` back-to-back
norms on as many input buffers (at least ``--min-program-bytes`` moved, so large calls find
nothing of theirs in the 60 MB L2); a call's time is the program's over ``calls``. Bytes:
y and z read once and the output written once (3 x T x 10240 x 2); GB/s and the fraction of
the H200's 4.8 TB/s are printed per case, with how many kernels XLA's program runs a call.
``--sweep`` also times the block-size variants of ``SWEEP`` and prints the best per case.

    python scripts/bench_gated_norm.py [--norm-tokens 1,32,256,2048,16384] [--sweep] [--reps 30]
    python scripts/bench_gated_norm.py --smoke      # CPU: interpret mode, toy shapes

Setup and the timing method: see ``bench_common.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re

import bench_common as bc
import jax
import jax.numpy as jnp

from jaxmamba.kernels.gated_norm import GpuBlockSizes, gated_group_rmsnorm, gated_group_rmsnorm_ref
from jaxmamba.kernels.gated_norm.gpu import gated_group_rmsnorm_gpu

PEAK_HBM = 4.8e12  # the H200's datasheet bandwidth
WIDTH, IN_PROJ, GROUPS, EPS = 10240, 22656, 8, 1e-5  # 9B: d_inner, in_proj width, n_groups
SMOKE = (640, 1000, 8)  # W (8 groups of 80), z_source width, groups
# Sweep: changes to ``GpuBlockSizes()``. ``elements`` sets the rows a program (at 1280
# columns a group: 2048 -> 1 row, 4096 -> 2, 8192 -> 4, 16384 -> 8); small T may take fewer.
SWEEP = [
    dict(elements=2048),
    dict(elements=2048, num_warps=2),
    dict(elements=2048, num_warps=8),
    dict(elements=4096),
    dict(elements=4096, num_warps=2),
    dict(elements=4096, num_warps=8),
    dict(num_warps=2),
    dict(num_warps=8),
    dict(elements=16384),
    dict(elements=16384, num_warps=8),
    dict(piece=256),
    dict(piece=256, elements=4096),
    dict(piece=512),
    dict(min_programs=132),
    dict(min_programs=528),
    dict(min_programs=1),
]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--norm-tokens", default="1,32,256,2048,16384", help="norm: rows T")
    parser.add_argument(
        "--norm-min-program-bytes", type=float, default=1e9, help="norm: bytes a timed program"
    )


def xla_kernels_a_call(fn, *args, calls: int) -> float:
    """Fusions and custom calls in ``fn``'s optimized program (wherever XLA put them: the entry
    computation or a command buffer), per call: 2 is a convert fusion and the norm's."""
    text = fn.lower(*args).compile().as_text()
    return len(re.findall(r" (?:fusion|custom-call)\(", text)) / calls


def bench_case(num_rows: int, args, table: bc.Table, results: list) -> None:
    width, z_width, groups = SMOKE if args.smoke else (WIDTH, IN_PROJ, GROUPS)
    moved = 3 * num_rows * width * 2  # y and z read, the output written (bf16)
    min_bytes = 0 if args.smoke else args.norm_min_program_bytes
    calls = max(2, min(16, math.ceil(min_bytes / moved)))
    keys = jax.random.split(jax.random.key(num_rows), 2 * calls + 1)
    ys = [jax.random.normal(k, (num_rows, width), jnp.bfloat16) for k in keys[:calls]]
    zs = [jax.random.normal(k, (num_rows, z_width), jnp.bfloat16) for k in keys[calls:-1]]
    scale = 1 + 0.1 * jax.random.normal(keys[-1], (width,), jnp.float32)
    kw = dict(num_groups=groups, eps=EPS, z_offset=0)
    want = gated_group_rmsnorm_ref(ys[0], zs[0], scale, out_dtype=jnp.float32, **kw)
    label = f"gated norm T={num_rows}"

    def program(norm):
        def calls_of(ys, zs, scale):
            return [norm(y, z, scale, **kw) for y, z in zip(ys, zs, strict=True)]

        return jax.jit(calls_of)

    def timed(fn):
        return bc.median_time(lambda: fn(ys, zs, scale), args.reps) / calls

    def measure(what, norm):
        fn = program(norm)
        bc.check(f"{label} {what}", fn(ys, zs, scale)[0].astype(jnp.float32), want, 1e-2)
        return timed(fn)

    def kernel(sizes):
        return functools.partial(gated_group_rmsnorm_gpu, interpret=args.smoke, block_sizes=sizes)

    ours = functools.partial(gated_group_rmsnorm, impl=bc.kernel_impl(args))
    xla_fn = program(gated_group_rmsnorm_ref)
    print(f"  {label}: XLA runs {xla_kernels_a_call(xla_fn, ys, zs, scale, calls=calls):.0f} "
          "kernel(s) a call")  # fmt: skip
    row = bc.Row(label, ours=measure("ours", ours), xla=timed(xla_fn), roof=bc.roofline(moved))
    variants = SWEEP if args.sweep else []
    names = [",".join(f"{f}={v}" for f, v in changes.items()) for changes in variants]
    measures = {
        name: functools.partial(measure, name, kernel(dataclasses.replace(GpuBlockSizes(), **c)))
        for name, c in zip(names, variants, strict=True)
    }
    bc.time_variants(row, measures)
    table.add(row)
    results.append((num_rows, moved, row))


def print_bandwidth(results: list) -> None:
    """Per case: µs, GB/s and the fraction of 4.8 TB/s of ours, XLA's and the best variant."""
    print("\n| T | bytes (MB) | ours (us) | ours GB/s | ours / 4.8 TB/s | XLA (us) | XLA GB/s "
          "| XLA / 4.8 TB/s | XLA/ours | best variant (us) |")  # fmt: skip
    print("|" + "---|" * 10)
    for num_rows, moved, row in results:
        best = min(row.variants.items(), key=lambda kv: kv[1], default=None)
        best_cell = f"{best[0]}: {best[1] * 1e6:.1f}" if best else "-"
        ours_bw, xla_bw = moved / row.ours, moved / row.xla
        print(
            f"| {num_rows} | {moved / 1e6:.1f} | {row.ours * 1e6:.1f} | {ours_bw / 1e9:.0f} | "
            f"{ours_bw / PEAK_HBM:.0%} | {row.xla * 1e6:.1f} | {xla_bw / 1e9:.0f} | "
            f"{xla_bw / PEAK_HBM:.0%} | {row.xla / row.ours:.2f} | {best_cell} |"
        )


def run(args, table: bc.Table) -> None:
    tokens = [1, 37] if args.smoke else [int(t) for t in args.norm_tokens.split(",")]
    results: list = []
    for num_rows in tokens:
        bench_case(num_rows, args, table, results)
    print_bandwidth(results)


CASES = {"gated_norm": run}

if __name__ == "__main__":
    bc.main_for(__doc__, CASES, add_args)
