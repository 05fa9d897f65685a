"""Small-M matmul ``y[M, N] = x[M, K] @ W[K, N]`` for decode (M <= 16 rows), and its reference.

At decode the dense projections are weight-streaming GEMVs: the time is reading W once from
HBM, the FLOPs are negligible. The Pallas GPU kernel (``gpu.py``) is built to stream W at HBM
bandwidth; the reference (``ref.py``) is XLA's ``jnp.dot`` with float32 accumulation. No TPU
kernel: ``impl="auto"`` runs the reference there.
"""

from __future__ import annotations

import jax

from ..dispatch import select_impl
from .gpu import MAX_ROWS, small_m_matmul_gpu
from .ref import small_m_matmul_ref

__all__ = ["MAX_ROWS", "small_m_matmul", "small_m_matmul_ref"]


def small_m_matmul(
    x: jax.Array,  # [M, K] M <= MAX_ROWS
    w: jax.Array,  # [K, N] row-major (N contiguous), same dtype as x
    *,
    out_dtype=None,  # default x.dtype
    impl: str = "auto",
) -> jax.Array:
    """``x @ w`` accumulated in float32, returned in ``out_dtype`` (x's dtype by default).

    ``impl="auto"`` is the Pallas GPU kernel on CUDA and the reference on TPU and CPU.
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"expected x [M, K] and w [K, N]; got x {x.shape}, w {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got x {x.dtype}, w {w.dtype}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"small_m_matmul takes 1..{MAX_ROWS} rows, got x {x.shape}")
    fn = select_impl("small_m_matmul", impl, ref=small_m_matmul_ref, pallas_gpu=small_m_matmul_gpu)
    return fn(x, w, out_dtype=out_dtype)
