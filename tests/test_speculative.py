"""Speculative decoding (issue 34, docs/speculative.md): the settings; the verify step's
recurrent math against the one-token decode references run position by position; prompt
lookup against a plain-Python one; acceptance and rejection sampling against the target
distribution computed in float64, with penalties that count the drafts before each position;
and the engine: greedy output token for token the non-speculative one (the spec's own
definition of correct), with and without penalties, sampling that keeps the target
distribution, counters, batch-size disable, no host syncs in the verify programs."""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.cli_args import add_engine_args
from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.config import EngineConfig, SpeculativeConfig
from jaxmamba.kernels.conv1d.ref import causal_conv1d_update_ref
from jaxmamba.kernels.gdn.ref import gdn_decode_ref
from jaxmamba.kernels.state_update.ref import selective_state_update_ref
from jaxmamba.model.sampling import Penalties, PenaltyState
from jaxmamba.model.speculative import (
    NgramSpec,
    commit_conv,
    commit_state,
    conv_verify,
    gdn_verify,
    mamba2_verify,
    propose_ngram,
    record_kept,
    verify_sample,
)
from jaxmamba.step_contract import MAX_LOGIT_BIAS, MAX_STOP_IDS

from model_helpers import FORBIDDEN, assert_same_token_distribution, primitive_names

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "lookup_min"),
        ({"method": "ngram", "typo": 1}, "typo"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "mtp", "model": "x"}, "speculative_config.model"),
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(config, names):
    with pytest.raises(ValueError, match=names):
        EngineConfig(speculative_config=config)


def test_speculative_config_flag_is_json_from_the_settings_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": 8}'
    args = parser.parse_args(["--speculative-config", flag])
    cfg = EngineConfig(speculative_config=args.speculative_config)
    assert cfg.speculative_config == SpeculativeConfig("ngram", 5, disable_by_batch_size=8)
    assert parser.parse_args([]).speculative_config is None


def test_unsupported_combinations_are_refused(tmp_path):
    # before anything loads (ngram and draft_model under TP: tests/test_speculative_tp.py)
    with pytest.raises(ValueError, match="method 'mtp' with tensor_parallel_size=2"):
        LLM("nemotron-h-tiny", speculative_config={"method": "mtp"}, tensor_parallel_size=2)
    from jaxmamba.export.writer import export_artifact

    draft = {"method": "draft_model", "model": "nemotron-h-tiny"}
    with pytest.raises(ValueError, match="'draft_model'.*weights"):
        export_artifact("nemotron-h-tiny", tmp_path / "art", engine={"speculative_config": draft})
    assert not list(tmp_path.iterdir())


# -- the verify step's recurrent math ---------------------------------------------------------


def _mamba_case(rng, rows=3, num=4, h=4, p=8, g=2, n=8, width=4, slots=6):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    conv_dim = h * p + 2 * g * n
    return dict(
        conv_pool=f(slots + 1, width - 1, conv_dim), ssm_pool=f(slots + 1, h, p, n),
        xbc=f(rows, num, conv_dim), dt=f(rows, num, h), weight=f(width, conv_dim) * 0.5,
        bias=f(conv_dim), A=-jnp.exp(f(h)), D=f(h), dt_bias=f(h),
        slots=jnp.asarray(rng.permutation(slots)[:rows], jnp.int32), dims=(h, p, g, n),
    )  # fmt: skip


def test_mamba2_verify_and_commit_match_decode_steps_position_by_position():
    """Each position's output and the state (SSM and conv window) after every accepted prefix
    equal the one-token conv update + selective state update run that many times."""
    c = _mamba_case(np.random.default_rng(0))
    h, p, g, n = c["dims"]
    rows, num, conv_dim = c["xbc"].shape
    slots = c["slots"]
    conv_out, conv_inputs = conv_verify(c["conv_pool"], c["xbc"], c["weight"], c["bias"], slots)
    split = lambda y: (y[..., : h * p].reshape(*y.shape[:-1], h, p),  # noqa: E731
                       y[..., h * p : h * p + g * n].reshape(*y.shape[:-1], g, n),
                       y[..., h * p + g * n :].reshape(*y.shape[:-1], g, n))  # fmt: skip
    x, b, cc = split(conv_out)
    y, pending = mamba2_verify(c["ssm_pool"], x, c["dt"], c["A"], b, cc, slots, D=c["D"],
                               dt_bias=c["dt_bias"])  # fmt: skip
    pending = pending._replace(conv_inputs=conv_inputs)
    conv_pool, ssm_pool = c["conv_pool"], c["ssm_pool"]
    for t in range(num):
        xt, conv_pool = causal_conv1d_update_ref(conv_pool, c["xbc"][:, t], c["weight"],
                                                 c["bias"], slots)  # fmt: skip
        xs, bs, cs = split(xt)
        yt, ssm_pool = selective_state_update_ref(
            ssm_pool, xs, c["dt"][:, t], c["A"], bs, cs, slots, D=c["D"], dt_bias=c["dt_bias"]
        )
        np.testing.assert_allclose(y[:, t], yt, rtol=2e-5, atol=2e-5)
        kept = jnp.full(rows, t + 1, jnp.int32)
        np.testing.assert_allclose(
            commit_state(c["ssm_pool"], pending, slots, kept)[slots], ssm_pool[slots],
            rtol=2e-5, atol=2e-5,
        )  # fmt: skip
        np.testing.assert_array_equal(
            commit_conv(c["conv_pool"], pending, slots, kept)[slots], conv_pool[slots]
        )
    # Rows keep different prefixes in one commit; other slots are untouched.
    kept = jnp.asarray([1, 3, 2], jnp.int32)
    committed = commit_state(c["ssm_pool"], pending, slots, kept)
    others = np.setdiff1d(np.arange(committed.shape[0]), np.asarray(slots))
    np.testing.assert_array_equal(committed[others], c["ssm_pool"][others])


def test_gdn_verify_and_commit_match_decode_steps_position_by_position():
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    rows, num, hk, hv, dk, dv, slots_n = 3, 5, 2, 4, 8, 6, 5
    pool = f(slots_n + 1, hv, dk, dv) * 0.3
    q, k, v = f(rows, num, hk, dk), f(rows, num, hk, dk), f(rows, num, hv, dv)
    a, b, a_log, dt_bias = f(rows, num, hv), f(rows, num, hv), f(hv) * 0.3, f(hv)
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    o, pending = gdn_verify(pool, q, k, v, a, b, a_log, dt_bias, slots, scale=dk**-0.5)
    state = pool
    for t in range(num):
        ot, state = gdn_decode_ref(state, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], a_log,
                                   dt_bias, slots, scale=dk**-0.5)  # fmt: skip
        np.testing.assert_allclose(o[:, t], ot, rtol=2e-5, atol=2e-5)
        kept = jnp.full(rows, t + 1, jnp.int32)
        np.testing.assert_allclose(commit_state(pool, pending, slots, kept)[slots], state[slots],
                                   rtol=2e-5, atol=2e-5)  # fmt: skip


# -- prompt lookup ------------------------------------------------------------------------------


def _ngram_reference(context: list[int], k: int, lo: int, hi: int) -> list[int] | None:
    """Plain Python: the longest n in [lo, hi] whose suffix recurs earlier, the latest such
    occurrence, and the k tokens after it (repeating with the period past the end)."""
    size = len(context)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = context[size - n :]
        for end in range(size - 2, n - 2, -1):  # the match's last token, latest first
            if context[end - n + 1 : end + 1] == suffix:
                period = size - 1 - end
                return [context[end + 1 + i % period] for i in range(k)]
    return None


def test_prompt_lookup_matches_a_plain_python_reference():
    rng = np.random.default_rng(2)
    spec = NgramSpec(num_tokens=4, lookup_min=1, lookup_max=3, window=32)
    slots, rows = 6, 5
    for trial in range(6):
        history = np.full((slots + 1, spec.window), -1, np.int32)
        lens = rng.integers(3, 60, rows)
        contexts, last = [], []
        for r in range(rows):
            seq = rng.integers(0, 4 + trial, lens[r] + 1).tolist()  # small vocab: many matches
            for pos, tok in enumerate(seq[:-1]):
                history[r, pos % spec.window] = tok
            contexts.append(seq[max(0, len(seq) - 1 - spec.window) :])
            last.append(seq[-1])
        drafts, found = propose_ngram(
            jnp.asarray(history), jnp.asarray(lens, jnp.int32), jnp.asarray(last, jnp.int32),
            jnp.arange(rows), spec,
        )  # fmt: skip
        for r in range(rows):
            want = _ngram_reference(contexts[r], 4, 1, 3)
            assert bool(found[r]) == (want is not None), (r, contexts[r])
            if want is not None:
                assert np.asarray(drafts[r]).tolist() == want, (r, contexts[r])


# -- acceptance and rejection sampling ----------------------------------------------------------


def _verify_rows(logits, drafts, temperature, seeds, penalties=None, **kw):
    rows, k = drafts.shape
    return verify_sample(
        jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32), jnp.ones(rows, bool),
        jnp.full(rows, temperature, jnp.float32), jnp.full(rows, kw.get("top_p", 1.0)),
        jnp.full(rows, kw.get("top_k", 0), jnp.int32), jnp.asarray(seeds, jnp.uint32),
        jnp.zeros(rows, jnp.int32), jnp.zeros(rows), jnp.zeros(rows, jnp.int32),
        jnp.full((rows, MAX_STOP_IDS), -1, jnp.int32), jnp.full((rows, MAX_LOGIT_BIAS), -1,
                                                                 jnp.int32),
        jnp.zeros((rows, MAX_LOGIT_BIAS)),
        None if penalties is None else Penalties(*map(jnp.asarray, penalties)),
    )  # fmt: skip


def _penalised(logits, prompt_mask, counts, presence, frequency, repetition):
    """vLLM's penalties in float64, one row: a token in the prompt or the output has a positive
    logit divided by `repetition` and a negative one multiplied; then `frequency` times its
    output count and `presence` if it was output are subtracted."""
    z = np.asarray(logits, np.float64)
    seen = prompt_mask | (counts > 0)
    z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z)
    return z - frequency * counts - presence * (counts > 0)


def test_greedy_acceptance_is_the_argmax_prefix():
    rng = np.random.default_rng(3)
    rows, k, vocab = 6, 3, 11
    logits = rng.standard_normal((rows, k + 1, vocab))
    best = logits.argmax(-1)
    drafts = best[:, :k].copy()
    for r in range(rows):  # row r: the first r drafts right, the next wrong
        if r < k:
            drafts[r, r] = (best[r, r] + 1) % vocab
    out, accepted = _verify_rows(logits.reshape(-1, vocab), drafts, 0.0, np.arange(rows))
    want = [min(r, k) for r in range(rows)]
    assert np.asarray(accepted).tolist() == want
    tokens = np.asarray(out.tokens).reshape(rows, k + 1)
    for r in range(rows):
        assert tokens[r, : want[r] + 1].tolist() == best[r, : want[r] + 1].tolist()


def test_each_position_is_penalised_with_the_drafts_before_it_as_outputs():
    """Greedy rows with presence, frequency, repetition, all three and no penalty: the token
    at every position j is the argmax of the float64 penalties applied with the row's counts
    plus drafts d_0..d_{j-1}. The row's prompt and earlier outputs are among tokens 0..7,
    whose logits are low; each position's raw logits favour the draft before it by less
    than its penalty, so counts without the drafts mostly pick that draft instead (checked:
    the case has teeth). The drafts are the reference's argmaxes, so every one is accepted."""
    rng = np.random.default_rng(6)
    k, vocab, seen_ids = 4, 23, 8
    params = [(1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (0.0, 0.0, 3.0), (0.8, 0.6, 1.8), (0.0, 0.0, 1.0)]
    rows = len(params)
    presence, frequency, repetition = np.array(params, np.float32).T
    prompt_mask = np.zeros((rows, vocab), bool)
    prompt_mask[:, :seen_ids] = rng.random((rows, seen_ids)) < 0.5
    counts = np.zeros((rows, vocab), np.int32)
    counts[:, :seen_ids] = rng.integers(0, 3, (rows, seen_ids))
    logits = rng.standard_normal((rows, k + 1, vocab)).astype(np.float32)
    logits[:, :, :seen_ids] -= 4.0

    def reference(r, j, seen):
        p = (presence[r], frequency[r], repetition[r])
        return int(np.argmax(_penalised(logits[r, j], prompt_mask[r], seen, *p)))

    drafts = np.zeros((rows, k), np.int64)
    stale = 0  # positions where the row's counts alone would choose otherwise
    for r in range(rows):
        seen = counts[r].copy()
        for j in range(k + 1):
            if j:  # the draft before leads the other tokens by 0.5
                others = np.delete(logits[r, j], drafts[r, j - 1])
                logits[r, j, drafts[r, j - 1]] = others.max() + 0.5
            stale += reference(r, j, seen) != reference(r, j, counts[r])
            if j < k:
                drafts[r, j] = reference(r, j, seen)
                seen[drafts[r, j]] += 1
    assert stale >= (k - 1) * (rows - 1)  # most later positions of the penalised rows
    penalties = (prompt_mask, counts, presence, frequency, repetition)
    out, accepted = _verify_rows(logits.reshape(-1, vocab), drafts, 0.0, np.arange(rows),
                                 penalties)  # fmt: skip
    want = np.zeros((rows, k + 1), np.int64)
    for r in range(rows):
        seen = counts[r].copy()
        for j in range(k + 1):
            want[r, j] = reference(r, j, seen)
            if j < k:
                seen[drafts[r, j]] += 1
    np.testing.assert_array_equal(np.asarray(out.tokens).reshape(rows, k + 1), want)
    assert np.asarray(accepted).tolist() == [k] * rows


def test_a_verify_step_counts_the_fed_tokens_it_kept():
    """`record_kept`: each row's last sampled token and its accepted drafts are added to its
    slot's output counts (repeats counted each time); rejected drafts and other slots are
    untouched, and the prompt mask is kept."""
    rng = np.random.default_rng(7)
    slots_n, vocab = 6, 9
    counts = rng.integers(0, 3, (slots_n + 1, vocab)).astype(np.int32)
    prompt = rng.random((slots_n + 1, vocab)) < 0.3
    slots = np.array([4, 1, 2], np.int32)
    fed = np.array([[3, 5, 5, 0], [7, 7, 7, 7], [2, 8, 1, 6]], np.int32)
    accepted = np.array([2, 3, 0], np.int32)
    state = record_kept(PenaltyState(jnp.asarray(prompt), jnp.asarray(counts)),
                        jnp.asarray(slots), jnp.asarray(fed), jnp.asarray(accepted))  # fmt: skip
    want = counts.copy()
    for slot, row, a in zip(slots, fed, accepted, strict=True):
        np.add.at(want[slot], row[: a + 1], 1)
    np.testing.assert_array_equal(np.asarray(state.output_counts), want)
    np.testing.assert_array_equal(np.asarray(state.prompt_mask), prompt)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's goodness of fit, categories with expected count < 5 pooled."""
    from scipy import stats

    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.parametrize("cut", [{}, {"top_k": 5, "top_p": 0.9}, {"penalties": True}])
def test_rejection_sampling_keeps_the_target_distribution(cut):
    """Over many seeds, with a fixed draft: the token at position 0 is distributed as the
    target p0 (float64 softmax, after top-k/top-p), the draft is accepted with probability
    p0(d) (a binomial check), and the token after an accepted draft is distributed as p1.
    With penalties, p1 is penalised with the draft counted as an output (the raw logits at
    position 1 favour the draft, so without it p1 would be far off: checked). Fixed seeds:
    the test is deterministic; each check fails by chance with p < 1e-4."""
    from scipy import stats

    rng = np.random.default_rng(4)
    vocab, k, trials, temp = 12, 2, 20000, 0.8
    logits = rng.standard_normal((k + 1, vocab)) * 1.5
    prompt_mask = np.zeros(vocab, bool)
    prompt_mask[[1, 4]] = True
    counts = np.zeros(vocab, np.int64)
    counts[[2, 4, 7]] = [1, 2, 1]
    weights = (1.0, 0.6, 1.5)  # presence, frequency, repetition
    draft0 = None

    def target(row, counted=True):
        z = logits[row]
        if cut.get("penalties"):
            seen = counts + (row > 0 and counted) * (np.arange(vocab) == draft0)
            z = _penalised(z, prompt_mask, seen, *weights)
        z = z / temp
        order = np.argsort(-z)
        keep = np.zeros(vocab, bool)
        kk = cut.get("top_k", vocab)
        probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        top = order[:kk]
        p_top = probs[top] / probs[top].sum()
        mass_before = np.cumsum(p_top) - p_top
        keep[top[mass_before < cut.get("top_p", 1.0)]] = True
        p = np.where(keep, probs, 0.0)
        return p / p.sum()

    p0 = target(0)
    draft0 = int(np.argsort(-p0)[1])  # a likely but not the likeliest token
    penalties = None
    if cut.get("penalties"):
        logits[1, draft0] = logits[1].max() + 1.0
        per_row = (prompt_mask, counts.astype(np.int32), *map(np.float32, weights))
        penalties = tuple(np.tile(a, (trials,) + (1,) * np.ndim(a)) for a in per_row)
        assert np.abs(target(1) - target(1, counted=False)).sum() > 0.5
    p1 = target(1)
    drafts = np.tile([draft0, int(np.argmax(p1))], (trials, 1))
    filters = {key: v for key, v in cut.items() if key != "penalties"}
    out, accepted = _verify_rows(np.tile(logits, (trials, 1)), drafts, temp,
                                 np.arange(trials), penalties, **filters)  # fmt: skip
    tokens = np.asarray(out.tokens).reshape(trials, k + 1)
    accepted = np.asarray(accepted)
    assert np.all((accepted >= 1) == (tokens[:, 0] == draft0))
    assert stats.binomtest(int((accepted >= 1).sum()), trials, p0[draft0]).pvalue > 1e-4
    assert _chi_square_p(np.bincount(tokens[:, 0], minlength=vocab), p0) > 1e-4
    after = tokens[accepted >= 1, 1]
    assert _chi_square_p(np.bincount(after, minlength=vocab), p1) > 1e-4


# -- the engine -----------------------------------------------------------------------------------

DEMO = "nemotron-h-demo"
# Prompts of 100-200 tokens through 64-token steps (chunked prefill), two sharing a prefix
# (prefix caching hits), a code-editing one that repeats itself (drafts get accepted).
ENGINE = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=64, page_size=16,
              enable_prefix_caching=True, compilation_cache=False, dtype="float32")  # fmt: skip
CODE = (
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\n"
    "# the same functions, with type hints:\n\ndef area(w: float, h: float) -> float:\n"
)


@pytest.fixture(scope="module")
def demo_pair():
    base = LLM(DEMO, **ENGINE)
    spec = LLM(DEMO, speculative_config={**NGRAM, "num_speculative_tokens": 4}, **ENGINE)
    return base, spec


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_output_is_identical_with_and_without_ngram_speculation(demo_pair):
    base, spec = demo_pair
    typed = CODE + "    return w * h\n\n\ndef perimeter(w: float, h: float) -> float:\n"
    prompts = [CODE, CODE[:90] + "# tests\n", "import os\nimport sys\n\n\ndef main():\n", typed]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0, stop=["\n\n\n"]),
              SamplingParams(max_tokens=33, temperature=0, n=2)]  # fmt: skip
    want = base.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in want]
    assert [c.finish_reason for o in got for c in o.outputs] == \
        [c.finish_reason for o in want for c in o.outputs]  # fmt: skip
    for a, b in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].rank == b[t].rank
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    stats = spec.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == pytest.approx(
        stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    )
    assert stats["spec_acceptance_rate_pos0"] >= stats["spec_acceptance_rate_pos3"]
    assert stats["steps"] < base.stats()["steps"]  # fewer steps for the same tokens


def test_seeded_sampling_reproduces_with_speculation(demo_pair):
    """Two runs that both hit the prefix cache give the same tokens (a run that fed the
    whole prompt drafts from more history, so its tokens may differ: docs/speculative.md)."""
    _, spec = demo_pair
    params = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.95, seed=1234)
    spec.generate([CODE], SamplingParams(max_tokens=1), use_tqdm=False)  # CODE is cached
    first = spec.generate([CODE], params, use_tqdm=False)
    again = spec.generate([CODE], params, use_tqdm=False)
    assert _tokens(first) == _tokens(again)


PENALTIES = {
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=0.5),
    "repetition": dict(repetition_penalty=1.3),
    "combined": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
}
# "a" and "b" (byte-level ids) far above every other token: which of the two comes next is
# the penalties' call at every step, and the output repeats itself, so drafts are accepted.
AB_BIAS = {97: 30.0, 98: 30.0}


def _unpaused(llm):
    """Forget the acceptance pause earlier tests left (`Scheduler.verified`): the steps that
    follow verify."""
    scheduler = llm.engine.scheduler
    scheduler._spec_misses = scheduler._spec_pause = scheduler._spec_backoff = 0


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_greedy_output_with_penalties_is_unchanged_by_speculation(demo_pair, penalty):
    """Each verify position is penalised with the drafts before it counted as outputs, and
    the step counts only what it kept: the output is the plain decode's token for token, on
    the repeating code prompt, and with "a" and "b" biased above the rest (the penalties pick
    between them). Drafts are accepted in each (checked, so the verify path runs), and the
    penalties change the output of at least one (checked, so they are applied). The combined
    case also forks (n = 2: the samples' counts are copied) and batches a row without
    penalties beside them."""
    base, spec = demo_pair
    combined = penalty == "combined"
    greedy = dict(max_tokens=40, temperature=0, ignore_eos=True)
    penalised = SamplingParams(n=1 + combined, **greedy, **PENALTIES[penalty])
    biased = SamplingParams(logit_bias=AB_BIAS, **greedy, **PENALTIES[penalty])
    runs = [([CODE], [penalised]), ([CODE], [biased])]
    if combined:
        runs[0] = ([CODE, CODE[:90]], [penalised, SamplingParams(max_tokens=20, temperature=0)])
    changed = []
    for prompts, params in runs:
        _unpaused(spec)
        want = base.generate(prompts, params, use_tqdm=False)
        before = spec.stats()["spec_accepted_tokens"]
        got = spec.generate(prompts, params, use_tqdm=False)
        assert _tokens(got) == _tokens(want)
        assert spec.stats()["spec_accepted_tokens"] > before
        off = dataclasses.replace(params[0], presence_penalty=0.0, frequency_penalty=0.0,
                                  repetition_penalty=1.0)  # fmt: skip
        changed.append(_tokens(base.generate(prompts[:1], off, use_tqdm=False))[0] !=
                       _tokens(want)[0])  # fmt: skip
    assert any(changed)


def test_seeded_sampling_with_penalties_reproduces_with_speculation(demo_pair):
    """A seeded request with penalties gives the same tokens twice (its repetition penalty
    keeps it off the prefix cache, so both runs draft from the same history)."""
    _, spec = demo_pair
    params = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.95, seed=99,
                            **PENALTIES["combined"])  # fmt: skip
    _unpaused(spec)
    before = spec.stats()["spec_verify_steps"]
    first = spec.generate([CODE], params, use_tqdm=False)
    _unpaused(spec)
    again = spec.generate([CODE], params, use_tqdm=False)
    assert _tokens(first) == _tokens(again)
    assert spec.stats()["spec_verify_steps"] > before


def test_verify_steps_that_keep_no_draft_pause_speculation_with_a_growing_pause():
    """Host policy (`Scheduler.verified`): 4 verify steps in a row that keep no draft pause
    speculation for 8 decode steps, each further such step doubles the pause (to 1024), and a
    kept draft ends it. Over 10,000 decode steps that never keep a draft, at most 1 % of the
    steps verify."""
    from types import SimpleNamespace

    from jaxmamba.engine.scheduler import (
        SPEC_MISSES_TO_PAUSE,
        SPEC_PAUSE,
        SPEC_PAUSE_MAX,
        Scheduler,
    )  # fmt: skip
    from jaxmamba.model.families import load_config

    engine = EngineConfig(max_num_seqs=4, max_model_len=64, speculative_config=NGRAM)
    scheduler = Scheduler(load_config("nemotron-h-tiny"), engine)
    rows = [SimpleNamespace(request=SimpleNamespace(params=SamplingParams(), matcher=None))]

    def run(steps: int, accepted: int) -> list[bool]:
        spoke = []
        for _ in range(steps):
            spoke.append(scheduler.speculates(rows))
            if spoke[-1]:
                scheduler.verified(accepted)
        return spoke

    spoke = run(SPEC_MISSES_TO_PAUSE + SPEC_PAUSE + 1 + 2 * SPEC_PAUSE + 1, accepted=0)
    pause_1 = [False] * SPEC_PAUSE
    pause_2 = [False] * (2 * SPEC_PAUSE)
    assert spoke == [True] * SPEC_MISSES_TO_PAUSE + pause_1 + [True] + pause_2 + [True]
    assert scheduler.spec_paused_steps == 3 * SPEC_PAUSE
    assert sum(run(10_000, accepted=0)) <= 100  # the pause grows to SPEC_PAUSE_MAX
    assert scheduler._spec_backoff == SPEC_PAUSE_MAX
    while not scheduler.speculates(rows):  # the pause runs out; a probe keeps a draft
        pass
    scheduler.verified(1)
    assert all(run(50, accepted=1))  # speculating on every step again


def test_batches_past_disable_by_batch_size_do_not_verify_and_penalties_do():
    llm = LLM(DEMO, speculative_config={**NGRAM, "disable_by_batch_size": 1}, **ENGINE)
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    two = llm.generate([CODE, CODE[:50]], greedy, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in two)
    decode = [s for s in steps if s is not None and s.num_decode_rows == len(s.rows)]
    assert any(len(s.rows) == 2 for s in decode)  # the two decoded side by side...
    assert all(s.num_spec == 0 for s in decode if len(s.rows) > 1)  # ...without verifying
    verifies = llm.stats()["spec_verify_steps"]
    llm.generate([CODE], SamplingParams(max_tokens=8, presence_penalty=0.5), use_tqdm=False)
    assert llm.stats()["spec_verify_steps"] > verifies


def test_gdn_greedy_output_is_identical_with_and_without_speculation():
    engine = dict(ENGINE, max_num_seqs=2)
    rng = np.random.default_rng(5)
    pattern = rng.integers(0, 250, 7).tolist()
    prompts = [pattern * 12, rng.integers(0, 250, 70).tolist() + pattern * 3]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = LLM("qwen3-next-tiny", **engine).generate(None, params, prompt_token_ids=prompts,
                                                     use_tqdm=False)  # fmt: skip
    spec = LLM("qwen3-next-tiny", speculative_config=NGRAM, **engine)
    got = spec.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert spec.stats()["spec_verify_steps"] > 0


def test_speculative_sampling_matches_plain_sampling_in_distribution(demo_pair):
    """The demo model at temperature 0.8 on a code prompt that repeats itself (drafts often
    accepted): the second, third and fourth tokens' distributions over 160 samples, with and
    without speculation, pass a chi-square test of homogeneity (p > 1e-4; fixed seeds make it
    deterministic). The exact check of the acceptance rule is
    `test_rejection_sampling_keeps_the_target_distribution`."""

    params = [SamplingParams(max_tokens=4, temperature=0.8, seed=s, n=4, ignore_eos=True)
              for s in range(40)]  # fmt: skip
    runs = {}
    for name, llm in zip(("plain", "spec"), demo_pair, strict=True):
        before = llm.stats().get("spec_accepted_tokens", 0)
        out = llm.generate([CODE] * len(params), params, use_tqdm=False)
        runs[name] = np.array([c.token_ids for o in out for c in o.outputs])
        if name == "spec":
            assert llm.stats()["spec_accepted_tokens"] > before
    assert_same_token_distribution(runs["plain"], runs["spec"], positions=(1, 2, 3))


def test_verify_programs_have_no_host_callback_nor_branch(demo_pair):
    _, spec = demo_pair
    runner, builder = spec.runner, spec.engine.builder
    for sampler in ("full", "plain", "greedy"):
        bucket = Bucket(2 * 5, 2, 2)
        inputs = builder.padding(bucket)
        step = functools.partial(runner._step_fn, num_decode=2, sampler=sampler)
        names = primitive_names(jax.make_jaxpr(step)(runner.params, runner.cache,
                                                     runner.slot_state, inputs).jaxpr)  # fmt: skip
        assert not [n for n in names if any(f in n for f in FORBIDDEN)], names
        assert not {"cond", "switch", "while"} & names, sampler


def test_programs_are_unchanged_without_speculation():
    """An engine that does not speculate has no verify buckets and sends no
    `lens_from_device`: its programs are those it had before the feature."""
    base = LLM("nemotron-h-tiny", max_num_seqs=4, max_model_len=64, compilation_cache=False)
    spec = LLM("nemotron-h-tiny", max_num_seqs=4, max_model_len=64, compilation_cache=False,
               speculative_config=NGRAM)  # fmt: skip
    plain_buckets = base.engine.scheduler.all_buckets()
    spec_buckets = spec.engine.scheduler.all_buckets()
    assert all(b.num_spec == 0 for b in plain_buckets)
    assert [b for b in spec_buckets if b.num_spec == 0] == plain_buckets
    assert {b.num_spec for b in spec_buckets} == {0, 3}
    assert base.engine.builder.padding(plain_buckets[0]).lens_from_device is None
    assert base.runner.slot_state.spec is None
