"""Step semantics on the built-in tiny model: chunked prefill, packing, decode, tracking."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import builder, make_runner, prefill_logits, random_prompts, row

ATOL = 2e-5


@pytest.fixture(scope="module")
def tiny():
    cfg = config_from_preset("nemotron-h-tiny")
    return cfg, init_params(cfg, seed=0)


def slot_states(runner, slot: int) -> list[np.ndarray]:
    """Every Mamba layer's conv and SSM state of one slot."""
    cache = runner.cache
    return [np.asarray(a[slot]) for a in (*cache.conv, *cache.ssm)]


def assert_states_equal(a, b, atol=ATOL):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5)


def test_chunked_prefill_matches_full_prefill(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params)
    c = cfg.chunk_size
    (prompt,) = random_prompts(np.random.default_rng(0), [3 * c + 5], cfg.vocab_size)
    (full,) = prefill_logits(runner, [row(prompt, 0, slot=0)])
    start = 0
    for end in (10, 10 + c + 7, len(prompt)):  # three extends, none chunk-aligned
        (part,) = prefill_logits(runner, [row(prompt[start:end], start, slot=1)])
        np.testing.assert_allclose(part, full[start:end], atol=ATOL, rtol=1e-5)
        start = end
    assert_states_equal(slot_states(runner, 0), slot_states(runner, 1))


def test_packed_varlen_batch_matches_each_sequence_alone(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params)
    c = cfg.chunk_size
    prompts = random_prompts(np.random.default_rng(1), [c + 3, 1, 2 * c, 5], cfg.vocab_size)
    packed = prefill_logits(runner, [row(p, 0, slot=i) for i, p in enumerate(prompts)], 128)
    for i, p in enumerate(prompts):
        (alone,) = prefill_logits(runner, [row(p, 0, slot=4 + i)])
        np.testing.assert_allclose(packed[i], alone, atol=ATOL, rtol=1e-5)
        assert_states_equal(slot_states(runner, i), slot_states(runner, 4 + i))


def test_tracked_state_equals_final_state_of_that_prefix(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params)
    c = cfg.chunk_size
    a, b = random_prompts(np.random.default_rng(2), [2 * c + 5, 3 * c + 2], cfg.vocab_size)
    # Row 0 checkpoints at 2c inside one prefill; row 1 first prefills 5 tokens, then an
    # extend that starts mid-chunk checkpoints at 2c (a boundary of the absolute chunking).
    prefill_logits(runner, [row(b[:5], 0, slot=1)])
    prefill_logits(
        runner,
        [
            row(a, 0, slot=0, track_slot=2, track_len=2 * c),
            row(b[5:], 5, slot=1, track_slot=3, track_len=2 * c),
        ],
    )
    prefill_logits(runner, [row(a[: 2 * c], 0, slot=4), row(b[: 2 * c], 0, slot=5)])
    assert_states_equal(slot_states(runner, 2), slot_states(runner, 4))
    assert_states_equal(slot_states(runner, 3), slot_states(runner, 5))
    # A checkpoint at the row's own end is its final state.
    prefill_logits(runner, [row(a[:c], 0, slot=6, track_slot=7, track_len=c)])
    assert_states_equal(slot_states(runner, 7), slot_states(runner, 6))


def test_decode_and_mixed_steps_match_full_prefill(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params)
    bld = builder(runner)
    p0, p1 = random_prompts(np.random.default_rng(3), [21, 9], cfg.vocab_size)
    (full0,) = prefill_logits(runner, [row(p0, 0, slot=0)])
    (full1,) = prefill_logits(runner, [row(p1, 0, slot=1)])
    # Feed all but the last token, then decode the last one (pure decode bucket, 2 rows).
    prefill_logits(runner, [row(p0[:-1], 0, slot=2), row(p1[:-1], 0, slot=3)])
    rows = [row(p0[-1:], 20, slot=2, track_slot=6, track_len=21), row(p1[-1:], 8, slot=3)]
    logits = np.asarray(runner.forward_logits(bld.build(rows, Bucket(2, 2, 2)), 2))
    np.testing.assert_allclose(logits[0], full0[-1], atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(logits[1], full1[-1], atol=ATOL, rtol=1e-5)
    assert_states_equal(slot_states(runner, 2), slot_states(runner, 0))
    assert_states_equal(slot_states(runner, 6), slot_states(runner, 0))  # decode checkpoint
    # Mixed: one decode row and one prefill row in the same forward.
    prefill_logits(runner, [row(p0[:-1], 0, slot=4)])
    rows = [row(p0[-1:], 20, slot=4), row(p1, 0, slot=5)]
    logits = np.asarray(runner.forward_logits(bld.build(rows, Bucket(16, 2, 1)), 1))
    np.testing.assert_allclose(logits[0], full0[-1], atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(logits[1 : 1 + len(p1)], full1, atol=ATOL, rtol=1e-5)
    assert_states_equal(slot_states(runner, 5), slot_states(runner, 1))


def test_nan_in_pad_slot_and_pad_page_does_not_reach_real_rows(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params)
    spec = runner.cache_spec
    poison = lambda pools, pad: tuple(p.at[pad].set(np.nan) for p in pools)  # noqa: E731
    cache = runner.cache
    runner.cache = cache._replace(
        conv=poison(cache.conv, spec.pad_slot),
        ssm=poison(cache.ssm, spec.pad_slot),
        k_pages=poison(cache.k_pages, spec.pad_page),
        v_pages=poison(cache.v_pages, spec.pad_page),
    )
    prompts = random_prompts(np.random.default_rng(4), [7, 18], cfg.vocab_size)
    outs = prefill_logits(runner, [row(p, 0, slot=i) for i, p in enumerate(prompts)], 64)
    assert all(np.isfinite(o).all() for o in outs)
    assert all(np.isfinite(s).all() for s in slot_states(runner, 0) + slot_states(runner, 1))


def test_step_raises_before_dispatch_on_malformed_rows(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params)
    bld = builder(runner)
    with pytest.raises(ValueError, match="decode row 0 must carry exactly 1 token"):
        bld.build([row([1, 2], 0, slot=0)], Bucket(4, 2, 1))
    with pytest.raises(ValueError, match="pure decode bucket"):
        bld.build([row([1], 3, slot=0)], Bucket(4, 1, 1))
    with pytest.raises(ValueError, match="outside the vocab"):
        bld.build([row([cfg.vocab_size], 0, slot=0)], Bucket(16, 1, 0))
    with pytest.raises(ValueError, match="track_len"):
        bld.build([row([1] * 20, 0, slot=0, track_slot=1, track_len=5)], Bucket(32, 1, 0))
    with pytest.raises(ValueError, match="do not fit"):
        bld.build([row([1] * 20, 0, slot=0)], Bucket(16, 1, 0))
    assert jax.device_get(runner.cache.ssm[0]).shape[0] == runner.cache_spec.num_slots + 1


def test_decode_checkpoints_copy_only_the_tracking_rows(tiny):
    cfg, params = tiny
    runner = make_runner(cfg, params, num_slots=24)
    bld = builder(runner)
    prompts = random_prompts(np.random.default_rng(5), [3 + i for i in range(10)], cfg.vocab_size)
    prefill_logits(runner, [row(p, 0, slot=i) for i, p in enumerate(prompts)], 128)
    tracking = {1: 20, 4: 21, 9: 22}  # row → its checkpoint slot
    rows = [
        row([7], len(p), slot=i, track_slot=tracking.get(i), track_len=len(p) + 1)
        for i, p in enumerate(prompts)
    ]
    runner.forward_logits(bld.build(rows, Bucket(16, 16, 16)), 16)
    for i, slot in tracking.items():
        assert_states_equal(slot_states(runner, slot), slot_states(runner, i), atol=0)
    untouched = slot_states(runner, 23)
    assert all(not np.any(s) for s in untouched)
    too_many = [row([7], len(p), slot=i, track_slot=12 + i, track_len=len(p) + 1)
                for i, p in enumerate(prompts)]  # fmt: skip
    with pytest.raises(ValueError, match="at most 8"):
        bld.build(too_many, Bucket(16, 16, 16))
