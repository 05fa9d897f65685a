"""Where every token of a varlen batch sits in the SSD's chunk grid: what the reference and
both kernels share.

Chunk alignment is absolute: a chunk boundary of a sequence sits where
``(start_position + relative_pos) % C == 0``, so the chunk-boundary states are the states at
absolute multiples of C (what prefix caching checkpoints). Token ``r`` of a sequence sits at
offset ``(start + r) % C`` of its chunk; other offsets of a chunk are empty (zero x, B, C, dt).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class ChunkLayout(NamedTuple):
    """Where every token of a varlen batch sits in the [NC, C] chunk grid (a pytree)."""

    token_index: jax.Array  # i32[NC, C] packed token of (chunk, offset); T for empty positions
    chunk_seq: jax.Array  # i32[NC] sequence of each chunk; S for unused chunks
    chunk_first: jax.Array  # bool[NC] chunk is its sequence's first
    chunk_end: jax.Array  # i32[NC] relative position just after the chunk's last token
    seq_first_chunk: jax.Array  # i32[S] index of each sequence's first chunk
    seq_last_chunk: jax.Array  # i32[S] index of each sequence's last chunk (clipped if empty)
    seq_num_chunks: jax.Array  # i32[S] chunks of each sequence (0 when empty)
    chunk_token_lo: jax.Array  # i32[NC] first packed token of each chunk (T when empty)
    chunk_token_count: jax.Array  # i32[NC] tokens in each chunk
    # What a kernel walking all NC chunks in order reads: unused chunks continue the last used
    # chunk's sequence with no tokens, and chunk 0 always (re)starts from an initial state.
    scan_seq: jax.Array  # i32[NC]
    scan_first: jax.Array  # i32[NC] 1 where the walk starts a sequence


def num_chunks(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Static chunk count that fits any varlen batch of ``num_tokens`` tokens in S sequences.

    A sequence of length L >= 1 starting at offset o = start % C (0 <= o <= C-1) spans
    n = floor((o + L - 1) / C) + 1 <= floor((L - 2 + C) / C) + 1 <= floor((L - 1) / C) + 2
    chunks, so n < L / C + 2. Summing, sum n < T / C + 2S, and since sum n is an integer,
    sum n <= floor(T / C) + 2S (empty sequences take no chunks).
    """
    return num_tokens // chunk_size + 2 * num_seqs


def build_chunk_layout(
    cu_seqlens: jax.Array,  # i32[S+1]
    num_tokens: int,
    chunk_size: int,
    start_positions: jax.Array | None = None,  # i32[S] absolute position of each first token
) -> ChunkLayout:
    """Chunk layout of a varlen batch; build once per forward and share across layers."""
    with jax.named_scope("ssd_chunk_layout"):
        return _build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)


def _build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions):
    num_seqs = cu_seqlens.shape[0] - 1
    nc = num_chunks(num_tokens, num_seqs, chunk_size)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [S]
    if start_positions is None:
        offsets = jnp.zeros((num_seqs,), jnp.int32)
    else:
        offsets = start_positions.astype(jnp.int32) % chunk_size
    seq_chunks = jnp.where(lengths > 0, (offsets + lengths - 1) // chunk_size + 1, 0)
    cu_chunks = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_chunks, dtype=jnp.int32)]
    )  # [S+1]

    c = jnp.arange(nc, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_chunks, c, side="right", method="compare_all").astype(jnp.int32) - 1
    used = c < cu_chunks[-1]
    seq_safe = jnp.clip(seq, 0, num_seqs - 1)
    j = c - cu_chunks[seq_safe]  # chunk index within its sequence
    chunk_rel_start = j * chunk_size - offsets[seq_safe]  # relative position of offset 0
    rel = chunk_rel_start[:, None] + jnp.arange(chunk_size, dtype=jnp.int32)  # [NC, C]
    valid = used[:, None] & (rel >= 0) & (rel < lengths[seq_safe][:, None])
    token_index = jnp.where(valid, cu_seqlens[seq_safe][:, None] + rel, num_tokens)
    chunk_end = jnp.minimum(chunk_rel_start + chunk_size, lengths[seq_safe])
    chunk_seq = jnp.where(used, seq_safe, num_seqs).astype(jnp.int32)
    chunk_first = used & (j == 0)
    token_index = token_index.astype(jnp.int32)
    num_used = cu_chunks[-1]
    last_seq = jnp.where(num_used > 0, chunk_seq[jnp.maximum(num_used - 1, 0)], 0)
    return ChunkLayout(
        token_index=token_index,
        chunk_seq=chunk_seq,
        chunk_first=chunk_first,
        chunk_end=jnp.where(used, chunk_end, 0).astype(jnp.int32),
        seq_first_chunk=jnp.clip(cu_chunks[:-1], 0, nc - 1),
        seq_last_chunk=jnp.clip(cu_chunks[1:] - 1, 0, nc - 1),
        seq_num_chunks=seq_chunks.astype(jnp.int32),
        chunk_token_lo=jnp.min(token_index, axis=1).astype(jnp.int32),
        chunk_token_count=jnp.sum(token_index < num_tokens, axis=1, dtype=jnp.int32),
        scan_seq=jnp.where(used, chunk_seq, last_seq).astype(jnp.int32),
        scan_first=(chunk_first | (c == 0)).astype(jnp.int32),
    )


def to_chunks(a: jax.Array, token_index: jax.Array) -> jax.Array:
    """[T, ...] -> [NC, C, ...] in a's dtype; empty positions (index T) read a zero row."""
    a = jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])
    return a[token_index]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["lo", "hi", "order", "rank", "request_rank"],
    meta_fields=["num_rows"],
)
@dataclasses.dataclass(frozen=True)
class TrackedRequests:
    """Which rows of the tracked-states output each chunk's end state fills: chunk ``c`` fills
    rows ``order[lo[c]:hi[c]]``, so a kernel writes every requested state straight into its
    row (duplicates included) and no gather copies them afterwards. ``rank`` numbers the
    requested chunks in chunk order (a kernel that writes one row per requested chunk and
    gathers afterwards, the TPU one, writes chunk ``c`` to row ``rank[c]``)."""

    lo: jax.Array  # i32[NC]
    hi: jax.Array  # i32[NC]
    order: jax.Array  # i32[max(K, 1)] output rows sorted by their chunk
    rank: jax.Array  # i32[NC] requested chunks before c (clipped at 0)
    request_rank: jax.Array  # i32[max(K, 1)] rank of each request's chunk
    num_rows: int  # K: rows of the tracked-states output (static)


def tracked_requests(
    num_chunks: int, state_chunks: jax.Array | None, all_chunks: bool
) -> TrackedRequests:
    """The requests of ``state_chunks`` (``return_chunk_states``: every chunk) by chunk.

    A requested chunk index is read as ``chunk_states[state_chunks]`` reads it: negative
    indices count from the end, and out-of-range ones are clamped. A step builds them once
    (``ForwardMetadata``) and every Mamba layer's scan reads them.
    """
    with jax.named_scope("ssd_tracked_requests"):
        chunks = jnp.arange(num_chunks, dtype=jnp.int32)
        if all_chunks:
            return TrackedRequests(chunks, chunks + 1, chunks, chunks, chunks, num_chunks)
        if state_chunks is None or state_chunks.shape[0] == 0:
            none, one = jnp.zeros((num_chunks,), jnp.int32), jnp.zeros((1,), jnp.int32)
            return TrackedRequests(none, none, one, none, one, 0)
        wanted = state_chunks.astype(jnp.int32)
        wanted = jnp.clip(jnp.where(wanted < 0, wanted + num_chunks, wanted), 0, num_chunks - 1)
        order = jnp.argsort(wanted, stable=True).astype(jnp.int32)
        by_chunk = wanted[order]
        lo = jnp.searchsorted(by_chunk, chunks, side="left", method="compare_all")
        hi = jnp.searchsorted(by_chunk, chunks, side="right", method="compare_all")
        rank = jnp.maximum(jnp.cumsum(hi > lo, dtype=jnp.int32) - 1, 0)
        lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
        return TrackedRequests(lo, hi, order, rank, rank[wanted], state_chunks.shape[0])


def tracked_rows(state_chunks: jax.Array | None, num_chunks: int, all_chunks: bool) -> int:
    """K: the rows of the tracked-states output (0 when no state is asked for)."""
    if all_chunks:
        return num_chunks
    return 0 if state_chunks is None else state_chunks.shape[0]


def check_tracked_requests(tracked: TrackedRequests, num_chunks: int, num_rows: int) -> None:
    if tracked.lo.shape != (num_chunks,) or tracked.num_rows != num_rows:
        raise ValueError(
            f"tracked requests over {tracked.lo.shape[0]} chunks for {tracked.num_rows} rows do "
            f"not fit this scan: expected {num_chunks} chunks and {num_rows} rows "
            "(build them with tracked_requests(layout chunks, state_chunks, ...))"
        )
