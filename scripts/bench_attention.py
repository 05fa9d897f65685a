"""Benchmark paged attention (``paged_attention``) on one GPU: our Pallas kernel against the
XLA reference (``impl="ref"``).

Nemotron-Nano-9B-v2 attention shapes (40 query / 8 KV heads of 128, no RoPE), bf16 queries
and KV cache of ``--page-size``-token pages (the engine's default, 16), pages assigned at
random. Cases: prefill 1x8192 and 8x2048 (whole prompts from position 0), decode batch
1 / 32 / 256 at contexts 512 and 4096 (one token a row at the last position), and a mixed
step laid out as the engine lays it out (64 decode rows at context 2048, two 1024-token
extends after 1024 cached tokens, padding tokens on a row of NaN pad pages).

Per case the kernel's output is checked against the reference first. A program runs
``--attention-steps`` calls (``lax.scan``, so no per-call dispatch), each on another page
table and query set over a page pool of at least 256 MB, so K/V do not stay in L2. Roofline:
the longer of the bytes (queries, outputs and each row's K/V once per KV head) and the
FLOPs (4 Dh per visible query-head/key pair).

    python scripts/bench_attention.py [--sweep] [--page-size 16] [--reps 30]
    python scripts/bench_attention.py --smoke      # CPU: interpret mode, toy shapes

Setup and the timing method: see ``bench_common.py``.
"""

from __future__ import annotations

import argparse
import functools

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels import paged_attention
from jaxmamba.kernels.attention.gpu import GpuBlockSizes, paged_attention_gpu

FULL = dict(q_heads=40, kv_heads=8, head_dim=128, pool_bytes=256 << 20)
FULL_CASES = [("prefill", 1, 8192), ("prefill", 8, 2048)] + [
    ("decode", batch, context) for context in (512, 4096) for batch in (1, 32, 256)
]
FULL_CASES.append(("mixed", 64, 2048))
SMOKE = dict(q_heads=4, kv_heads=2, head_dim=32, pool_bytes=1 << 20)
SMOKE_CASES = [("prefill", 1, 64), ("prefill", 2, 24), ("decode", 1, 40), ("decode", 4, 64)]
SMOKE_CASES.append(("mixed", 3, 40))
SWEEP = {
    "rows64 kv64": GpuBlockSizes(max_rows=64),
    "rows128 kv32": GpuBlockSizes(block_kv=32),
    "rows128 kv128": GpuBlockSizes(block_kv=128),
    "stages3": GpuBlockSizes(num_stages=3),
    "warps4": GpuBlockSizes(num_warps=4),
    "no split": GpuBlockSizes(min_programs=1),
    "split 2048 progs": GpuBlockSizes(min_programs=2048, min_split_kv=256),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-size", type=int, default=16, help="attention: tokens a page")
    parser.add_argument(
        "--attention-steps", type=int, default=4, help="attention: calls a timed program"
    )
    parser.add_argument(
        "--skip-ref", action="store_true", help="attention: check against XLA, skip timing it"
    )


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
    k_pages = jax.random.normal(jax.random.key(1), (pool + 1, page_size, hkv, dh), bc.ACT)
    v_pages = jax.random.normal(jax.random.key(2), (pool + 1, page_size, hkv, dh), bc.ACT)
    k_pages, v_pages = k_pages.at[pad_page].set(jnp.nan), v_pages.at[pad_page].set(jnp.nan)
    q = jax.random.normal(jax.random.key(3), (steps, token_rows.size, hq, dh), bc.ACT)
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


def bench_case(kind, rows, length, args, table: bc.Table, rng) -> None:
    shapes = SMOKE if args.smoke else FULL
    page_size = 8 if args.smoke else args.page_size
    steps = 2 if args.smoke else args.attention_steps
    inputs, token_rows, positions, num_real, (nbytes, flops) = make_case(
        kind, rows, length, shapes, page_size, steps, rng
    )
    scale = shapes["head_dim"] ** -0.5
    kernel = functools.partial(paged_attention_gpu, interpret=args.smoke)
    ref_fn = stepped(functools.partial(paged_attention, impl="ref"), token_rows, positions, scale)
    expected = ref_fn(*inputs)[:, :num_real].astype(jnp.float32)
    name = f"attention {case_name(kind, rows, length)}"

    def checked(label, fn):
        got = fn(*inputs)[:, :num_real].astype(jnp.float32)
        bc.check(f"{name} {label}", got, expected, 1e-2)

    def timed(fn):
        return bc.median_time(lambda: fn(*inputs), args.reps) / steps

    ours_fn = stepped(kernel, token_rows, positions, scale)
    checked("ours", ours_fn)
    xla = float("nan") if args.skip_ref else timed(ref_fn)
    row = bc.Row(name, ours=timed(ours_fn), xla=xla, roof=bc.roofline(nbytes, flops))

    def measure(label, sizes):
        fn = stepped(functools.partial(kernel, block_sizes=sizes), token_rows, positions, scale)
        checked(label, fn)
        return timed(fn)

    measures = {label: functools.partial(measure, label, sizes) for label, sizes in SWEEP.items()}
    bc.time_variants(row, measures if args.sweep else {})
    table.add(row)


def run(args, table: bc.Table) -> None:
    print(f"attention: page size {8 if args.smoke else args.page_size}")
    rng = np.random.default_rng(0)
    for kind, rows, length in SMOKE_CASES if args.smoke else FULL_CASES:
        bench_case(kind, rows, length, args, table, rng)


CASES = {"attention": run}

if __name__ == "__main__":
    bc.main_for(__doc__, CASES, add_args)
