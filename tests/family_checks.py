"""What every model family must show against HF transformers (torch, CPU), on random-weight
checkpoints written by `save_pretrained`: packed prefill logits (fp32, and one bf16 case),
greedy generation through the engine's cache equal to `generate` with matching logprobs,
through chunked prefill and a prefix-cache hit.

The checkpoints' parameters are redrawn by `hf_fixtures.perturb_parameters` (HF's init sets
norms to 1, D to 1, biases to 0, A_log to log(1..H), routers to 0: values that would hide
transposes, swapped halves and missing terms).
"""

from __future__ import annotations

import copy
import math

import jax.numpy as jnp
import numpy as np
import torch

from jaxmamba import LLM, SamplingParams
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import load_hf_checkpoint

from model_helpers import make_runner, prefill_logits, random_prompts, row


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    """HF's logits of every prompt token, in one forward without a cache (transformers 5.25
    cannot make a NemotronH cache whose first layer is not a mixer)."""
    with torch.no_grad():
        return model(torch.tensor([prompt]), use_cache=False).logits[0].float().numpy()


def assert_logits_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> None:
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours - ref).max())
    assert err <= rel * scale, f"max abs logit diff {err:.3g} > {rel} x scale {scale:.3g}"


def check_prefill_logits(path, model, *, seed: int = 0, lengths: list[int] | None = None) -> None:
    """Several odd-length prompts packed into one padded prefill step, each against HF.
    `lengths` defaults to chunk-relative ones (1, c - 1, 2c + 5, c + 3)."""
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    runner = make_runner(cfg, params)
    c = cfg.chunk_size
    lengths = lengths or [1, c - 1, 2 * c + 5, c + 3]
    prompts = random_prompts(np.random.default_rng(seed), lengths, cfg.vocab_size)
    rows = [row(p, 0, slot) for slot, p in enumerate(prompts)]
    ours = prefill_logits(runner, rows, num_tokens=sum(lengths) + 5)
    for p, logits in zip(prompts, ours, strict=True):
        assert_logits_close(logits, hf_logits(model, p))


def check_bf16_prefill_logits(path, model, *, rel: float = 0.06, length: int | None = None) -> None:
    """bf16 weights and activations on both sides: the same logits within bf16 rounding, on
    one prompt of `length` tokens (default 2c + 3)."""
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=jnp.bfloat16)
    runner = make_runner(cfg, params, dtype=jnp.bfloat16)
    length = length or 2 * cfg.chunk_size + 3
    prompt = random_prompts(np.random.default_rng(5), [length], cfg.vocab_size)[0]
    (ours,) = prefill_logits(runner, [row(prompt, 0, 0)])
    ref = hf_logits(copy.deepcopy(model).to(torch.bfloat16), prompt)
    assert_logits_close(np.asarray(ours, np.float32), ref, rel=rel)


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # Every prompt token is real: without the mask, HF takes a random prompt's pad ids for
        # padding.
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = gen.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[tok].item()
        for step, tok in zip(gen.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def check_generation(path, model, *, max_tokens: int = 5) -> None:
    """Greedy generation through the engine (decode through the cache; a prompt longer than the
    token budget is prefilled in chunks) equals HF `generate`, logprobs too; then a prompt
    extending the first hits the prefix cache and still equals HF."""
    chunk = load_config(str(path)).chunk_size
    block = math.lcm(chunk, 4)
    # 64, or what the longest prompt and its completion need (chunks of 64: Gated DeltaNet).
    max_model_len = max(64, 2 * block + 8 + max_tokens)
    llm = LLM(
        str(path), max_num_seqs=2, max_model_len=max_model_len, max_num_batched_tokens=16,
        page_size=4,
    )  # fmt: skip
    cfg = llm.model_cfg
    rng = np.random.default_rng(1)
    first = random_prompts(rng, [2 * block + 5, 3], cfg.vocab_size)  # 2 block + 5 > 16: chunked
    extended = [first[0] + random_prompts(rng, [3], cfg.vocab_size)[0]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompts in (first, extended):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            tokens, logprobs = hf_greedy(model, prompt, max_tokens)
            completion = out.outputs[0]
            assert completion.token_ids == tokens, (len(prompt), completion.token_ids, tokens)
            ours = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
            np.testing.assert_allclose(ours, logprobs, atol=1e-4, rtol=0)
    assert outs[0].num_cached_tokens >= 2 * block, outs[0].num_cached_tokens
