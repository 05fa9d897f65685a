"""Host side of a step: turn a list of row descriptions into padded `StepInputs` (numpy).

A row with a grammar (structured outputs: `RowSpec.matcher`) has its allowed tokens written
into the step's `token_bitmask` by its matcher; a step without such a row has no bitmask.

Validation happens here, in numpy, before anything is dispatched: a malformed step raises a
`ValueError` that names the row and the values, and the device never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from jaxmamba.step_contract import (
    MAX_DECODE_CHECKPOINTS,
    MAX_FORKS,
    MAX_LOGIT_BIAS,
    MAX_PREFILL_CHECKPOINTS,
    MAX_STOP_IDS,
    ROW_FIELDS,
    CacheSpec,
    StepInputs,
    padding,
    with_on_demand_fields,
)

if TYPE_CHECKING:
    from jaxmamba.structured.matcher import GrammarMatcher


@dataclass
class RowSpec:
    """One row of a step: `tokens` are appended after `prefix_len` cached tokens.

    A *fork* row (n > 1) has no tokens: it samples from the logits of the row before it, whose
    `forks` copy that row's end state into the fork row's slot (and the prompt's partial last
    KV page into its own page) after the step (`runner.fork_fn`)."""

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
    # Structured outputs: the row samples only what its grammar allows next (None: anything).
    matcher: GrammarMatcher | None = None

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

    @property
    def num_spec(self) -> int:
        """k of a verify bucket (speculative decoding: decode rows of 1 + k tokens), else 0."""
        if self.num_decode != self.num_rows or self.num_tokens == self.num_rows:
            return 0
        return self.num_tokens // self.num_rows - 1


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


_TOKENS = attrgetter("tokens")
_SLOTS = attrgetter("state_slot", "init_slot")
_SEED = attrgetter("seed")
# A row's scalar fields, read in one pass: the step inputs set from one row attribute each
# (`step_contract.ROW_FIELDS`), and what the builder alone reads, by column name.
_COLUMNS = (*ROW_FIELDS, "fork")
_SCALARS = attrgetter(*ROW_FIELDS.values(), "fork")
_COLUMN = {name: k for k, name in enumerate(_COLUMNS)}


def _is_rare(row: RowSpec) -> bool:
    """The row has a field that few rows use (read row by row)."""
    return bool(
        row.forks or row.fork or row.track_slot is not None or row.tracks
        or row.min_tokens > 0 or row.logit_bias or row.prompt_logprob_targets
        or row.matcher is not None
    )  # fmt: skip


class _Columns:
    """The rows' fields as arrays, read once for the checks and the packing."""

    def __init__(self, rows: list[RowSpec]):
        n = len(rows)
        token_lists = list(map(_TOKENS, rows))
        self.lens = np.fromiter(map(len, token_lists), np.int64, n)
        self.pages = list(map(attrgetter("pages"), rows))
        self.rare = [r for r, row in enumerate(rows) if _is_rare(row)]
        try:
            self.tokens = np.fromiter(chain.from_iterable(token_lists), np.int64,
                                      int(self.lens.sum()))  # fmt: skip
            self.values = np.array(list(map(_SCALARS, rows)), np.float64).reshape(n, len(_COLUMNS))
        except (OverflowError, TypeError, ValueError):  # the checks name the bad field
            self.tokens = np.zeros(int(self.lens.sum()), np.int64)
            self.values = None
            return
        self.prefix = self["prefix_lens"].astype(np.int64)
        self.slots = self["state_slots"].astype(np.int64)
        self.forked = self["fork"].astype(bool)

    def __getitem__(self, name: str) -> np.ndarray:
        """The column of a scalar field (a step input's name, or "fork")."""
        return self.values[:, _COLUMN[name]]


def _fill_ragged(out: np.ndarray, lists: list) -> None:
    """`out[r, :len(lists[r])] = lists[r]` for every r, as one masked assignment."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    total = int(lens.sum())
    if total:
        mask = np.arange(out.shape[1]) < lens[:, None]  # row-major: the lists in order
        out[: len(lists)][mask] = np.fromiter(chain.from_iterable(lists), out.dtype, total)


@dataclass
class StepBuilder:
    """Packs rows into `StepInputs` for a bucket. Decode rows come first, one token each."""

    spec: CacheSpec
    max_pages_per_seq: int
    vocab_size: int
    chunk_size: int
    # The engine speculates: every step carries `lens_from_device` (set on the rows that take
    # their token from the device), and a verify bucket's rows carry 1 + k tokens.
    speculative: bool = False
    _templates: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def build(
        self, rows: list[RowSpec], bucket: Bucket, num_decode_rows: int | None = None
    ) -> StepInputs:
        """Pack `rows` (decode rows first) into `bucket`.

        A pure decode bucket pads with empty rows at the end. A mixed bucket reserves its
        first `bucket.num_decode` tokens for decode rows: when fewer than that decode
        (`num_decode_rows`), dummy one-token rows on the pad slot/page fill the gap, so the
        prefill tokens always start at token `num_decode`. A verify bucket (`Bucket.num_spec`)
        pads with rows of 1 + k tokens on the pad slot: every row has that many.
        """
        nd = bucket.num_decode
        if bucket.num_spec and len(rows) < bucket.num_rows:
            filler = RowSpec([0] * (1 + bucket.num_spec), 0, self.spec.pad_slot, [])
            filler.init_slot = self.spec.pad_slot
            rows = rows + [filler] * (bucket.num_rows - len(rows))
        if 0 < nd < bucket.num_rows:
            real = nd if num_decode_rows is None else num_decode_rows
            if real > nd:
                raise ValueError(f"{real} decode rows do not fit the bucket's {nd} decode rows")
            filler = RowSpec([0], 0, self.spec.pad_slot, [])
            filler.init_slot = self.spec.pad_slot
            rows = rows[:real] + [filler] * (nd - real) + rows[real:]
        cols = _Columns(rows)
        self._validate(rows, bucket, cols)
        return self._pack(rows, bucket, cols)

    def _defaults(self, bucket: Bucket) -> StepInputs:
        """The bucket's arrays as padding rows have them (made once per bucket; copied)."""
        out = self._templates.get(bucket)
        if out is None:
            out = padding(bucket.num_tokens, bucket.num_rows, self.max_pages_per_seq, self.spec)
            if self.speculative:
                out = with_on_demand_fields(out, self.vocab_size, ("lens_from_device",))
            self._templates[bucket] = out
        return out

    def _pack(self, rows: list[RowSpec], bucket: Bucket, cols: _Columns) -> StepInputs:
        """The arrays, a column at a time: the scalar fields of all rows are read in one pass
        (`_Columns`) and set by one slice each, the ragged ones (tokens, pages) by one fancy
        index each, and what few rows use (checkpoints, forks, logit bias, min_tokens, prompt
        logprobs, grammars) only on the rows that have it. Padding rows keep the bucket's
        defaults."""
        n, pad_slot = len(rows), self.spec.pad_slot
        x = StepInputs(*(None if a is None else a.copy() for a in self._defaults(bucket)))
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(cols.lens, out=offsets[1:])
        total = int(offsets[-1])
        x.input_ids[:total] = cols.tokens
        x.query_start_loc[: n + 1] = offsets
        x.query_start_loc[n + 1 :] = total
        for name in ROW_FIELDS:
            getattr(x, name)[:n] = cols[name]
        if x.lens_from_device is not None:  # a decode row's length is as unknown as its token
            x.lens_from_device[:n] = cols["tokens_from_device"]
        slots, prefix, forked = cols.slots, cols.prefix, cols.forked
        init = np.fromiter((slot if init is None else init
                            for slot, init in map(_SLOTS, rows)), np.int64, n)  # fmt: skip
        init[forked] = pad_slot  # a fork row's state comes from the fork copy
        x.init_slots[:n] = init
        real = slots != pad_slot
        x.has_initial_state[:n] = (prefix > 0) & real & ~forked
        # A request's first step starts from scratch or from a prefix-cache hit's slot.
        x.penalty_reset[:n] = ((prefix == 0) | (init != slots)) & real
        x.seeds[:n] = np.fromiter((seed & 0xFFFFFFFF for seed in map(_SEED, rows)), np.uint32, n)
        _fill_ragged(x.page_table, cols.pages)
        num_forks = 0
        constrained = []  # rows with a grammar
        for r in cols.rare:  # the fields only some rows use
            row = rows[r]
            if row.matcher is not None:
                constrained.append(r)
            if row.prompt_logprob_targets:
                targets = row.prompt_logprob_targets[: cols.lens[r]]
                x.prompt_logprob_targets[offsets[r] : offsets[r] + len(targets)] = targets
            for slot, src_page, dst_page in row.forks:
                x.fork_src_slots[num_forks], x.fork_dst_slots[num_forks] = row.state_slot, slot
                if src_page is not None:
                    x.fork_src_pages[num_forks] = src_page
                    x.fork_dst_pages[num_forks] = dst_page
                num_forks += 1
            for k, (slot, length) in enumerate(row.checkpoints):
                x.track_slots[r, k], x.track_lens[r, k] = slot, length
            # A complete grammar allows only stop ids: it wins over min_tokens.
            if row.min_tokens > 0 and not (row.matcher is not None and row.matcher.must_stop()):
                x.min_tokens[r] = row.min_tokens
                x.stop_ids[r, : len(row.stop_ids)] = row.stop_ids
            if row.logit_bias:
                x.logit_bias_ids[r, : len(row.logit_bias)] = list(row.logit_bias)
                x.logit_bias_values[r, : len(row.logit_bias)] = list(row.logit_bias.values())
        if constrained:
            x = self._fill_bitmask(x, [rows[r].matcher for r in constrained], constrained)
        return x

    def _fill_bitmask(self, x: StepInputs, matchers: list[GrammarMatcher], rows: list[int]
                      ) -> StepInputs:  # fmt: skip
        """`x` with its token bitmask: each constrained row's written by its matcher, every
        other row's allowing every token."""
        from jaxmamba.structured import fill_bitmasks

        x = with_on_demand_fields(x, self.vocab_size)
        fill_bitmasks(matchers, x.token_bitmask, rows)
        return x

    def padding(self, bucket: Bucket) -> StepInputs:
        """A step of padding only (every row on the pad slot): for warming a bucket up."""
        return self.build([], bucket, num_decode_rows=0)

    def _validate(self, rows: list[RowSpec], bucket: Bucket, cols: _Columns) -> None:
        if len(rows) > bucket.num_rows:
            raise ValueError(f"{len(rows)} rows do not fit the bucket's {bucket.num_rows} rows")
        total = len(cols.tokens)
        if total > bucket.num_tokens:
            raise ValueError(f"{total} tokens do not fit the bucket's {bucket.num_tokens} tokens")
        nd = bucket.num_decode
        per_decode = 1 + bucket.num_spec  # tokens of a decode row
        if nd and nd == bucket.num_rows:
            if bucket.num_spec and not self.speculative:
                raise ValueError(f"a pure decode bucket needs num_tokens == num_rows, got {bucket} "
                                 "(rows of 1 + k tokens: a verify bucket, which only a "
                                 "speculating engine's builder takes)")  # fmt: skip
            if bucket.num_tokens != nd * per_decode:
                raise ValueError(f"a pure decode bucket needs num_tokens == num_rows x (1 + k), "
                                 f"k = {bucket.num_spec}, got {bucket}")  # fmt: skip
        rare = [rows[r] for r in cols.rare]
        decode_checkpoints = sum(len(rows[r].checkpoints) for r in cols.rare if r < nd)
        if decode_checkpoints > MAX_DECODE_CHECKPOINTS:
            raise ValueError(
                f"{decode_checkpoints} decode rows checkpoint in one step, at most "
                f"{MAX_DECODE_CHECKPOINTS}"
            )
        num_forks = sum(len(row.forks) for row in rare)
        if num_forks > MAX_FORKS:
            raise ValueError(f"{num_forks} forked samples in one step, at most {MAX_FORKS}")
        if not self._rows_plainly_valid(nd, cols, per_decode):
            self._validate_rows(rows, nd, per_decode)  # raises, naming the first bad row
            raise TypeError("a row field is not a number (RowSpec holds ints and floats)")
        pad_slot = self.spec.pad_slot
        for r, row in zip(cols.rare, rare, strict=True):  # what only some rows have, on them
            if row.state_slot != pad_slot:
                if row.fork:
                    self._validate_fork(r, row, rows)
                self._validate_sampling(r, row)
                self._validate_checkpoints(r, row, decode=r < nd)

    def _rows_plainly_valid(self, nd: int, cols: _Columns, per_decode: int = 1) -> bool:
        """The per-row checks of `_validate_rows` that every row needs (token counts and ids,
        where the token comes from, pages), over all rows at once: True when all pass."""
        if cols.values is None:
            return False  # a field is not a number: the per-row checks say which
        n, lens = len(cols.lens), cols.lens
        checked = cols.slots != self.spec.pad_slot  # filler rows are not checked
        decode = np.arange(n) < nd
        # A verify row's drafts past its pages write the pad page (a request's end: dropped).
        need = -(-(cols.prefix + np.where(decode, 1, lens)) // self.spec.page_size)
        num_pages = np.fromiter(map(len, cols.pages), np.int64, n)
        bad = (
            (lens == 0) & ~cols.forked
            | decode & (lens != per_decode)
            | cols["tokens_from_device"].astype(bool) & ~decode
            | (need > self.max_pages_per_seq)
            | (num_pages < need)
        )
        if np.any(bad & checked):
            return False
        tokens = cols.tokens
        if tokens.size == 0 or 0 <= tokens.min() and tokens.max() < self.vocab_size:
            return True
        in_vocab = (tokens >= 0) & (tokens < self.vocab_size)
        return bool(np.all(in_vocab | ~np.repeat(checked, lens)))  # filler rows' tokens

    def _validate_rows(self, rows: list[RowSpec], nd: int, per_decode: int = 1) -> None:
        """Every row's checks, a row at a time: the first bad row raises."""
        page_size = self.spec.page_size
        for r, row in enumerate(rows):
            n = len(row.tokens)
            if row.state_slot == self.spec.pad_slot:
                continue  # a filler row
            if row.fork:
                self._validate_fork(r, row, rows)
            elif n == 0:
                raise ValueError(f"row {r} has no tokens")
            if r < nd and n != per_decode:
                raise ValueError(f"decode row {r} must carry exactly {per_decode} token(s), "
                                 f"got {n}")  # fmt: skip
            if row.token_from_device and r >= nd:
                raise ValueError(f"row {r} takes its token from the device but is not a decode row")
            bad = [t for t in row.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"row {r}: token ids {bad[:5]} outside the vocab [0, {self.vocab_size})"
                )
            self._validate_sampling(r, row)
            need = -(-(row.prefix_len + (1 if r < nd else n)) // page_size)
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
