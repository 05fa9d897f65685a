"""Host side of a step: turn a list of row descriptions into padded `StepInputs` (numpy).

Validation happens here, in numpy, before anything is dispatched: a malformed step raises a
`ValueError` that names the row and the values, and the device never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.metadata import (
    MAX_DECODE_CHECKPOINTS,
    MAX_FORKS,
    MAX_PREFILL_CHECKPOINTS,
    StepInputs,
)
from jaxmamba.model.sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS


@dataclass
class RowSpec:
    """One row of a step: `tokens` are appended after `prefix_len` cached tokens.

    A *fork* row (n > 1) has no tokens: it samples from the logits of the row before it, whose
    `forks` copy that row's end state into the fork row's slot (and the prompt's partial last
    KV page into its own page) inside the step."""

    tokens: list[int]
    prefix_len: int
    state_slot: int
    pages: list[int]
    init_slot: int | None = None  # defaults to state_slot; a prefix-cache hit reads elsewhere
    token_from_device: bool = False  # a decode row fed the token its previous step sampled
    track_slot: int | None = None  # one checkpoint: the state after `track_len` tokens
    track_len: int = 0
    # More checkpoints, (slot, length) each; with `track_slot` at most MAX_PREFILL_CHECKPOINTS
    # in all (a decode row: one, at its new length).
    tracks: list[tuple[int, int]] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    sample_counter: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # eos + stop_token_ids, masked until min_tokens are out
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # prompt_logprobs: the prompt token after each of `tokens` (shorter at the prompt's end)
    prompt_logprob_targets: list[int] | None = None
    fork: bool = False  # a forked sample: no tokens, state copied from the row before
    # This row's end state goes to these samples: (slot, source page, own page) each; the
    # pages are None when the prompt ends on a page boundary (nothing to copy).
    forks: list[tuple[int, int | None, int | None]] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.tokens)

    @property
    def checkpoints(self) -> list[tuple[int, int]]:
        """Every (slot, length) this row checkpoints this step."""
        first = [] if self.track_slot is None else [(self.track_slot, self.track_len)]
        return first + list(self.tracks)


@dataclass(frozen=True)
class Bucket:
    num_tokens: int
    num_rows: int
    num_decode: int = 0


def pow2_buckets(limit: int, start: int = 1) -> list[int]:
    sizes, n = [], start
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(limit)
    return sizes


def smallest_fitting(sizes: list[int], n: int, what: str) -> int:
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")


@dataclass
class StepBuilder:
    """Packs rows into `StepInputs` for a bucket. Decode rows come first, one token each."""

    spec: CacheSpec
    max_pages_per_seq: int
    vocab_size: int
    chunk_size: int

    def build(
        self, rows: list[RowSpec], bucket: Bucket, num_decode_rows: int | None = None
    ) -> StepInputs:
        """Pack `rows` (decode rows first) into `bucket`.

        A pure decode bucket pads with empty rows at the end. A mixed bucket reserves its
        first `bucket.num_decode` tokens for decode rows: when fewer than that decode
        (`num_decode_rows`), dummy one-token rows on the pad slot/page fill the gap, so the
        prefill tokens always start at token `num_decode`.
        """
        nd = bucket.num_decode
        if 0 < nd < bucket.num_rows:
            real = nd if num_decode_rows is None else num_decode_rows
            if real > nd:
                raise ValueError(f"{real} decode rows do not fit the bucket's {nd} decode rows")
            filler = RowSpec([0], 0, self.spec.pad_slot, [])
            filler.init_slot = self.spec.pad_slot
            rows = rows[:real] + [filler] * (nd - real) + rows[real:]
        self._validate(rows, bucket)
        T, B = bucket.num_tokens, bucket.num_rows
        pad_slot, pad_page = self.spec.pad_slot, self.spec.pad_page
        input_ids = np.zeros(T, np.int32)
        from_device = np.zeros(B, bool)
        qsl = np.zeros(B + 1, np.int32)
        prefix_lens = np.zeros(B, np.int32)
        state_slots = np.full(B, pad_slot, np.int32)
        init_slots = np.full(B, pad_slot, np.int32)
        has_init = np.zeros(B, bool)
        track_slots = np.full((B, MAX_PREFILL_CHECKPOINTS), pad_slot, np.int32)
        track_lens = np.zeros((B, MAX_PREFILL_CHECKPOINTS), np.int32)
        page_table = np.full((B, self.max_pages_per_seq), pad_page, np.int32)
        temperature = np.zeros(B, np.float32)
        top_p = np.ones(B, np.float32)
        top_k = np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        counters = np.zeros(B, np.int32)
        min_p = np.zeros(B, np.float32)
        min_tokens = np.zeros(B, np.int32)
        stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)
        bias_ids = np.full((B, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((B, MAX_LOGIT_BIAS), np.float32)
        presence = np.zeros(B, np.float32)
        frequency = np.zeros(B, np.float32)
        repetition = np.ones(B, np.float32)
        penalty_reset = np.zeros(B, bool)
        prompt_targets = np.full(T, -1, np.int32)
        fork_src_slots = np.full(MAX_FORKS, pad_slot, np.int32)
        fork_dst_slots = np.full(MAX_FORKS, pad_slot, np.int32)
        fork_src_pages = np.full(MAX_FORKS, pad_page, np.int32)
        fork_dst_pages = np.full(MAX_FORKS, pad_page, np.int32)
        num_forks = 0
        offset = 0
        for r, row in enumerate(rows):
            n = len(row.tokens)
            input_ids[offset : offset + n] = row.tokens
            if row.prompt_logprob_targets:
                targets = row.prompt_logprob_targets[:n]
                prompt_targets[offset : offset + len(targets)] = targets
            offset += n
            prefix_lens[r] = row.prefix_len
            from_device[r] = row.token_from_device
            state_slots[r] = row.state_slot
            init_slots[r] = row.state_slot if row.init_slot is None else row.init_slot
            has_init[r] = row.prefix_len > 0 and row.state_slot != pad_slot and not row.fork
            if row.fork:
                init_slots[r] = pad_slot  # its state comes from the fork copy
            for slot, src_page, dst_page in row.forks:
                fork_src_slots[num_forks], fork_dst_slots[num_forks] = row.state_slot, slot
                if src_page is not None:
                    fork_src_pages[num_forks], fork_dst_pages[num_forks] = src_page, dst_page
                num_forks += 1
            for k, (slot, length) in enumerate(row.checkpoints):
                track_slots[r, k], track_lens[r, k] = slot, length
            page_table[r, : len(row.pages)] = row.pages
            temperature[r] = row.temperature
            top_p[r] = row.top_p
            top_k[r] = row.top_k
            seeds[r] = np.uint32(row.seed & 0xFFFFFFFF)
            counters[r] = row.sample_counter
            min_p[r] = row.min_p
            presence[r] = row.presence_penalty
            frequency[r] = row.frequency_penalty
            repetition[r] = row.repetition_penalty
            # A request's first step starts from scratch or from a prefix-cache hit's slot.
            first_step = row.prefix_len == 0 or init_slots[r] != row.state_slot
            penalty_reset[r] = first_step and row.state_slot != pad_slot
            if row.min_tokens > 0:
                min_tokens[r] = row.min_tokens
                stop_ids[r, : len(row.stop_ids)] = row.stop_ids
            if row.logit_bias:
                bias_ids[r, : len(row.logit_bias)] = list(row.logit_bias)
                bias_values[r, : len(row.logit_bias)] = list(row.logit_bias.values())
        qsl[1 : len(rows) + 1] = np.cumsum([len(row.tokens) for row in rows])
        qsl[len(rows) + 1 :] = offset
        return StepInputs(
            input_ids, from_device, qsl, prefix_lens, state_slots, init_slots, has_init,
            track_slots, track_lens, page_table, temperature, top_p, top_k, seeds, counters,
            min_p, min_tokens, stop_ids, bias_ids, bias_values, presence, frequency, repetition,
            penalty_reset, prompt_targets, fork_src_slots, fork_dst_slots, fork_src_pages,
            fork_dst_pages,
        )  # fmt: skip

    def padding(self, bucket: Bucket) -> StepInputs:
        """A step of padding only (every row on the pad slot): for warming a bucket up."""
        return self.build([], bucket, num_decode_rows=0)

    def _validate(self, rows: list[RowSpec], bucket: Bucket) -> None:
        if len(rows) > bucket.num_rows:
            raise ValueError(f"{len(rows)} rows do not fit the bucket's {bucket.num_rows} rows")
        total = sum(len(row.tokens) for row in rows)
        if total > bucket.num_tokens:
            raise ValueError(f"{total} tokens do not fit the bucket's {bucket.num_tokens} tokens")
        nd = bucket.num_decode
        if nd:
            if nd == bucket.num_rows and bucket.num_tokens != nd:
                raise ValueError(f"a pure decode bucket needs num_tokens == num_rows, got {bucket}")
        decode_checkpoints = sum(len(row.checkpoints) for row in rows[:nd])
        if decode_checkpoints > MAX_DECODE_CHECKPOINTS:
            raise ValueError(
                f"{decode_checkpoints} decode rows checkpoint in one step, at most "
                f"{MAX_DECODE_CHECKPOINTS}"
            )
        num_forks = sum(len(row.forks) for row in rows)
        if num_forks > MAX_FORKS:
            raise ValueError(f"{num_forks} forked samples in one step, at most {MAX_FORKS}")
        page_size = self.spec.page_size
        for r, row in enumerate(rows):
            n = len(row.tokens)
            if row.state_slot == self.spec.pad_slot:
                continue  # a filler row
            if row.fork:
                self._validate_fork(r, row, rows)
            elif n == 0:
                raise ValueError(f"row {r} has no tokens")
            if r < nd and n != 1:
                raise ValueError(f"decode row {r} must carry exactly 1 token, got {n}")
            if row.token_from_device and r >= nd:
                raise ValueError(f"row {r} takes its token from the device but is not a decode row")
            bad = [t for t in row.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"row {r}: token ids {bad[:5]} outside the vocab [0, {self.vocab_size})"
                )
            self._validate_sampling(r, row)
            need = -(-row.seq_len // page_size)
            if need > self.max_pages_per_seq:
                raise ValueError(
                    f"row {r}: length {row.seq_len} needs {need} pages, "
                    f"more than max_pages_per_seq={self.max_pages_per_seq}"
                )
            if len(row.pages) < need:
                raise ValueError(
                    f"row {r}: length {row.seq_len} needs {need} pages, has {len(row.pages)}"
                )
            self._validate_checkpoints(r, row, decode=r < nd)

    def _validate_fork(self, r: int, row: RowSpec, rows: list[RowSpec]) -> None:
        """A fork row carries nothing and follows its source row (or a sibling fork row), so
        the source's last token is the one before it and it samples those logits."""
        src = r - 1
        while src >= 0 and rows[src].fork:
            src -= 1
        if row.tokens or row.token_from_device or row.checkpoints or row.forks:
            raise ValueError(f"fork row {r} must have no tokens, checkpoints or forks")
        if src < 0 or row.state_slot not in [slot for slot, _, _ in rows[src].forks]:
            raise ValueError(f"fork row {r} (slot {row.state_slot}) does not follow the row "
                             f"that forks into its slot")  # fmt: skip
        if row.prefix_len != rows[src].seq_len:
            raise ValueError(f"fork row {r}: prefix_len {row.prefix_len} must equal its source "
                             f"row's length {rows[src].seq_len}")  # fmt: skip

    def _validate_checkpoints(self, r: int, row: RowSpec, *, decode: bool) -> None:
        checkpoints = row.checkpoints
        limit = 1 if decode else MAX_PREFILL_CHECKPOINTS
        if len(checkpoints) > limit:
            raise ValueError(f"row {r} has {len(checkpoints)} checkpoints, at most {limit}")
        slots = [slot for slot, _ in checkpoints]
        if len(set(slots)) != len(slots) or row.state_slot in slots:
            raise ValueError(f"row {r}: checkpoint slots {slots} must be distinct from each "
                             f"other and from its state slot {row.state_slot}")  # fmt: skip
        lo, hi = row.prefix_len, row.seq_len
        for _, length in checkpoints:
            aligned = length % self.chunk_size == 0 or length == hi
            if not (lo < length <= hi and aligned):
                raise ValueError(
                    f"row {r}: track_len {length} must be in ({lo}, {hi}] and a "
                    f"multiple of chunk_size {self.chunk_size} (or the row's end)"
                )
            if decode and length != hi:
                raise ValueError(f"decode row {r}: track_len must equal its length {hi}")

    def _validate_sampling(self, r: int, row: RowSpec) -> None:
        stop_ids = row.stop_ids if row.min_tokens > 0 else ()
        bias = row.logit_bias or {}
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"row {r}: min_tokens masks {len(stop_ids)} stop ids (eos + stop_token_ids), "
                f"at most {MAX_STOP_IDS}"
            )
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"row {r}: {len(bias)} logit_bias entries, at most {MAX_LOGIT_BIAS}")
        bad = [t for t in (*stop_ids, *bias) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"row {r}: stop/logit_bias token ids {bad[:5]} outside the vocab "
                f"[0, {self.vocab_size})"
            )
