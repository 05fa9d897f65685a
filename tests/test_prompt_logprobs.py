"""prompt_logprobs (vLLM's layout) against HF transformers' logits of the same random model;
special tokens' decoded_token as vLLM decodes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxmamba import LLM, SamplingParams

from hf_fixtures import make_nemotron_h_checkpoint

K = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, model = make_nemotron_h_checkpoint(
        tmp_path_factory.mktemp("pl"), pattern="M*M-", with_tokenizer=True, seed=4
    )
    # Small token budget: long prompts are prefilled in several chunks.
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    return path, model.eval(), llm


def hf_log_softmax(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def generate(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def check_against_hf(model, prompt, got, k):
    ref = hf_log_softmax(model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        row, token, entry = ref[p - 1], prompt[p], got[p]
        assert next(iter(entry)) == token  # the prompt token first, as vLLM
        assert entry[token].logprob == pytest.approx(row[token], abs=2e-4)
        assert entry[token].rank == int(np.sum(row >= row[token]))
        top = set(np.argsort(-row)[:k].tolist())
        assert set(entry) - {token} == top - {token}
        for t in top:
            assert entry[t].logprob == pytest.approx(row[t], abs=2e-4)


def test_prompt_logprobs_match_hf_across_chunks_and_mixed_rows(setup):
    _, model, llm = setup
    rng = np.random.default_rng(0)
    lengths = [1, 5, 23, 40]
    prompts = [[1, *rng.integers(4, 97, n - 1).tolist()] for n in lengths]
    params = [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K),
              SamplingParams(max_tokens=2, temperature=0.0),
              SamplingParams(max_tokens=2, temperature=0.7, seed=1, prompt_logprobs=0),
              SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)]  # fmt: skip
    outs = generate(llm, prompts, params)
    assert outs[1].prompt_logprobs is None
    check_against_hf(model, prompts[0], outs[0].prompt_logprobs, K)
    check_against_hf(model, prompts[3], outs[3].prompt_logprobs, K)
    zero = outs[2].prompt_logprobs  # k = 0: the prompt token alone
    assert all(len(d) == 1 for d in zero[1:])
    check_against_hf(model, prompts[2], zero, 0)


def test_prompt_logprobs_skip_the_prefix_cache_and_a_new_mix_does_not_recompile(setup):
    _, model, llm = setup
    rng = np.random.default_rng(1)
    prompt = [1, *rng.integers(4, 97, 36).tolist()]
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    asking = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K)
    first = generate(llm, [prompt], plain)[0]
    again = generate(llm, [prompt], plain)[0]
    warm = llm.runner.num_compiles
    assert again.num_cached_tokens > 0  # the cache serves the plain request
    scored = generate(llm, [prompt], asking)[0]
    assert scored.num_cached_tokens == 0  # every prompt token computed
    check_against_hf(model, prompt, scored.prompt_logprobs, K)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    # Same shapes as the first, uncached request: the buckets exist already.
    assert llm.runner.num_compiles == warm


def test_decoded_token_of_special_tokens_is_their_text_as_vllm_decodes(setup):
    """vLLM decodes each logprob token alone with the tokenizer's default
    (skip_special_tokens=False), whatever the request's skip_special_tokens."""
    from transformers import PreTrainedTokenizerFast

    path, _, llm = setup
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    eos = 2
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=1,
                            logit_bias={eos: 100.0}, ignore_eos=True)  # fmt: skip
    out = generate(llm, [[5, 1, 7]], params)[0]
    completion = out.outputs[0]
    assert completion.token_ids == [eos, eos]
    assert completion.text == ""  # skipped in the text, as the request asks
    assert completion.logprobs[0][eos].decoded_token == hf.decode([eos]) == "</s>"
    assert out.prompt_logprobs[1][1].decoded_token == hf.decode([1]) == "<s>"


def test_prompt_logprobs_past_the_per_step_cap_are_all_scored(setup, monkeypatch):
    """A step scores at most MAX_PROMPT_LOGPROB_TOKENS prompt tokens: with a cap of 6 (below
    the 16-token step budget) the scheduler splits the scoring requests' chunks, the step
    scores exactly its cap, and every prompt position still matches HF."""
    from jaxmamba.engine import runner, scheduler
    from jaxmamba.model import step

    path, model, _ = setup
    monkeypatch.setattr(step, "MAX_PROMPT_LOGPROB_TOKENS", 6)
    monkeypatch.setattr(runner, "MAX_PROMPT_LOGPROB_TOKENS", 6)
    monkeypatch.setattr(scheduler, "MAX_PROMPT_LOGPROB_TOKENS", 6)
    # Another max_num_seqs: new step shapes, so the steps are traced with the patched cap.
    llm = LLM(str(path), dtype="float32", max_num_seqs=3, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    rng = np.random.default_rng(2)
    prompts = [[1, *rng.integers(4, 97, n - 1).tolist()] for n in (29, 17, 33)]
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=K),
              SamplingParams(max_tokens=3, temperature=0.0),
              SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=K)]  # fmt: skip
    outs = generate(llm, prompts, params)
    check_against_hf(model, prompts[0], outs[0].prompt_logprobs, K)
    check_against_hf(model, prompts[2], outs[2].prompt_logprobs, K)
    assert outs[1].prompt_logprobs is None
    with torch.no_grad():  # the greedy tokens are unchanged by the split chunks
        for prompt, out in zip(prompts, outs, strict=True):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
            assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
