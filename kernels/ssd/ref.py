"""The varlen chunked SSD scan in plain jnp (float32 throughout): the kernels' reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..common import ColumnView, as_array, process_dt
from .layout import ChunkLayout, build_chunk_layout, to_chunks


def ssd_varlen_ref(
    x: jax.Array | ColumnView,  # [T, H, P]
    dt: jax.Array | ColumnView,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array | ColumnView,  # [T, G, N]
    C: jax.Array | ColumnView,  # [T, G, N]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    chunk_size: int,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | ColumnView | None = None,  # [T, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: jax.Array | None = None,  # [S, H, P, N]
    start_positions: jax.Array | None = None,  # i32[S]
    layout: ChunkLayout | None = None,
    return_chunk_states: bool = False,
    state_chunks: jax.Array | None = None,  # i32[K]
):
    x, dt, B, C = (as_array(a) for a in (x, dt, B, C))
    z = None if z is None else as_array(z)
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    heads_per_group = num_heads // num_groups
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    nc = layout.token_index.shape[0]
    idx = layout.token_index

    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    # Heads split as (G, R): head h uses group h // R.
    xc = to_chunks(x.astype(jnp.float32), idx).reshape(
        nc, chunk_size, num_groups, heads_per_group, head_dim
    )
    dtc = to_chunks(dt, idx).reshape(nc, chunk_size, num_groups, heads_per_group)
    bc = to_chunks(B.astype(jnp.float32), idx)  # [NC, C, G, N]
    cc = to_chunks(C.astype(jnp.float32), idx)  # [NC, C, G, N]
    a = A.astype(jnp.float32).reshape(num_groups, heads_per_group)

    # Empty positions have dt = 0, so they neither decay nor contribute.
    da_cum = jnp.cumsum(dtc * a, axis=1)  # [NC, C, G, R], non-increasing along C
    dtx = dtc[..., None] * xc  # [NC, C, G, R, P]

    # Intra-chunk (diagonal blocks): y_i += sum_{j<=i} (C_i·B_j) exp(cum_i - cum_j) dt_j x_j.
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    seg = da_cum[:, :, None] - da_cum[:, None, :]  # [NC, Ci, Cj, G, R]
    decay = jnp.exp(jnp.where(causal[None, :, :, None, None], seg, -jnp.inf))
    cb = jnp.einsum("cign,cjgn->cijg", cc, bc)  # [NC, Ci, Cj, G]
    y = jnp.einsum("cijgr,cjgrp->cigrp", cb[..., None] * decay, dtx)

    # Chunk-local end states (from a zero entering state).
    decay_to_end = jnp.exp(da_cum[:, -1:] - da_cum)  # [NC, C, G, R]
    local_states = jnp.einsum("cjgn,cjgr,cjgrp->cgrpn", bc, decay_to_end, dtx)
    chunk_decay = jnp.exp(da_cum[:, -1])  # [NC, G, R]

    # Sequential pass over chunks in packed order; a sequence's first chunk starts from its
    # initial state. Unused chunks (chunk_seq == S) read the appended zero state.
    state_shape = (num_groups, heads_per_group, head_dim, state_size)
    if initial_states is None:
        init = jnp.zeros((num_seqs + 1,) + state_shape, jnp.float32)
    else:
        init = jnp.concatenate(
            [
                initial_states.astype(jnp.float32).reshape((num_seqs,) + state_shape),
                jnp.zeros((1,) + state_shape, jnp.float32),
            ]
        )

    def step(carry, inputs):
        first, seq, dec, local = inputs
        entering = jnp.where(first, init[seq], carry)
        out = entering * dec[..., None, None] + local
        return out, (entering, out)

    # chunk_states of unused chunks are arbitrary (they carry the previous state along).
    _, (entering, chunk_states) = lax.scan(
        step,
        jnp.zeros(state_shape, jnp.float32),
        (layout.chunk_first, layout.chunk_seq, chunk_decay, local_states),
    )

    # Inter-chunk (off-diagonal): y_i += exp(cum_i) C_i · entering state.
    y = y + jnp.einsum("cign,cgrpn,cigr->cigrp", cc, entering, jnp.exp(da_cum))

    y = y.reshape(nc * chunk_size, num_heads, head_dim)
    y = (
        jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)
        .at[idx.reshape(-1)]
        .set(y, mode="drop")
    )
    if D is not None:
        y = y + D.astype(jnp.float32)[:, None] * x.astype(jnp.float32)
    if z is not None:
        y = y * jax.nn.silu(z.astype(jnp.float32))
    y = y.astype(x.dtype)

    chunk_states = chunk_states.reshape(nc, num_heads, head_dim, state_size)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    final_states = jnp.where(
        (lengths > 0)[:, None, None, None],
        chunk_states[layout.seq_last_chunk],
        init[:num_seqs].reshape(num_seqs, num_heads, head_dim, state_size),
    ).astype(state_dtype)
    if return_chunk_states:
        return y, final_states, chunk_states.astype(state_dtype)
    if state_chunks is not None:
        return y, final_states, chunk_states[state_chunks].astype(state_dtype)
    return y, final_states
