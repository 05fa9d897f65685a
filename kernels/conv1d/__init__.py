"""Depthwise causal conv1d over packed variable-length sequences, and its decode update.

``out[t] = act(sum_k weight[k] * in[t - (K-1) + k] + bias)`` per channel, where inputs before
a sequence's first token come from its initial state (the K-1 preceding inputs, oldest first).
The references are in ``ref.py``, the Mosaic TPU kernels in ``tpu.py``, the Triton-lowered GPU
kernels in ``gpu.py``. The GPU kernels' SiLU is exact for float32 outputs and, for bf16
outputs, a ``tanh.approx`` form whose error is a small part of the bf16 rounding for
y >= -8 (``gpu.silu``).
"""

from __future__ import annotations

import jax

from ..common import ColumnView
from ..dispatch import select_impl
from .gpu import causal_conv1d_update_gpu, causal_conv1d_varlen_gpu
from .ref import (
    TokenStarts,
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
    check_activation,
    conv_window_indices,
    token_seq_ids,
    token_starts,
    windows_at,
)
from .tpu import causal_conv1d_update_tpu, causal_conv1d_varlen_tpu

__all__ = [
    "TokenStarts",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "causal_conv1d_varlen",
    "causal_conv1d_varlen_ref",
    "conv_window_indices",
    "token_seq_ids",
    "token_starts",
    "windows_at",
]


def _check_conv_shapes(x, weight, bias, initial_states, num_seqs, activation):
    check_activation(activation)
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"expected x [T, D] and weight [K, D]; got x {x.shape}, weight {weight.shape}"
        )
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"expected bias [D={x.shape[1]}], got {bias.shape}")
    k = weight.shape[0]
    if initial_states is not None and initial_states.shape != (num_seqs, k - 1, x.shape[1]):
        raise ValueError(
            f"expected initial_states [S={num_seqs}, K-1={k - 1}, D={x.shape[1]}], "
            f"got {initial_states.shape}"
        )


def causal_conv1d_varlen(
    x: jax.Array | ColumnView,  # [T, D] activation dtype
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D] or None
    cu_seqlens: jax.Array,  # i32[S+1] monotone; tokens >= cu_seqlens[-1] are padding
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D] or None (zeros)
    track_ends: jax.Array | None = None,  # i32[S] relative positions, 0 <= e <= len_s
    activation: str | None = "silu",
    starts: TokenStarts | None = None,  # token_starts(cu_seqlens, T), once per step
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Causal depthwise conv over packed sequences.

    Returns ``(y [T, D] x.dtype, final_states [S, K-1, D], tracked [S, K-1, D] or None)``:
    the final window is the K-1 inputs before position ``len_s`` (the initial state for an
    empty sequence); ``tracked`` is the window before position ``track_ends[s]``. States
    have the dtype of ``initial_states`` (float32 without).

    ``x`` may be a ``ColumnView`` (D columns of a wider array, e.g. the in_proj output): the
    GPU kernel reads it in place, the reference and the TPU kernel take its slice.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    _check_conv_shapes(x, weight, bias, initial_states, num_seqs, activation)
    if track_ends is not None and track_ends.shape != (num_seqs,):
        raise ValueError(f"expected track_ends [S={num_seqs}], got {track_ends.shape}")
    fn = select_impl(
        "causal_conv1d_varlen",
        impl,
        ref=causal_conv1d_varlen_ref,
        pallas_tpu=causal_conv1d_varlen_tpu,
        pallas_gpu=causal_conv1d_varlen_gpu,
    )
    return fn(
        x,
        weight,
        bias,
        cu_seqlens,
        initial_states=initial_states,
        track_ends=track_ends,
        activation=activation,
        starts=starts,
    )


def causal_conv1d_update(
    conv_state: jax.Array,  # [S', K-1, D] slot pool, row S'-1 is the pad slot
    x: jax.Array,  # [B, D] one new token per row
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D] or None
    slots: jax.Array,  # i32[B] slot of each row (pad rows -> pad slot, duplicates allowed there)
    *,
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One decode step: returns ``(y [B, D] x.dtype, new_conv_state [S', K-1, D])``.

    The Pallas kernels shift ``conv_state`` in place (aliased); donate it in the jitted caller.
    """
    if x.ndim != 2 or slots.shape != (x.shape[0],):
        raise ValueError(f"expected x [B, D] and slots [B]; got x {x.shape}, slots {slots.shape}")
    _check_conv_shapes(x, weight, bias, None, 0, activation)
    k = weight.shape[0]
    if conv_state.ndim != 3 or conv_state.shape[1:] != (k - 1, x.shape[1]):
        raise ValueError(
            f"expected conv_state [S', K-1={k - 1}, D={x.shape[1]}], got {conv_state.shape}"
        )
    fn = select_impl(
        "causal_conv1d_update",
        impl,
        ref=causal_conv1d_update_ref,
        pallas_tpu=causal_conv1d_update_tpu,
        pallas_gpu=causal_conv1d_update_gpu,
    )
    return fn(conv_state, x, weight, bias, slots, activation=activation)
