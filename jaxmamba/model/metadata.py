"""Per-step inputs and the metadata every layer reads, derived once per jitted forward.

Layout of a step (all shapes static, padded to a bucket):

* tokens: ``T`` packed tokens; the first ``num_decode`` tokens belong to the decode rows
  (one token each), the rest to the prefill/extend rows, row after row; tokens past the
  last row's end are padding.
* rows: ``B`` rows; rows ``[0, num_decode)`` decode, rows ``[num_decode, B)`` prefill.
  Padding rows have zero tokens and point at the pad slot / pad page.

`ForwardMetadata.build` turns the host's `StepInputs` into everything the layers need: the
token→row map, positions, the KV write slots, the varlen chunk layout (and the SSD kernels'
tracked requests by chunk, the conv kernels' sequence starts), and the **tracked-row
selection** (where each row's state checkpoint goes this step and which chunk/conv window it
is read from); `with_attention_blocks` adds the attention kernels' query blocks. Each is
built once per forward and read by every layer. Nothing here reads a device value on the
host, branches on traced data, or uses an unsized `nonzero`: the selection is masked scatters
into the pad slot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels.attention import QueryBlocks, attention_query_blocks
from jaxmamba.kernels.conv1d import TokenStarts, token_starts
from jaxmamba.kernels.ssd import ChunkLayout, TrackedRequests, build_chunk_layout, tracked_requests


class StepInputs(NamedTuple):
    """Fixed-shape arrays the host fills for one step; the runner moves them as one buffer
    (`PackedStepInputs`)."""

    input_ids: jax.Array  # i32[T]
    tokens_from_device: jax.Array  # bool[B] decode row's input is its slot's last sampled token
    query_start_loc: jax.Array  # i32[B+1] cumulative token counts per row (pad rows: 0 tokens)
    prefix_lens: jax.Array  # i32[B] tokens already in the cache before this step
    state_slots: jax.Array  # i32[B] working state slot (pad rows: the pad slot)
    init_slots: jax.Array  # i32[B] slot the initial state is read from (a prefix-cache hit's node)
    has_initial_state: jax.Array  # bool[B]
    # Where to checkpoint the state this step: up to MAX_PREFILL_CHECKPOINTS per prefill row
    # (decode rows use column 0); unused entries hold the pad slot and length 0. A `[B]`
    # array is read as one column.
    track_slots: jax.Array  # i32[B, KP]
    track_lens: jax.Array  # i32[B, KP] absolute length of each checkpoint
    page_table: jax.Array  # i32[B, MP] KV pages per row (pad entries: the pad page)
    temperature: jax.Array  # f32[B] 0 = greedy
    top_p: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B] 0 = off
    seeds: jax.Array  # u32[B] per-request sampling seed
    sample_counters: jax.Array  # i32[B] tokens sampled so far (folds into the seed)
    min_p: jax.Array  # f32[B] 0 = off
    min_tokens: jax.Array  # i32[B] stop_ids are masked while sample_counters < min_tokens
    stop_ids: jax.Array  # i32[B, MAX_STOP_IDS] eos + stop_token_ids (-1 = pad)
    logit_bias_ids: jax.Array  # i32[B, MAX_LOGIT_BIAS] (-1 = pad)
    logit_bias_values: jax.Array  # f32[B, MAX_LOGIT_BIAS]
    presence_penalty: jax.Array  # f32[B] 0 = off
    frequency_penalty: jax.Array  # f32[B] 0 = off
    repetition_penalty: jax.Array  # f32[B] 1 = off
    penalty_reset: jax.Array  # bool[B] the row is its request's first step (clears its slot)
    # i32[T] the prompt token after each prefill token, for prompt_logprobs (-1: not asked);
    # None: the step scores no prompt tokens.
    prompt_logprob_targets: jax.Array | None = None
    # n > 1 forks: the step copies each source slot's sampler penalties to its destination
    # slot, and `runner.fork_fn`, run after it, the state (SSM, conv) and each source KV page
    # (a prompt's partial last page) to its destination. Unused entries: pad -> pad. None: no
    # forks.
    fork_src_slots: jax.Array | None = None  # i32[KF]
    fork_dst_slots: jax.Array | None = None  # i32[KF]
    fork_src_pages: jax.Array | None = None  # i32[KF]
    fork_dst_pages: jax.Array | None = None  # i32[KF]


def _to_i32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.bool_:
        return a.astype(np.int32)
    if a.dtype in (np.int32, np.uint32, np.float32):
        return a.view(np.int32)
    raise TypeError(f"a step input of dtype {a.dtype}: expected int32, uint32, float32 or bool")


def _from_i32(x: jax.Array, dtype: str) -> jax.Array:
    if dtype == "bool":
        return x != 0
    if dtype == "int32":
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


@jax.tree_util.register_pytree_node_class
class PackedStepInputs:
    """A step's `StepInputs` as one int32 buffer (floats and uint32 bit-cast, bools 0/1), and
    the static layout that reads them back (`unpack`, inside the step). Handing the step one
    array means one host→device copy a step: each of the ~25 fields was a copy of its own,
    and a 9B prefill step on the H200 waited ~2 ms for them before its first kernel
    (docs/benchmarks.md). The layout is the pytree's static part, so a bucket's steps share
    one program."""

    def __init__(self, buffer, layout: tuple):
        self.buffer = buffer  # i32[N]
        self.layout = layout  # ((field, shape, dtype name), ...) of the fields present

    def tree_flatten(self):
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    @classmethod
    def pack(cls, inputs: StepInputs) -> PackedStepInputs:
        """Host side: every field present, flattened into one buffer."""
        layout, parts = [], []
        for name, value in zip(inputs._fields, inputs, strict=True):
            if value is None:
                continue
            a = np.asarray(value)
            layout.append((name, a.shape, a.dtype.name))
            parts.append(_to_i32(a).ravel())
        return cls(np.concatenate(parts), tuple(layout))

    def unpack(self) -> StepInputs:
        """Device side: the fields, sliced at static offsets (XLA folds each into its
        readers)."""
        fields, offset = {}, 0
        for name, shape, dtype in self.layout:
            size = math.prod(shape)
            flat = self.buffer[offset : offset + size]
            fields[name] = _from_i32(flat, dtype).reshape(shape)
            offset += size
        return StepInputs(**fields)


class PrefillMetadata(NamedTuple):
    """The varlen part of a step: rows ``[num_decode, B)`` and their tokens."""

    cu_seqlens: jax.Array  # i32[Bp+1] relative to the first prefill token
    start_positions: jax.Array  # i32[Bp] absolute position of each row's first new token
    layout: ChunkLayout  # chunk layout shared by every Mamba layer
    conv_starts: TokenStarts  # each prefill token's row and that row's first token, [Tp]
    state_slots: jax.Array  # i32[Bp]
    init_slots: jax.Array  # i32[Bp]
    has_initial_state: jax.Array  # bool[Bp]
    # The tracked-row selection, flattened over (row, checkpoint): [Bp * KP] entries.
    track_slots: jax.Array  # i32[Bp*KP] checkpoint target, pad slot for unused entries
    track_rows: jax.Array  # i32[Bp*KP] prefill row of each checkpoint
    track_ends: jax.Array  # i32[Bp*KP] tracked length relative to its row's first new token
    track_chunks: jax.Array  # i32[Bp*KP] chunk whose end state is the tracked SSM state
    tracked: TrackedRequests  # track_chunks by chunk, what the SSD kernels write them from


# A decode step checkpoints at most this many rows (rows whose length crosses a multiple of
# the track interval); the scheduler enforces it. Copying only these rows — not a masked copy
# of every row — keeps decode from moving every state twice.
MAX_DECODE_CHECKPOINTS = 8

# A prefill/extend row writes at most this many checkpoints in one step: one where its prompt
# branches off a prefix other requests share (the deepest block boundary inside the shared
# part) and one at the last block boundary of the chunk it feeds. A third is never needed: a
# request has one branch point (the deepest; shallower ones are covered by it), and a
# multi-turn or decode checkpoint is the chunk-end one. Each entry costs the SSD scan one
# more chunk-boundary state written and the conv a K-1 row gather, so the bound stays small.
MAX_PREFILL_CHECKPOINTS = 2

# A step scores at most this many prompt tokens for prompt_logprobs (the scheduler caps a
# request's chunk to it): a step with prefill rows keeps their hidden states, and
# `runner.score_fn`, run after it only when some row asks, computes their logits and top
# logprobs (a fixed block: one program whatever the bucket).
MAX_PROMPT_LOGPROB_TOKENS = 128


# A step forks at most this many sample slots off the prompts it finishes (n > 1: sample 0
# prefills, samples 1..n-1 take copies of its end state). `runner.fork_fn` copies this many
# states per Mamba layer, used or not (a static shape), so it stays small; a request's samples
# past it resume from the prefix cache instead.
MAX_FORKS = 4


class DecodeMetadata(NamedTuple):
    """The decode part of a step: rows ``[0, num_decode)``, one token each."""

    state_slots: jax.Array  # i32[Bd]
    track_src_slots: jax.Array  # i32[KT] checkpoint copies: from these working slots...
    track_dst_slots: jax.Array  # i32[KT] ...to these track slots (unused entries: pad → pad)
    track_slots: jax.Array  # i32[Bd] the same copies by row: each row's target (pad: none)


class ForwardMetadata(NamedTuple):
    token_rows: jax.Array  # i32[T] row of each token (pad tokens: clamped to a valid row)
    token_valid: jax.Array  # bool[T]
    positions: jax.Array  # i32[T] absolute position of each token
    kv_slot_mapping: jax.Array  # i32[T] flat KV write index page*page_size+offset (pad → pad page)
    page_table: jax.Array  # i32[B, MP]
    last_token_index: jax.Array  # i32[B] token whose logits are sampled for each row
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    # The attention kernels' query blocks (`with_attention_blocks`); None: the reference
    # attention, or a model without attention layers.
    attention_blocks: QueryBlocks | None = None

    def with_attention_blocks(self, num_q_heads: int, num_kv_heads: int, impl: str):
        """This metadata plus the query blocks the attention kernel of ``impl`` cuts the step
        into: they depend on the kernel and the head grouping, so the model adds them once,
        before its first layer, and every attention layer reads them."""
        blocks = attention_query_blocks(
            self.token_rows,
            self.positions,
            self.page_table.shape[0],
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            impl=impl,
        )
        return self._replace(attention_blocks=blocks)

    @staticmethod
    def build(
        inputs: StepInputs,
        *,
        num_decode: int,
        chunk_size: int,
        page_size: int,
        pad_page: int,
        pad_slot: int,
    ) -> ForwardMetadata:
        """Derive the step's metadata on device. Call once per forward, inside the jit."""
        inputs = jax.tree.map(jnp.asarray, inputs)
        num_tokens = inputs.input_ids.shape[0]
        num_rows = inputs.state_slots.shape[0]
        qsl = inputs.query_start_loc
        token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
        raw_rows = jnp.searchsorted(qsl[1:], token_ids, side="right").astype(jnp.int32)
        token_valid = token_ids < qsl[-1]
        token_rows = jnp.minimum(raw_rows, num_rows - 1)
        positions = inputs.prefix_lens[token_rows] + token_ids - qsl[token_rows]
        positions = jnp.where(token_valid, positions, 0)

        page_of_token = inputs.page_table[token_rows, positions // page_size]
        kv_slot_mapping = jnp.where(
            token_valid, page_of_token * page_size + positions % page_size, pad_page * page_size
        )
        last_token_index = jnp.maximum(qsl[1:] - 1, 0)

        track_slots, track_lens = inputs.track_slots, inputs.track_lens
        if track_slots.ndim == 1:
            track_slots, track_lens = track_slots[:, None], track_lens[:, None]
        decode = None
        if num_decode > 0:
            slots = inputs.state_slots[:num_decode]
            targets = track_slots[:num_decode, 0]
            tracking = targets != pad_slot
            k = min(num_decode, MAX_DECODE_CHECKPOINTS)
            (rows,) = jnp.nonzero(tracking, size=k, fill_value=0)
            used = jnp.arange(k) < jnp.sum(tracking)
            decode = DecodeMetadata(
                state_slots=slots,
                track_src_slots=jnp.where(used, slots[rows], pad_slot),
                track_dst_slots=jnp.where(used, targets[rows], pad_slot),
                track_slots=targets,
            )

        prefill = None
        num_prefill_tokens = num_tokens - num_decode
        if num_rows > num_decode and num_prefill_tokens > 0:
            rows = slice(num_decode, None)
            cu_seqlens = qsl[num_decode:] - qsl[num_decode]
            starts = inputs.prefix_lens[rows]
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            layout = build_chunk_layout(cu_seqlens, num_prefill_tokens, chunk_size, starts)
            kp = track_slots.shape[1]
            num_prefill_rows = num_rows - num_decode
            track_rows = jnp.repeat(jnp.arange(num_prefill_rows, dtype=jnp.int32), kp)
            row_starts = starts[track_rows]
            track_ends = jnp.clip(track_lens[rows].reshape(-1) - row_starts, 0, lengths[track_rows])
            # A tracked length is a chunk boundary (or the row's end), so its state is the
            # end state of the chunk holding the token just before it.
            chunk_of_end = (row_starts + jnp.maximum(track_ends, 1) - 1) // chunk_size
            track_chunks = (
                layout.seq_first_chunk[track_rows] + chunk_of_end - row_starts // chunk_size
            )
            num_chunks = layout.chunk_seq.shape[0]
            track_chunks = jnp.clip(track_chunks, 0, num_chunks - 1)
            prefill = PrefillMetadata(
                cu_seqlens=cu_seqlens,
                start_positions=starts,
                layout=layout,
                conv_starts=token_starts(cu_seqlens, num_prefill_tokens),
                state_slots=inputs.state_slots[rows],
                init_slots=inputs.init_slots[rows],
                has_initial_state=inputs.has_initial_state[rows],
                track_slots=track_slots[rows].reshape(-1),
                track_rows=track_rows,
                track_ends=track_ends,
                track_chunks=track_chunks,
                tracked=tracked_requests(num_chunks, track_chunks, all_chunks=False),
            )

        return ForwardMetadata(
            token_rows=token_rows,
            token_valid=token_valid,
            positions=positions,
            kv_slot_mapping=kv_slot_mapping,
            page_table=inputs.page_table,
            last_token_index=last_token_index,
            decode=decode,
            prefill=prefill,
        )
