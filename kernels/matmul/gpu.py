"""Pallas GPU kernel (Triton lowering) for the small-M matmul ``x[M, K] @ W[K, N]``, M <= 32.

The kernel is bound by reading W once, so everything serves a steady stream of W tiles:

* Grid ``(N / block_n, split_k)``. A program owns ``block_n`` output columns and one of
  ``split_k`` contiguous ranges of K; it walks its range in ``[block_k, block_n]`` tiles of W.
  W is ``[K, N]`` row-major (the model's ``Linear`` stores ``kernel [in, out]``), so a tile
  is ``block_k`` contiguous runs of ``block_n`` elements: wide vector loads along N.
  Column blocks vary fastest, so neighbouring programs read neighbouring runs of a row.
* Each step is a tensor-core ``dot`` of x's ``[16 or 32, block_k]`` slice (rows past M
  masked to zero: Triton's smallest dot edge is 16) with the W tile, accumulated in float32.
  A dot operand in a loop is what Triton's software pipeliner prefetches: ``num_stages`` W tiles
  are in flight (async copies into shared memory) while the current one is multiplied.
  x is re-read every step, but it is a few KB that stays in L1/L2.
  For M = 1, ``single_row_fma`` (opt-in; slower than the dot at every 9B shape in the H200
  sweep, ``scripts/bench_matmul.py --sweep``) instead multiply-adds each tile into a float32
  ``[block_k, block_n]`` accumulator (no shared-memory staging, one reduction over K at the
  end).
* The decode projections have few column blocks (N = 4480 is 35 blocks of 128) against
  132 SMs, so K is split until there are at least ``min_programs`` programs; each split
  writes float32 partials ``[split_k, M, N]`` that XLA sums and casts (a tiny extra pass).
  ``split_k = 1`` writes the output directly.

K and N need not be multiples of the blocks: the edge tiles are masked (zeros in, nothing
out), and masks are only emitted where a dimension has an edge.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import MIN_DOT_DIM, matmul_precision, pallas_call, pow2_at_least

MAX_ROWS = 32  # rows of x the kernel takes (decode buckets); padded to 16 or 32 rows


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tiles and launch shape. ``split_k=None`` picks the smallest power of two giving at
    least ``min_programs`` programs (2 per SM of an H100/H200), capped so that every split
    keeps at least ``min_steps`` tiles of K."""

    block_n: int = 128  # output columns per program (power of two)
    block_k: int = 64  # rows of W per step (power of two, >= 16)
    split_k: int | None = None
    min_programs: int = 264
    min_steps: int = 4
    num_warps: int = 4
    num_stages: int = 4
    # M = 1 only: multiply-add W tiles into a float32 [block_k, block_n] accumulator and
    # reduce over K once at the end, instead of the 16-row (15 of them zero) tensor-core dot.
    single_row_fma: bool = False

    @classmethod
    def for_shape(cls, k: int, n: int, rows: int) -> GpuBlockSizes:
        """The sizes measured best on the H200 for this projection shape and row class
        (``TUNED``), else the defaults."""
        return cls(**TUNED.get((k, n, row_class(rows)), {}))

    def splits(self, k: int, n: int) -> int:
        if self.split_k is not None:
            return self.split_k
        column_blocks = pl.cdiv(n, self.block_n)
        max_splits = max(1, pl.cdiv(k, self.block_k) // self.min_steps)
        split = 1
        while column_blocks * split < self.min_programs and split * 2 <= max_splits:
            split *= 2
        return split


def row_class(rows: int) -> int:
    """The rows a launch is tuned for: 1 (a single-row GEMV), 16 (2..16) or 32 (17..32)."""
    return 1 if rows == 1 else 16 if rows <= 16 else 32


# (K, N, row class): changes to the defaults that ran fastest for that shape on the H200
# (``scripts/bench_matmul.py --sweep`` at M = 1 and 32; docs/benchmarks.md), for
# Nemotron-Nano-9B-v2's decode projections: in_proj, out_proj, MLP up and down. The class
# 2..16 has no entry: at batch 16 the defaults and XLA's dot take the same step time.
TUNED: dict[tuple[int, int, int], dict] = {
    (4480, 22656, 1): dict(block_n=64),
    (10240, 4480, 1): dict(num_stages=3),
    (4480, 15680, 1): dict(split_k=1),
    (15680, 4480, 1): dict(block_n=64),
    (4480, 22656, 32): dict(block_n=64),
    (10240, 4480, 32): dict(block_n=64),
    (4480, 15680, 32): dict(block_n=64, split_k=1),
    (15680, 4480, 32): dict(block_n=64),
}


def _kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, N]
    out_ref,  # [M, N] out dtype (split_k = 1) or f32[split_k, M, N]
    *,
    block_rows: int,
    block_n: int,
    block_k: int,
    steps: int,
    split_k: int,
    fma: bool,
):
    num_rows, k_total = x_ref.shape
    n_total = w_ref.shape[1]
    col_block, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(col_block * block_n, block_n)
    cols = n0 + jnp.arange(block_n)
    row_ids = jnp.arange(block_rows)
    k_edge = split_k * steps * block_k > k_total
    n_mask = (cols < n_total)[None, :] if n_total % block_n else None
    row_mask = (row_ids < num_rows)[:, None] if block_rows > num_rows else None
    precision = matmul_precision(x_ref.dtype)

    def both(a, b):
        return b if a is None else a if b is None else a & b

    def step(i, acc):
        k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
        k_mask = (k0 + jnp.arange(block_k) < k_total) if k_edge else None
        w_mask = both(None if k_mask is None else k_mask[:, None], n_mask)
        x_mask = both(row_mask, None if k_mask is None else k_mask[None, :])
        w_tile = w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)]
        w = w_tile[...] if w_mask is None else pltriton.load(w_tile, mask=w_mask, other=0)
        if fma:  # one row: x's K slice as a column
            x_tile = x_ref.at[jnp.int32(0), pl.ds(k0, block_k)]
            x = x_tile[...] if k_mask is None else pltriton.load(x_tile, mask=k_mask, other=0)
            return acc + x.astype(jnp.float32)[:, None] * w.astype(jnp.float32)
        x_tile = x_ref.at[pl.ds(0, block_rows), pl.ds(k0, block_k)]
        x = x_tile[...] if x_mask is None else pltriton.load(x_tile, mask=x_mask, other=0)
        return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    acc_shape = (block_k if fma else block_rows, block_n)
    acc = lax.fori_loop(0, steps, step, jnp.zeros(acc_shape, jnp.float32))
    if fma:
        acc = jnp.sum(acc, axis=0, keepdims=True)  # [1, block_n]
    out_mask = both(row_mask, n_mask)
    if split_k == 1:
        out = out_ref.at[pl.ds(0, block_rows), pl.ds(n0, block_n)]
    else:
        out = out_ref.at[split, pl.ds(0, block_rows), pl.ds(n0, block_n)]
    acc = acc.astype(out_ref.dtype)
    if out_mask is None:
        out[...] = acc
    else:
        pltriton.store(out, acc, mask=out_mask)


def small_m_matmul_gpu(
    x: jax.Array,  # [M, K] M <= MAX_ROWS
    w: jax.Array,  # [K, N]
    *,
    out_dtype=None,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
) -> jax.Array:
    rows, k = x.shape
    n = w.shape[1]
    bs = block_sizes or GpuBlockSizes.for_shape(k, n, rows)
    if rows > MAX_ROWS:
        raise ValueError(f"small_m_matmul_gpu takes at most {MAX_ROWS} rows, got x {x.shape}")
    for name in ("block_n", "block_k"):
        size = getattr(bs, name)
        if size < MIN_DOT_DIM or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {size}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    split_k = bs.splits(k, n)
    steps = pl.cdiv(pl.cdiv(k, split_k), bs.block_k)
    fma = bs.single_row_fma and rows == 1
    block_rows = 1 if fma else max(MIN_DOT_DIM, pow2_at_least(rows))
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, rows, n), jnp.float32)
    kernel = functools.partial(
        _kernel,
        block_rows=block_rows,
        block_n=bs.block_n,
        block_k=bs.block_k,
        steps=steps,
        split_k=split_k,
        fma=fma,
    )
    out = pallas_call(
        kernel,
        grid=(pl.cdiv(n, bs.block_n), split_k),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="small_m_matmul",
    )(x, w)
    if split_k == 1:
        return out
    return jnp.sum(out, axis=0).astype(out_dtype)
