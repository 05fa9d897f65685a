"""The step contract: every input of one engine step with its shape, dtype and padding value,
the limits that size them, and the cache sizes they index. Numpy only: the host (scheduler,
`StepBuilder`) fills a step by field name, the device (`ForwardMetadata`, the runner) reads
it, and neither imports the other.

Dimension letters: T tokens, B rows, MP KV pages per row (`max_pages_per_seq`), KP checkpoints
per prefill row (`MAX_PREFILL_CHECKPOINTS`), KF forks (`MAX_FORKS`), SI stop ids
(`MAX_STOP_IDS`), LB logit bias entries (`MAX_LOGIT_BIAS`), VW int32 words of a token bitmask
(`ceil(V / 32)`, V the model's vocabulary).

Layout of a step (all shapes static, padded to a bucket): the first ``num_decode`` tokens
belong to the decode rows (one token each), the rest to the prefill/extend rows, row after
row; tokens past the last row's end are padding. Rows ``[0, num_decode)`` decode, the rest
prefill; padding rows have zero tokens and point at the pad slot / pad page.

A *verify* step (speculative decoding, `jaxmamba.model.speculative`) is a pure decode step
whose rows carry ``1 + k`` tokens each (``T = B·(1 + k)``): the row's last sampled token and
``k`` draft tokens, all taken on the device. Its shape alone says so.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxmamba.structured.bitmask import bitmask_words

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

# The sampler's fixed widths: top logprobs returned per token (vLLM's default cap), logit_bias
# entries and stop ids (eos + stop_token_ids, masked until min_tokens) per row.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 64
MAX_STOP_IDS = 16


class CacheSpec(NamedTuple):
    """Sizes of a cache; `num_slots`/`num_pages` exclude the pad slot/page."""

    num_slots: int
    num_pages: int
    page_size: int
    ssm_dtype: str = "float32"
    kv_dtype: str = "auto"  # the attention pages' dtype: "auto" (the model's) or "fp8"

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    @property
    def pad_page(self) -> int:
        return self.num_pages


@dataclass(frozen=True)
class InputField:
    """One step input: its dimensions (letters of the notation above), dtype, and the value
    padding rows and tokens hold ("pad_slot" / "pad_page": the cache spec's)."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    fill: float | str
    # The `RowSpec` attribute every row sets this `[B]` field from, in the builder's one pass
    # over the rows; None: the builder fills it its own way.
    row: str | None = None
    # May be None in `StepInputs` (a step built by hand); the builder sends it in every step.
    optional: bool = False
    # Sent only in the steps where some row uses it, None (absent from the packed buffer) in
    # the others: its presence makes a program of its own, so a step without it runs, and
    # moves, exactly what it would if the field did not exist.
    on_demand: bool = False


FIELDS: tuple[InputField, ...] = (
    InputField("input_ids", ("T",), "int32", 0),
    # a decode row's input is its slot's last sampled token
    InputField("tokens_from_device", ("B",), "bool", False, row="token_from_device"),
    # cumulative token counts per row (pad rows: 0 tokens)
    InputField("query_start_loc", ("B+1",), "int32", 0),
    # tokens already in the cache before this step
    InputField("prefix_lens", ("B",), "int32", 0, row="prefix_len"),
    InputField("state_slots", ("B",), "int32", "pad_slot", row="state_slot"),  # working slot
    # slot the initial state is read from (a prefix-cache hit's node)
    InputField("init_slots", ("B",), "int32", "pad_slot"),
    InputField("has_initial_state", ("B",), "bool", False),
    # Where to checkpoint the state this step: up to KP per prefill row (decode rows use
    # column 0), the absolute length of each; unused entries hold the pad slot and length 0.
    # A `[B]` array is read as one column.
    InputField("track_slots", ("B", "KP"), "int32", "pad_slot"),
    InputField("track_lens", ("B", "KP"), "int32", 0),
    InputField("page_table", ("B", "MP"), "int32", "pad_page"),  # KV pages per row
    InputField("temperature", ("B",), "float32", 0.0, row="temperature"),  # 0 = greedy
    InputField("top_p", ("B",), "float32", 1.0, row="top_p"),
    InputField("top_k", ("B",), "int32", 0, row="top_k"),  # 0 = off
    InputField("seeds", ("B",), "uint32", 0),  # per-request sampling seed
    # tokens sampled so far (folds into the seed)
    InputField("sample_counters", ("B",), "int32", 0, row="sample_counter"),
    InputField("min_p", ("B",), "float32", 0.0, row="min_p"),  # 0 = off
    # stop_ids are masked while sample_counters < min_tokens
    InputField("min_tokens", ("B",), "int32", 0),
    InputField("stop_ids", ("B", "SI"), "int32", -1),  # eos + stop_token_ids (-1 = pad)
    InputField("logit_bias_ids", ("B", "LB"), "int32", -1),  # -1 = pad
    InputField("logit_bias_values", ("B", "LB"), "float32", 0.0),
    InputField("presence_penalty", ("B",), "float32", 0.0, row="presence_penalty"),  # 0 = off
    InputField("frequency_penalty", ("B",), "float32", 0.0, row="frequency_penalty"),
    InputField("repetition_penalty", ("B",), "float32", 1.0, row="repetition_penalty"),  # 1=off
    # the row is its request's first step (clears its slot's sampler penalties)
    InputField("penalty_reset", ("B",), "bool", False),
    # the prompt token after each prefill token, for prompt_logprobs (-1: not asked)
    InputField("prompt_logprob_targets", ("T",), "int32", -1, optional=True),
    # n > 1 forks: the step copies each source slot's sampler penalties to its destination
    # slot, and `runner.fork_fn`, run after it, the state (SSM, conv) and each source KV page
    # (a prompt's partial last page) to its destination. Unused entries: pad -> pad.
    InputField("fork_src_slots", ("KF",), "int32", "pad_slot", optional=True),
    InputField("fork_dst_slots", ("KF",), "int32", "pad_slot", optional=True),
    InputField("fork_src_pages", ("KF",), "int32", "pad_page", optional=True),
    InputField("fork_dst_pages", ("KF",), "int32", "pad_page", optional=True),
    # Structured outputs: the tokens each row may sample, bit i of word j allowing token
    # 32 j + i (`jaxmamba.structured.bitmask`); rows without a constraint allow all (-1).
    # The builder sends it only in steps with a constrained row; the runner gives the other
    # steps of the programs that read it (FULL, `runner.takes_bitmask`) an all-allowing one.
    InputField("token_bitmask", ("B", "VW"), "int32", -1, optional=True, on_demand=True),
    # Speculative decoding: a decode row's length (its `prefix_lens`, and `sample_counters`
    # shifted alike) is the device's (`SpecState.seq_lens`), since the host does not know how
    # many drafts the step before accepted. Sent in every step of an engine that speculates
    # (whose steps also record each slot's length and token history), never in the others.
    InputField("lens_from_device", ("B",), "bool", False, optional=True, on_demand=True),
)

FIELD = {f.name: f for f in FIELDS}

# The step's inputs, one array per field of `FIELDS` (a pytree: the device reads it as is).
StepInputs = collections.namedtuple(
    "StepInputs",
    [f.name for f in FIELDS],
    defaults=[None for f in FIELDS if f.optional],
)
StepInputs.__doc__ = "Fixed-shape arrays one step reads, one per `FIELDS` entry."

# The `[B]` fields set from one `RowSpec` attribute each: input field -> attribute.
ROW_FIELDS = {f.name: f.row for f in FIELDS if f.row is not None}

_CONSTANT_DIMS = {
    "KP": MAX_PREFILL_CHECKPOINTS,
    "KF": MAX_FORKS,
    "SI": MAX_STOP_IDS,
    "LB": MAX_LOGIT_BIAS,
}


def padding(num_tokens: int, num_rows: int, max_pages_per_seq: int, spec: CacheSpec) -> StepInputs:
    """A step of `num_tokens` tokens and `num_rows` rows that are all padding: every field at
    its fill value, but the fields sent on demand, which are absent (None;
    `with_on_demand_fields` adds them)."""
    sizes = {"T": num_tokens, "B": num_rows, "B+1": num_rows + 1, "MP": max_pages_per_seq,
             **_CONSTANT_DIMS}  # fmt: skip
    fills = {"pad_slot": spec.pad_slot, "pad_page": spec.pad_page}
    return StepInputs(**{
        f.name: np.full(tuple(sizes[d] for d in f.dims), fills.get(f.fill, f.fill), f.dtype)
        for f in FIELDS if not f.on_demand
    })  # fmt: skip


def with_on_demand_fields(inputs: StepInputs, vocab_size: int,
                          names: tuple[str, ...] = ("token_bitmask",)) -> StepInputs:  # fmt: skip
    """`inputs` with the fields sent on demand among `names` that it lacks, at their fill
    values: a step of the programs that read them (FULL sampler programs: the token bitmask;
    a speculating engine's steps: `lens_from_device`) where no row uses them."""
    sizes = {"T": len(inputs.input_ids), "B": len(inputs.state_slots),
             "VW": bitmask_words(vocab_size)}  # fmt: skip
    return inputs._replace(**{
        f.name: np.full(tuple(sizes[d] for d in f.dims), f.fill, f.dtype)
        for f in FIELDS if f.on_demand and f.name in names and getattr(inputs, f.name) is None
    })  # fmt: skip


def _to_i32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.bool_:
        return a.astype(np.int32)
    if a.dtype in (np.int32, np.uint32, np.float32):
        return a.view(np.int32)
    raise TypeError(f"a step input of dtype {a.dtype}: expected int32, uint32, float32 or bool")


def pack(inputs: StepInputs) -> tuple[np.ndarray, tuple]:
    """Every field present, flattened into one int32 buffer (floats and uint32 bit-cast,
    bools 0/1), and its layout: `((field, shape, dtype name), ...)` in buffer order."""
    layout, parts = [], []
    for name, value in zip(inputs._fields, inputs, strict=True):
        if value is None:
            continue
        a = np.asarray(value)
        layout.append((name, a.shape, a.dtype.name))
        parts.append(_to_i32(a).ravel())
    return np.concatenate(parts), tuple(layout)
