"""`LLM(dtype="bfloat16")` end to end against HF transformers in bf16 (torch, CPU) on the same
random checkpoint: the logprob of every generated token, and every greedy pick whose margin
is wider than bf16 rounding can close.

Why the tolerance: both sides round the same float32 weights to bf16 and compute in bf16, but
round intermediates at different points. Each of the model's L layers and the LM head rounds
its output to bf16 (relative error at most u = 2^-8), so to first order two bf16
implementations' logits z differ by at most delta = (L + 1) * u * max|z|. The log-softmax of
a token moves by at most its own logit's change plus the largest change: 2 * delta. A greedy
pick is certain only where HF's top-2 logit margin exceeds 2 * delta (each of the two logits
moves by at most delta). Measured differences are ~5x below these bounds."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxmamba import LLM, SamplingParams

from hf_fixtures import make_nemotron_h_checkpoint

PATTERN = "M-M*-"
BF16_UNIT_ROUNDOFF = 2.0**-8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_nemotron_h_checkpoint(tmp_path_factory.mktemp("hf"), pattern=PATTERN, seed=7)


def test_bf16_engine_logprobs_and_greedy_picks_match_hf_bf16(checkpoint):
    path, model = checkpoint
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    # A 16-token budget: the 30-token prompt is prefilled in two chunks, then decoded.
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    assert llm.dtype == jnp.bfloat16
    assert jnp.dtype(jnp.bfloat16) in {x.dtype for x in jax.tree.leaves(llm.runner.params)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, n).tolist() for n in (5, 17, 30, 9)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    checked = steps = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        # HF scores the engine's own sequence (teacher forcing): every step is compared on the
        # same context, so one near-tie does not derail the rest.
        with torch.no_grad():
            z = hf_bf16(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
        delta = (len(PATTERN) + 1) * BF16_UNIT_ROUNDOFF * float(z.abs().max())
        want = torch.log_softmax(z, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        ours = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]
        np.testing.assert_allclose(ours, want.numpy(), atol=2 * delta, rtol=0)
        top2 = torch.topk(z, 2)
        clear = (top2.values[:, 0] - top2.values[:, 1] > 2 * delta).numpy()
        picks = top2.indices[:, 0].numpy()
        assert np.array_equal(np.asarray(tokens)[clear], picks[clear]), (tokens, picks, clear)
        checked += int(clear.sum())
        steps += len(tokens)
    assert checked >= steps // 3, (checked, steps)  # the greedy check is not vacuous
