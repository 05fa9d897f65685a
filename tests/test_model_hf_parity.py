"""Whole-model parity with HF transformers (torch, CPU, float32) on random-weight checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
from family_checks import assert_logits_close, hf_greedy, hf_logits

from jaxmamba import LLM, SamplingParams
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import load_hf_checkpoint

from hf_fixtures import make_mamba2_checkpoint, make_nemotron_h_checkpoint
from model_helpers import make_runner, prefill_logits, random_prompts, row

MODELS = {
    "nemotron_h-M-M*-": lambda p: make_nemotron_h_checkpoint(p, pattern="M-M*-", n_groups=2),
    "nemotron_h-*MM-M": lambda p: make_nemotron_h_checkpoint(
        p, pattern="*MM-M", n_groups=3, mamba_num_heads=6, chunk_size=4, seed=1
    ),
    "nemotron_h-g1": lambda p: make_nemotron_h_checkpoint(
        p, pattern="M*M-", n_groups=1, seed=2, max_shard_size="40KB"
    ),
    "mamba2-g2": lambda p: make_mamba2_checkpoint(p, n_groups=2),
    "mamba2-untied": lambda p: make_mamba2_checkpoint(p, n_groups=1, tie=False, seed=3),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    path, model = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    model.eval()
    return path, model


def test_packed_prefill_logits_match_hf(checkpoint):
    path, model = checkpoint
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    runner = make_runner(cfg, params)
    c = cfg.chunk_size
    lengths = [1, c - 1, 3 * c + 5, c + 1, 2 * c]
    prompts = random_prompts(np.random.default_rng(0), lengths, cfg.vocab_size)
    rows = [row(p, 0, slot) for slot, p in enumerate(prompts)]
    # A bucket larger than the tokens: padding tokens must not leak into real rows.
    ours = prefill_logits(runner, rows, num_tokens=sum(lengths) + 7)
    for p, logits in zip(prompts, ours, strict=True):
        assert_logits_close(logits, hf_logits(model, p))


def test_greedy_generation_matches_hf_generate(checkpoint):
    path, model = checkpoint
    # A 16-token budget: the 19-token prompt is prefilled in two chunks, in few buckets.
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, page_size=4)
    lengths = [7, 1, 19]
    prompts = random_prompts(np.random.default_rng(1), lengths, llm.model_cfg.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(model, prompt, 6)
        completion = out.outputs[0]
        assert completion.token_ids == hf_tokens
        ours = [completion.logprobs[i][tok].logprob for i, tok in enumerate(hf_tokens)]
        np.testing.assert_allclose(ours, hf_logprobs, atol=1e-4, rtol=0)
        assert all(len(lp) >= 2 for lp in completion.logprobs)
