"""Depthwise causal conv1d over packed variable-length sequences, and its decode update.

``out[t] = act(sum_k weight[k] * in[t - (K-1) + k] + bias)`` per channel, where inputs before
a sequence's first token come from its initial state (the K-1 preceding inputs, oldest first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .conv1d_pallas import (
    causal_conv1d_update_gpu,
    causal_conv1d_update_tpu,
    causal_conv1d_varlen_gpu,
    causal_conv1d_varlen_tpu,
)
from .dispatch import select_impl

_ACTIVATIONS = (None, "silu", "swish")


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    return y if activation is None else jax.nn.silu(y)


def token_seq_ids(cu_seqlens: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: the sequence of each packed token (padding tokens get the last sequence).

    With empty sequences several entries of ``cu_seqlens`` are equal; ``side="right"`` picks
    the last of them, i.e. the non-empty sequence that actually holds the token.
    ``compare_all`` ([T, S+1] compares) is cheap for S in the hundreds, vectorises on every
    backend and compiles much faster than the default while-loop search.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right", method="compare_all").astype(jnp.int32) - 1
    return jnp.clip(seq, 0, num_seqs - 1)


def conv_window_indices(
    cu_seqlens: jax.Array,  # i32[S+1]
    seqs: jax.Array,  # i32[...] sequence of each window
    ends: jax.Array,  # i32[...] relative position just after each window
    *,
    width: int,
    state_len: int,
    num_tokens: int,
    has_initial_states: bool = True,
) -> jax.Array:
    """i32[..., width]: rows of the ``width`` inputs preceding relative position ``ends``.

    Rows index the concatenation ``[x (T rows); initial_states.reshape(S*state_len, D) (only
    if has_initial_states); one zero row]``: relative position ``p >= 0`` is token
    ``cu_seqlens[s] + p``; ``-state_len <= p < 0`` is row ``p`` of the sequence's initial
    state, or the zero row without initial states.
    """
    p = ends[..., None] - width + jnp.arange(width, dtype=jnp.int32)
    token_rows = cu_seqlens[seqs][..., None] + p
    if has_initial_states:
        state_rows = num_tokens + seqs[..., None] * state_len + state_len + p
    else:
        state_rows = jnp.full_like(p, num_tokens)  # the zero row right after x
    return jnp.where(p >= 0, token_rows, state_rows).astype(jnp.int32)


def _check_conv_shapes(x, weight, bias, initial_states, num_seqs):
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


def causal_conv1d_varlen_ref(
    x: jax.Array,  # [T, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D]
    track_ends: jax.Array | None = None,  # i32[S]
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    num_tokens, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    k = weight.shape[0]
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype

    has_initial_states = initial_states is not None
    parts = [x.astype(jnp.float32)]
    if has_initial_states:
        parts.append(initial_states.reshape(num_seqs * (k - 1), dim).astype(jnp.float32))
    parts.append(jnp.zeros((1, dim), jnp.float32))
    source = jnp.concatenate(parts)  # [T (+ S*(K-1)) + 1, D]; the last row is zero

    window = dict(state_len=k - 1, num_tokens=num_tokens, has_initial_states=has_initial_states)
    seq = token_seq_ids(cu_seqlens, num_tokens)
    rel = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[seq]
    # Padding tokens (>= cu_seqlens[-1]) read only tokens <= themselves, never a real output.
    rows = conv_window_indices(cu_seqlens, seq, rel + 1, width=k, **window)  # [T, K]
    w = weight.astype(jnp.float32)
    y = jnp.zeros((num_tokens, dim), jnp.float32)
    # One tap at a time keeps the gather at [T, D] instead of [T, K, D].
    for tap in range(k):
        y = y + w[tap] * source[rows[:, tap]]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = _activate(y, activation).astype(x.dtype)

    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    final_rows = conv_window_indices(cu_seqlens, seqs, lengths, width=k - 1, **window)
    final_states = source[final_rows].astype(state_dtype)  # [S, K-1, D]
    tracked = None
    if track_ends is not None:
        track_rows = conv_window_indices(cu_seqlens, seqs, track_ends, width=k - 1, **window)
        tracked = source[track_rows].astype(state_dtype)
    return y, final_states, tracked


def causal_conv1d_varlen(
    x: jax.Array,  # [T, D] activation dtype
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D] or None
    cu_seqlens: jax.Array,  # i32[S+1] monotone; tokens >= cu_seqlens[-1] are padding
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D] or None (zeros)
    track_ends: jax.Array | None = None,  # i32[S] relative positions, 0 <= e <= len_s
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Causal depthwise conv over packed sequences.

    Returns ``(y [T, D] x.dtype, final_states [S, K-1, D], tracked [S, K-1, D] or None)``:
    the final window is the K-1 inputs before position ``len_s`` (the initial state for an
    empty sequence); ``tracked`` is the window before position ``track_ends[s]``. States
    have the dtype of ``initial_states`` (float32 without).
    """
    num_seqs = cu_seqlens.shape[0] - 1
    _check_conv_shapes(x, weight, bias, initial_states, num_seqs)
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
    )


def causal_conv1d_update_ref(
    conv_state: jax.Array,  # [S', K-1, D]
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    slots: jax.Array,  # i32[B]
    *,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    window = jnp.concatenate(
        [conv_state[slots].astype(jnp.float32), x.astype(jnp.float32)[:, None]], axis=1
    )  # [B, K, D]
    y = jnp.einsum("bkd,kd->bd", window, weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = _activate(y, activation).astype(x.dtype)
    new_state = conv_state.at[slots].set(window[:, 1:].astype(conv_state.dtype))
    return y, new_state


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
    _check_conv_shapes(x, weight, bias, None, 0)
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
