"""What a shard's layers do differently under tensor parallelism, inside `shard_map`.

`ShardLayout` is the one static object the model's modules receive (None without TP). The
helpers here are the only places the forward communicates: one all-reduce after every
row-parallel projection (`reduce`), the vocab-parallel embedding lookup (one all-reduce),
the logits all-gather before sampling, and — only when a gated-norm group straddles two
shards — a small all-reduce of per-group sums of squares.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class ShardLayout:
    axis: str  # the mesh axis the model is split over
    size: int  # shards
    vocab_size: int  # the model's vocabulary (logits are cut back to it after the gather)
    vocab_rows: int  # embedding / lm_head rows per shard (vocabulary padded to size·rows)
    norm_group_size: int  # columns per gated-norm group: global d_inner / n_groups


def reduce(y: jax.Array, tp: ShardLayout | None) -> jax.Array:
    """Sum a row-parallel projection's partial outputs over the shards (float32 in, out)."""
    return y if tp is None else lax.psum(y, tp.axis)


def embed_lookup(table: jax.Array, ids: jax.Array, tp: ShardLayout | None) -> jax.Array:
    """Rows of a vocab-parallel table `[V/n, E]` for token ids `i32[T]`: each shard looks up
    the ids it holds, zeros elsewhere, then one all-reduce."""
    if tp is None:
        return jnp.take(table, ids, axis=0)
    local = ids - lax.axis_index(tp.axis) * tp.vocab_rows
    mine = (local >= 0) & (local < tp.vocab_rows)
    rows = jnp.take(table, jnp.clip(local, 0, tp.vocab_rows - 1), axis=0)
    return lax.psum(jnp.where(mine[:, None], rows, jnp.zeros_like(rows)), tp.axis)


def gather_logits(logits: jax.Array, tp: ShardLayout | None) -> jax.Array:
    """`[..., V/n]` vocab-parallel logits → the full `[..., V]` on every shard."""
    if tp is None:
        return logits
    full = lax.all_gather(logits, tp.axis, axis=logits.ndim - 1, tiled=True)
    return full[..., : tp.vocab_size]


def group_mean_square(
    y: jax.Array,  # f32[T, W] this shard's columns of the gated output
    group_size: int,
    tp: ShardLayout | None,
) -> jax.Array:
    """Mean of squares of every column's norm group, broadcast back to `[T, W]`. A group
    inside one shard is reduced locally; groups that straddle shards (n_groups not a
    multiple of the shard count) sum per-group partial squares across shards."""
    T, W = y.shape
    if tp is None or W % group_size == 0:
        grouped = y.reshape(T, W // group_size, group_size)
        ms = jnp.mean(grouped * grouped, axis=-1, keepdims=True)
        return jnp.broadcast_to(ms, grouped.shape).reshape(T, W)
    num_groups = W * tp.size // group_size
    group = (lax.axis_index(tp.axis) * W + jnp.arange(W)) // group_size  # [W]
    partial = jax.ops.segment_sum((y * y).T, group, num_segments=num_groups)  # [G, T]
    total = lax.psum(partial, tp.axis)
    return (total[group] / group_size).T
