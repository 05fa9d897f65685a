"""Small-M matmul ``y[M, N] = x[M, K] @ W[K, N]`` for decode (M <= 32 rows), and its reference.

At decode the dense projections are weight-streaming GEMVs: the time is reading W once from
HBM, the FLOPs are negligible. The Pallas GPU kernel (``gpu.py``) is built to stream W at HBM
bandwidth; the reference (``ref.py``) is XLA's ``jnp.dot`` with float32 accumulation. No TPU
kernel: ``impl="auto"`` runs the reference there.

Quantized weights (FP8, int8) multiply through ``quantized.scaled_matmul``, on XLA's dot at
every size: the kernel takes bf16 ``[K, N]`` weights only.
"""

from __future__ import annotations

import os

import jax

from ..dispatch import current_platform, select_impl
from .gpu import MAX_ROWS, small_m_matmul_gpu
from .quantized import QuantizedWeight, scaled_grouped_matmul, scaled_matmul
from .ref import small_m_matmul_ref

__all__ = [
    "MAX_ROWS",
    "SMALL_M_ENV",
    "QuantizedWeight",
    "model_small_m_impl",
    "scaled_grouped_matmul",
    "scaled_matmul",
    "small_m_matmul",
    "small_m_matmul_ref",
]

# "0" keeps XLA's dot for the decode projections of GPU models (for A/B runs). Read when a
# model resolves its impls (`model_small_m_impl`), so set it before building the runner.
SMALL_M_ENV = "JAXMAMBA_SMALL_M_MATMUL"
# The impls of a model's ops that can run the GPU kernels; the decode projections take the same.
_GPU_IMPLS = ("auto", "pallas", "auto_gpu", "pallas_gpu")


def model_small_m_impl(impl: str, small_m_impl: str | None = None) -> str | None:
    """The impl of ``small_m_matmul`` for the decode projections of a model whose other ops
    run with ``impl``; None means XLA's dot.

    ``small_m_impl`` None (the default) follows ``impl``: the Pallas GPU kernel where ``impl``
    runs the GPU kernels (``auto``/``pallas`` on CUDA, ``auto_gpu``, ``pallas_gpu``), XLA's
    dot elsewhere (TPU has no kernel; ``ref`` and ``interpret`` runs keep the plain dot):
    ``bench_engine.py --cases d1 d32 --small-m-impls none auto`` times the two.
    ``"xla"`` asks for XLA's dot; any other value is ``small_m_matmul``'s impl, used as given.
    """
    if small_m_impl == "xla":
        return None
    if small_m_impl is not None:
        return small_m_impl
    if os.environ.get(SMALL_M_ENV, "1") == "0":
        return None
    if impl not in _GPU_IMPLS or (impl in ("auto", "pallas") and current_platform() != "gpu"):
        return None
    return impl


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
