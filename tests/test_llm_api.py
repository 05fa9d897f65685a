"""The vLLM-style `LLM` API on the built-in tiny model and on HF checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams

from hf_fixtures import make_nemotron_h_checkpoint


@pytest.fixture(scope="module")
def llm():
    return LLM("nemotron-h-tiny", max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64)


def greedy(n=8, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_tiny_model_generates_text_from_prompts(llm):
    outs = llm.generate(["Hello, Mamba!", "JAX"], greedy(8))
    assert [o.prompt for o in outs] == ["Hello, Mamba!", "JAX"]
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 8
        assert completion.finish_reason == "length"
        assert isinstance(completion.text, str)
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert out.prompt_token_ids[0] == llm.model_cfg.bos_token_id


def test_more_prompts_than_rows_match_each_prompt_alone(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 70, 17, 1, 33, 64)]
    together = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(6))
    for prompt, out in zip(prompts, together, strict=True):
        (alone,) = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(6))
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(llm):
    prompt = [[5, 6, 7, 8]]

    def sample(seed):
        sp = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate(prompt_token_ids=prompt, sampling_params=sp)[0].outputs[0].token_ids

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


def test_top_k_one_is_greedy_and_logprobs_are_top_k(llm):
    prompt = [[10, 20, 30]]
    base = llm.generate(prompt_token_ids=prompt, sampling_params=greedy(6, logprobs=3))[0]
    k1 = SamplingParams(max_tokens=6, temperature=0.8, top_k=1, seed=3, ignore_eos=True)
    assert llm.generate(prompt_token_ids=prompt, sampling_params=k1)[0].outputs[0].token_ids == (
        base.outputs[0].token_ids
    )
    tp = SamplingParams(max_tokens=6, temperature=0.8, top_p=1e-6, seed=4, ignore_eos=True)
    assert llm.generate(prompt_token_ids=prompt, sampling_params=tp)[0].outputs[0].token_ids == (
        base.outputs[0].token_ids
    )
    completion = base.outputs[0]
    assert len(completion.logprobs) == 6
    for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(top) == 3 and token in top  # greedy: the sampled token is the top one
        assert max(v.logprob for v in top.values()) == top[token].logprob <= 0.0
        assert top[token].rank == 1 and top[token].decoded_token == llm.tokenizer.decode([token])
    probs = np.exp([v.logprob for v in completion.logprobs[0].values()])
    assert probs.sum() <= 1.0 + 1e-5


def test_stop_token_ends_generation(llm):
    prompt = [[1, 2, 3]]
    (first,) = llm.generate(prompt_token_ids=prompt, sampling_params=greedy(6))
    stop = first.outputs[0].token_ids[2]
    sp = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop])
    (out,) = llm.generate(prompt_token_ids=prompt, sampling_params=sp)
    ids = out.outputs[0].token_ids
    assert ids[-1] == stop and stop not in ids[:-1] and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_token_ids=[[1] * 97]), "more than max_model_len"),
        (dict(prompt_token_ids=[[1, 272]]), "outside the vocab"),
        (dict(prompt_token_ids=[[1, -1]]), "outside the vocab"),
        (dict(prompt_token_ids=[[]]), "is empty"),
        (dict(prompts=["ok"], sampling_params=[greedy(2)] * 2), "sampling params for 1 prompts"),
    ],
)
def test_bad_input_raises_value_error_and_llm_stays_usable(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(**kwargs)
    (out,) = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy(3))
    assert len(out.outputs[0].token_ids) == 3
    llm.reset_prefix_cache()
    scheduler = llm.engine.scheduler
    assert scheduler.slots.num_free == scheduler.slots.capacity
    assert scheduler.pages.num_free == scheduler.pages.capacity


BAD_SAMPLING = [
    ("max_tokens", 0), ("max_tokens", -3), ("top_p", 0.0), ("temperature", -1.0), ("top_k", -2),
    ("logprobs", 21),
]  # fmt: skip


@pytest.mark.parametrize("field, value", BAD_SAMPLING)
def test_bad_sampling_params_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unreadable_checkpoints_raise_value_error(tmp_path):
    with pytest.raises(ValueError):
        LLM(str(tmp_path / "does-not-exist"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    path, _ = make_nemotron_h_checkpoint(tmp_path / "ok")
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(path))


def test_hf_checkpoint_with_tokenizer_decodes_text(tmp_path):
    path, _ = make_nemotron_h_checkpoint(tmp_path / "m", with_tokenizer=True)
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64)
    assert json.loads((path / "config.json").read_text())["model_type"] == "nemotron_h"
    (out,) = llm.generate("the quick brown fox", greedy(5))
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_cli_generate_prints_throughput_and_rejects_bad_models(capsys):
    from jaxmamba.cli import main

    assert main(["generate", "--prompt", "hi", "--max-tokens", "4", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens/s" in out and "'hi'" in out
    assert main(["generate", "--model", "no-such-preset"]) == 2
    assert "error:" in capsys.readouterr().err
