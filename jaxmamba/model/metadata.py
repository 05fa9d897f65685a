"""The metadata every layer reads, derived once per jitted forward from the step's inputs
(`jaxmamba.step_contract`: the fields, their shapes and the layout of a step).

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

from jaxmamba.kernels.attention import QueryBlocks, attention_query_blocks
from jaxmamba.kernels.conv1d import TokenStarts, token_starts
from jaxmamba.kernels.ssd import ChunkLayout, TrackedRequests, build_chunk_layout, tracked_requests
from jaxmamba.step_contract import MAX_DECODE_CHECKPOINTS, StepInputs, pack


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
    array means one host→device copy a step, not one a field, which the device would wait
    for before its first kernel. The layout is the pytree's static part, so a bucket's steps share
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
        """Host side: every field present, flattened into one buffer (`step_contract.pack`)."""
        return cls(*pack(inputs))

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


class DecodeMetadata(NamedTuple):
    """The decode part of a step: rows ``[0, num_decode)``, one token each."""

    state_slots: jax.Array  # i32[Bd]
    track_src_slots: jax.Array  # i32[KT] checkpoint copies: from these working slots...
    track_dst_slots: jax.Array  # i32[KT] ...to these track slots (unused entries: pad → pad)
    track_slots: jax.Array  # i32[Bd] the same copies by row: each row's target (pad: none)


class VerifyMetadata(NamedTuple):
    """A verify step (speculative decoding): every row carries ``J = 1 + k`` tokens, its last
    sampled token and k drafts (`jaxmamba.model.speculative`)."""

    state_slots: jax.Array  # i32[B]
    num_positions: int  # J (static)


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
    verify: VerifyMetadata | None = None  # a verify step's rows (then decode and prefill: None)

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
        num_spec: int = 0,
    ) -> ForwardMetadata:
        """Derive the step's metadata on device. Call once per forward, inside the jit.
        `num_spec` > 0: a verify step, every row a decode row of ``1 + num_spec`` tokens."""
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

        writes = token_valid
        if inputs.lens_from_device is not None:
            # Lengths from the device may run past the page table (tokens after a request's
            # end that the host drops): those write the pad page, not a clamped real one, and
            # attend as if at the last position the table holds (no read past it).
            capacity = inputs.page_table.shape[1] * page_size
            writes = writes & (positions < capacity)
            positions = jnp.minimum(positions, capacity - 1)
        page_of_token = inputs.page_table[token_rows, positions // page_size]
        kv_slot_mapping = jnp.where(
            writes, page_of_token * page_size + positions % page_size, pad_page * page_size
        )
        last_token_index = jnp.maximum(qsl[1:] - 1, 0)

        track_slots, track_lens = inputs.track_slots, inputs.track_lens
        if track_slots.ndim == 1:
            track_slots, track_lens = track_slots[:, None], track_lens[:, None]
        every_step = dict(token_rows=token_rows, token_valid=token_valid, positions=positions,
                          kv_slot_mapping=kv_slot_mapping, page_table=inputs.page_table,
                          last_token_index=last_token_index)  # fmt: skip
        if num_spec:
            verify = VerifyMetadata(inputs.state_slots, 1 + num_spec)
            return ForwardMetadata(**every_step, decode=None, prefill=None, verify=verify)
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

        return ForwardMetadata(**every_step, decode=decode, prefill=prefill)
