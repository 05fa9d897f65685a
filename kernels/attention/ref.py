"""The paged KV cache write, and causal GQA attention over paged K/V in plain jnp (the
kernels' reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def write_kv(
    k_pages: jax.Array,  # [NP+1, PS, Hkv, Dh] last page is the pad sink
    v_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    k: jax.Array,  # [T, Hkv, Dh]
    v: jax.Array,  # [T, Hkv, Dh]
    slot_mapping: jax.Array,  # i32[T] page * PS + offset; pad tokens point into the pad page
) -> tuple[jax.Array, jax.Array]:
    """Scatter each token's K/V into its page slot; returns the new ``(k_pages, v_pages)``."""
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"expected k_pages, v_pages [NP+1, PS, Hkv, Dh]; got {k_pages.shape}, {v_pages.shape}"
        )
    num_tokens = k.shape[0]
    if k.shape != (num_tokens,) + k_pages.shape[2:] or v.shape != k.shape:
        raise ValueError(
            f"expected k, v [T, Hkv, Dh] = [T, {k_pages.shape[2]}, {k_pages.shape[3]}]; "
            f"got {k.shape}, {v.shape}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"expected slot_mapping [T={num_tokens}], got {slot_mapping.shape}")
    pages_shape = k_pages.shape
    flat_shape = (-1,) + pages_shape[2:]
    # Writes into the pad page (padding tokens, filler rows) are dropped, not made: a bucket's
    # padding tokens all map to one slot there, and a scatter with that many copies of an
    # index serializes on it (19 ms a layer against 20 µs: `bench_throughput.py --profile-from 0`).
    sink = (pages_shape[0] - 1) * pages_shape[1]  # the pad page's first slot
    total = pages_shape[0] * pages_shape[1]
    slots = jnp.where(slot_mapping < sink, slot_mapping, total)  # total: out of range, dropped
    new_k = k_pages.reshape(flat_shape).at[slots].set(k.astype(k_pages.dtype), mode="drop")
    new_v = v_pages.reshape(flat_shape).at[slots].set(v.astype(v_pages.dtype), mode="drop")
    return new_k.reshape(pages_shape), new_v.reshape(pages_shape)


def paged_attention_ref(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    v_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    page_table: jax.Array,  # i32[R, MP]
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    *,
    scale: float,
    block_tokens: int = 64,
) -> jax.Array:
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_table.shape[1]
    context = max_pages * page_size

    num_blocks = -(-num_tokens // block_tokens)
    pad = num_blocks * block_tokens - num_tokens
    # Tokens added to fill the last block use row 0, position 0; their outputs are dropped.
    q_blocks = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(
        num_blocks, block_tokens, num_kv_heads, group, head_dim
    )
    row_blocks = jnp.pad(token_rows, (0, pad)).reshape(num_blocks, block_tokens)
    pos_blocks = jnp.pad(token_positions, (0, pad)).reshape(num_blocks, block_tokens)
    key_pos = jnp.arange(context, dtype=jnp.int32)

    def attend_block(inputs):
        qb, rows, positions = inputs  # [bt, Hkv, g, Dh], [bt], [bt]
        pages = page_table[rows]  # [bt, MP]
        kb = k_pages[pages].reshape(block_tokens, context, num_kv_heads, head_dim)
        vb = v_pages[pages].reshape(block_tokens, context, num_kv_heads, head_dim)
        if kb.dtype != q.dtype:  # FP8 pages: multiplied in the query's dtype
            kb, vb = kb.astype(q.dtype), vb.astype(q.dtype)
        visible = key_pos[None, :] <= positions[:, None]  # [bt, L]
        # K/V stay in the cache dtype (the [bt, L, Hkv, Dh] gathers dominate memory); the
        # contractions accumulate in float32.
        scores = scale * jnp.einsum("bkgd,blkd->bkgl", qb, kb, preferred_element_type=jnp.float32)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        # Slots past a token's position may hold garbage (even NaN): 0 * NaN would leak.
        vb = jnp.where(visible[:, :, None, None], vb, jnp.zeros((), vb.dtype))
        return jnp.einsum("bkgl,blkd->bkgd", probs, vb, preferred_element_type=jnp.float32)

    out = lax.map(attend_block, (q_blocks, row_blocks, pos_blocks))
    out = out.reshape(num_blocks * block_tokens, num_q_heads, head_dim)[:num_tokens]
    return out.astype(q.dtype)
