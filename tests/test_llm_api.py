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


def test_sampled_token_rank_is_its_place_among_the_top_logprobs(llm):
    # High temperature: many sampled tokens are not the most likely one.
    sp = SamplingParams(max_tokens=24, temperature=3.0, seed=11, ignore_eos=True, logprobs=20)
    completion = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp)[0].outputs[0]
    ranks = []
    for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
        others = [v.logprob for t, v in top.items() if t != token]
        if len(top) > 20:  # the sampled token is outside the top 20
            assert top[token].rank > 20 and top[token].logprob <= min(others)
        else:
            assert top[token].rank == 1 + sum(lp > top[token].logprob for lp in others)
        ranks.append(top[token].rank)
    assert max(ranks) > 1


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

    # The module's `llm` engine sizes: the steps it compiled serve the CLI too.
    argv = ["generate", "--prompt", "hi", "--max-tokens", "4", "--max-model-len", "96",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "generated tokens/s" in out and "'hi'" in out
    assert main(["generate", "--model", "no-such-preset"]) == 2
    assert "error:" in capsys.readouterr().err


def test_bfloat16_state_keeps_greedy_tokens_close_to_float32(llm):
    """mamba_ssm_cache_dtype="bfloat16" stores every recurrent state in bf16: the greedy
    tokens' logprobs stay within rounding of float32's (a token may differ only where its
    logprob ties the float32 choice's, and the texts part from there)."""
    import jax.numpy as jnp

    bf16 = LLM("nemotron-h-tiny", max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64,
               mamba_ssm_cache_dtype="bfloat16", params=llm.runner.params)  # fmt: skip
    assert bf16.runner.cache_spec.ssm_dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in bf16.runner.cache.ssm)
    assert all(x.dtype == jnp.float32 for x in bf16.runner.cache.conv)
    assert all(x.dtype == jnp.float32 for x in llm.runner.cache.ssm)
    # 70 tokens: a prefill in two chunks, the state stored in between.
    prompts = [np.random.default_rng(1).integers(0, 256, 70).tolist(), [10, 20, 30]]
    ref = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(16, logprobs=1))
    got = bf16.generate(prompt_token_ids=prompts, sampling_params=greedy(16, logprobs=1))
    for r, g in zip(ref, got, strict=True):
        r, g = r.outputs[0], g.outputs[0]
        for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids, strict=True)):
            assert g.logprobs[i][b].logprob == pytest.approx(r.logprobs[i][a].logprob, abs=1e-2)
            if a != b:
                break


@pytest.mark.parametrize("command", ["generate", "bench", "serve", "export", "aot"])
def test_cli_mamba_ssm_cache_dtype_reaches_the_engine(monkeypatch, command):
    """`--mamba-ssm-cache-dtype` of every engine-building command reaches `LLM(...)`, the
    exported or compiled engine's settings, or the benchmark's cache."""
    import functools

    import jaxmamba.bench
    import jaxmamba.export.aot
    import jaxmamba.export.writer
    from jaxmamba.cli import main
    from jaxmamba.engine.config import EngineConfig

    seen = {}

    class Reached(Exception):
        pass

    @functools.wraps(LLM.__init__)
    def llm_init(self, model, **kwargs):
        seen["llm"] = kwargs["mamba_ssm_cache_dtype"]
        raise Reached

    def export(model, out, *, engine, **kwargs):
        seen["engine"] = EngineConfig(**engine).ssm_dtype
        raise Reached

    def bench(cfg, params, **kwargs):
        seen["bench"] = kwargs["ssm_dtype"]
        raise Reached

    monkeypatch.setattr(LLM, "__init__", llm_init)
    monkeypatch.setattr(jaxmamba.export.writer, "export_artifact", export)
    monkeypatch.setattr(jaxmamba.export.aot, "aot_compile", lambda model, *, engine, **kw: export(
        model, None, engine=engine))  # fmt: skip
    monkeypatch.setattr(jaxmamba.bench, "bench_one_batch", bench)
    argv = [command, "--model", "nemotron-h-tiny", "--mamba-ssm-cache-dtype", "bfloat16"]
    argv += {"export": ["--out", "unused"], "bench": ["--batch-size", "1"]}.get(command, [])
    with pytest.raises(Reached):
        main(argv)
    assert list(seen.values()) == ["bfloat16"]


def test_every_vllm_prompt_form_gives_the_same_completion(llm):
    ids = llm.get_tokenizer().encode("JAX")
    assert ids == [256, *b"JAX"]
    (ref,) = llm.generate("JAX", greedy(5))
    forms = [
        llm.generate(["JAX"], greedy(5)),
        llm.generate({"prompt": "JAX"}, greedy(5)),
        llm.generate([{"prompt": "JAX"}], greedy(5)),
        llm.generate({"prompt_token_ids": ids}, greedy(5)),
        llm.generate([{"prompt_token_ids": np.array(ids, np.int64)}], greedy(5)),
        llm.generate(prompt_token_ids=ids, sampling_params=greedy(5)),
        llm.generate(prompt_token_ids=[ids], sampling_params=greedy(5)),
        llm.generate(prompt_token_ids=np.array(ids, np.int32), sampling_params=greedy(5)),
        llm.generate(prompt_token_ids=np.array([ids]), sampling_params=greedy(5)),
    ]
    for (out,) in forms:
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    mixed = llm.generate(["JAX", {"prompt_token_ids": ids}, {"prompt": "JAX"}], greedy(5))
    assert [o.prompt for o in mixed] == ["JAX", None, "JAX"]
    assert all(o.outputs[0].token_ids == ref.outputs[0].token_ids for o in mixed)


BAD_PROMPTS = [
    (dict(prompts={"text": "hi"}), TypeError, r"keys \['text'\]"),
    (dict(prompts={"prompt": "hi", "extra": 1}), TypeError, r"keys \['extra', 'prompt'\]"),
    (dict(prompts={"prompt": b"hi"}), TypeError, r"\['prompt'\] must be a str, got bytes"),
    (dict(prompts=5), TypeError, "got int"),
    (dict(prompts=[[104, 105]]), TypeError, r"prompts\[0\].*got list"),
    (dict(prompts={"prompt_token_ids": [1, 2.5]}), TypeError, r"\[1\] must be an int.*float"),
    (dict(prompts={"prompt_token_ids": "hi"}), TypeError, "got str"),
    (dict(prompt_token_ids=[1.0, 2.0]), TypeError, "float"),
    (dict(prompt_token_ids=[True, 3]), TypeError, "bool"),
    (dict(prompt_token_ids=[[1, 2], [3, [4]]]), TypeError, r"prompt_token_ids\[1\]\[1\]"),
    (dict(prompt_token_ids=np.array([1.0, 2.0])), TypeError, "float64"),
    (dict(prompt_token_ids=np.zeros((1, 1, 2), int)), TypeError, "3-D"),
    (dict(prompt_token_ids=[[1, 2], []]), ValueError, "prompt 1 is empty"),
    (dict(prompt_token_ids=[]), ValueError, "no prompts"),
    (dict(prompts=[]), ValueError, "no prompts"),
    (dict(prompt_token_ids=[5, 272]), ValueError, r"\[272\] outside the vocab \[0, 272\)"),
    (dict(prompt_token_ids=[-1]), ValueError, "outside the vocab"),
    (dict(prompts="hi", prompt_token_ids=[1]), ValueError, "not both"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_PROMPTS)
def test_bad_prompts_raise_naming_the_type_and_the_next_request_works(llm, kwargs, error, message):
    with pytest.raises(error, match=message):
        llm.generate(sampling_params=greedy(2), **kwargs)
    (out,) = llm.generate("ok", greedy(2))
    assert len(out.outputs[0].token_ids) == 2


def test_dtype_auto_is_the_checkpoints_torch_dtype(tmp_path):
    from jaxmamba.llm import resolve_dtype

    assert resolve_dtype("auto", "nemotron-h-tiny") == "float32"  # random weights
    assert resolve_dtype("bf16", "nemotron-h-tiny") == "bf16"
    path, _ = make_nemotron_h_checkpoint(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "float32"
    assert resolve_dtype("auto", str(path)) == "float32"
    for named, expected in (("bfloat16", "bfloat16"), ("float16", "bfloat16"), (None, "float32")):
        config.pop("dtype", None)
        config["torch_dtype"] = named
        (path / "config.json").write_text(json.dumps(config))
        assert resolve_dtype("auto", str(path)) == expected, named
    config["torch_dtype"] = "int8"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="torch_dtype='int8'"):
        resolve_dtype("auto", str(path))
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("float64", "nemotron-h-tiny")


def test_default_track_interval_fits_a_chunk_size_that_is_no_power_of_two(tmp_path):
    from jaxmamba.engine.config import EngineConfig

    assert EngineConfig().for_chunk_size(48).track_interval == 288  # lcm(48, 16) * 6
    assert EngineConfig(page_size=32).for_chunk_size(24).track_interval == 288
    assert EngineConfig().for_chunk_size(64).track_interval == 256
    with pytest.raises(
        ValueError, match=r"track_interval=100 .*lcm\(chunk_size=48, page_size=16\)"
    ):
        EngineConfig(track_interval=100).for_chunk_size(48)
    for field, value in (("page_size", 0), ("track_interval", -16), ("max_num_seqs", 2.0)):
        with pytest.raises(ValueError, match=f"EngineConfig.{field} must be a positive int"):
            EngineConfig(**{field: value})
    path, _ = make_nemotron_h_checkpoint(tmp_path / "m", chunk_size=12, with_tokenizer=True)
    llm = LLM(str(path), max_num_seqs=2, max_model_len=64)
    assert llm.engine_cfg.track_interval == 288  # lcm(12, 16) = 48
    (out,) = llm.generate("the quick brown fox", greedy(5))
    assert len(out.outputs[0].token_ids) == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--batch-size", "0"], "--batch-size: must be a positive int, got 0"),
        (["bench", "--output-len", "0"], "--output-len: must be a positive int, got 0"),
        (["bench", "--input-len", "x"], "--input-len: must be a positive int, got 'x'"),
        (["bench", "--max-model-len", "64"], "unrecognized arguments: --max-model-len"),
        (["generate", "--max-num-seqs", "0"], "--max-num-seqs: must be a positive int"),
        (["serve", "--mamba-ssm-cache-dtype", "float16"], "--mamba-ssm-cache-dtype: invalid"),
    ],
)
def test_cli_rejects_bad_sizes_and_bench_offers_no_engine_limits(capsys, argv, message):
    from jaxmamba.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_one_batch_rejects_empty_sizes():
    from jaxmamba.bench import bench_one_batch
    from jaxmamba.model.families import config_from_preset

    cfg = config_from_preset("nemotron-h-tiny")
    for field in ("batch", "input_len", "output_len"):
        sizes = {"batch": 1, "input_len": 4, "output_len": 2, field: 0}
        with pytest.raises(ValueError, match=f"{field} must be a positive int, got 0"):
            bench_one_batch(cfg, None, **sizes)
