"""The Mamba2 mixer's decode step from the in_proj output: conv update + SiLU, dt processing,
the selective state update with the D skip, and the decode checkpoint copies, reading and
writing the slot-indexed conv and SSM state pools in place.

The reference (``ref.py``) is the chain it replaces: ``causal_conv1d_update``, the slices of
its output, ``selective_state_update``, then the checkpoint copies as gathers and scatters of
whole states. The GPU kernels (``gpu.py``) read the in_proj output by column offset and store
the checkpoints from registers; the GPU's ``auto`` takes them unless ``use_fused`` says
otherwise (they are faster than the chain at every batch size `bench_mamba_decode.py` times).
There is no TPU
kernel: on TPU the op runs that chain with the two ops' Mosaic TPU kernels.
"""

from __future__ import annotations

import functools
import os

import jax

from ..common import check_optional_shapes
from ..conv1d import causal_conv1d_update
from ..dispatch import select_impl
from ..state_update import selective_state_update
from .gpu import GpuBlockSizes, mamba2_decode_gpu
from .ref import DecodeLayout, decode_chain, mamba2_decode_ref

__all__ = ["DecodeLayout", "GpuBlockSizes", "mamba2_decode", "mamba2_decode_ref", "use_fused"]

# "0" turns the GPU's `auto` back to the chain of the two ops' kernels (for A/B runs); read
# at trace time, so a process that flips it must `jax.clear_caches()` (jit reuses its traces).
# Unset or "1": the fused kernels (0.38-0.96 of the chain's time: `bench_mamba_decode.py`).
FUSED_ENV = "JAXMAMBA_FUSED_MAMBA_DECODE"


def use_fused(rows: int) -> bool:
    """Whether a GPU decode step of ``rows`` rows takes the fused kernels (``impl="auto"`` /
    ``"pallas"``; ``"interpret"`` always does)."""
    return os.environ.get(FUSED_ENV, "1") != "0"


def mamba2_decode(
    conv_state: jax.Array,  # [S', K-1, D] slot pool, row S'-1 is the pad slot
    ssm_state: jax.Array,  # [S', H, P, N] slot pool (fp32 default), row S'-1 is the pad slot
    zxbcdt: jax.Array,  # [T, W] in_proj output [z | xBC | dt]; rows [0, B) are the decode rows
    conv_weight: jax.Array,  # [K, D]
    conv_bias: jax.Array | None,  # [D] or None
    A: jax.Array,  # [H] negative
    slots: jax.Array,  # i32[B] slot of each row (pad rows -> pad slot, duplicates allowed there)
    *,
    D: jax.Array | None = None,  # [H]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    track_src: jax.Array | None = None,  # i32[KT] checkpoint copies: from these working slots
    track_dst: jax.Array | None = None,  # i32[KT] ...to these (unused entries: pad → pad)
    track_by_row: jax.Array | None = None,  # i32[B] the same copies by row (pad slot: none)
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode token per row: ``xBC = silu(conv(state, xBC) + bias)``, then
    ``h' = exp(dt A) h + dt x ⊗ B``, ``y = h'·C + D x`` with ``dt = softplus(dt + dt_bias)``
    clipped to ``dt_limit``; after the step the state of slot ``track_src[j]`` is also in
    ``track_dst[j]`` (every ``track_src`` entry with a non-pad ``track_dst`` is one of
    ``slots``). ``track_by_row``, when given, holds each row's target of those copies: the GPU
    kernels read one target a row (they derive it from the list otherwise), the chain the list.

    Returns ``(y [B, H·P] zxbcdt.dtype, new_conv_state, new_ssm_state)``. The GPU kernels
    update both pools in place (aliased): donate them in the jitted caller.
    """
    lay = DecodeLayout.of(ssm_state, conv_weight, A)
    rows = slots.shape[0]
    k = conv_weight.shape[0]
    if (
        zxbcdt.ndim != 2
        or zxbcdt.shape[1] != lay.width
        or zxbcdt.shape[0] < rows
        or slots.ndim != 1
        or conv_state.shape != (ssm_state.shape[0], k - 1, lay.conv_dim)
    ):
        raise ValueError(
            f"expected zxbcdt [T >= B={rows}, W={lay.width}], slots [B] and conv_state "
            f"[S'={ssm_state.shape[0]}, K-1={k - 1}, D={lay.conv_dim}]; got zxbcdt "
            f"{zxbcdt.shape}, slots {slots.shape}, conv_state {conv_state.shape}"
        )
    if (track_src is None) != (track_dst is None) or (
        track_src is not None and (track_src.ndim != 1 or track_src.shape != track_dst.shape)
    ):
        raise ValueError(
            "track_src and track_dst go together, both [KT]; got "
            f"{None if track_src is None else track_src.shape}, "
            f"{None if track_dst is None else track_dst.shape}"
        )
    if track_by_row is not None and (track_src is None or track_by_row.shape != (rows,)):
        raise ValueError(
            f"track_by_row goes with track_src/track_dst and is [B={rows}]; got "
            f"{track_by_row.shape} with track_src {None if track_src is None else track_src.shape}"
        )
    check_optional_shapes(
        conv_bias=(conv_bias, (lay.conv_dim,)),
        D=(D, (lay.num_heads,)),
        dt_bias=(dt_bias, (lay.num_heads,)),
    )
    chain = functools.partial(
        decode_chain,
        functools.partial(causal_conv1d_update, impl=impl),
        functools.partial(selective_state_update, impl=impl),
    )

    def gpu(*args, interpret: bool, **kwargs):
        if interpret or use_fused(rows):
            return mamba2_decode_gpu(*args, track_by_row=track_by_row, interpret=interpret,
                                     **kwargs)  # fmt: skip
        return chain(*args, **kwargs)

    # No TPU kernel of its own: there the chain runs the two ops' TPU kernels.
    fn = select_impl("mamba2_decode", impl, ref=chain, pallas_gpu=gpu, ref_where_no_kernel=True)
    return fn(
        conv_state, ssm_state, zxbcdt, conv_weight, conv_bias, A, slots,
        D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        track_src=track_src, track_dst=track_dst,
    )  # fmt: skip
