"""What the Pallas SSD kernels share: the math of one chunk and the per-chunk metadata.

Both kernels walk each head's chunks in order and keep the running ``[P, N]`` state on chip;
per chunk they compute, in the transposed domain (``P`` on sublanes/rows, chunk positions on
lanes/columns, so every matmul is ``A @ B`` or ``A @ Bᵀ``):

* ``yᵀ = xᵀ (B Cᵀ ∘ Lᵀ ∘ dt)``  — the intra-chunk quadratic form (MXU / tensor cores),
* ``yᵀ += state Cᵀ ∘ exp(cum)``  — the inter-chunk term from the carried state,
* ``state = exp(cum_last) state + (xᵀ ∘ dt exp(cum_last - cum)) B``.

Empty chunk positions must arrive with ``dt = 0`` and finite (zero) x, B, C.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .ssd import ChunkLayout


def _dot(a, b, *, transpose_b: bool = False):
    """``a @ b`` (or ``a @ bᵀ``) with float32 accumulation; exact for float32 operands."""
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def chunk_update(
    xt: jax.Array,  # [P, C] dot dtype; zero at empty positions
    dt_row: jax.Array,  # f32[1, C] processed dt; zero at empty positions
    a,  # f32 scalar A of the head
    b: jax.Array,  # [C, N] dot dtype
    c: jax.Array,  # [C, N] dot dtype
    state: jax.Array,  # f32[P, N] state entering the chunk
) -> tuple[jax.Array, jax.Array]:
    """One chunk of one head: ``(yᵀ f32[P, C], state after the chunk f32[P, N])``.

    Written with 2-D shapes, iotas and keepdims reductions only, so it lowers through both
    Mosaic TPU and Triton.
    """
    size = dt_row.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)  # j (source position)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)  # i (target position)
    diag = rows == cols
    da_row = dt_row * a  # [1, C]
    # Column forms and the inclusive cumsum via masked reductions (no transposes, no scans).
    dt_col = jnp.sum(jnp.where(diag, dt_row, 0.0), axis=1, keepdims=True)  # [C, 1]
    cum_col = jnp.sum(jnp.where(cols <= rows, da_row, 0.0), axis=1, keepdims=True)  # [C, 1]
    cum_row = jnp.sum(jnp.where(diag, cum_col, 0.0), axis=0, keepdims=True)  # [1, C]
    total = jnp.sum(da_row, axis=1, keepdims=True)  # [1, 1]

    # decay[j, i] = exp(cum_i - cum_j) for j <= i; exponents are <= 0, so nothing overflows.
    decay = jnp.exp(jnp.where(rows <= cols, cum_row - cum_col, -jnp.inf))  # [Cj, Ci]
    bc = _dot(b, c, transpose_b=True)  # [Cj, Ci] = B_j · C_i
    mt = (bc * decay * dt_col).astype(xt.dtype)
    yt = _dot(xt, mt)  # [P, Ci]
    yt = yt + _dot(state.astype(c.dtype), c, transpose_b=True) * jnp.exp(cum_row)

    w_row = dt_row * jnp.exp(total - cum_row)  # [1, C] weight of each position in the end state
    xw = (xt.astype(jnp.float32) * w_row).astype(xt.dtype)
    new_state = jnp.exp(total) * state + _dot(xw, b)  # [P, N]
    return yt, new_state


class ChunkMeta(NamedTuple):
    """Per-chunk scalars the kernels read (scalar prefetch on TPU, plain loads on GPU)."""

    token_lo: jax.Array  # i32[NC] first packed token of the chunk (T for unused chunks)
    token_count: jax.Array  # i32[NC] number of tokens in the chunk (0 for unused)
    track: jax.Array  # i32[NC] 1 where the end state of the chunk is wanted
    slot: jax.Array  # i32[NC] rank of the chunk among tracked chunks (monotone, >= 0)
    num_slots: int  # static rows of the tracked-states output


def chunk_tokens(layout: ChunkLayout, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(first packed token, number of tokens), i32[NC] each, of every chunk."""
    idx = layout.token_index  # [NC, C]
    token_lo = jnp.min(idx, axis=1).astype(jnp.int32)
    token_count = jnp.sum(idx < num_tokens, axis=1, dtype=jnp.int32)
    return token_lo, token_count


def chunk_meta(
    layout: ChunkLayout,
    num_tokens: int,
    state_chunks: jax.Array | None,  # i32[K] or None
    all_chunks: bool,
) -> ChunkMeta:
    """Token range of every chunk and where each requested chunk state goes."""
    nc = layout.token_index.shape[0]
    token_lo, token_count = chunk_tokens(layout, num_tokens)
    if all_chunks:
        track = jnp.ones((nc,), jnp.int32)
        num_slots = nc
    elif state_chunks is not None:
        track = jnp.zeros((nc,), jnp.int32).at[state_chunks].set(1, mode="drop")
        num_slots = max(1, min(nc, state_chunks.shape[0]))
    else:
        track = jnp.zeros((nc,), jnp.int32)
        num_slots = 1
    slot = jnp.maximum(jnp.cumsum(track, dtype=jnp.int32) - 1, 0)
    return ChunkMeta(token_lo, token_count, track, slot, num_slots)


def gather_tracked(
    states: jax.Array,  # [num_slots, H, P, N]
    meta: ChunkMeta,
    state_chunks: jax.Array | None,  # i32[K]
    all_chunks: bool,
) -> jax.Array | None:
    if all_chunks:
        return states
    if state_chunks is None:
        return None
    return states[meta.slot[state_chunks]]


class TrackedRequests(NamedTuple):
    """Which rows of the tracked-states output each chunk's end state fills: chunk ``c`` fills
    rows ``order[lo[c]:hi[c]]``, so a kernel writes every requested state straight into its
    row (duplicates included) and no gather copies them afterwards."""

    lo: jax.Array  # i32[NC]
    hi: jax.Array  # i32[NC]
    order: jax.Array  # i32[max(K, 1)] output rows sorted by their chunk
    num_rows: int  # K: rows of the tracked-states output


def tracked_requests(
    num_chunks: int, state_chunks: jax.Array | None, all_chunks: bool
) -> TrackedRequests:
    """The requests of ``state_chunks`` (``return_chunk_states``: every chunk) by chunk.

    A requested chunk index is read as ``chunk_states[state_chunks]`` reads it: negative
    indices count from the end, and out-of-range ones are clamped.
    """
    chunks = jnp.arange(num_chunks, dtype=jnp.int32)
    if all_chunks:
        return TrackedRequests(chunks, chunks + 1, chunks, num_chunks)
    if state_chunks is None or state_chunks.shape[0] == 0:
        none = jnp.zeros((num_chunks,), jnp.int32)
        return TrackedRequests(none, none, jnp.zeros((1,), jnp.int32), 0)
    wanted = state_chunks.astype(jnp.int32)
    wanted = jnp.clip(jnp.where(wanted < 0, wanted + num_chunks, wanted), 0, num_chunks - 1)
    order = jnp.argsort(wanted, stable=True).astype(jnp.int32)
    by_chunk = wanted[order]
    lo = jnp.searchsorted(by_chunk, chunks, side="left", method="compare_all")
    hi = jnp.searchsorted(by_chunk, chunks, side="right", method="compare_all")
    return TrackedRequests(lo.astype(jnp.int32), hi.astype(jnp.int32), order, state_chunks.shape[0])
