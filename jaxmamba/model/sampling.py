"""Token sampling on device, in vLLM's order, with per-row parameters and seeds.

Per row: logit_bias is added and, until `min_tokens` tokens are out, the row's stop ids are
masked; then the repetition, frequency and presence penalties, the structured-outputs token
bitmask (tokens it disallows to -inf), temperature, top-k, top-p over the top-k survivors
renormalised, and min-p. Greedy rows (temperature 0) take the argmax of
the processed logits. Every parameter is a per-row array, so a new mix of parameters never
recompiles.

The program has no device branch (`tests/test_no_host_sync.py` checks it); the host chooses
instead: the sort of each row's scaled logits serves only the top-k/top-p/min-p cut-off, and
the top logprobs (a two-stage top-k, `top_k_blocked`, exact to the ids and cheaper than one
`lax.top_k` over the vocabulary) only requests that ask for them, so `sample(cutoff=False,
top_logprobs=False)` is a second program without either, for steps where no row needs them
(`needs_cutoff`; the runner picks it for decode steps), and with `draw=False, ranks=False` and
no penalties a third, the argmax alone, for steps of greedy rows that ask for no logprobs.

The penalties read `PenaltyState`, one row per state slot, kept on device and updated inside
the step (`record_tokens`): which tokens the slot's prompt holds, and how often each output
token came out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Top logprobs are always computed for MAX_LOGPROBS tokens (a static shape).
from jaxmamba.step_contract import MAX_LOGPROBS

# First-stage block of `top_k_blocked`: the fastest of 1024-8192 (`scripts/bench_sampling.py`).
TOP_K_BLOCK = 1024


class PenaltyState(NamedTuple):
    """Per state slot, what the penalties need: `(1 + 4) * V` bytes a slot."""

    prompt_mask: jax.Array  # bool[S+1, V] token occurs in the slot's prompt
    output_counts: jax.Array  # i32[S+1, V] times the slot's request has output the token


class Penalties(NamedTuple):
    """One step's rows: their slots' penalty state and their penalty parameters."""

    prompt_mask: jax.Array  # bool[B, V]
    output_counts: jax.Array  # i32[B, V]
    presence: jax.Array  # f32[B] 0 = off
    frequency: jax.Array  # f32[B] 0 = off
    repetition: jax.Array  # f32[B] 1 = off


def init_penalty_state(num_slots: int, vocab: int) -> PenaltyState:
    """State for `num_slots` slots and the pad slot."""
    return PenaltyState(
        jnp.zeros((num_slots + 1, vocab), bool), jnp.zeros((num_slots + 1, vocab), jnp.int32)
    )


def record_tokens(
    state: PenaltyState,
    input_ids: jax.Array,  # i32[T] the step's tokens (decode rows' are their last outputs)
    token_rows: jax.Array,  # i32[T]
    token_valid: jax.Array,  # bool[T]
    state_slots: jax.Array,  # i32[B] (pad rows: the pad slot)
    reset: jax.Array,  # bool[B] the row is its request's first step: clear its slot first
    *,
    num_decode: int,
    pad_slot: int,
) -> PenaltyState:
    """Add a step's tokens: a decode row's input is its previous output, so it is counted
    before this step samples; prefill rows carry prompt tokens."""
    prompt_mask, counts = state
    num_rows = state_slots.shape[0]
    if num_decode:
        counts = counts.at[state_slots[:num_decode], input_ids[:num_decode]].add(1)
    if num_rows > num_decode:
        reset_slots = jnp.where(reset[num_decode:], state_slots[num_decode:], pad_slot)
        prompt_mask = prompt_mask.at[reset_slots].set(False)
        counts = counts.at[reset_slots].set(0)
        token_slots = jnp.where(token_valid, state_slots[token_rows], pad_slot)[num_decode:]
        prompt_mask = prompt_mask.at[token_slots, input_ids[num_decode:]].set(True)
    return PenaltyState(prompt_mask, counts)


def apply_penalties(logits: jax.Array, p: Penalties) -> jax.Array:  # f32[B, V]
    """vLLM's penalties: a token seen in the prompt or the output has a positive logit divided
    by `repetition` and a negative one multiplied; then `frequency` times its output count and
    `presence` if it was output at all are subtracted."""
    output = p.output_counts > 0
    rp = p.repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(p.prompt_mask | output, penalised, logits)
    logits = logits - p.frequency[:, None] * p.output_counts.astype(jnp.float32)
    return logits - p.presence[:, None] * output.astype(jnp.float32)


class SampleOutput(NamedTuple):
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B] log-probability of the sampled token under the raw model
    ranks: jax.Array  # i32[B] 1-based rank of the sampled token under the raw model
    top_ids: jax.Array  # i32[B, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[B, MAX_LOGPROBS]


def filter_cutoff(
    sorted_desc: jax.Array,  # f32[B, V] temperature-scaled logits, sorted descending
    top_k: jax.Array,  # i32[B] 0 → off
    top_p: jax.Array,  # f32[B] 1 → off
    min_p: jax.Array | None = None,  # f32[B] 0 → off
) -> jax.Array:
    """f32[B]: the lowest scaled logit a row keeps, applying in turn

    * top-k: the k largest (every copy of the k-th value);
    * top-p: of those, renormalised, the smallest prefix whose mass reaches top_p;
    * min-p: those whose probability is at least min_p times the most likely one's.

    The most likely token is always kept. Each step keeps a prefix of the sorted row, so the
    result is the highest of the three cut values.
    """
    vocab = sorted_desc.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)[:, 0]
    in_top_k = sorted_desc >= kth_value[:, None]
    top_k_logits = jnp.where(in_top_k, sorted_desc, -jnp.inf)
    sorted_probs = jax.nn.softmax(top_k_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    num_kept = jnp.maximum(jnp.sum(in_top_k & (mass_before < top_p[:, None]), axis=-1), 1)
    # Off means off: in float32 the running mass reaches 1 before a long tail ends.
    num_kept = jnp.where(top_p < 1.0, num_kept, vocab)
    top_p_value = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]
    cut = jnp.maximum(kth_value, top_p_value)
    if min_p is not None:
        ratio = jnp.exp(sorted_desc - sorted_desc[:, :1])  # p / p_max, renormalising cancels
        num_min_p = jnp.maximum(jnp.sum(ratio >= min_p[:, None], axis=-1), 1)
        min_p_value = jnp.take_along_axis(sorted_desc, (num_min_p - 1)[:, None], axis=-1)[:, 0]
        cut = jnp.maximum(cut, min_p_value)
    return cut


def needs_cutoff(temperature, top_k, top_p, min_p, vocab: int) -> bool:
    """Whether some row of a step draws through a top-k/top-p/min-p cut-off (host arrays): if
    none does, `sample(cutoff=False)` gives the same tokens without the sort. Greedy rows never
    do; a top_k of at least `vocab` keeps every token, as off does."""
    t, k = np.asarray(temperature), np.asarray(top_k)
    filtered = ((k > 0) & (k < vocab)) | (np.asarray(top_p) < 1.0) | (np.asarray(min_p) > 0.0)
    return bool(np.any((t > 0) & filtered))


def top_k_blocked(
    x: jax.Array,  # f32[B, V]
    k: int,
    *,
    block: int | None = None,  # None: TOP_K_BLOCK
) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` — the same values and ids, ties to the lower id — in two stages: the
    top k of each block of ``block`` entries, then the top k of those ``V / block * k``
    candidates (on the GPU a top-k of a long row costs a sort of it; short rows are cheap)."""
    rows, vocab = x.shape
    block = block or TOP_K_BLOCK
    if k > block or vocab <= 2 * block:
        return lax.top_k(x, k)
    num_blocks = -(-vocab // block)
    pad = num_blocks * block - vocab
    # Padding sorts after every real entry (-inf, and a higher id than any -inf entry).
    blocks = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    values, ids = lax.top_k(blocks.reshape(rows, num_blocks, block), k)  # [B, NB, k]
    ids = ids + (jnp.arange(num_blocks, dtype=ids.dtype) * block)[None, :, None]
    # Candidates are block-major, so among equal values the lower id comes first, as in a
    # single top-k.
    top, pick = lax.top_k(values.reshape(rows, num_blocks * k), k)
    return top, jnp.take_along_axis(ids.reshape(rows, num_blocks * k), pick, axis=-1)


def process_logits(
    logits: jax.Array,  # f32[B, V]
    counters: jax.Array,  # i32[B] tokens sampled so far
    min_tokens: jax.Array,  # i32[B]
    stop_ids: jax.Array,  # i32[B, MAX_STOP_IDS] -1 = pad
    bias_ids: jax.Array,  # i32[B, MAX_LOGIT_BIAS] -1 = pad
    bias_values: jax.Array,  # f32[B, MAX_LOGIT_BIAS]
) -> jax.Array:
    """f32[B, V]: logit_bias added, and stop ids at -inf while a row is below min_tokens.

    Unused entries are sent to index V, past the end, where `mode="drop"` drops them: a
    negative index would wrap to V-1 (NumPy indexing) and hit the last token."""
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    bias_ids = jnp.where(bias_ids >= 0, bias_ids, vocab)
    logits = logits.at[rows, bias_ids].add(bias_values, mode="drop")
    masking = (counters < min_tokens)[:, None] & (stop_ids >= 0)
    stop_ids = jnp.where(masking, stop_ids, vocab)
    return logits.at[rows, stop_ids].set(-jnp.inf, mode="drop")


def apply_token_bitmask(
    logits: jax.Array,  # f32[B, V]
    bitmask: jax.Array,  # i32[B, VW] bit i of word j allows token 32 j + i
) -> jax.Array:
    """f32[B, V]: `logits` with every token the bitmask disallows at -inf (on the host:
    `jaxmamba.structured.apply_bitmask_ref`)."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[B, VW, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B] 0 → greedy
    top_p: jax.Array,  # f32[B] 1 → off
    top_k: jax.Array,  # i32[B] 0 → off
    seeds: jax.Array,  # u32[B]
    counters: jax.Array,  # i32[B] how many tokens the request has sampled before
    min_p: jax.Array | None = None,  # f32[B] 0 → off
    min_tokens: jax.Array | None = None,  # i32[B]
    stop_ids: jax.Array | None = None,  # i32[B, MAX_STOP_IDS]
    bias_ids: jax.Array | None = None,  # i32[B, MAX_LOGIT_BIAS]
    bias_values: jax.Array | None = None,  # f32[B, MAX_LOGIT_BIAS]
    penalties: Penalties | None = None,
    token_bitmask: jax.Array | None = None,  # i32[B, VW] structured outputs; None: no row
    *,
    cutoff: bool = True,
    top_logprobs: bool = True,
    draw: bool = True,
    ranks: bool = True,
) -> SampleOutput:
    """Sample one token per row: greedy, or a Gumbel-max draw from the processed,
    temperature-scaled distribution cut by top-k/top-p/min-p (``filter_cutoff``).

    Logprobs, ranks and the top logprobs are those of the raw model (vLLM's default), also
    for rows that `token_bitmask` constrains (it masks after the penalties, as vLLM does).

    Static switches (each value is its own program): ``cutoff=False`` leaves out the sort and
    the cut-off, exact only when no drawing row filters (`needs_cutoff` is False: every kept
    set is then the whole vocabulary); ``top_logprobs=False`` leaves out the top logprobs
    (``top_ids`` and ``top_logprobs`` are zeros), for steps where no row asks for them;
    ``draw=False`` leaves out the random draw, exact only when every row is greedy;
    ``ranks=False`` leaves out the ranks (zeros), for steps where no row asks for logprobs.
    """
    raw = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(raw, axis=-1)
    processed = raw
    if bias_ids is not None:
        processed = process_logits(raw, counters, min_tokens, stop_ids, bias_ids, bias_values)
    if penalties is not None:
        processed = apply_penalties(processed, penalties)
    if token_bitmask is not None:
        processed = apply_token_bitmask(processed, token_bitmask)
    tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if draw:
        tokens = jnp.where(temperature > 0, _draw(processed, temperature, top_p, top_k, min_p,
                                                  seeds, counters, cutoff), tokens)  # fmt: skip

    return sample_output(raw, log_norm, tokens, ranks=ranks, top_logprobs=top_logprobs)


def sample_output(raw: jax.Array,  # f32[B, V] the model's logits
                  log_norm: jax.Array,  # f32[B] their log-sum-exp
                  tokens: jax.Array,  # i32[B] the tokens sampled
                  *, ranks: bool, top_logprobs: bool) -> SampleOutput:  # fmt: skip
    """The sampled tokens with their logprobs under the raw model, their 1-based ranks
    (zeros unless `ranks`) and the top `MAX_LOGPROBS` logprobs (zeros unless `top_logprobs`)."""
    token_logits = jnp.take_along_axis(raw, tokens[:, None], axis=-1)
    rank = jnp.zeros(tokens.shape, jnp.int32)
    if ranks:
        rank = jnp.sum(raw >= token_logits, axis=-1).astype(jnp.int32)
    k = min(MAX_LOGPROBS, raw.shape[-1])
    top_ids = jnp.zeros((raw.shape[0], k), jnp.int32)
    top_lp = jnp.zeros((raw.shape[0], k), jnp.float32)
    if top_logprobs:
        top_logits, top_ids = top_k_blocked(raw, k)
        top_lp = top_logits - log_norm[:, None]
    return SampleOutput(tokens, token_logits[:, 0] - log_norm, rank, top_ids.astype(jnp.int32),
                        top_lp)  # fmt: skip


def _draw(processed, temperature, top_p, top_k, min_p, seeds, counters, cutoff: bool):
    """i32[B]: a Gumbel-max draw from each row's temperature-scaled logits, cut by
    top-k/top-p/min-p when ``cutoff``."""
    vocab = processed.shape[-1]
    scaled = processed / jnp.maximum(temperature, 1e-6)[:, None]
    masked = scaled
    if cutoff:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        lowest_kept = filter_cutoff(sorted_desc, top_k, top_p, min_p)
        masked = jnp.where(scaled >= lowest_kept[:, None], scaled, -jnp.inf)

    def row_key(seed, counter):
        return jax.random.fold_in(jax.random.PRNGKey(seed), counter)

    rng_keys = jax.vmap(row_key)(seeds, counters)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(rng_keys)
    return jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)


class PromptLogprobs(NamedTuple):
    """Per prefill token: how likely the model found the prompt token that follows it."""

    logprobs: jax.Array  # f32[T] log-probability of the next prompt token
    ranks: jax.Array  # i32[T] its 1-based rank (count of tokens at least as likely)
    top_ids: jax.Array  # i32[T, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[T, MAX_LOGPROBS]


def prompt_logprobs(
    logits: jax.Array,  # f32[T, V] raw logits at each prefill token
    targets: jax.Array,  # i32[T] the prompt token after each (-1: none; its values are unused)
) -> PromptLogprobs:
    """vLLM's prompt logprobs: the raw model's log-softmax at each prompt token, read at the
    token that follows it, its rank, and the top MAX_LOGPROBS."""
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    safe = jnp.clip(targets, 0, vocab - 1)
    target_logits = jnp.take_along_axis(logits, safe[:, None], axis=-1)
    ranks = jnp.sum(logits >= target_logits, axis=-1).astype(jnp.int32)
    top_logits, top_ids = top_k_blocked(logits, min(MAX_LOGPROBS, vocab))
    return PromptLogprobs(
        target_logits[:, 0] - log_norm,
        ranks,
        top_ids.astype(jnp.int32),
        top_logits - log_norm[:, None],
    )
