"""The whole model's decode through the fused Mamba2 decode kernels (interpret mode; every other
op the reference) against the unfused path and HF transformers (torch, CPU, float32): logits,
states, the decode checkpoint, and HF's greedy tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from family_checks import assert_logits_close, hf_greedy, hf_logits

from jaxmamba.engine.batch import Bucket
from jaxmamba.kernels.mamba_decode import mamba2_decode
from jaxmamba.model import mamba2
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import load_hf_checkpoint

from hf_fixtures import make_nemotron_h_checkpoint
from model_helpers import builder, make_runner, prefill_logits, random_prompts, row

STEPS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, model = make_nemotron_h_checkpoint(
        tmp_path_factory.mktemp("fused"), pattern="M-M*-", n_groups=2, seed=4
    )
    model.eval()
    return path, model


@pytest.fixture
def fused_decode(monkeypatch):
    """Switches the model's decode op to the fused GPU kernels, interpreted (on CPU `auto`
    takes the reference chain), when called; returns how often the op was traced since. The
    step's jit is module-level, so its traces are dropped on the way in and out."""
    traced = []

    def interpreted(*args, **kwargs):
        traced.append(1)
        return mamba2_decode(*args, **{**kwargs, "impl": "interpret"})

    def switch():
        monkeypatch.setattr(mamba2, "mamba2_decode", interpreted)
        jax.clear_caches()
        return traced

    yield switch
    jax.clear_caches()


def _decode(cfg, params, prompts, continuations):
    """Prefill both prompts, then STEPS decode steps of the given tokens; row 0 checkpoints
    its state into slot 5 at the third step. Returns per-step logits [STEPS, 2, V], cache."""
    runner = make_runner(cfg, params)
    prefill_logits(runner, [row(p, 0, slot=i) for i, p in enumerate(prompts)])
    logits = []
    for i in range(STEPS):
        rows = [row([c[i]], len(p) + i, slot=s)
                for s, (p, c) in enumerate(zip(prompts, continuations, strict=True))]  # fmt: skip
        if i == 2:
            rows[0] = row([continuations[0][i]], len(prompts[0]) + i, slot=0, track_slot=5,
                          track_len=len(prompts[0]) + i + 1)  # fmt: skip
        inputs = builder(runner).build(rows, Bucket(2, 2, 2))
        logits.append(np.asarray(runner.forward_logits(inputs, 2))[:2])
    return np.stack(logits), runner.cache


def test_fused_decode_logits_and_states_match_unfused_path_and_hf(checkpoint, fused_decode):
    path, model = checkpoint
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [9, 5], cfg.vocab_size)
    # Row 0 decodes HF's greedy tokens, row 1 random ones.
    greedy = hf_greedy(model, prompts[0], STEPS + 1)[0]
    continuations = [greedy[:STEPS], *random_prompts(rng, [STEPS], cfg.vocab_size)]
    unfused, cache_u = _decode(cfg, params, prompts, continuations)
    traced = fused_decode()
    fused, cache_f = _decode(cfg, params, prompts, continuations)
    assert len(traced) == cfg.num_mamba_layers  # one decode trace, every Mamba layer on it

    np.testing.assert_allclose(fused, unfused, atol=2e-5, rtol=1e-5)
    pad = cache_f.ssm[0].shape[0] - 1
    for ours, theirs in zip(cache_f.ssm + cache_f.conv, cache_u.ssm + cache_u.conv, strict=True):
        np.testing.assert_allclose(np.asarray(ours)[:pad], np.asarray(theirs)[:pad], atol=1e-5)
        assert np.abs(np.asarray(ours)[5]).max() > 0  # the decode checkpoint was written
    for r, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        hf = hf_logits(model, p + c)[len(p) : len(p) + STEPS]
        assert_logits_close(fused[:, r], hf)
    assert fused[:, 0].argmax(-1).tolist() == greedy[1:]  # the greedy tokens, unchanged
