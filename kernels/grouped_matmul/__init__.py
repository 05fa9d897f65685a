"""Grouped matmul ``y[r] = x[r] @ W[e(r)]`` for mixture-of-experts layers: the rows are the
(token, expert) assignments sorted by expert, in blocks of ``BM`` rows that each belong to one
expert (``layout.build_expert_blocks``), and ``block_expert`` names each block's expert.

The Pallas GPU kernel (``gpu.py``) reads only the experts a step routes to and skips unused
blocks; the reference (``ref.py``) loops over the blocks with ``jnp.dot``. No TPU kernel:
there XLA lowers ``jax.lax.ragged_dot`` to a grouped matmul, which the model uses instead
(``jaxmamba/model/moe.py``), and ``impl="auto"`` runs the reference.

Both also take quantized experts as published, ``[X, N, K]`` int8 or FP8 (``transpose_w``);
their scales are applied by ``jaxmamba.kernels.matmul.quantized.scaled_grouped_matmul``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..dispatch import select_impl
from .gpu import GpuBlockSizes, grouped_matmul_gpu
from .layout import ExpertBlocks, assignment_blocks, build_expert_blocks, num_blocks
from .ref import grouped_matmul_ref

__all__ = [
    "ExpertBlocks",
    "GpuBlockSizes",
    "assignment_blocks",
    "build_expert_blocks",
    "grouped_matmul",
    "grouped_matmul_ref",
    "has_kernel",
    "num_blocks",
]


def _select(impl: str):
    return select_impl(
        "grouped_matmul", impl, ref=grouped_matmul_ref, pallas_gpu=grouped_matmul_gpu
    )


def has_kernel(impl: str) -> bool:
    """Whether ``impl`` runs the Pallas kernel (not the reference) on this backend."""
    return _select(impl) is not grouped_matmul_ref


def grouped_matmul(
    x: jax.Array,  # [NB·BM, K]
    w: jax.Array,  # [X, K, N]; [X, N, K] with transpose_w
    block_expert: jax.Array,  # i32[NB] expert of each block; -1 for an unused block
    *,
    out_dtype=None,  # default x.dtype
    transpose_w: bool = False,
    impl: str = "auto",
) -> jax.Array:
    """``x[block b] @ w[block_expert[b]]`` per block, accumulated in float32, as
    ``[NB·BM, N]`` in ``out_dtype``. Rows of unused blocks are unspecified (zeros in the
    reference, unwritten by the kernel).

    ``w`` has ``x``'s dtype, or is a quantized expert stack as published (``transpose_w``:
    ``[X, N, K]``, K minor): int8 (converted to ``x``'s dtype tile by tile) or
    float8_e4m3fn with FP8 ``x`` (an FP8 dot). Its scales are the caller's
    (``jaxmamba.model.moe``)."""
    k_axis = 2 if transpose_w else 1
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[k_axis]:
        want = "[X, N, K]" if transpose_w else "[X, K, N]"
        raise ValueError(f"expected x [R, K] and w {want}; got x {x.shape}, w {w.shape}")
    if block_expert.ndim != 1 or x.shape[0] % block_expert.shape[0]:
        raise ValueError(
            f"x's {x.shape[0]} rows must be whole blocks: block_expert {block_expert.shape}"
        )
    int8 = w.dtype == jnp.int8 and jnp.issubdtype(x.dtype, jnp.floating)
    if x.dtype != w.dtype and not int8:
        raise ValueError(f"x and w must share a dtype (or w int8); got x {x.dtype}, w {w.dtype}")
    return _select(impl)(x, w, block_expert, out_dtype=out_dtype, transpose_w=transpose_w)
