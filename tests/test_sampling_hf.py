"""The device sampler against HF transformers' logits processors, the independent oracle.

vLLM's order is HF's processors composed as: logit bias / min-new-tokens, temperature, top-k,
top-p, min-p. Kept sets must match on random logits with ties; draws never leave the kept set;
draw frequencies match the renormalised distribution (chi-square, false-alarm rate 1e-3 per
row, fixed seeds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jaxmamba import LLM, SamplingParams
from jaxmamba.model.sampling import (
    Penalties,
    apply_penalties,
    filter_cutoff,
    needs_cutoff,
    sample,
)
from jaxmamba.step_contract import MAX_LOGIT_BIAS, MAX_STOP_IDS

from hf_fixtures import make_nemotron_h_checkpoint
from model_helpers import random_prompts

FALSE_ALARM_RATE = 1e-3


def hf_scores(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """f32[V]: one row through HF's warpers in vLLM's order (-inf = removed)."""
    scores = torch.from_numpy(logits[None].astype(np.float32))
    ids = torch.zeros((1, 1), dtype=torch.long)
    warpers = [TemperatureLogitsWarper(float(temperature))]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(float(min_p)))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores[0].numpy()


def random_rows(rng, rows: int, vocab: int):
    logits = rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4, (rows, 1))
    logits = (np.round(logits * 4) / 4).astype(np.float32)  # many ties
    temperature = rng.choice([0.3, 0.7, 1.0, 1.8], rows).astype(np.float32)
    top_k = rng.choice([-1, 0, 1, 2, 5, 40, vocab + 3], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.1], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.1, 0.5], rows).astype(np.float32)
    return logits, temperature, np.maximum(top_k, 0), top_p, min_p


def device_kept(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    scaled = jnp.asarray(logits) / jnp.asarray(temperature)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    cut = filter_cutoff(sorted_desc, jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p))
    return np.asarray(scaled >= cut[:, None])


@pytest.mark.parametrize("vocab", [16, 257, 3000])
def test_kept_sets_match_hf_warpers_with_ties(vocab):
    rng = np.random.default_rng(vocab)
    rows = 64
    logits, temperature, top_k, top_p, min_p = random_rows(rng, rows, vocab)
    kept = device_kept(logits, temperature, top_k, top_p, min_p)
    for r in range(rows):
        hf = np.isfinite(hf_scores(logits[r], temperature[r], top_k[r], top_p[r], min_p[r]))
        what = f"row {r}: T={temperature[r]} k={top_k[r]} p={top_p[r]} min_p={min_p[r]}"
        if top_p[r] < 1.0:
            # HF's top-p cuts at a position of its sort, so it may keep only some copies of
            # a value tied at the cut; the device keeps every copy of the cut value.
            assert not (hf & ~kept[r]).any(), what
            extra = kept[r] & ~hf
            assert (logits[r][extra] == logits[r][hf].min()).all(), what
        else:
            np.testing.assert_array_equal(kept[r], hf, err_msg=what)


def test_draws_never_leave_the_hf_kept_set():
    rng = np.random.default_rng(0)
    rows, vocab, draws = 32, 200, 40
    logits, temperature, top_k, top_p, min_p = random_rows(rng, rows, vocab)
    logits += rng.uniform(0, 1e-3, logits.shape).astype(np.float32)  # no ties at the cut
    allowed = np.stack([
        np.isfinite(hf_scores(logits[r], temperature[r], top_k[r], top_p[r], min_p[r]))
        for r in range(rows)
    ])  # fmt: skip
    for draw in range(draws):
        out = sample(
            jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_p),
            jnp.asarray(top_k), jnp.arange(rows, dtype=jnp.uint32) + 1000 * draw,
            jnp.full((rows,), draw, jnp.int32), jnp.asarray(min_p),
        )  # fmt: skip
        tokens = np.asarray(out.tokens)
        assert allowed[np.arange(rows), tokens].all(), np.nonzero(~allowed[np.arange(rows), tokens])


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 8, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 10, 0.9, 0.05),
     (1.0, 0, 1.0, 0.1)],
)  # fmt: skip
def test_draw_frequencies_match_the_renormalised_hf_distribution(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(7)
    vocab, draws = 24, 20000
    logits = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    scores = hf_scores(logits, temperature, top_k, top_p, min_p).astype(np.float64)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    out = sample(
        jnp.broadcast_to(jnp.asarray(logits), (draws, vocab)),
        jnp.full((draws,), temperature, jnp.float32), jnp.full((draws,), top_p, jnp.float32),
        jnp.full((draws,), top_k, jnp.int32), jnp.arange(draws, dtype=jnp.uint32),
        jnp.zeros((draws,), jnp.int32), jnp.full((draws,), min_p, jnp.float32),
    )  # fmt: skip
    counts = np.bincount(np.asarray(out.tokens), minlength=vocab)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    _, p_value = scipy.stats.chisquare(counts[kept], probs[kept] * draws)
    assert p_value > FALSE_ALARM_RATE, (p_value, counts[kept], probs[kept] * draws)


def test_sort_free_draws_match_the_hf_distribution_when_no_row_filters(temperature=0.6):
    """`sample(cutoff=False)`, the program of steps where `needs_cutoff` is False, draws from
    HF's tempered distribution."""
    rng = np.random.default_rng(8)
    vocab, draws = 24, 20000
    logits = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    temperatures = np.full(draws, temperature, np.float32)
    ones, zeros = np.ones(draws, np.float32), np.zeros(draws, np.float32)
    assert not needs_cutoff(temperatures, np.zeros(draws, np.int32), ones, zeros, vocab)
    scores = hf_scores(logits, temperature, 0, 1.0, 0.0).astype(np.float64)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    out = sample(
        jnp.broadcast_to(jnp.asarray(logits), (draws, vocab)), jnp.asarray(temperatures),
        jnp.asarray(ones), jnp.zeros((draws,), jnp.int32), jnp.arange(draws, dtype=jnp.uint32),
        jnp.zeros((draws,), jnp.int32), jnp.asarray(zeros), cutoff=False, top_logprobs=False,
    )  # fmt: skip
    counts = np.bincount(np.asarray(out.tokens), minlength=vocab)
    _, p_value = scipy.stats.chisquare(counts, probs * draws)
    assert p_value > FALSE_ALARM_RATE, (p_value, counts, probs * draws)
    assert not np.asarray(out.top_ids).any() and not np.asarray(out.top_logprobs).any()


def test_sort_free_sampler_gives_the_full_samplers_tokens_logprobs_and_ranks():
    """Rows that do not filter (greedy with any top-k/top-p/min-p, draws without them, top_k
    past the vocabulary) with ties, penalties, logit_bias and min_tokens: the program without
    the sort gives exactly the full one's tokens, logprobs and ranks."""
    rng = np.random.default_rng(21)
    rows, vocab = 64, 300
    logits, temperature, top_k, top_p, min_p = random_rows(rng, rows, vocab)
    drawing = rng.random(rows) < 0.5
    temperature = np.where(drawing, temperature, 0.0).astype(np.float32)
    top_k = np.where(drawing, rng.choice([0, vocab, vocab + 5], rows), top_k).astype(np.int32)
    top_p = np.where(drawing, 1.0, top_p).astype(np.float32)
    min_p = np.where(drawing, 0.0, min_p).astype(np.float32)
    assert not needs_cutoff(temperature, top_k, top_p, min_p, vocab)
    assert needs_cutoff(np.r_[temperature, 0.5], np.r_[top_k, 3], np.r_[top_p, 1.0],
                        np.r_[min_p, 0.0], vocab)  # fmt: skip
    bias_ids = np.stack([padded(rng.choice(vocab, 4, replace=False), MAX_LOGIT_BIAS, -1,
                                np.int32) for _ in range(rows)])  # fmt: skip
    bias_values = np.where(bias_ids >= 0, rng.uniform(-5, 5, bias_ids.shape), 0)
    stop = np.stack([padded(rng.choice(vocab, 2, replace=False), MAX_STOP_IDS, -1, np.int32)
                     for _ in range(rows)])  # fmt: skip
    penalties = Penalties(
        jnp.asarray(rng.random((rows, vocab)) < 0.05),
        jnp.asarray(rng.integers(0, 3, (rows, vocab)) * (rng.random((rows, vocab)) < 0.03)),
        jnp.asarray(rng.uniform(-1, 1, rows), jnp.float32),
        jnp.asarray(rng.uniform(-1, 1, rows), jnp.float32),
        jnp.asarray(rng.uniform(0.7, 1.5, rows), jnp.float32),
    )
    args = (
        jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k),
        jnp.asarray(rng.integers(0, 2**31, rows), jnp.uint32),
        jnp.asarray(rng.integers(0, 6, rows), jnp.int32), jnp.asarray(min_p),
        jnp.asarray(rng.integers(0, 6, rows), jnp.int32), jnp.asarray(stop),
        jnp.asarray(bias_ids), jnp.asarray(bias_values, jnp.float32), penalties,
    )  # fmt: skip
    jitted = jax.jit(sample, static_argnames=("cutoff", "top_logprobs", "draw", "ranks"))
    full = jitted(*args)
    plain = jitted(*args, cutoff=False, top_logprobs=False)
    for name in ("tokens", "logprobs", "ranks"):
        np.testing.assert_array_equal(np.asarray(getattr(plain, name)),
                                      np.asarray(getattr(full, name)), err_msg=name)  # fmt: skip
    assert len(set(np.asarray(full.tokens[drawing]).tolist())) > 10  # the draws are draws

    # The argmax-only program (GREEDY: greedy rows, no penalties, no ranks read) on the greedy
    # rows, their penalties off: the full program's tokens and logprobs.
    greedy_args = list(args)
    greedy_args[1] = jnp.zeros(rows, jnp.float32)
    off = Penalties(penalties.prompt_mask, penalties.output_counts, jnp.zeros(rows),
                    jnp.zeros(rows), jnp.ones(rows))  # fmt: skip
    full = jitted(*greedy_args[:-1], off)
    argmax_only = jitted(*greedy_args[:-1], None, cutoff=False, top_logprobs=False, draw=False,
                         ranks=False)  # fmt: skip
    for name in ("tokens", "logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(argmax_only, name)),
                                      np.asarray(getattr(full, name)), err_msg=name)  # fmt: skip
    assert not np.any(np.asarray(argmax_only.ranks))  # not computed: zeros


def padded(values, size, fill, dtype):
    out = np.full(size, fill, dtype)
    out[: len(values)] = values
    return out


def test_logit_bias_and_min_tokens_match_hf_processors():
    rng = np.random.default_rng(3)
    rows, vocab = 6, 50
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    bias = []
    for _ in range(rows):
        ids, values = rng.choice(vocab, 5, replace=False), rng.uniform(-8, 8, 5)
        bias.append({int(t): float(b) for t, b in zip(ids, values, strict=True)})
    stop = [rng.choice(vocab, 3, replace=False).tolist() for _ in range(rows)]
    # The most likely biased token is a stop id in every row, so masking it moves the argmax.
    for r in range(rows):
        biased = logits[r].copy()
        biased[list(bias[r])] += list(bias[r].values())
        stop[r][0] = int(np.argmax(biased))
    min_tokens = np.array([0, 3, 3, 5, 1, 2], np.int32)
    counters = np.array([0, 2, 3, 0, 0, 9], np.int32)
    out = sample(
        jnp.asarray(logits), jnp.zeros(rows), jnp.ones(rows), jnp.zeros(rows, jnp.int32),
        jnp.zeros(rows, jnp.uint32), jnp.asarray(counters), jnp.zeros(rows),
        jnp.asarray(min_tokens),
        jnp.asarray(np.stack([padded(s, MAX_STOP_IDS, -1, np.int32) for s in stop])),
        jnp.asarray(np.stack([padded(list(b), MAX_LOGIT_BIAS, -1, np.int32) for b in bias])),
        jnp.asarray(np.stack([padded(list(b.values()), MAX_LOGIT_BIAS, 0, np.float32)
                              for b in bias])),
    )  # fmt: skip
    for r in range(rows):
        scores = torch.from_numpy(logits[r : r + 1])
        ids = torch.zeros((1, int(counters[r])), dtype=torch.long)
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias[r].items()])(ids, scores)
        scores = MinNewTokensLengthLogitsProcessor(0, int(min_tokens[r]), stop[r])(ids, scores)
        assert int(out.tokens[r]) == int(scores[0].argmax()), f"row {r}"
    # The logprobs stay those of the raw model.
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    expected = raw[np.arange(rows), np.asarray(out.tokens)]
    np.testing.assert_allclose(np.asarray(out.logprobs), expected, atol=1e-5)


def test_ranks_count_the_raw_logits_at_or_above_the_sampled_one():
    rng = np.random.default_rng(5)
    rows, vocab = 8, 100
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    out = sample(
        jnp.asarray(logits), jnp.full(rows, 1.0), jnp.ones(rows), jnp.zeros(rows, jnp.int32),
        jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32),
    )  # fmt: skip
    tokens = np.asarray(out.tokens)
    order = np.argsort(-logits, axis=-1)
    expected = np.array([int(np.nonzero(order[r] == tokens[r])[0][0]) + 1 for r in range(rows)])
    np.testing.assert_array_equal(np.asarray(out.ranks), expected)


def test_penalties_match_hf_repetition_and_vllm_formulas():
    rng = np.random.default_rng(11)
    rows, vocab = 5, 40
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 5, 12, 3, 8)]
    outputs = [rng.integers(0, vocab, n).tolist() for n in (0, 4, 9, 2, 6)]
    repetition = np.array([1.0, 1.3, 0.7, 2.0, 1.1], np.float32)
    frequency = np.array([0.0, 0.5, -0.3, 0.0, 1.2], np.float32)
    presence = np.array([0.0, 0.2, 0.0, -1.0, 0.7], np.float32)
    prompt_mask = np.zeros((rows, vocab), bool)
    counts = np.zeros((rows, vocab), np.int32)
    for r in range(rows):
        prompt_mask[r, prompts[r]] = True
        np.add.at(counts[r], outputs[r], 1)
    penalties = Penalties(*map(jnp.asarray, (prompt_mask, counts, presence, frequency, repetition)))
    ours = np.asarray(apply_penalties(jnp.asarray(logits), penalties))
    for r in range(rows):
        ids = torch.tensor([prompts[r] + outputs[r]])
        scores = torch.from_numpy(logits[r : r + 1].copy())
        expected = RepetitionPenaltyLogitsProcessor(float(repetition[r]))(ids, scores)[0].numpy()
        # vLLM's frequency and presence penalties count output tokens only.
        expected = expected - frequency[r] * counts[r] - presence[r] * (counts[r] > 0)
        np.testing.assert_allclose(ours[r], expected, rtol=1e-6, atol=1e-6, err_msg=f"row {r}")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path, model = make_nemotron_h_checkpoint(tmp_path_factory.mktemp("penalties"), seed=4)
    model.eval()
    llm = LLM(str(path), max_num_seqs=3, max_model_len=96, max_num_batched_tokens=32, page_size=4)
    return llm, model


def test_greedy_with_penalties_matches_hf_forward_and_processor(hf_checkpoint):
    """The engine (chunked prefill, decode, the per-slot penalty state) against a host loop:
    HF's full forward each token, HF's repetition penalty, vLLM's frequency/presence."""
    llm, model = hf_checkpoint
    prompts = random_prompts(np.random.default_rng(2), [5, 40, 1], llm.model_cfg.vocab_size)
    kw = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(repetition_penalty=1.8, **kw),
        SamplingParams(frequency_penalty=1.5, repetition_penalty=0.8, **kw),
        SamplingParams(presence_penalty=2.0, repetition_penalty=1.2, **kw),
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        tokens = list(prompt)
        counts = np.zeros(llm.model_cfg.vocab_size)
        for _ in range(sp.max_tokens):
            ids = torch.tensor([tokens])
            with torch.no_grad():
                scores = model(ids).logits[:, -1].float()
            scores = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, scores)
            scores = scores[0].numpy() - sp.frequency_penalty * counts
            token = int(np.argmax(scores - sp.presence_penalty * (counts > 0)))
            tokens.append(token)
            counts[token] += 1
        assert out.outputs[0].token_ids == tokens[len(prompt) :], sp
    assert llm.engine.runner.variant_steps["plain"] > 0  # greedy decode: the sort-free sampler


def test_engine_takes_the_sort_free_sampler_only_when_no_request_needs_the_full_one(
    hf_checkpoint,
):
    """Decode steps of greedy requests that ask no logprobs run the argmax-only sampler, with
    logprobs=0 (ranks read) the sort-free one, and both give the full one's tokens and
    logprobs; a request with logprobs >= 1, or one that draws through top-p, puts every decode
    step it is in on the full sampler."""
    llm, _ = hf_checkpoint
    steps = llm.engine.runner.variant_steps
    prompts = random_prompts(np.random.default_rng(6), [7, 19], llm.model_cfg.vocab_size)
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)

    def generate(params):
        before = dict(steps)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return outs, {k: steps[k] - before.get(k, 0) for k in ("greedy", "plain", "full")}

    greedy, ran = generate(SamplingParams(**kw))
    assert ran["greedy"] > 0 and ran["plain"] == 0
    plain, ran = generate(SamplingParams(logprobs=0, **kw))
    assert ran["plain"] > 0 and ran["greedy"] == 0
    full, ran = generate(SamplingParams(logprobs=2, **kw))
    assert ran["plain"] == ran["greedy"] == 0 and ran["full"] > 0
    for a, b, c in zip(greedy, plain, full, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for x in (a, b):
            np.testing.assert_allclose(x.outputs[0].cumulative_logprob,
                                       c.outputs[0].cumulative_logprob, rtol=1e-6)  # fmt: skip
        for top_b, top_c in zip(b.outputs[0].logprobs, c.outputs[0].logprobs, strict=True):
            ((token, lp),) = top_b.items()  # logprobs=0: the sampled token alone
            assert lp.rank == top_c[token].rank and lp.logprob == top_c[token].logprob
    for b in full:
        for token, top in zip(b.outputs[0].token_ids, b.outputs[0].logprobs, strict=True):
            ranked = sorted(top.items(), key=lambda kv: kv[1].rank)
            assert len(top) == 2 and ranked[0][0] == token  # greedy: the sampled token leads
            assert ranked[0][1].logprob >= ranked[1][1].logprob
    drawn = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    _, ran = generate([SamplingParams(**kw), drawn])
    assert ran["plain"] == ran["greedy"] == 0
