"""The whole model's prefill through the GPU conv and SSD kernels (interpret mode; every other
op the reference), which read the in_proj and conv outputs by column (`ColumnView`), against
the reference path: logits and every state the steps write (final states and checkpoints),
in a prefill step and in a mixed step whose prefill rows start behind decode rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.kernels import ColumnView
from jaxmamba.kernels.conv1d.gpu import causal_conv1d_varlen_gpu
from jaxmamba.kernels.ssd.gpu import ssd_varlen_gpu
from jaxmamba.model import mamba2
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import builder, make_runner, random_prompts, row


@pytest.fixture
def gpu_prefill_kernels(monkeypatch):
    """Switches the mixer's conv and SSD to the GPU kernels, interpreted (on CPU `auto` takes
    the references, `interpret` the TPU kernels), when called; returns the operands each call
    got. The step's jit is module-level, so its traces are dropped on the way in and out."""
    calls = []

    def interpreted(kernel):
        def call(*args, impl, **kwargs):
            calls.append((kernel, args))
            return kernel(*args, interpret=True, **kwargs)

        return call

    def switch():
        monkeypatch.setattr(mamba2, "causal_conv1d_varlen", interpreted(causal_conv1d_varlen_gpu))
        monkeypatch.setattr(mamba2, "ssd_varlen", interpreted(ssd_varlen_gpu))
        jax.clear_caches()
        return calls

    yield switch
    jax.clear_caches()


def _prefill_then_mixed(cfg, params):
    """A prefill step (odd lengths, a checkpoint, padding tokens), then a mixed step: two
    decode rows, a row extending its cached state and a new one that checkpoints. Returns
    each step's logits of its real tokens [T', V] (the GPU scan writes no padding rows) and
    the cache."""
    runner = make_runner(cfg, params)
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [37, 11, 5], cfg.vocab_size)
    rows = [
        row(prompts[0], 0, slot=0, track_slot=5, track_len=32),
        row(prompts[1], 0, slot=1),
        row(prompts[2], 0, slot=2),
    ]
    logits = [runner.forward_logits(builder(runner).build(rows, Bucket(64, 3, 0)), 0)[:53]]
    more = random_prompts(rng, [1, 1, 9, 19], cfg.vocab_size)
    rows = [
        row(more[0], 37, slot=0),
        row(more[1], 11, slot=1),
        row(more[2], 5, slot=2),
        row(more[3], 0, slot=3, track_slot=6, track_len=16),
    ]
    logits.append(runner.forward_logits(builder(runner).build(rows, Bucket(32, 4, 2)), 2)[:30])
    return [np.asarray(v) for v in logits], runner.cache


def test_prefill_kernels_on_column_views_match_the_reference_path(gpu_prefill_kernels):
    cfg = config_from_preset("nemotron-h-tiny")
    params = init_params(cfg, seed=0)
    ref_logits, ref_cache = _prefill_then_mixed(cfg, params)
    calls = gpu_prefill_kernels()
    logits, cache = _prefill_then_mixed(cfg, params)

    # One trace per step of each kernel in every Mamba layer, its inputs all column views.
    assert len(calls) == 2 * 2 * cfg.num_mamba_layers
    for kernel, args in calls:
        columns = (0,) if kernel is causal_conv1d_varlen_gpu else (0, 1, 3, 4)  # x, dt, B, C
        assert all(isinstance(args[i], ColumnView) for i in columns)
    for ours, theirs in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    pad = cache.ssm[0].shape[0] - 1
    for ours, theirs in zip(cache.ssm + cache.conv, ref_cache.ssm + ref_cache.conv, strict=True):
        ours, theirs = np.asarray(ours)[:pad], np.asarray(theirs)[:pad]
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
        assert np.abs(ours[5]).max() > 0 and np.abs(ours[6]).max() > 0  # the checkpoints
