"""Token sampling on device: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Top logprobs are always computed for this many tokens (a static shape); a request asks for
# up to this many (vLLM's default `max_logprobs` is the same).
MAX_LOGPROBS = 20


class SampleOutput(NamedTuple):
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B] log-probability of the sampled token under the raw model
    top_ids: jax.Array  # i32[B, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[B, MAX_LOGPROBS]


def filter_cutoff(
    sorted_desc: jax.Array,  # f32[B, V] temperature-scaled logits, sorted descending
    top_k: jax.Array,  # i32[B] 0 → off
    top_p: jax.Array,  # f32[B] 1 → off
) -> jax.Array:
    """f32[B]: the lowest scaled logit a row keeps. top-k keeps the k largest; top-p the
    smallest prefix of the sorted distribution whose mass reaches top_p (the most likely
    token is always kept); the cut is the higher of the two."""
    vocab = sorted_desc.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)[:, 0]
    sorted_probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    num_kept = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    top_p_value = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]
    return jnp.maximum(kth_value, top_p_value)


def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B] 0 → greedy
    top_p: jax.Array,  # f32[B] 1 → off
    top_k: jax.Array,  # i32[B] 0 → off
    seeds: jax.Array,  # u32[B]
    counters: jax.Array,  # i32[B] how many tokens the request has sampled before
) -> SampleOutput:
    """Sample one token per row: greedy, or a Gumbel-max draw from the temperature-scaled
    distribution cut by top-k/top-p (``filter_cutoff``).

    One key-value sort of each row's logits serves both the cut-off (scaling by a positive
    temperature keeps the order) and the top logprobs: a separate ``lax.top_k`` of 20 costs
    as much as the sort itself (``scripts/bench_sampling.py``, docs/benchmarks.md).
    """
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    neg_sorted, sorted_ids = jax.lax.sort((-logits, ids), dimension=1, num_keys=1)
    sorted_logits = -neg_sorted
    log_norm = jax.nn.logsumexp(sorted_logits, axis=-1, keepdims=True)
    greedy = sorted_ids[:, 0]

    inv_temperature = 1.0 / jnp.maximum(temperature, 1e-6)[:, None]
    cutoff = filter_cutoff(sorted_logits * inv_temperature, top_k, top_p)
    scaled = logits * inv_temperature
    masked = jnp.where(scaled >= cutoff[:, None], scaled, -jnp.inf)

    def row_key(seed, counter):
        return jax.random.fold_in(jax.random.PRNGKey(seed), counter)

    rng_keys = jax.vmap(row_key)(seeds, counters)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(rng_keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)

    k = min(MAX_LOGPROBS, vocab)
    token_logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_norm[:, 0]
    return SampleOutput(tokens, token_logprobs, sorted_ids[:, :k], sorted_logits[:, :k] - log_norm)
