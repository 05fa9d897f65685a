"""The sampler's top-k / top-p cut-off and its draws against a float64 sort in numpy and HF's
warpers (edge cases: ties, k >= V, top-p with top-k, min-p); the two-stage top-k of the top
logprobs against one `lax.top_k`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling_hf import hf_scores

from jaxmamba import sampling_params
from jaxmamba.model import sampling
from jaxmamba.model.sampling import MAX_LOGPROBS, filter_cutoff, sample, top_k_blocked
from jaxmamba.sampling_params import NOT_IMPLEMENTED, SamplingParams
from jaxmamba.structured import StructuredOutputsParams


def kept_by_sorting(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """bool[V]: what top-k then top-p keep, by sorting (ties: every copy of the cut value)."""
    order = np.argsort(-scaled, kind="stable")
    values = scaled[order]
    cut = -np.inf
    if top_k > 0:
        cut = max(cut, values[min(top_k, len(values)) - 1])
    if top_p < 1.0:  # over the top-k survivors, renormalised
        probs = np.where(values >= cut, np.exp(values.astype(np.float64) - values.max()), 0.0)
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        num_kept = max(int(np.sum(mass_before < top_p)), 1)
        cut = max(cut, values[num_kept - 1])
    return scaled >= cut


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
    sorted_desc = -jnp.sort(-jnp.asarray(scaled), axis=-1)
    cutoff = filter_cutoff(sorted_desc, jnp.asarray(top_k), jnp.asarray(top_p))
    kept = scaled >= np.asarray(cutoff)[:, None]
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


def test_greedy_and_logprobs_match_numpy():
    vocab, rows = 300, 5
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    out = sample(jnp.asarray(logits), jnp.zeros(rows), jnp.ones(rows), jnp.zeros(rows, jnp.int32),
                 jnp.zeros(rows, jnp.uint32), jnp.zeros(rows, jnp.int32))  # fmt: skip
    logprobs = (
        logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1))[:, None]
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(out.logprobs), logprobs.max(-1), atol=1e-5)
    top = np.argsort(-logprobs, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), top)
    expected = np.take_along_axis(logprobs, top, -1)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), expected, atol=1e-5)


def test_padding_of_stop_and_bias_ids_never_touches_the_last_token():
    """Rows whose min_tokens mask and logit_bias lists are all padding must leave every
    logit as it was: the last token (id V-1) included, where a wrapped -1 would land."""
    vocab, rows = 50, 3
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[:, -1] = 10.0  # the last id is every row's greedy choice
    pad = lambda width: jnp.full((rows, width), -1, jnp.int32)  # noqa: E731
    zeros_i, zeros_f = jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.float32)
    out = sample(
        jnp.asarray(logits), zeros_f, jnp.ones(rows), zeros_i, jnp.zeros(rows, jnp.uint32),
        zeros_i, min_p=zeros_f, min_tokens=jnp.array([0, 5, 5], jnp.int32), stop_ids=pad(4),
        bias_ids=pad(4), bias_values=jnp.ones((rows, 4), jnp.float32),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens), [vocab - 1] * rows)
    # A real stop id is still masked while below min_tokens, and a real bias still applies.
    stop = pad(4).at[1, 0].set(vocab - 1)
    bias_ids = pad(4).at[2, 0].set(7)
    bias_values = jnp.zeros((rows, 4), jnp.float32).at[2, 0].set(100.0)
    out = sample(
        jnp.asarray(logits), zeros_f, jnp.ones(rows), zeros_i, jnp.zeros(rows, jnp.uint32),
        zeros_i, min_p=zeros_f, min_tokens=jnp.array([0, 5, 5], jnp.int32), stop_ids=stop,
        bias_ids=bias_ids, bias_values=bias_values,
    )  # fmt: skip
    second = int(np.argsort(-logits[1])[1])
    np.testing.assert_array_equal(np.asarray(out.tokens), [vocab - 1, second, 7])


BAD_VALUES = [
    ("temperature", float("nan"), ValueError, "finite"),
    ("temperature", float("inf"), ValueError, "finite"),
    ("temperature", True, TypeError, "float"),
    ("temperature", "0.5", TypeError, "float"),
    ("top_k", 1.5, TypeError, "int"),
    ("top_k", -2, ValueError, "top_k"),
    ("top_p", 1.5, ValueError, r"\(0, 1\]"),
    ("min_p", -0.1, ValueError, r"\[0, 1\]"),
    ("max_tokens", True, TypeError, "int"),
    ("max_tokens", 4.0, TypeError, "int"),
    ("n", 0, ValueError, "n must"),
    ("seed", 1.0, TypeError, "int"),
    ("stop_token_ids", [1.0], TypeError, "int"),
    ("stop_token_ids", [True], TypeError, "int"),
    ("stop_token_ids", [-1], ValueError, "stop_token_ids"),
    ("stop", [1], TypeError, "str"),
    ("stop", "", ValueError, "non-empty"),
    ("ignore_eos", 1, TypeError, "bool"),
    ("presence_penalty", 2.5, ValueError, r"\[-2, 2\]"),
    ("frequency_penalty", float("nan"), ValueError, "finite"),
    ("repetition_penalty", 0.0, ValueError, "> 0"),
    ("logprobs", 1.0, TypeError, "int"),
    ("prompt_logprobs", MAX_LOGPROBS + 1, ValueError, "prompt_logprobs"),
    ("logit_bias", {1.0: 2.0}, TypeError, "int"),
    ("logit_bias", {3: float("nan")}, ValueError, "finite"),
    ("logit_bias", [(3, 1.0)], TypeError, "dict"),
    ("min_tokens", -1, ValueError, "min_tokens"),
]


@pytest.mark.parametrize("field, value, error, match", BAD_VALUES)
def test_bad_sampling_values_raise_saying_what_was_expected(field, value, error, match):
    with pytest.raises(error, match=match) as info:
        SamplingParams(**{field: value})
    assert field.split("[")[0] in str(info.value)


def test_min_tokens_above_max_tokens_raises():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_sampling_values_are_normalised_to_exact_types():
    sp = SamplingParams(
        temperature=1, top_k=np.int64(5), seed=np.int32(7), stop_token_ids=[np.int64(3)]
    )
    assert type(sp.temperature) is float and type(sp.top_k) is int and type(sp.seed) is int
    assert sp.stop_token_ids == (3,) and type(sp.stop_token_ids[0]) is int
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams(top_k=0).top_k
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


# One non-default value per field, and the value SamplingParams stores for it.
NON_DEFAULT = {
    "n": (2, 2), "presence_penalty": (0.5, 0.5), "frequency_penalty": (0.5, 0.5),
    "repetition_penalty": (1.2, 1.2), "temperature": (0.5, 0.5), "top_p": (0.9, 0.9),
    "top_k": (5, 5), "min_p": (0.1, 0.1), "seed": (7, 7), "stop": ("x", ("x",)),
    "stop_token_ids": ([3], (3,)), "include_stop_str_in_output": (True, True),
    "ignore_eos": (True, True), "max_tokens": (None, None), "min_tokens": (2, 2),
    "logprobs": (1, 1), "prompt_logprobs": (1, 1), "skip_special_tokens": (False, False),
    "logit_bias": ({1: 2.0}, {1: 2.0}),
    "structured_outputs": (StructuredOutputsParams(regex="a+"),) * 2,
}  # fmt: skip


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_field_is_kept_unless_declared_unimplemented_then_refused(field, monkeypatch):
    """Every field (a new one needs its entry in NON_DEFAULT) takes a non-default value, and
    is refused instead of silently ignored once it is listed in NOT_IMPLEMENTED."""
    value, stored = NON_DEFAULT[field]
    assert value != getattr(SamplingParams(), field)
    if field in NOT_IMPLEMENTED:
        with pytest.raises(NotImplementedError, match=field):
            SamplingParams(**{field: value})
    else:
        assert getattr(SamplingParams(**{field: value}), field) == stored
    monkeypatch.setattr(sampling_params, "NOT_IMPLEMENTED", frozenset({field}))
    with pytest.raises(NotImplementedError, match=field):
        SamplingParams(**{field: value})
    SamplingParams()  # the default is never refused


def tied_logits(rng, rows: int, vocab: int) -> np.ndarray:
    logits = rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4, (rows, 1))
    return (np.round(logits * 4) / 4).astype(np.float32)  # many ties


@pytest.mark.parametrize("vocab, block, k", [(1000, 64, 20), (4099, 128, 64), (777, 32, 32)])
def test_two_stage_top_k_gives_lax_top_k_ids_with_ties(vocab, block, k):
    rng = np.random.default_rng(vocab)
    x = tied_logits(rng, 6, vocab)
    x[1] = 0.25  # one value everywhere: the lowest ids win
    x[2, ::3] = -np.inf  # masked entries
    top, ids = top_k_blocked(jnp.asarray(x), k, block=block)
    want_top, want_ids = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(want_top))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(ids[1]), np.arange(k))


def edge_rows(rng, vocab: int):
    """Rows covering the filter's edge cases: ties at the cut, top-k >= V, top-p with and
    without top-k, min-p, no filter."""
    cases = [  # (top_k, top_p, min_p)
        (0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (16, 1.0, 0.0), (17, 1.0, 0.0),
        (vocab, 1.0, 0.0), (vocab + 7, 0.9, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.0), (8, 0.8, 0.0),
        (12, 0.5, 0.1), (0, 1.0, 0.05), (3, 1.0, 0.5), (16, 0.95, 0.02), (vocab, 0.7, 0.01),
    ]  # fmt: skip
    columns = list(zip(*cases, strict=True))
    top_k = np.array(columns[0], np.int32)
    top_p = np.array(columns[1], np.float32)
    min_p = np.array(columns[2], np.float32)
    scaled = tied_logits(rng, len(cases), vocab)
    scaled[4, :40] = scaled[4].max() + 1  # 40 copies of the largest value: top-17 keeps all
    scaled[3, 10:30] = np.sort(scaled[3])[-16]  # many copies of the 16th value
    return scaled, top_k, top_p, min_p


def hf_kept(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    return np.isfinite(hf_scores(scaled, 1.0, top_k, top_p, min_p))


@pytest.mark.parametrize("vocab", [300, 2500])
def test_edge_case_cutoffs_keep_the_hf_set(vocab):
    rng = np.random.default_rng(vocab)
    scaled, top_k, top_p, min_p = edge_rows(rng, vocab)
    args = [jnp.asarray(a) for a in (top_k, top_p, min_p)]
    cut = np.asarray(filter_cutoff(-jnp.sort(-jnp.asarray(scaled), axis=-1), *args))
    for r in range(len(top_k)):
        kept = scaled[r] >= cut[r]
        hf = hf_kept(scaled[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        what = f"row {r}: k={top_k[r]} p={top_p[r]} min_p={min_p[r]}"
        if top_p[r] < 1.0:
            # HF's top-p cuts at a position of its sort, so it may keep only some copies of a
            # value tied at the cut; the device keeps every copy of the cut value.
            assert not (hf & ~kept).any(), what
            assert (scaled[r][kept & ~hf] == scaled[r][hf].min()).all(), what
        else:
            np.testing.assert_array_equal(kept, hf, err_msg=what)
    assert (scaled[4] >= cut[4]).sum() == 40  # every copy of the k-th value


def test_sample_top_logprobs_are_lax_top_k_with_ties(monkeypatch):
    monkeypatch.setattr(sampling, "TOP_K_BLOCK", 128)  # the two-stage top-k at vocab 1500
    rng = np.random.default_rng(5)
    rows, vocab = 6, 1500
    logits = tied_logits(rng, rows, vocab)
    logits[2] = 1.0
    out = sample(jnp.asarray(logits), jnp.zeros(rows), jnp.ones(rows), jnp.zeros(rows, jnp.int32),
                 jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))  # fmt: skip
    top, ids = jax.lax.top_k(jnp.asarray(logits), MAX_LOGPROBS)
    log_norm = jax.nn.logsumexp(jnp.asarray(logits), axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.asarray(top - log_norm), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids[2]), np.arange(MAX_LOGPROBS))
