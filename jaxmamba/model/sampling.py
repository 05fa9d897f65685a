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


def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B] 0 → greedy
    top_p: jax.Array,  # f32[B] 1 → off
    top_k: jax.Array,  # i32[B] 0 → off
    seeds: jax.Array,  # u32[B]
    counters: jax.Array,  # i32[B] how many tokens the request has sampled before
) -> SampleOutput:
    vocab = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p
    # (the most likely token is always kept).
    sorted_probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = mass_before < top_p[:, None]
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    top_p_value = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, top_p_value)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)

    def row_key(seed, counter):
        return jax.random.fold_in(jax.random.PRNGKey(seed), counter)

    keys = jax.vmap(row_key)(seeds, counters)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)

    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, vocab))
    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)
