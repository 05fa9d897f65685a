"""The sampler's top-k / top-p cut-off (a radix select) against a float64 sort in numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.model.sampling import _filter_threshold, _order_key, sample


def kept_by_sorting(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """bool[V]: what top-k then top-p keep, by sorting (ties: every copy of the cut value)."""
    order = np.argsort(-scaled, kind="stable")
    values = scaled[order]
    cut = -np.inf
    if top_k > 0:
        cut = max(cut, values[min(top_k, len(values)) - 1])
    if top_p < 1.0:
        probs = np.exp(values.astype(np.float64) - values.max())
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        num_kept = max(int(np.sum(mass_before < top_p)), 1)
        cut = max(cut, values[num_kept - 1])
    return scaled >= cut


def test_order_key_sorts_like_the_floats():
    x = np.array(
        [-np.inf, -3e38, -2.5, -1e-30, -0.0, 0.0, 1e-30, 1.0, 7.5, 3e38, np.inf], np.float32
    )
    keys = np.asarray(_order_key(jnp.asarray(x))).astype(np.int64)
    assert np.all(np.diff(keys) >= 0)
    assert np.all(np.diff(keys)[np.diff(x) > 0] > 0)


@pytest.mark.parametrize("vocab", [7, 1000, 4099])
def test_filter_matches_a_sort(vocab):
    rng = np.random.default_rng(vocab)
    rows = 12
    scaled = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 6, (rows, 1))).astype(
        np.float32
    )
    scaled[3, :5] = scaled[3, 5]  # ties at the cut
    top_k = np.array([0, 1, 2, 5, 0, 0, 3, vocab, vocab + 9, 0, 50, 1], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 1.0, 0.9, 0.1, 0.95, 0.3, 1.0, 0.999, 0.7, 0.2], np.float32)
    keys = _order_key(jnp.asarray(scaled))
    probs = jax.nn.softmax(jnp.asarray(scaled), axis=-1)
    k = jnp.minimum(jnp.asarray(top_k), vocab)
    threshold = _filter_threshold(keys, probs, k, jnp.asarray(top_p))
    kept = np.asarray(keys >= threshold[:, None])
    for r in range(rows):
        expected = kept_by_sorting(scaled[r], int(top_k[r]), float(top_p[r]))
        np.testing.assert_array_equal(kept[r], expected, err_msg=f"row {r}")
    assert kept[0].all() and kept[1].sum() == 1  # off keeps all; top-1 keeps one


def test_sampling_respects_the_filter():
    vocab, rows = 50, 4
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32) * 3)
    temperature = jnp.full((rows,), 1.5, jnp.float32)
    top_k = jnp.array([3, 0, 0, 1], jnp.int32)
    top_p = jnp.array([1.0, 0.5, 1.0, 1.0], jnp.float32)
    counts = np.zeros((rows, vocab), np.int64)
    for draw in range(300):
        out = sample(logits, temperature, top_p, top_k, jnp.arange(rows, dtype=jnp.uint32),
                     jnp.full((rows,), draw, jnp.int32))  # fmt: skip
        counts[np.arange(rows), np.asarray(out.tokens)] += 1
    scaled = np.asarray(logits) / 1.5
    for r, (k, p) in enumerate([(3, 1.0), (0, 0.5), (0, 1.0), (1, 1.0)]):
        allowed = kept_by_sorting(scaled[r], k, p)
        assert counts[r][~allowed].sum() == 0, f"row {r} drew a filtered token"
    assert (counts[0] > 0).sum() == 3  # all three survivors of top-3 get drawn
    assert (counts[2] > 0).sum() > 10  # no filter: draws spread over the vocabulary
    assert counts[3, np.argmax(scaled[3])] == 300
