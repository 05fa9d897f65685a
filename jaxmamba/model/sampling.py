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


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys that sort like the float32 values (-inf lowest, +inf highest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _filter_threshold(
    keys: jax.Array,  # u32[B, V] order keys of the scaled logits
    probs: jax.Array,  # f32[B, V] their softmax
    top_k: jax.Array,  # i32[B] 0 → off
    top_p: jax.Array,  # f32[B] >= 1 → off
    bits_per_pass: int = 4,
) -> jax.Array:
    """Key of the lowest value a row keeps: the largest key ``t`` with ``count(keys >= t) >=
    top_k`` (the k-th largest value) or ``mass(keys >= t) >= top_p`` (the token whose
    cumulative mass first reaches top_p), whichever is higher; 0 (keep all) when both are off.

    A radix select instead of a sort: the key is found from its top bits down,
    ``bits_per_pass`` bits per pass over the vocabulary, each pass testing every candidate
    value of those bits at once (32 / bits_per_pass passes, each a fused reduction).
    """
    k_on = (top_k > 0)[:, None]
    p_on = (top_p < 1.0)[:, None]
    candidates = jnp.arange(1 << bits_per_pass, dtype=jnp.uint32)  # [R]
    prefix = jnp.zeros(keys.shape[:1], jnp.uint32)
    for shift in range(32 - bits_per_pass, -1, -bits_per_pass):
        trial = prefix[:, None] | (candidates[None, :] << shift)  # [B, R]
        above = keys[:, None, :] >= trial[:, :, None]  # [B, R, V]
        count = jnp.sum(above, axis=-1, dtype=jnp.int32)
        mass = jnp.sum(jnp.where(above, probs[:, None, :], 0.0), axis=-1)
        ok = (k_on & (count >= top_k[:, None])) | (p_on & (mass >= top_p[:, None]))
        # ok is monotone (true for small trials); candidate 0 keeps the prefix itself.
        best = jnp.maximum(jnp.sum(ok, axis=-1, dtype=jnp.uint32), 1) - 1
        prefix = prefix | (best << shift)
    return prefix


def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B] 0 → greedy
    top_p: jax.Array,  # f32[B] 1 → off
    top_k: jax.Array,  # i32[B] 0 → off
    seeds: jax.Array,  # u32[B]
    counters: jax.Array,  # i32[B] how many tokens the request has sampled before
) -> SampleOutput:
    """Sample one token per row. top-k keeps the k most likely tokens, top-p the smallest set
    of most likely tokens whose probability reaches top_p (the most likely token is always
    kept); both apply to the temperature-scaled distribution, then a Gumbel-max draw picks
    from what is kept. No sort: the cut-off comes from a radix select (``_filter_threshold``).
    """
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    keys = _order_key(scaled)
    top_k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), 0)
    threshold = _filter_threshold(keys, jax.nn.softmax(scaled, axis=-1), top_k, top_p)
    masked = jnp.where(keys >= threshold[:, None], scaled, -jnp.inf)

    def row_key(seed, counter):
        return jax.random.fold_in(jax.random.PRNGKey(seed), counter)

    rng_keys = jax.vmap(row_key)(seeds, counters)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(rng_keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)

    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, vocab))
    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)
