"""Gated group RMSNorm, the Mamba2 mixer's norm after the SSD scan:
``rmsnorm(y * silu(z))`` within ``G`` equal groups of the last axis, times a float32 ``scale``.

z is a column range of the in_proj output ``[z | xBC | dt]``: the op takes that whole array and
the range's first column, so the GPU kernel reads z in place. The reference (``ref.py``)
computes in float32 through XLA; the Pallas GPU kernel (``gpu.py``) streams y and z once and
writes the output once. No TPU kernel: on TPU every impl but ``"interpret"`` runs the
reference (XLA fuses it into one pass there), so a model whose ops take ``impl="pallas"`` runs.
"""

from __future__ import annotations

import jax

from ..dispatch import select_impl
from .gpu import GpuBlockSizes, gated_group_rmsnorm_gpu, group_pieces
from .ref import gated_group_rmsnorm_ref

__all__ = [
    "GpuBlockSizes",
    "gated_group_rmsnorm",
    "gated_group_rmsnorm_ref",
    "group_pieces",
]


def gated_group_rmsnorm(
    y: jax.Array,  # [T, W]
    z_source: jax.Array,  # [T, Wz] z is columns [z_offset, z_offset + W), e.g. the in_proj out
    scale: jax.Array,  # f32[W]
    *,
    num_groups: int,
    eps: float,
    z_offset: int = 0,
    out_dtype=None,  # default y.dtype
    impl: str = "auto",
) -> jax.Array:
    """``scale * g * rsqrt(mean(g²) + eps)`` with ``g = y * silu(z)``, the mean over each of
    ``num_groups`` equal groups of W columns, computed in float32; returns ``[T, W]`` in
    ``out_dtype``. ``impl="auto"`` is the Pallas GPU kernel on CUDA and the reference on CPU
    and TPU (``"pallas"`` too there: the op has no TPU kernel)."""
    if y.ndim != 2 or z_source.ndim != 2 or z_source.shape[0] != y.shape[0]:
        raise ValueError(
            f"expected y [T, W] and z_source [T, Wz]; got y {y.shape}, z_source {z_source.shape}"
        )
    width = y.shape[1]
    if num_groups < 1 or width % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the width W={width}")
    if not 0 <= z_offset <= z_source.shape[1] - width:
        raise ValueError(
            f"z columns [{z_offset}, {z_offset + width}) must lie in z_source {z_source.shape}"
        )
    if scale.shape != (width,):
        raise ValueError(f"expected scale [W={width}], got {scale.shape}")
    fn = select_impl(
        "gated_group_rmsnorm",
        impl,
        ref=gated_group_rmsnorm_ref,
        pallas_gpu=gated_group_rmsnorm_gpu,
        ref_where_no_kernel=True,  # TPU: XLA fuses the reference into one pass
    )
    return fn(
        y, z_source, scale, num_groups=num_groups, eps=eps, z_offset=z_offset, out_dtype=out_dtype
    )
