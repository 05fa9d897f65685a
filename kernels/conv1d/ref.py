"""The causal conv1d references in plain jnp, and the XLA-side pieces the kernels share
with them: each token's sequence, the windows before a position, the initial-state terms.

``out[t] = act(sum_k weight[k] * in[t - (K-1) + k] + bias)`` per channel, where inputs before
a sequence's first token come from its initial state (the K-1 preceding inputs, oldest first).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..common import ColumnView, as_array, as_view

ACTIVATIONS = (None, "silu", "swish")


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    check_activation(activation)
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


class TokenStarts(NamedTuple):
    """Where each packed token's sequence starts: what every varlen conv call reads."""

    seq: jax.Array  # i32[T] sequence of each token (padding tokens: the last sequence)
    start: jax.Array  # i32[T] first packed token of that sequence


def token_starts(cu_seqlens: jax.Array, num_tokens: int) -> TokenStarts:
    """Each token's sequence and that sequence's first token. A step builds them once
    (``ForwardMetadata``) and every Mamba layer's conv reads them."""
    with jax.named_scope("conv_token_starts"):
        seq = token_seq_ids(cu_seqlens, num_tokens)
        return TokenStarts(seq, cu_seqlens[seq])


def check_token_starts(starts: TokenStarts, num_tokens: int) -> None:
    if starts.seq.shape != (num_tokens,) or starts.start.shape != (num_tokens,):
        raise ValueError(
            f"expected token starts seq/start i32[T={num_tokens}], got {starts.seq.shape}, "
            f"{starts.start.shape}"
        )


def state_windows(
    x: jax.Array | ColumnView,  # [T, D]
    initial_states: jax.Array | None,  # [S, width, D]
    cu_seqlens: jax.Array,  # i32[S+1]
    ends: jax.Array,  # i32[S] relative positions
    width: int,
) -> jax.Array:
    """[S, width, D]: the ``width`` inputs before relative position ``ends[s]`` of each
    sequence, in the dtype of ``initial_states`` (float32 without). A gather: no copy of x."""
    num_tokens = x.shape[0]
    p = ends[:, None] - width + jnp.arange(width, dtype=jnp.int32)  # [S, width]
    if num_tokens:
        rows = jnp.clip(cu_seqlens[:-1, None] + p, 0, num_tokens - 1)
        from_x = as_view(x).take_rows(rows).astype(jnp.float32)
    else:  # no tokens: every window lies in the initial state
        from_x = jnp.zeros(p.shape + x.shape[1:], jnp.float32)
    if initial_states is None:
        from_state = jnp.zeros_like(from_x)
    else:
        rows = jnp.clip(width + p, 0, width - 1)  # state row K-1+p for p < 0
        from_state = jnp.take_along_axis(
            initial_states.astype(jnp.float32), rows[..., None], axis=1
        )
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    return jnp.where((p >= 0)[..., None], from_x, from_state).astype(state_dtype)


def windows_at(
    x: jax.Array | ColumnView,  # [T, D]
    initial_states: jax.Array,  # [S, width, D]
    cu_seqlens: jax.Array,  # i32[S+1]
    seqs: jax.Array,  # i32[W] sequence of each window
    ends: jax.Array,  # i32[W] relative position just after each window
    width: int,
) -> jax.Array:
    """[W, width, D]: the ``width`` inputs before relative position ``ends[w]`` of sequence
    ``seqs[w]`` (several windows per sequence allowed), in the dtype of ``initial_states``.
    Two static-shape gathers (tokens, initial-state rows) and a select."""
    num_tokens = x.shape[0]
    p = ends[:, None] - width + jnp.arange(width, dtype=jnp.int32)  # [W, width]
    if num_tokens:
        from_x = as_view(x).take_rows(jnp.clip(cu_seqlens[seqs][:, None] + p, 0, num_tokens - 1))
    else:
        from_x = jnp.zeros(p.shape + x.shape[1:], x.dtype)
    from_state = initial_states[seqs[:, None], jnp.clip(width + p, 0, width - 1)]
    state_dtype = initial_states.dtype
    return jnp.where((p >= 0)[..., None], from_x.astype(state_dtype), from_state)


def final_and_tracked_states(
    x: jax.Array | ColumnView,  # [T, D]
    initial_states: jax.Array | None,  # [S, K-1, D]
    cu_seqlens: jax.Array,  # i32[S+1]
    track_ends: jax.Array | None,  # i32[S]
    width: int,  # K-1
) -> tuple[jax.Array, jax.Array | None]:
    """The windows before each sequence's end and before ``track_ends`` (None without)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    final = state_windows(x, initial_states, cu_seqlens, lengths, width)
    if track_ends is None:
        return final, None
    return final, state_windows(x, initial_states, cu_seqlens, track_ends, width)


def initial_state_terms(weight: jax.Array, initial_states: jax.Array) -> jax.Array:
    """f32[S, K-1, D]: row j is the part of token j's output (relative position j < K-1 in
    its sequence) that comes from the initial state: the taps that reach before the start."""
    k = weight.shape[0]
    w, init = weight.astype(jnp.float32), initial_states.astype(jnp.float32)
    rows = []
    for j in range(k - 1):
        term = jnp.zeros_like(init[:, 0])
        for tap in range(k - 1 - j):  # tap reads position j - (K-1) + tap < 0: state row j + tap
            term = term + w[tap] * init[:, j + tap]
        rows.append(term)
    return jnp.stack(rows, axis=1)


def causal_conv1d_varlen_ref(
    x: jax.Array | ColumnView,  # [T, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D]
    track_ends: jax.Array | None = None,  # i32[S]
    activation: str | None = "silu",
    starts: TokenStarts | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    x = as_array(x)
    num_tokens, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    k = weight.shape[0]
    has_initial_states = initial_states is not None
    parts = [x.astype(jnp.float32)]
    if has_initial_states:
        parts.append(initial_states.reshape(num_seqs * (k - 1), dim).astype(jnp.float32))
    parts.append(jnp.zeros((1, dim), jnp.float32))
    source = jnp.concatenate(parts)  # [T (+ S*(K-1)) + 1, D]; the last row is zero

    window = dict(state_len=k - 1, num_tokens=num_tokens, has_initial_states=has_initial_states)
    if starts is None:
        starts = token_starts(cu_seqlens, num_tokens)
    check_token_starts(starts, num_tokens)
    seq = starts.seq
    rel = jnp.arange(num_tokens, dtype=jnp.int32) - starts.start
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
    final, tracked = final_and_tracked_states(x, initial_states, cu_seqlens, track_ends, k - 1)
    return y, final, tracked


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
