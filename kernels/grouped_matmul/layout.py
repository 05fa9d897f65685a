"""Where every (token, expert) assignment of a routing sits in the grouped matmul's row blocks:
what the reference and the GPU kernel share.

The assignments are sorted by expert and each expert's group is padded to whole blocks of
``block_rows`` rows, so every block belongs to one expert. Shapes are static: ``A = T·k``
assignments touch at most ``min(X, A)`` experts, each with at most one partial block, so
``num_blocks(A, X, block_rows)`` blocks hold any routing; the blocks past the last used one
are marked unused (expert -1). For a handful of assignments, `assignment_blocks` gives each
its own block instead: no sort, no counts, nothing scattered.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertBlocks(NamedTuple):
    """The row-block layout of one routing (a pytree)."""

    rows: jax.Array  # i32[NB·BM] token of each padded row; T for a padding row
    position: jax.Array  # i32[A] padded row of each assignment, in assignment order (t·k + j)
    block_expert: jax.Array  # i32[NB] expert of each block; -1 for an unused block


def num_blocks(num_assignments: int, num_experts: int, block_rows: int) -> int:
    """Static block count for any routing of ``num_assignments`` over ``num_experts``: each
    of the at most ``min(X, A)`` experts hit adds at most ``block_rows - 1`` padding rows."""
    hit = min(num_experts, num_assignments)
    return -(-(num_assignments + hit * (block_rows - 1)) // block_rows)


def build_expert_blocks(
    idx: jax.Array,  # i32[T, k] expert of each assignment
    num_experts: int,
    block_rows: int,
) -> ExpertBlocks:
    T, k = idx.shape
    A, X = T * k, num_experts
    nb = num_blocks(A, X, block_rows)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted slot -> assignment
    expert = flat[order]
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    padded = (sizes + block_rows - 1) // block_rows * block_rows
    padded_end = jnp.cumsum(padded)
    group_start = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(A, dtype=jnp.int32)
    dest = padded_end[expert] - padded[expert] + slot - group_start[expert]  # [A] sorted
    rows = jnp.full((nb * block_rows,), T, jnp.int32).at[dest].set(order // k)
    position = jnp.zeros((A,), jnp.int32).at[order].set(dest)
    starts = jnp.arange(nb, dtype=jnp.int32) * block_rows
    # The first expert whose padded group ends after the block's start, as one compare and
    # count (`searchsorted`'s default method is a loop).
    block_expert = jnp.sum(padded_end[None, :] <= starts[:, None], axis=1, dtype=jnp.int32)
    block_expert = jnp.where(starts < padded_end[-1], block_expert, -1)
    return ExpertBlocks(rows, position, block_expert)


def assignment_blocks(
    idx: jax.Array,  # i32[T, k] expert of each assignment
    block_rows: int,
) -> ExpertBlocks:
    """One block per assignment (its token in the block's first row, the rest padding): the
    layout of a decode step with few tokens, built from iotas alone. An expert two tokens
    share is read once per token, so this suits `T·k` well under `X`."""
    T, k = idx.shape
    A = T * k
    first = jnp.arange(block_rows, dtype=jnp.int32)[None, :] == 0
    rows = jnp.where(first, jnp.arange(A, dtype=jnp.int32)[:, None] // k, T)
    position = jnp.arange(A, dtype=jnp.int32) * block_rows
    return ExpertBlocks(rows.reshape(-1), position, idx.reshape(-1).astype(jnp.int32))
