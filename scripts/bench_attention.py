"""Benchmark the Pallas GPU paged-attention kernel against the XLA reference on one GPU.

Nemotron-Nano-9B-v2 attention shapes (40 query / 8 KV heads of 128, no RoPE), bf16 queries
and KV cache of ``--page-size``-token pages (the engine's default, 16), pages assigned at
random. Cases: prefill 1x8192 and 8x2048 (whole prompts from position 0), decode batch
1 / 32 / 256 at contexts 512 and 4096 (one token a row at the last position).

Per case the kernel's output is checked against the reference (``impl="ref"``) first. Times
are the median of ``--reps`` runs of ``--steps`` calls inside one jitted program (``lax.scan``,
so no per-call dispatch), each call on another page table and query set over a page pool of
at least 256 MB, so K/V do not stay in L2. Roofline = max(bytes / 4.3 TB/s, FLOPs / 800
TFLOP/s), bytes = queries + outputs + each row's K/V once per KV head, FLOPs = 4 Dh per
visible (query head, key) pair. ``--sweep`` also times a few block-size variants.

    python scripts/bench_attention.py [--sweep]      # on the GPU
    python scripts/bench_attention.py --smoke        # CPU: interpret mode, toy shapes
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:
    from jaxmamba.kernels import attention_pallas_gpu, paged_attention  # noqa: E402
except ImportError:  # not installed (the GPU machine): the repo root is on sys.path
    from kernels import attention_pallas_gpu, paged_attention  # noqa: E402

HBM = 4.3e12  # bytes/s, measured D2D copy on the H200 (DESIGN §8)
MXU = 800e12  # FLOP/s, measured bf16 matmul on the H200
ACT = jnp.bfloat16
FULL = dict(q_heads=40, kv_heads=8, head_dim=128, pool_bytes=256 << 20)
FULL_CASES = [("prefill", 1, 8192), ("prefill", 8, 2048)] + [
    ("decode", batch, context) for context in (512, 4096) for batch in (1, 32, 256)
]
SMOKE = dict(q_heads=4, kv_heads=2, head_dim=32, pool_bytes=1 << 20)
SMOKE_CASES = [("prefill", 1, 64), ("prefill", 2, 24), ("decode", 1, 40), ("decode", 4, 64)]
SWEEP = {
    "rows64 kv64": attention_pallas_gpu.GpuBlockSizes(max_rows=64),
    "rows128 kv32": attention_pallas_gpu.GpuBlockSizes(block_kv=32),
    "rows128 kv128": attention_pallas_gpu.GpuBlockSizes(block_kv=128),
    "stages3": attention_pallas_gpu.GpuBlockSizes(num_stages=3),
    "warps4": attention_pallas_gpu.GpuBlockSizes(num_warps=4),
    "no split": attention_pallas_gpu.GpuBlockSizes(min_programs=1),
    "split 2048 progs": attention_pallas_gpu.GpuBlockSizes(min_programs=2048, min_split_kv=256),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def median_time(fn, reps: int) -> float:
    fn()  # warm-up (compile, autotune)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_case(kind, rows, length, shapes, page_size, steps, rng):
    """Stacked inputs for ``steps`` calls: queries, pages, page tables, token rows/positions."""
    hq, hkv, dh = shapes["q_heads"], shapes["kv_heads"], shapes["head_dim"]
    max_pages = -(-length // page_size)
    if kind == "prefill":
        token_rows = np.repeat(np.arange(rows), length)
        positions = np.tile(np.arange(length), rows)
    else:
        token_rows, positions = np.arange(rows), np.full(rows, length - 1)
    page_bytes = 2 * page_size * hkv * dh * 2  # K and V
    pool = max(rows * max_pages * steps, shapes["pool_bytes"] // page_bytes)
    page_sets = rng.permutation(pool)[: rows * max_pages * steps]
    tables = page_sets.reshape(steps, rows, max_pages).astype(np.int32)
    k_pages = jax.random.normal(jax.random.key(1), (pool + 1, page_size, hkv, dh), ACT)
    v_pages = jax.random.normal(jax.random.key(2), (pool + 1, page_size, hkv, dh), ACT)
    q = jax.random.normal(jax.random.key(3), (steps, token_rows.size, hq, dh), ACT)
    nbytes = 2 * token_rows.size * hq * dh * 2 + rows * length * page_bytes
    flops = 4 * float(np.sum(positions + 1)) * hq * dh
    return (
        (q, k_pages, v_pages, jnp.asarray(tables)),
        jnp.asarray(token_rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        (nbytes, flops),
    )


def stepped(attend, token_rows, positions, scale):
    """One jitted program running ``attend`` once per (queries, page table) set."""

    def run(qs, k_pages, v_pages, tables):
        def body(carry, inp):
            q, table = inp
            return carry, attend(q, k_pages, v_pages, table, token_rows, positions, scale=scale)

        return jax.lax.scan(body, 0, (qs, tables))[1]

    return jax.jit(run)


def bench_case(kind, rows, length, args, rng, rows_out):
    shapes = SMOKE if args.smoke else FULL
    inputs, token_rows, positions, (nbytes, flops) = make_case(
        kind, rows, length, shapes, args.page_size, args.steps, rng
    )
    scale = shapes["head_dim"] ** -0.5
    kernel = functools.partial(attention_pallas_gpu.paged_attention_gpu, interpret=args.smoke)
    ref = functools.partial(paged_attention, impl="ref")
    ours_fn = stepped(kernel, token_rows, positions, scale)
    ref_fn = stepped(ref, token_rows, positions, scale)
    name = f"{kind} {rows}x{length}" if kind == "prefill" else f"decode bs {rows} ctx {length}"
    out, expected = ours_fn(*inputs), ref_fn(*inputs)
    err = rel_err(out.astype(jnp.float32), expected.astype(jnp.float32))
    if not err < 1e-2:
        raise SystemExit(f"{name}: kernel output differs from the reference (rel err {err:.2e})")

    def timed(fn):
        return median_time(lambda: fn(*inputs).block_until_ready(), args.reps) / args.steps

    ours = timed(ours_fn)
    xla = timed(ref_fn) if not args.skip_ref else float("nan")
    roof = max(nbytes / HBM, flops / MXU)
    rows_out.append((name, ours, xla, roof, err))
    print(
        f"  {name:26s} ours {ours * 1e6:9.1f} us | xla {xla * 1e6:10.1f} us | "
        f"roofline {roof * 1e6:8.1f} us = {roof / ours:6.1%} of ours | rel err {err:.1e}",
        flush=True,
    )
    if args.sweep:
        for label, sizes in SWEEP.items():
            variant = functools.partial(kernel, block_sizes=sizes)
            t = timed(stepped(variant, token_rows, positions, scale))
            print(f"    variant {label:18s} {t * 1e6:9.1f} us = {roof / t:6.1%} of roofline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="CPU: interpret mode, toy shapes")
    parser.add_argument("--sweep", action="store_true", help="also time block-size variants")
    parser.add_argument("--skip-ref", action="store_true", help="check against XLA, skip timing it")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if args.smoke:
        args.page_size, args.steps, args.reps = 8, 2, 1
    elif jax.default_backend() != "gpu":
        raise SystemExit("needs a GPU (or --smoke for the interpret-mode check on CPU)")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, page size {args.page_size}")
    rng = np.random.default_rng(0)
    rows_out = []
    for kind, rows, length in SMOKE_CASES if args.smoke else FULL_CASES:
        bench_case(kind, rows, length, args, rng, rows_out)
    print("\n| case | Pallas | XLA reference | XLA / Pallas | roofline | % of roofline |")
    print("|---|---|---|---|---|---|")
    for name, ours, xla, roof, _ in rows_out:
        print(
            f"| {name} | {ours * 1e6:.1f} us | {xla * 1e6:.1f} us | {xla / ours:.1f}x | "
            f"{roof * 1e6:.1f} us | {roof / ours:.0%} |"
        )


if __name__ == "__main__":
    main()
