"""The engine step as pure functions of pytrees, on device: `step_fn` (forward, sample at
each row's last token, remember the samples), its side programs `score_fn` (prompt logprobs)
and `fork_fn` (n > 1 state copies), and `logits_fn` (every token's logits). The runners
(`jaxmamba.engine.runner`, `jaxmamba.export`) dispatch them; `jaxmamba.parallel.step` runs
the same functions over a mesh.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import StateCache, copy_entries
from jaxmamba.model.draft import DraftSpec, advance_draft, init_draft_cache, propose_draft
from jaxmamba.model.metadata import ForwardMetadata, PackedStepInputs
from jaxmamba.model.mtp import MtpSpec, advance_mtp, init_mtp_state, next_tokens, propose_mtp
from jaxmamba.model.sampling import (
    Penalties,
    PenaltyState,
    SampleOutput,
    init_penalty_state,
    prompt_logprobs,
    record_tokens,
    sample,
)
from jaxmamba.model.speculative import (
    NgramSpec,
    SpecState,
    commit_pending,
    init_spec_state,
    propose_ngram,
    record_history,
    record_kept,
    verify_sample,
)
from jaxmamba.step_contract import MAX_PROMPT_LOGPROB_TOKENS, CacheSpec, StepInputs

if TYPE_CHECKING:  # the model is a static argument: serving an exported artifact runs the
    # engine without importing the model code
    from jaxmamba.model.model import Mamba2HybridLM


class SlotState(NamedTuple):
    """What the sampler keeps per state slot between steps, on device, and the hidden states
    the last step with prefill rows leaves for `score_fn`."""

    last_tokens: jax.Array  # i32[S+1] the slot's last sampled token (fed to its next decode)
    penalties: PenaltyState  # prompt tokens and output counts, [S+1, V]
    # [MAX_PROMPT_LOGPROB_TOKENS, E] model dtype: at the prefill tokens that ask for
    # prompt_logprobs (`prompt_tokens_to_score`), in step order; padding repeats a position
    prompt_hidden: jax.Array
    # Speculative decoding: each slot's length and token history (None: the runner does not
    # speculate, and its steps carry nothing of it)
    spec: SpecState | None = None


def init_slot_state(cfg: ModelConfig, spec: CacheSpec, dtype,
                    speculative: NgramSpec | DraftSpec | MtpSpec | None = None
                    ) -> SlotState:  # fmt: skip
    """A runner's first `SlotState` (under `jax.eval_shape`: its shapes)."""
    spec_state = None
    if speculative is not None:
        spec_state = init_spec_state(spec.num_slots, speculative)
        if isinstance(speculative, DraftSpec):
            spec_state = spec_state._replace(draft=init_draft_cache(speculative, spec))
        if isinstance(speculative, MtpSpec):
            draft, hidden = init_mtp_state(speculative, spec)
            spec_state = spec_state._replace(draft=draft, mtp_hidden=hidden)
    return SlotState(
        jnp.zeros(spec.num_slots + 1, jnp.int32),
        init_penalty_state(spec.num_slots, cfg.vocab_size),
        jnp.zeros((MAX_PROMPT_LOGPROB_TOKENS, cfg.hidden_size), dtype),
        spec_state,
    )


def pack_sample_output(out: SampleOutput) -> jax.Array:
    """One `i32[B, 3 + 2 * MAX_LOGPROBS]` array per step (the one device→host transfer): the
    sampled token, its logprob, its rank, the top token ids and their logprobs; the float
    logprobs are bit-cast to int32, the ids are stored as they are."""
    as_i32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    columns = [out.tokens[:, None], as_i32(out.logprobs)[:, None], out.ranks[:, None]]
    return jnp.concatenate([*columns, out.top_ids, as_i32(out.top_logprobs)], axis=-1)


def build_metadata(model: Mamba2HybridLM, spec: CacheSpec, inputs: StepInputs, num_decode: int,
                   num_spec: int = 0):  # fmt: skip
    return ForwardMetadata.build(
        inputs,
        num_decode=num_decode,
        chunk_size=model.cfg.chunk_size,
        page_size=spec.page_size,
        pad_page=spec.pad_page,
        pad_slot=spec.pad_slot,
        num_spec=num_spec,
    )


def verify_tokens(inputs: StepInputs, num_decode: int) -> int:
    """k of a verify step (its rows carry 1 + k tokens), from its shapes; 0 for any other."""
    num_tokens, num_rows = inputs.input_ids.shape[0], inputs.state_slots.shape[0]
    if num_decode != num_rows or num_tokens == num_rows:
        return 0
    return num_tokens // num_rows - 1


def _with_device_lens(inputs: StepInputs, state: SpecState) -> StepInputs:
    """The rows that take their length from the device: `prefix_lens` from it, and
    `sample_counters` shifted as much (a row's counter and length advance together)."""
    shift = state.seq_lens[inputs.state_slots] - inputs.prefix_lens
    shift = jnp.where(inputs.lens_from_device, shift, 0)
    return inputs._replace(prefix_lens=inputs.prefix_lens + shift,
                           sample_counters=inputs.sample_counters + shift)  # fmt: skip


def _input_ids(inputs: StepInputs, last_tokens: jax.Array, num_decode: int) -> jax.Array:
    if num_decode == 0:
        return inputs.input_ids
    decode_ids = jnp.where(
        inputs.tokens_from_device[:num_decode],
        last_tokens[inputs.state_slots[:num_decode]],
        inputs.input_ids[:num_decode],
    )
    # Not `.at[:num_decode].set`: where every row decodes, that scatter's index is a
    # zero-sized constant, which a shard_map takes as an operand and XLA 0.11's SPMD
    # partitioner segfaults on (scripts/dev/xla_tp_segfault.py).
    return jax.lax.dynamic_update_slice(inputs.input_ids, decode_ids, (0,))


# Traces (= compilations) of the jitted step per (model, cache spec) in this process.
TRACE_COUNTS: Counter = Counter()

# The sampler variants of a step (its static `sampler` argument): FULL samples any mix of
# parameters and returns the top logprobs; PLAIN has neither the cut-off's sort nor the top
# logprobs (zeros), for a decode step where no row filters or asks for them; GREEDY is the
# argmax of the biased logits and the token's logprob, for a decode step of greedy rows
# without penalties where no row asks for logprobs (ranks and top logprobs are zeros) — vLLM's
# all-greedy path (0.07-0.45 ms off a 9B decode step: `bench_engine.py --plain-sampler-too`).
FULL, PLAIN, GREEDY = "full", "plain", "greedy"


def step_fn(params, cache: StateCache, slot_state: SlotState, inputs: StepInputs,
            draft_params=None, *, model, spec, num_decode, sampler: str = FULL,
            speculative: NgramSpec | DraftSpec | MtpSpec | None = None):  # fmt: skip
    """One engine step: forward, sample at each row's last token, remember the samples.

    The packed output has a row per step row. A bucket with prefill rows also keeps the
    hidden states of the prefill tokens that ask for prompt_logprobs (`SlotState.
    prompt_hidden`, for `score_fn`); forks' state copies are `fork_fn`'s. Inputs with a
    `token_bitmask` (structured outputs) are a program of their own, whatever the sampler:
    the sampler masks with it (`sample`).

    `speculative` (a runner that speculates; its slot state has `spec`): a step whose rows
    carry ``1 + k`` tokens is a verify step (`verify_step`); every step whose inputs have
    `lens_from_device` reads those rows' lengths from the device and records every row's
    length and fed tokens. A `DraftSpec` runner's draft model (`draft_params`) consumes every
    step's tokens as the target does (`draft.advance_draft`); an `MtpSpec` runner's MTP head
    (`draft_params`) every step's positions, paired with the next tokens (`mtp.advance_mtp`)."""
    TRACE_COUNTS[(model, spec)] += 1  # runs only while tracing
    if isinstance(inputs, PackedStepInputs):
        inputs = inputs.unpack()
    num_spec = verify_tokens(inputs, num_decode)
    if num_spec:
        if speculative is None or num_spec != speculative.num_tokens:
            raise ValueError(f"a verify step of {num_spec} drafts a row, but the runner "
                             f"speculates {speculative}")  # fmt: skip
        return verify_step(params, cache, slot_state, inputs, draft_params, model=model,
                           spec=spec, sampler=sampler, speculative=speculative)  # fmt: skip
    recording = inputs.lens_from_device is not None and slot_state.spec is not None
    if recording:
        inputs = _with_device_lens(inputs, slot_state.spec)
    meta = build_metadata(model, spec, inputs, num_decode)
    input_ids = _input_ids(inputs, slot_state.last_tokens, num_decode)
    hidden, cache = model.apply({"params": params}, input_ids, cache, meta)
    num_rows = inputs.state_slots.shape[0]
    prompt_hidden = slot_state.prompt_hidden
    if inputs.prompt_logprob_targets is not None and num_rows > num_decode:
        positions = prompt_tokens_to_score(inputs.prompt_logprob_targets, num_decode)
        prompt_hidden = hidden[positions].astype(prompt_hidden.dtype)
    logits = model.apply({"params": params}, hidden[meta.last_token_index], method="logits")
    slots = inputs.state_slots
    seen = record_tokens(
        slot_state.penalties, input_ids, meta.token_rows, meta.token_valid, slots,
        inputs.penalty_reset, num_decode=num_decode, pad_slot=spec.pad_slot,
    )  # fmt: skip
    if num_rows > num_decode and inputs.fork_src_slots is not None:
        # n > 1: the forked samples see the prompt as their own from this step on
        src, dst = inputs.fork_src_slots, inputs.fork_dst_slots
        seen = PenaltyState(
            seen.prompt_mask.at[dst].set(seen.prompt_mask[src]),
            seen.output_counts.at[dst].set(seen.output_counts[src]),
        )
    penalties = None
    if sampler != GREEDY:  # the [B, V] gathers: GREEDY steps have no penalised row
        penalties = Penalties(
            seen.prompt_mask[slots], seen.output_counts[slots], inputs.presence_penalty,
            inputs.frequency_penalty, inputs.repetition_penalty,
        )  # fmt: skip
    out = sample(
        logits, inputs.temperature, inputs.top_p, inputs.top_k, inputs.seeds,
        inputs.sample_counters, inputs.min_p, inputs.min_tokens, inputs.stop_ids,
        inputs.logit_bias_ids, inputs.logit_bias_values, penalties, inputs.token_bitmask,
        cutoff=sampler == FULL, top_logprobs=sampler == FULL, draw=sampler != GREEDY,
        ranks=sampler != GREEDY,
    )  # fmt: skip
    last_tokens = slot_state.last_tokens.at[slots].set(out.tokens)
    spec_state = slot_state.spec
    if isinstance(speculative, DraftSpec):
        draft = advance_draft(speculative, draft_params, spec_state.draft, input_ids, meta,
                              inputs, num_decode)  # fmt: skip
        spec_state = spec_state._replace(draft=draft)
    if isinstance(speculative, MtpSpec):
        draft, mtp_hidden = advance_mtp(
            speculative, draft_params, params, spec_state.draft, spec_state.mtp_hidden, hidden,
            next_tokens(input_ids, out.tokens, meta), meta, slots, meta.last_token_index, inputs,
            num_decode,
        )  # fmt: skip
        spec_state = spec_state._replace(draft=draft, mtp_hidden=mtp_hidden)
    if recording:
        qsl = inputs.query_start_loc
        if num_rows > num_decode:  # a request's first step: forget its slot's last occupant
            first = jnp.where(inputs.penalty_reset, slots, spec.pad_slot)
            spec_state = spec_state._replace(history=spec_state.history.at[first].set(-1))
        token_slots = jnp.where(meta.token_valid, slots[meta.token_rows], spec.pad_slot)
        spec_state = record_history(spec_state, token_slots, meta.positions, input_ids, slots,
                                    inputs.prefix_lens + qsl[1:] - qsl[:-1])  # fmt: skip
        if num_rows > num_decode and inputs.fork_src_slots is not None:
            src, dst = inputs.fork_src_slots, inputs.fork_dst_slots
            spec_state = spec_state._replace(
                history=spec_state.history.at[dst].set(spec_state.history[src])
            )
    return pack_sample_output(out), cache, SlotState(last_tokens, seen, prompt_hidden, spec_state)


def verify_step(params, cache: StateCache, slot_state: SlotState, inputs: StepInputs,
                draft_params=None, *, model, spec, sampler: str,
                speculative: NgramSpec | DraftSpec | MtpSpec):  # fmt: skip
    """A verify step (speculative decoding, `jaxmamba.model.speculative`): every row feeds its
    last sampled token and k drafts proposed here from its slot's history, the target scores
    the ``J = 1 + k`` positions, the accepted prefix is chosen, and the row's recurrent state
    is written after it; the row's length, history, output counts and last token advance by
    what it kept. A `DraftSpec` runner's drafts are its draft model's (`draft.propose_draft`),
    whose state is written after the same kept positions; an `MtpSpec` runner's are its MTP
    head's (`mtp.propose_mtp`), which then scores the verify positions again with the
    target's hidden states and keeps its output at the last kept one.

    Returns ``i32[B, 2 + J·(3 + 2·MAX_LOGPROBS)]``: per row the drafts accepted, whether it
    proposed any (1/0), then each position's packed sample (`pack_sample_output`); the row
    emits positions ``0..accepted``."""
    state = slot_state.spec
    inputs = _with_device_lens(inputs, state)
    slots, lens = inputs.state_slots, inputs.prefix_lens
    rows, k = slots.shape[0], speculative.num_tokens
    last = slot_state.last_tokens[slots]
    meta = build_metadata(model, spec, inputs, rows, num_spec=k)
    if isinstance(speculative, DraftSpec):
        drafts, draft_pending, draft_cache = propose_draft(speculative, draft_params, state.draft,
                                                           last, meta)  # fmt: skip
        proposed = jnp.ones(rows, bool)
    elif isinstance(speculative, MtpSpec):
        drafts, mtp_cache = propose_mtp(speculative, draft_params, params, model, state.draft,
                                        state.mtp_hidden, slots, meta)  # fmt: skip
        proposed = jnp.ones(rows, bool)
    else:
        drafts, proposed = propose_ngram(state.history, lens, last, slots, speculative)
    input_ids = jnp.concatenate([last[:, None], drafts], axis=1).reshape(-1)  # [B*J]
    hidden, cache, pending = model.apply({"params": params}, input_ids, cache, meta)
    logits = model.apply({"params": params}, hidden, method="logits")  # [B*J, V]
    seen = slot_state.penalties
    penalties = None
    if sampler != GREEDY:  # the [B, V] gathers: GREEDY steps have no penalised row
        # Position 0 sees the counts with the row's last token, which its plain decode step
        # would have counted as it fed it (`record_tokens`); `verify_sample` adds the drafts.
        counts = seen.output_counts[slots].at[jnp.arange(rows), last].add(1)
        penalties = Penalties(seen.prompt_mask[slots], counts, inputs.presence_penalty,
                              inputs.frequency_penalty, inputs.repetition_penalty)  # fmt: skip
    out, accepted = verify_sample(
        logits, drafts, proposed, inputs.temperature, inputs.top_p, inputs.top_k, inputs.seeds,
        inputs.sample_counters, inputs.min_p, inputs.min_tokens, inputs.stop_ids,
        inputs.logit_bias_ids, inputs.logit_bias_values, penalties,
        cutoff=sampler == FULL, top_logprobs=sampler == FULL, draw=sampler != GREEDY,
        ranks=sampler != GREEDY,
    )  # fmt: skip
    kept = accepted + 1
    cache = commit_pending(cache, pending, slots, kept)
    if isinstance(speculative, DraftSpec):
        state = state._replace(draft=commit_pending(draft_cache, draft_pending, slots, kept))
    if isinstance(speculative, MtpSpec):  # position j pairs h_j with the token emitted after it
        mtp_cache, mtp_hidden = advance_mtp(
            speculative, draft_params, params, mtp_cache, state.mtp_hidden, hidden, out.tokens,
            meta, slots, jnp.arange(rows) * (k + 1) + accepted,
        )  # fmt: skip
        state = state._replace(draft=mtp_cache, mtp_hidden=mtp_hidden)
    emitted = out.tokens.reshape(rows, k + 1)
    last_tokens = slot_state.last_tokens.at[slots].set(
        jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
    )
    state = record_history(state, jnp.repeat(slots, k + 1), meta.positions, input_ids, slots,
                           lens + kept)  # fmt: skip
    seen = record_kept(seen, slots, input_ids.reshape(rows, k + 1), accepted)
    packed = jnp.concatenate(
        [accepted[:, None], proposed[:, None].astype(jnp.int32),
         pack_sample_output(out).reshape(rows, -1)], axis=1,
    )  # fmt: skip
    return packed, cache, SlotState(last_tokens, seen, slot_state.prompt_hidden, state)


def prompt_tokens_to_score(
    targets: jax.Array,  # i32[T] next prompt token where prompt_logprobs is asked, else -1
    num_decode: int,
) -> jax.Array:
    """i32[MAX_PROMPT_LOGPROB_TOKENS]: the step positions of the prefill tokens that ask for
    prompt_logprobs, in order (the scheduler keeps their count within the width); padding
    repeats the first prefill position. `asked_targets` lists the same tokens' targets."""
    (index,) = jnp.nonzero(targets[num_decode:] >= 0, size=MAX_PROMPT_LOGPROB_TOKENS,
                           fill_value=0)  # fmt: skip
    return num_decode + index


def score_fn(params, prompt_hidden: jax.Array, targets: jax.Array, *, model, spec) -> jax.Array:
    """vLLM's prompt logprobs of the tokens a step kept (`SlotState.prompt_hidden`), packed as
    the samples are: `i32[W, 3 + 2 * MAX_LOGPROBS]`, per token its target (the next prompt
    token; -1 for padding), its logprob and rank, and the top ids and logprobs."""
    TRACE_COUNTS[(model, spec)] += 1  # runs only while tracing
    logits = model.apply({"params": params}, prompt_hidden, method="logits")
    p = prompt_logprobs(logits, targets)
    return pack_sample_output(SampleOutput(targets, p.logprobs, p.ranks, p.top_ids,
                                           p.top_logprobs))  # fmt: skip


def fork_fn(cache: StateCache, src_slots, dst_slots, src_pages, dst_pages, *, model=None,
            spec=None) -> StateCache:  # fmt: skip
    """n > 1: copy a prompt's end state into its other samples' slots, and its partial last
    KV page into theirs, after the step that ends the prompt (unused entries: the pad slot
    and page onto themselves). `model` and `spec` only count its compilations."""
    TRACE_COUNTS[(model, spec)] += 1  # runs only while tracing
    return copy_entries(cache, src_slots, dst_slots, src_pages, dst_pages)


def logits_fn(params, cache: StateCache, inputs: StepInputs, *, model, spec, num_decode):
    TRACE_COUNTS[(model, spec)] += 1
    meta = build_metadata(model, spec, inputs, num_decode)
    return model.apply({"params": params}, inputs.input_ids, cache, meta, method="forward_logits")


# Module-level jits with the model and cache spec static: every runner of the same model
# and cache shape (several `LLM`s, tests) shares one compiled executable per bucket.
jitted_step = jax.jit(
    step_fn,
    static_argnames=("model", "spec", "num_decode", "sampler", "speculative"),
    donate_argnames=("cache", "slot_state"),
)
# The same step for an MTP runner on XLA:CPU, compiled without XLA:CPU's fusion emitters:
# with them, a verify step of the MTP head now and then never finished on CPU (every thread
# idle, the step's output never ready; docs/speculative.md). Off, 300 runs in a row of the
# program that hung finished (`scripts/dev/mtp_cpu_hang.py`). The option is CPU-only.
jitted_step_without_cpu_fusion_emitters = jax.jit(
    step_fn,
    static_argnames=("model", "spec", "num_decode", "sampler", "speculative"),
    donate_argnames=("cache", "slot_state"),
    compiler_options={"xla_cpu_use_fusion_emitters": False},
)
jitted_logits = jax.jit(
    logits_fn, static_argnames=("model", "spec", "num_decode"), donate_argnames=("cache",)
)
jitted_score = jax.jit(score_fn, static_argnames=("model", "spec"))
jitted_fork = jax.jit(fork_fn, static_argnames=("model", "spec"), donate_argnames=("cache",))
