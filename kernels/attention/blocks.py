"""What the paged-attention kernels share: the query blocks of a packed step.

Both kernels give one program a **query block**: up to ``tokens_per_block`` consecutive tokens
of one row, so the program reads that row's K/V pages once for all of its tokens (and, per KV
head, for all ``Hq / Hkv`` query heads of the group). Blocks are cut from the packed tokens on
device with static shapes: a new block starts where the row changes and every
``tokens_per_block`` tokens within a run of one row.

Layout contract (what `jaxmamba.model.metadata.ForwardMetadata` produces): the tokens of each
row are consecutive, and padding tokens come last (they may belong to any row, at any
position). So there are at most ``R + 1`` runs of equal rows and at most
``ceil(T / tokens_per_block) + R`` blocks. A token's K/V must be written before the call, and
every position up to the largest position of a block must hold finite K/V (the row's cached
prefix and this step's tokens do); positions past it may hold anything, NaN included.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class QueryBlocks(NamedTuple):
    start: jax.Array  # i32[NB] first token of the block (T for unused blocks)
    length: jax.Array  # i32[NB] tokens in the block, <= tokens_per_block (0: unused)
    row: jax.Array  # i32[NB] page-table row of the block's tokens
    max_position: jax.Array  # i32[NB] largest position of the block's tokens (-1: unused)
    token_block: jax.Array  # i32[T] block of each token
    token_offset: jax.Array  # i32[T] index of each token inside its block


def num_query_blocks(num_tokens: int, num_rows: int, tokens_per_block: int) -> int:
    """Static bound on the blocks of a step that follows the layout contract."""
    runs = min(num_tokens, num_rows + 1)  # each row once, plus trailing padding tokens
    return max(1, min(num_tokens, -(-num_tokens // tokens_per_block) + runs - 1))


def build_query_blocks(
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    num_rows: int,
    tokens_per_block: int,
) -> QueryBlocks:
    """Cut the packed tokens into query blocks (on device; no host sync, sized nonzero).
    A step builds them once (``ForwardMetadata``) and every attention layer reads them."""
    with jax.named_scope("attention_query_blocks"):
        return _build_query_blocks(token_rows, token_positions, num_rows, tokens_per_block)


def check_query_blocks(blocks: QueryBlocks, num_tokens: int, num_rows: int, tokens_per_block: int):
    """Raise if ``blocks`` were not cut for this step's shape and the kernel's block size."""
    num_blocks = num_query_blocks(num_tokens, num_rows, tokens_per_block)
    if blocks.start.shape != (num_blocks,) or blocks.token_block.shape != (num_tokens,):
        raise ValueError(
            f"query blocks of {blocks.start.shape[0]} blocks over {blocks.token_block.shape[0]} "
            f"tokens do not fit this kernel: expected {num_blocks} blocks of <= "
            f"{tokens_per_block} tokens over T={num_tokens} (R={num_rows}); build them with "
            "attention_query_blocks for the same impl"
        )


def _build_query_blocks(token_rows, token_positions, num_rows, tokens_per_block):
    num_tokens = token_rows.shape[0]
    num_blocks = num_query_blocks(num_tokens, num_rows, tokens_per_block)
    token_rows = token_rows.astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    run_begins = jnp.concatenate([jnp.ones((1,), bool), token_rows[1:] != token_rows[:-1]])
    run_start = lax.cummax(jnp.where(run_begins, t, 0), axis=0)
    begins = (t - run_start) % tokens_per_block == 0
    (start,) = jnp.nonzero(begins, size=num_blocks, fill_value=num_tokens)
    start = start.astype(jnp.int32)
    end = jnp.concatenate([start[1:], jnp.full((1,), num_tokens, jnp.int32)])
    length = jnp.minimum(end - start, tokens_per_block)
    token_block = jnp.cumsum(begins, dtype=jnp.int32) - 1
    max_position = jax.ops.segment_max(
        token_positions.astype(jnp.int32), token_block, num_segments=num_blocks
    )
    return QueryBlocks(
        start=start,
        length=length,
        row=token_rows[jnp.minimum(start, num_tokens - 1)],
        max_position=jnp.where(length > 0, max_position, -1),
        token_block=token_block,
        token_offset=t - start[jnp.minimum(token_block, num_blocks - 1)],
    )
