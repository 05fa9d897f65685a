"""Decode projections on one GPU: the small-M matmul Pallas kernel vs XLA's ``jnp.dot``.

Nemotron-Nano-9B-v2 shapes, bf16 x and W, float32 accumulation, bf16 out: Mamba in_proj
[4480 -> 22656], out_proj [10240 -> 4480], MLP up [4480 -> 15680] and down [15680 -> 4480]
at M = 1, 4, 16, and the lm_head [4480 -> 131072] at M = 1.

    python3 scripts/bench_gemv.py [--sweep] [--json PATH]
    python3 scripts/bench_gemv.py --smoke      # CPU, interpret mode, toy shapes

Every implementation is first checked against XLA's dot on the device. Timing: one jitted
program makes ``calls`` back-to-back matmuls of the same x with as many different weight
buffers (at least ~1 GB of weights per program, so no call finds its W in the 60 MB L2 and
no two calls can be merged); time per call = the program's median wall time / ``calls``
(it includes the launch gaps, as a decode step would). "% HBM" = (W + x + y bytes) / time
against 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernels.matmul import small_m_matmul_ref  # noqa: E402
from kernels.matmul_pallas_gpu import SWEEP, BlockSizes, small_m_matmul_gpu  # noqa: E402

HBM = 4.3e12
PROJECTIONS = {  # name: (K, N)
    "mamba in_proj": (4480, 22656),
    "mamba out_proj": (10240, 4480),
    "mlp up": (4480, 15680),
    "mlp down": (15680, 4480),
}
LM_HEAD = ("lm_head", 4480, 131072)


def cases(smoke: bool, rows: list[int]):
    if smoke:
        return [("toy", 200, 333, m) for m in (1, 3)] + [("toy wide", 96, 1000, 16)]
    out = [(name, k, n, m) for m in rows for name, (k, n) in PROJECTIONS.items()]
    return out + ([(*LM_HEAD, 1)] if 1 in rows else [])


def nbytes(k: int, n: int, m: int) -> int:
    return 2 * (k * n + m * k + m * n)


def make_program(matmul, calls: int):
    def program(x, weights):
        return [matmul(x, w) for w in weights[:calls]]

    return jax.jit(program)


def time_program(fn, x, weights, calls, reps):
    jax.block_until_ready(fn(x, weights))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, weights))
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def variant_name(bs: BlockSizes) -> str:
    default = BlockSizes()
    diff = [
        f"{f.name}={getattr(bs, f.name)}"
        for f in dataclasses.fields(bs)
        if getattr(bs, f.name) != getattr(default, f.name)
    ]
    return ",".join(diff) or "default"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", action="store_true", help="also time every BlockSizes in SWEEP")
    p.add_argument("--smoke", action="store_true", help="CPU interpret mode at toy shapes")
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16], help="rows of x to time")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--min-program-bytes", type=float, default=1e9)
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args()
    interpret = args.smoke
    reps = 2 if args.smoke else args.reps
    min_bytes = 0 if args.smoke else args.min_program_bytes
    variants = list(SWEEP) if args.sweep else [BlockSizes()]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, interpret={interpret}")

    rng = np.random.default_rng(0)
    results, failures = [], 0
    key = jax.random.key(0)
    for name, k, n, m in cases(args.smoke, args.m):
        calls = max(4, min(16, math.ceil(min_bytes / (2 * k * n))))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        keys = jax.random.split(jax.random.fold_in(key, k * n + m), calls)
        weights = [jax.random.normal(kw, (k, n), jnp.bfloat16) * k**-0.5 for kw in keys]
        ref = np.asarray(small_m_matmul_ref(x, weights[0]), np.float32)
        scale = float(np.abs(ref).max())
        impls = [("xla dot", small_m_matmul_ref)]
        impls += [
            (
                variant_name(bs),
                lambda x, w, bs=bs: small_m_matmul_gpu(x, w, interpret=interpret, block_sizes=bs),
            )
            for bs in variants
            if m == 1 or not bs.single_row_fma  # with more rows it is the dot path again
        ]
        xla_s = None
        for label, matmul in impls:
            program = make_program(matmul, calls)
            start = time.perf_counter()
            got = np.asarray(program(x, weights)[0], np.float32)  # compiles it, too
            compile_s = time.perf_counter() - start
            err = float(np.abs(got - ref).max()) / scale
            ok = err <= 2e-2  # bf16 output rounding (2^-8) and f32 summation order
            seconds = time_program(program, x, weights, calls, reps)
            xla_s = seconds if xla_s is None else xla_s
            pct = 100 * nbytes(k, n, m) / seconds / HBM
            row = dict(case=name, K=k, N=n, M=m, impl=label, us=seconds * 1e6, hbm_pct=pct)
            row.update(rel_err=err, ok=ok, calls=calls, vs_xla=xla_s / seconds, compile_s=compile_s)
            results.append(row)
            failures += not ok
            status = "" if ok else f"  MISMATCH rel err {err:.2e}"
            print(
                f"{name:15s} M={m:2d} {label:40s} {seconds * 1e6:9.1f} us {pct:5.1f} % HBM "
                f"{xla_s / seconds:5.2f}x xla (compile+run {compile_s:.1f} s){status}",
                flush=True,
            )
        del weights

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n| case | M | XLA dot us (% HBM) | best kernel | us (% HBM) | vs XLA |")
    print("|---|---|---|---|---|---|")
    for name, _, _, m in cases(args.smoke, args.m):
        rows = [r for r in results if (r["case"], r["M"]) == (name, m)]
        xla = rows[0]
        best = min((r for r in rows[1:] if r["ok"]), key=lambda r: r["us"], default=None)
        if best is None:
            print(f"| {name} | {m} | {xla['us']:.1f} ({xla['hbm_pct']:.0f} %) | none correct |")
            continue
        print(
            f"| {name} | {m} | {xla['us']:.1f} ({xla['hbm_pct']:.0f} %) | {best['impl']} | "
            f"{best['us']:.1f} ({best['hbm_pct']:.0f} %) | {best['vs_xla']:.2f}x |"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
