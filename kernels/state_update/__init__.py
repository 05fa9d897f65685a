"""Decode-step selective state update for Mamba2, reading and writing a slot-indexed pool.

The reference is in ``ref.py``, the Mosaic TPU kernel in ``tpu.py``, the Triton-lowered GPU
kernel in ``gpu.py``.
"""

from __future__ import annotations

import jax

from ..common import check_optional_shapes
from ..dispatch import select_impl
from .gpu import selective_state_update_gpu
from .ref import selective_state_update_ref
from .tpu import selective_state_update_tpu

__all__ = ["selective_state_update", "selective_state_update_ref"]


def selective_state_update(
    state: jax.Array,  # [S', H, P, N] slot pool (fp32 default), row S'-1 is the pad slot
    x: jax.Array,  # [B, H, P] activation dtype
    dt: jax.Array,  # [B, H] raw dt (before bias/softplus)
    A: jax.Array,  # [H] negative
    B: jax.Array,  # [B, G, N]
    C: jax.Array,  # [B, G, N]
    slots: jax.Array,  # i32[B] slot of each row (pad rows -> pad slot, duplicates allowed there)
    *,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | None = None,  # [B, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """``h' = exp(dt A) h + dt x ⊗ B``; ``y = h'·C + D x``, gated by ``silu(z)``.

    Returns ``(y [B, H, P] x.dtype, new_state [S', H, P, N] state.dtype)``. The Pallas
    kernels update ``state`` in place (aliased); donate it in the jitted caller so XLA does
    not copy it first.
    """
    if x.ndim != 3 or state.ndim != 4 or state.shape[1:3] != x.shape[1:]:
        raise ValueError(
            f"expected state [S', H, P, N] and x [B, H, P]; got {state.shape}, {x.shape}"
        )
    rows, num_heads, _ = x.shape
    num_groups = B.shape[1] if B.ndim == 3 else 0
    if (
        dt.shape != (rows, num_heads)
        or A.shape != (num_heads,)
        or B.shape != (rows, num_groups, state.shape[3])
        or C.shape != B.shape
        or slots.shape != (rows,)
        or num_groups == 0
        or num_heads % num_groups
    ):
        raise ValueError(
            f"expected dt [B, H], A [H], B/C [B, G, N] with H % G == 0, slots [B] for "
            f"x {x.shape}, state {state.shape}; got dt {dt.shape}, A {A.shape}, B {B.shape}, "
            f"C {C.shape}, slots {slots.shape}"
        )
    check_optional_shapes(D=(D, (num_heads,)), dt_bias=(dt_bias, (num_heads,)), z=(z, x.shape))
    fn = select_impl(
        "selective_state_update",
        impl,
        ref=selective_state_update_ref,
        pallas_tpu=selective_state_update_tpu,
        pallas_gpu=selective_state_update_gpu,
    )
    return fn(
        state,
        x,
        dt,
        A,
        B,
        C,
        slots,
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
    )
