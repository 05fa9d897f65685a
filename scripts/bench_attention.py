"""Benchmark the Pallas GPU paged-attention kernel against the XLA reference on one GPU.

Nemotron-Nano-9B-v2 attention shapes (40 query / 8 KV heads of 128, no RoPE), bf16 queries
and KV cache of ``--page-size``-token pages (the engine's default, 16), pages assigned at
random. Cases: prefill 1x8192 and 8x2048 (whole prompts from position 0), decode batch
1 / 32 / 256 at contexts 512 and 4096 (one token a row at the last position), and a mixed
step laid out as the engine lays it out (64 decode rows at context 2048, two 1024-token
extends after 1024 cached tokens, padding tokens on a row of NaN pad pages).

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
FULL_CASES.append(("mixed", 64, 2048))
SMOKE = dict(q_heads=4, kv_heads=2, head_dim=32, pool_bytes=1 << 20)
SMOKE_CASES = [("prefill", 1, 64), ("prefill", 2, 24), ("decode", 1, 40), ("decode", 4, 64)]
SMOKE_CASES.append(("mixed", 3, 40))
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


PAD_TOKENS = 5  # mixed case: padding tokens on an empty row whose pages are the pad page


def row_layout(kind, rows, length):
    """[(cached, new)] per row: the step's token layout, as ForwardMetadata orders it."""
    if kind == "prefill":
        return [(0, length)] * rows
    decode = [(length - 1, 1)] * rows
    if kind == "decode":
        return decode
    return decode + [(length // 2, length // 2)] * 2 + [(0, 0)]  # mixed: + 2 extends + pad row


def make_case(kind, rows, length, shapes, page_size, steps, rng):
    """Stacked inputs for ``steps`` calls (queries, pages, page tables), token rows/positions,
    the number of real tokens, and the roofline's bytes and FLOPs."""
    hq, hkv, dh = shapes["q_heads"], shapes["kv_heads"], shapes["head_dim"]
    layout = row_layout(kind, rows, length)
    lengths = np.array([c + n for c, n in layout])
    token_rows = np.concatenate([np.full(n, r) for r, (c, n) in enumerate(layout)])
    positions = np.concatenate([np.arange(c, c + n) for c, n in layout])
    num_real = token_rows.size
    if kind == "mixed":
        token_rows = np.concatenate([token_rows, np.full(PAD_TOKENS, len(layout) - 1)])
        positions = np.concatenate([positions, np.zeros(PAD_TOKENS, int)])
    max_pages = -(-lengths.max() // page_size)
    kv_bytes = 2 * hkv * dh * 2  # K and V of one position
    needed = -(-lengths // page_size)
    pool = max(needed.sum() * steps, shapes["pool_bytes"] // (page_size * kv_bytes))
    pad_page = pool
    free = iter(rng.permutation(pool))
    tables = np.full((steps, len(layout), max_pages), pad_page, np.int32)
    for step in range(steps):  # each call reads other pages: K/V do not stay in L2
        for r, n in enumerate(needed):
            tables[step, r, :n] = [next(free) for _ in range(n)]
    k_pages = jax.random.normal(jax.random.key(1), (pool + 1, page_size, hkv, dh), ACT)
    v_pages = jax.random.normal(jax.random.key(2), (pool + 1, page_size, hkv, dh), ACT)
    k_pages, v_pages = k_pages.at[pad_page].set(jnp.nan), v_pages.at[pad_page].set(jnp.nan)
    q = jax.random.normal(jax.random.key(3), (steps, token_rows.size, hq, dh), ACT)
    nbytes = 2 * token_rows.size * hq * dh * 2 + lengths.sum() * kv_bytes
    flops = 4 * float(np.sum(positions[:num_real] + 1)) * hq * dh
    return (
        (q, k_pages, v_pages, jnp.asarray(tables)),
        jnp.asarray(token_rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        num_real,
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


def case_name(kind, rows, length):
    if kind == "prefill":
        return f"prefill {rows}x{length}"
    if kind == "decode":
        return f"decode bs {rows} ctx {length}"
    return f"mixed bs {rows} ctx {length} + 2x{length // 2}"


def bench_case(kind, rows, length, args, rng, rows_out):
    shapes = SMOKE if args.smoke else FULL
    inputs, token_rows, positions, num_real, (nbytes, flops) = make_case(
        kind, rows, length, shapes, args.page_size, args.steps, rng
    )
    scale = shapes["head_dim"] ** -0.5
    kernel = functools.partial(attention_pallas_gpu.paged_attention_gpu, interpret=args.smoke)
    ref_fn = stepped(functools.partial(paged_attention, impl="ref"), token_rows, positions, scale)
    expected = ref_fn(*inputs)[:, :num_real].astype(jnp.float32)
    name = case_name(kind, rows, length)

    def checked(fn):
        """Relative error of ``fn`` against the reference on the real tokens."""
        return rel_err(fn(*inputs)[:, :num_real].astype(jnp.float32), expected)

    def timed(fn):
        return median_time(lambda: fn(*inputs).block_until_ready(), args.reps) / args.steps

    ours_fn = stepped(kernel, token_rows, positions, scale)
    err = checked(ours_fn)
    if not err < 1e-2:
        raise SystemExit(f"{name}: kernel output differs from the reference (rel err {err:.2e})")
    ours = timed(ours_fn)
    xla = float("nan") if args.skip_ref else timed(ref_fn)
    roof = max(nbytes / HBM, flops / MXU)
    rows_out.append((name, ours, xla, roof))
    print(
        f"  {name:32s} ours {ours * 1e6:9.1f} us | xla {xla * 1e6:10.1f} us | "
        f"roofline {roof * 1e6:8.1f} us = {roof / ours:6.1%} of ours | rel err {err:.1e}",
        flush=True,
    )
    if args.sweep:
        for label, sizes in SWEEP.items():
            variant = stepped(
                functools.partial(kernel, block_sizes=sizes), token_rows, positions, scale
            )
            try:
                err, t = checked(variant), timed(variant)
            except Exception as e:  # one variant failing to compile must not stop the sweep
                print(f"    variant {label:18s} failed: {str(e).splitlines()[0][:200]}")
                continue
            print(
                f"    variant {label:18s} {t * 1e6:9.1f} us = {roof / t:6.1%} of roofline "
                f"| rel err {err:.1e}"
            )


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
    for name, ours, xla, roof in rows_out:
        print(
            f"| {name} | {ours * 1e6:.1f} us | {xla * 1e6:.1f} us | {xla / ours:.1f}x | "
            f"{roof * 1e6:.1f} us | {roof / ours:.0%} |"
        )


if __name__ == "__main__":
    main()
