"""Pallas GPU kernel (Triton lowering) for the grouped matmul ``y[r] = x[r] @ W[e(r)]``, where
the rows come in blocks of ``BM`` that each belong to one expert (``layout.py``).

* Grid ``(NB, N / block_n)``, row blocks fastest: a program reads its block's expert from
  ``block_expert`` (a tiny int32 array in GPU memory, so a new routing is new values, never a
  new kernel), returns at once for an unused block (-1), and otherwise walks K in
  ``[BM, block_k] x [block_k, block_n]`` tensor-core dots accumulated in float32.
  Consecutive programs are consecutive blocks of the same column tile, so the blocks of one
  expert read the same W tiles at about the same time and share them through L2: W is read
  from HBM about once per expert hit.
* Only the experts a step routes to are read, and only their used blocks are computed: at
  decode (BM 16) that is ``k`` experts' weights per token, as a weight-streaming GEMV.
* K and N need not be multiples of the blocks: edge tiles are masked. Rows are whole blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import MIN_DOT_DIM, matmul_precision, pallas_call


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    block_n: int = 128  # output columns per program (power of two)
    block_k: int = 64  # K per step (power of two, >= 16)
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def get_default(cls, block_rows: int) -> GpuBlockSizes:
        """Small blocks (decode) stream W: narrower column tiles give more programs for the
        few blocks a step has; large blocks are compute tiles."""
        if block_rows <= 32:
            return cls(block_n=64, block_k=128, num_warps=4, num_stages=4)
        return cls(block_n=128, block_k=64, num_warps=8 if block_rows >= 128 else 4,
                   num_stages=3)  # fmt: skip


def _kernel(
    block_expert_ref,  # i32[NB]
    x_ref,  # [NB·BM, K]
    w_ref,  # [X, K, N]; [X, N, K] with transpose_w
    out_ref,  # [NB·BM, N]
    *,
    block_rows: int,
    block_n: int,
    block_k: int,
    transpose_w: bool,
):
    k_total, n_total = w_ref.shape[1:] if not transpose_w else w_ref.shape[:0:-1]
    block, col_block = pl.program_id(0), pl.program_id(1)
    expert = block_expert_ref[block]
    r0 = pl.multiple_of(block * block_rows, block_rows)
    n0 = pl.multiple_of(col_block * block_n, block_n)
    n_mask = (n0 + jnp.arange(block_n) < n_total)[None, :] if n_total % block_n else None
    k_edge = k_total % block_k != 0
    precision = matmul_precision(x_ref.dtype)

    @pl.when(expert >= 0)
    def _():
        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            x_tile = x_ref.at[pl.ds(r0, block_rows), pl.ds(k0, block_k)]
            if transpose_w:  # [block_n, block_k] tiles of a [N, K] weight
                w_tile = w_ref.at[expert, pl.ds(n0, block_n), pl.ds(k0, block_k)]
                wn_mask = None if n_mask is None else n_mask.T
            else:
                w_tile = w_ref.at[expert, pl.ds(k0, block_k), pl.ds(n0, block_n)]
                wn_mask = n_mask
            if k_edge:
                k_mask = k0 + jnp.arange(block_k) < k_total
                x = pltriton.load(x_tile, mask=k_mask[None, :], other=0)
                wk_mask = k_mask[None, :] if transpose_w else k_mask[:, None]
                w_mask = wk_mask if wn_mask is None else wk_mask & wn_mask
                w = pltriton.load(w_tile, mask=w_mask, other=0)
            else:
                x = x_tile[...]
                w = w_tile[...] if wn_mask is None else pltriton.load(w_tile, mask=wn_mask, other=0)
            if w.dtype != x.dtype:  # int8 weights: converted in registers
                w = w.astype(x.dtype)
            dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
            return acc + lax.dot_general(x, w, dims, precision=precision,
                                         preferred_element_type=jnp.float32)  # fmt: skip

        steps = pl.cdiv(k_total, block_k)
        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_rows, block_n), jnp.float32))
        out = out_ref.at[pl.ds(r0, block_rows), pl.ds(n0, block_n)]
        acc = acc.astype(out_ref.dtype)
        if n_mask is None:
            out[...] = acc
        else:
            pltriton.store(out, acc, mask=n_mask)


def grouped_matmul_gpu(
    x: jax.Array,  # [NB·BM, K]
    w: jax.Array,  # [X, K, N]; [X, N, K] with transpose_w
    block_expert: jax.Array,  # i32[NB]
    *,
    out_dtype=None,
    transpose_w: bool = False,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
) -> jax.Array:
    """Rows of unused blocks (expert -1) are left unwritten: read only the used rows."""
    rows, k = x.shape
    nb = block_expert.shape[0]
    block_rows = rows // nb
    bs = block_sizes or GpuBlockSizes.get_default(block_rows)
    if block_rows < MIN_DOT_DIM or block_rows & (block_rows - 1):
        raise ValueError(
            f"grouped_matmul_gpu: rows per block must be a power of two >= {MIN_DOT_DIM}, got "
            f"x {x.shape} for {nb} blocks"
        )
    for name in ("block_n", "block_k"):
        size = getattr(bs, name)
        if size < MIN_DOT_DIM or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {size}")
    n = w.shape[1 if transpose_w else 2]
    kernel = functools.partial(_kernel, block_rows=block_rows, block_n=bs.block_n,
                               block_k=bs.block_k, transpose_w=transpose_w)  # fmt: skip
    return pallas_call(
        kernel,
        grid=(nb, pl.cdiv(n, bs.block_n)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.dtype(out_dtype or x.dtype)),
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(block_expert, x, w)
