"""The host stays out of the forward: no callbacks, no implicit transfers, no recompiles."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.runner import FULL, GREEDY, PLAIN, fallback_sampler
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import FORBIDDEN, builder, make_runner, primitive_names, row


@pytest.fixture(scope="module")
def runner():
    cfg = config_from_preset("nemotron-h-tiny")
    return make_runner(cfg, init_params(cfg, seed=0))


def prefill_rows(rng, lengths, vocab, first_slot=0):
    return [
        row(rng.integers(0, vocab, n).tolist(), 0, slot=first_slot + i)
        for i, n in enumerate(lengths)
    ]


def step_primitives(runner, bucket, seed=2, sampler=FULL):
    rng = np.random.default_rng(seed)
    vocab = runner.cfg.vocab_size
    rows = [row([int(rng.integers(vocab))], 5, slot=i) for i in range(bucket.num_decode)]
    rows += prefill_rows(rng, [9, 3], vocab, first_slot=bucket.num_decode)[
        : bucket.num_rows - bucket.num_decode
    ]
    inputs = builder(runner).build(rows, bucket)
    step = functools.partial(runner._step_fn, num_decode=bucket.num_decode, sampler=sampler)
    return primitive_names(jax.make_jaxpr(step)(runner.params, runner.cache, runner.slot_state,
                                                inputs).jaxpr)  # fmt: skip


@pytest.mark.parametrize("bucket", [Bucket(64, 4, 0), Bucket(4, 4, 4), Bucket(32, 4, 2)])
def test_step_jaxpr_has_no_host_callbacks(runner, bucket):
    names = step_primitives(runner, bucket, seed=0)
    assert "scan" in names or bucket.num_decode == bucket.num_rows  # the jaxpr is the real step
    assert not [n for n in names if any(f in n for f in FORBIDDEN)], names


# No device branches: on the H200 a decode step with two `lax.cond`s in its sampler ran ~5 ms
# slower at every batch size (issue 17, docs/benchmarks.md), as if the host waited for each
# predicate before launching the rest of the step and the next one.
def test_decode_step_has_no_device_branch(runner):
    assert not {"cond", "switch"} & step_primitives(runner, Bucket(4, 4, 4))


def test_prefill_step_has_no_device_branch(runner):
    assert "cond" not in step_primitives(runner, Bucket(32, 4, 2))


def test_sampler_variants_leave_out_what_they_say_and_do_not_branch(runner):
    """The decode step's PLAIN sampler leaves out the sort (the cut-off) and the top-k (top
    logprobs); the FULL one has both; GREEDY also leaves out the random draw. None branches on
    the device."""
    full = step_primitives(runner, Bucket(4, 4, 4))
    plain = step_primitives(runner, Bucket(4, 4, 4), sampler=PLAIN)
    greedy = step_primitives(runner, Bucket(4, 4, 4), sampler=GREEDY)
    assert {"sort", "top_k"} <= full
    assert not {"sort", "top_k", "cond", "switch"} & plain
    assert "random_bits" in plain
    assert not {"sort", "top_k", "cond", "switch", "random_bits"} & greedy


# (row parameters of a decode step, does a row read the top logprobs, the ranks) -> the
# variant chosen
VARIANT_CASES = [
    ([{}, {}, {}], False, False, GREEDY),  # greedy, no logprobs asked
    ([{}, {}, {}], False, True, PLAIN),  # greedy, a row asks for logprobs=0
    ([dict(top_k=5, top_p=0.5, min_p=0.2), dict(logit_bias={3: 2.0}, min_tokens=2,
      stop_ids=(1,))], False, False, GREEDY),  # filters on greedy rows do nothing; bias stays
    ([{}, dict(repetition_penalty=1.2)], False, False, PLAIN),  # a penalty: PLAIN applies it
    ([dict(presence_penalty=-0.5)], False, False, PLAIN),
    ([dict(temperature=1.0), dict(temperature=0.5, seed=3)], False, False, PLAIN),  # draws
    ([dict(top_k=5, top_p=0.5, min_p=0.2)], False, True, PLAIN),
    ([dict(temperature=0.7, top_k=1000)], False, True, PLAIN),  # top_k >= vocab keeps all
    ([dict(frequency_penalty=0.5, logit_bias={3: 2.0}, min_tokens=2, stop_ids=(1,))], False,
     True, PLAIN),
    ([{}, dict(temperature=0.7, top_k=5)], False, False, FULL),  # one filtered row: the step
    ([{}, dict(temperature=0.7, top_p=0.9)], False, True, FULL),
    ([dict(temperature=0.7, min_p=0.1), {}], False, True, FULL),
    ([{}, {}], True, True, FULL),  # a row reads the top logprobs
]  # fmt: skip


@pytest.mark.parametrize("params, asks, ranks, expected", VARIANT_CASES)
def test_decode_steps_take_the_cheapest_sampler_no_row_needs_more_than(
    runner, params, asks, ranks, expected
):
    assert runner.cfg.vocab_size <= 1000
    rows = [row([1], 5, slot=i, **kw) for i, kw in enumerate(params)]
    inputs = builder(runner).build(rows, Bucket(4, 4, 4))
    assert runner.sampler_variant(inputs, 4, top_logprobs=asks, ranks=ranks) == expected


def test_an_artifact_without_a_variant_serves_its_steps_on_the_next_dearer_program():
    assert fallback_sampler(GREEDY, (FULL, PLAIN, GREEDY)) == GREEDY
    assert fallback_sampler(GREEDY, (FULL, PLAIN)) == PLAIN  # exported before GREEDY existed
    assert fallback_sampler(GREEDY, (FULL,)) == FULL
    assert fallback_sampler(PLAIN, (FULL, GREEDY)) == FULL  # GREEDY cannot serve PLAIN's rows


def test_steps_with_prefill_rows_take_the_full_sampler(runner):
    rows = [row([1], 5, slot=0), row([1, 2, 3], 0, slot=1)]
    inputs = builder(runner).build(rows, Bucket(32, 4, 2), num_decode_rows=1)
    assert runner.sampler_variant(inputs, 2, top_logprobs=False) == FULL


def test_steps_run_under_transfer_guard_without_recompiling(runner):
    bld = builder(runner)
    rng = np.random.default_rng(1)
    vocab = runner.cfg.vocab_size
    prefill_bucket, decode_bucket = Bucket(64, 4, 0), Bucket(4, 4, 4)

    def run(rows, bucket, ranks=True):
        with jax.transfer_guard("disallow"):
            packed = runner.step(bld.build(rows, bucket), bucket.num_decode, top_logprobs=False,
                                 ranks=ranks)  # fmt: skip
            return jax.device_get(packed)  # explicit: the one read per step

    run(prefill_rows(rng, [20, 7, 1, 30], vocab), prefill_bucket)
    run([row([1], 20, slot=0)], decode_bucket)  # the PLAIN sampler
    run([row([1], 20, slot=0)], decode_bucket, ranks=False)  # the GREEDY one
    run([row([1], 20, slot=0, temperature=1.0, top_k=3)], decode_bucket)  # the FULL one
    warm = runner.num_compiles
    steps = dict(runner.variant_steps)
    # Different compositions inside the same buckets: row counts, lengths, slots, sampling.
    for lengths in ([1], [63], [16, 16, 16, 16], [5, 40]):
        run(prefill_rows(rng, lengths, vocab, first_slot=2), prefill_bucket)
    mixes = [
        dict(temperature=0.7),
        dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3),
        dict(frequency_penalty=0.5, presence_penalty=-0.5, logit_bias={3: 2.0}),
        dict(temperature=1.0, min_tokens=4, stop_ids=(1, 2), sample_counter=1),
    ]
    for n in (1, 3, 4):
        rows = [
            row([int(rng.integers(vocab))], 40 + i, slot=i, seed=i, **mixes[(n + i) % 4])
            for i in range(n)
        ]
        run(rows, decode_bucket)
        # Without the filtered mix: the PLAIN sampler; greedy rows alone asking no logprobs:
        # the GREEDY one.
        run([r for r in rows if r.top_k == 0], decode_bucket)
        run([row([int(rng.integers(vocab))], 40, slot=i) for i in range(n)], decode_bucket,
            ranks=False)  # fmt: skip
    assert runner.num_compiles == warm
    assert runner.variant_steps[GREEDY] - steps[GREEDY] == 3
    assert runner.variant_steps[PLAIN] - steps[PLAIN] == 3
    assert runner.variant_steps[FULL] - steps[FULL] == 4 + 3  # the prefill steps, the mixes


def test_forks_and_prompt_scores_are_programs_of_their_own_run_only_when_asked(runner):
    """A step with prefill rows neither scores prompt tokens nor copies fork states: its
    logits are its rows' alone, and `fork_fn` / `score_fn` run after it only for steps that
    ask, each compiled once, under the transfer guard. The fork leaves the source's end state
    in the fork's slot; the scores' targets are the asked prompt tokens, in step order."""
    from jaxmamba.engine.runner import MAX_PROMPT_LOGPROB_TOKENS, unpack_step_output

    from model_helpers import pages_for

    bld, vocab, bucket = builder(runner), runner.cfg.vocab_size, Bucket(64, 4, 0)
    rng = np.random.default_rng(5)
    tokens = [rng.integers(0, vocab, n).tolist() for n in (12, 9, 20)]

    def rows(fork: bool, scored: bool):
        first = row(tokens[0], 0, slot=0)
        if fork:  # slot 3 takes a copy of slot 0's end state and its partial last page
            first.forks = [(3, pages_for(0, 12)[-1], pages_for(3, 12)[-1])]
        second = row(tokens[1], 0, slot=1)
        if scored:  # the second row asks for its prompt's next tokens (one short at its end)
            second.prompt_logprob_targets = tokens[1][1:]
        forked = [row([], 12, slot=3, fork=True)] if fork else []
        return [first, *forked, second, row(tokens[2], 0, slot=2)]

    def run(fork: bool, scored: bool):
        with jax.transfer_guard("disallow"):
            out = runner.step(bld.build(rows(fork, scored), bucket), 0, top_logprobs=False)
            return jax.device_get(out)

    step = functools.partial(runner._step_fn, num_decode=0)
    jaxpr = jax.make_jaxpr(step)(runner.params, runner.cache, runner.slot_state,
                                 bld.build(rows(True, True), bucket)).jaxpr  # fmt: skip
    vocab_dots = [
        e.outvars[0].aval.shape
        for e in jaxpr.eqns
        if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == vocab
    ]
    assert vocab_dots == [(bucket.num_rows, vocab)]  # the lm_head over the rows alone

    for fork, scored in ((False, False), (True, True)):  # warm-up: every program once
        run(fork, scored)
    warm = runner.num_compiles
    sampled, scores = unpack_step_output(run(False, False))
    assert scores is None and sampled.tokens.shape == (bucket.num_rows,)
    sampled, scores = unpack_step_output(run(True, True))
    assert scores.tokens.shape == (MAX_PROMPT_LOGPROB_TOKENS,)
    assert scores.tokens[:8].tolist() == tokens[1][1:] and (scores.tokens[8:] == -1).all()
    assert runner.num_compiles == warm
    for layer, pool in enumerate(runner.cache.ssm):
        np.testing.assert_array_equal(np.asarray(pool[3]), np.asarray(pool[0]), f"layer {layer}")
    for pool in runner.cache.conv:
        np.testing.assert_array_equal(np.asarray(pool[3]), np.asarray(pool[0]))
    assert np.abs(np.asarray(runner.cache.ssm[0][0])).sum() > 0  # a real state was copied


def test_verify_steps_run_under_transfer_guard_without_recompiling():
    """Speculative decoding: a prefill, a plain decode and verify steps (rows of 1 + k tokens)
    of a speculating runner need no host transfer but their inputs and the one read, carry no
    callback or device branch, and compile once per bucket and sampler."""
    import jax.numpy as jnp

    from jaxmamba.engine.batch import StepBuilder
    from jaxmamba.engine.runner import ModelRunner
    from jaxmamba.model.cache import CacheSpec
    from jaxmamba.model.speculative import NgramSpec

    from model_helpers import MAX_PAGES, PAGE_SIZE

    cfg = config_from_preset("nemotron-h-tiny")
    spec = CacheSpec(num_slots=8, num_pages=8 * MAX_PAGES, page_size=PAGE_SIZE)
    k = 3
    runner = ModelRunner(cfg, init_params(cfg, seed=0), spec, dtype=jnp.float32,
                         speculative=NgramSpec(k, 1, 3))  # fmt: skip
    bld = StepBuilder(spec, MAX_PAGES, cfg.vocab_size, cfg.chunk_size, speculative=True)
    rng = np.random.default_rng(3)
    vocab = cfg.vocab_size
    verify = Bucket(4 * (1 + k), 4, 4)

    def run(rows, bucket, **kw):
        with jax.transfer_guard("disallow"):
            out = runner.step(bld.build(rows, bucket), bucket.num_decode, **kw)
            return jax.device_get(out)

    run(prefill_rows(rng, [20, 7, 1, 30], vocab), Bucket(64, 4, 0))
    run([row([0], 20, slot=0, token_from_device=True)], Bucket(4, 4, 4))
    vrow = lambda i, **kw: row([0] * (1 + k), 20, slot=i, token_from_device=True, **kw)  # noqa: E731
    run([vrow(0), vrow(1)], verify, top_logprobs=False, ranks=False)  # GREEDY
    run([vrow(0), vrow(1, temperature=0.8)], verify, top_logprobs=False)  # PLAIN
    run([vrow(0), vrow(1, temperature=0.8)], verify)  # FULL
    warm = runner.num_compiles
    for n in (1, 3, 4):
        run([vrow(i, temperature=0.5 * (i % 2), seed=i) for i in range(n)], verify)
        run([vrow(i) for i in range(n)], verify, top_logprobs=False, ranks=False)
    assert runner.num_compiles == warm
    inputs = bld.build([vrow(0)], verify)
    step = functools.partial(runner._step_fn, num_decode=4, sampler=FULL)
    names = primitive_names(jax.make_jaxpr(step)(runner.params, runner.cache, runner.slot_state,
                                                 inputs).jaxpr)  # fmt: skip
    assert not [n for n in names if any(f in n for f in FORBIDDEN)], names
    assert not {"cond", "switch"} & names
