"""The CLI's success paths: `jaxmamba bench` (= `bench one-batch`) prints a row per phase and
shape whose numbers agree with each other; `jaxmamba bench throughput` runs vLLM's random
dataset from its flags and prints and writes vLLM's figures, consistent with the requests; and
`jaxmamba serve` as its own process honours --api-key (401 without it), --chat-template FILE
(the prompt is the file's template rendered by Jinja), and --tensor-parallel-size 2 on two
forced host devices (greedy tokens equal HF transformers on the same weights)."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import jax
import jax.numpy as jnp
import jinja2
import pytest

import jaxmamba.bench
import jaxmamba.bench_throughput
from jaxmamba.bench_throughput import sample_requests, token_pool
from jaxmamba.cli import build_parser, main
from jaxmamba.engine.config import EngineConfig, RunConfig
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params
from jaxmamba.tokenizer import ByteTokenizer

from hf_oracle import hf_greedy, hf_model_of
from server_helpers import serve_process

TINY = "nemotron-h-tiny"
ENGINE = ["--max-num-seqs", "2", "--max-model-len", "64", "--max-num-batched-tokens", "16",
          "--dtype", "float32", "--seed", "0", "--log-level", "warning"]  # fmt: skip
KEY = "sk-cli"
TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] | upper }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<ASSISTANT>>{% endif %}"
)
PROMPT = [256, *b"state space"]  # the tiny preset's ids: bos, then UTF-8 bytes


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """HF transformers on the weights `serve --model nemotron-h-tiny --seed 0` draws."""
    cfg = config_from_preset(TINY)
    return hf_model_of(init_params(cfg, jnp.float32, 0), cfg, tmp_path_factory.mktemp("tiny"))


def test_bench_prints_a_consistent_row_per_phase_and_shape(capsys):
    argv = ["bench", "--model", TINY, "--dtype", "float32", "--batch-size", "2",
            "--input-len", "16", "--output-len", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \| ([\d.]+) ms \| ([\d,]+) \|", out, re.M)
    seen = {(phase, int(b), int(n)) for phase, b, n, _, _ in rows}
    assert seen == {(p, b, 16) for p in ("prefill", "decode") for b in (2,)}, out
    for phase, batch, input_len, ms, per_s in rows:
        # tokens/s is the step's tokens over its time: batch x input_len for a prefill step,
        # batch for a decode step (ms is rounded to 0.01, so compare loosely).
        tokens = int(batch) * (int(input_len) if phase == "prefill" else 1)
        assert float(ms) > 0
        assert float(per_s.replace(",", "")) == pytest.approx(tokens / (float(ms) / 1e3), rel=0.1)


def test_bench_without_a_subcommand_is_bench_one_batch(monkeypatch):
    seen = []
    monkeypatch.setattr(
        jaxmamba.bench, "bench_one_batch", lambda cfg, params, **kw: seen.append(kw) or []
    )
    flags = ["--model", TINY, "--batch-size", "3", "--input-len", "5", "--output-len", "2"]
    assert main(["bench", *flags]) == main(["bench", "one-batch", *flags]) == 0
    assert len(seen) == 2 and seen[0] == seen[1]
    assert (seen[0]["batch"], seen[0]["input_len"], seen[0]["output_len"]) == (3, 5, 2)


def test_bench_one_batch_quantizes_the_weights_and_the_kv_cache_it_is_asked_to(monkeypatch):
    seen = []
    monkeypatch.setattr(jaxmamba.bench, "bench_one_batch",
                        lambda cfg, params, **kw: seen.append((params, kw)) or [])  # fmt: skip
    flags = ["--model", TINY, "--batch-size", "1", "--input-len", "4", "--output-len", "2"]
    assert main(["bench", "one-batch", *flags]) == 0
    assert main(["bench", "one-batch", *flags, "--quantization", "fp8",
                 "--kv-cache-dtype", "fp8"]) == 0  # fmt: skip
    (plain, plain_kw), (fp8, fp8_kw) = seen
    dtypes = [{str(x.dtype) for x in jax.tree.leaves(p)} for p in (plain, fp8)]
    assert "float8_e4m3fn" in dtypes[1] and "float8_e4m3fn" not in dtypes[0]
    assert (plain_kw["kv_dtype"], fp8_kw["kv_dtype"]) == ("auto", "fp8")


def test_bench_throughput_prints_and_writes_vllms_figures_of_its_requests(
    monkeypatch, tmp_path, capsys
):
    calls = []
    timed_generate = jaxmamba.bench_throughput.timed_generate

    def spy(llm, requests, **kwargs):
        calls.append((requests, kwargs))
        return timed_generate(llm, requests, **kwargs)

    monkeypatch.setattr(jaxmamba.bench_throughput, "timed_generate", spy)
    path = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", TINY, "--dtype", "float32", "--max-num-seqs", "2",
            "--max-model-len", "64", "--max-num-batched-tokens", "16", "--dataset-name", "random",
            "--num-prompts", "3", "--input-len", "9", "--output-len", "4",
            "--random-range-ratio", "0.5", "--random-prefix-len", "3", "--seed", "5", "--n", "2",
            "--disable-detokenize", "--output-json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out

    pool = token_pool(272, ByteTokenizer())  # the tiny preset's
    want = sample_requests("random", num_prompts=3, input_len=9, output_len=4, range_ratio=0.5,
                           prefix_len=3, token_ids=pool, seed=5)  # fmt: skip
    (warmup, warm_kw), (requests, kw) = calls  # the warm-up pass first: same lengths
    assert requests == want and kw == warm_kw == {"n": 2, "detokenize": False}
    assert [len(r.prompt_token_ids) for r in warmup] == [len(r.prompt_token_ids) for r in want]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in want)
    output_tokens = 2 * sum(r.output_len for r in want)  # ignore_eos: every token asked for

    record = json.loads(path.read_text())
    assert set(record) == {"elapsed_time", "num_requests", "total_num_tokens",
                           "requests_per_second", "tokens_per_second"}  # fmt: skip
    elapsed = record["elapsed_time"]
    assert record["num_requests"] == 3
    assert record["total_num_tokens"] == prompt_tokens + output_tokens
    assert record["requests_per_second"] == pytest.approx(3 / elapsed)
    assert record["tokens_per_second"] == pytest.approx((prompt_tokens + output_tokens) / elapsed)
    line = re.search(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, "
                     r"([\d.]+) output tokens/s$", out, re.M)  # fmt: skip
    assert line, out
    printed = [float(x) for x in line.groups()]
    assert printed == pytest.approx(
        [3 / elapsed, (prompt_tokens + output_tokens) / elapsed, output_tokens / elapsed],
        abs=0.01,
    )
    assert f"Total num prompt tokens:  {prompt_tokens}\n" in out
    assert f"Total num output tokens:  {output_tokens}\n" in out
    assert "Compilations in the timed pass: 0\n" in out  # the warm-up met every bucket


def test_bench_throughput_takes_every_engine_setting_with_its_default():
    args = build_parser().parse_args(["bench", "throughput", "--input-len", "8"])
    for cls in (EngineConfig, RunConfig):
        for f in dataclasses.fields(cls):
            assert getattr(args, f.name) == f.default, f.name


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset-name", "sharegpt"], "invalid choice: 'sharegpt' (choose from 'random')"),
        (["--dataset", "data.json"], "unrecognized arguments: --dataset data.json"),
        (["--backend", "vllm"], "unrecognized arguments: --backend vllm"),
        (["--random-range-ratio", "1"], "must be a number in [0, 1), got '1'"),
        (["--random-prefix-len", "-1"], "must be an int >= 0, got '-1'"),
    ],
)
def test_bench_throughput_refuses_what_it_does_not_support(flags, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "throughput", "--model", TINY, "--input-len", "8", *flags])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_api_key_and_chat_template_file(tmp_path, hf_tiny):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--model", TINY, *ENGINE, "--api-key", KEY, "--chat-template", str(template)]
    with serve_process(args) as (_, url):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        want, _, _ = hf_greedy(hf_tiny, PROMPT, 4)
        assert r.json()["choices"][0]["token_ids"] == want

        messages = [{"role": "user", "content": "hi"}]
        rendered = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
        assert rendered == "<<USER>> hi\n<<ASSISTANT>>"
        r = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=120, json={
            "messages": messages, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True})  # fmt: skip
        assert r.status_code == 200, r.text
        # The template writes any special tokens itself: the prompt is the rendered bytes.
        assert r.json()["prompt_token_ids"] == list(rendered.encode())


def test_serve_tensor_parallel_2_on_two_host_devices_generates_like_hf(hf_tiny):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    args = ["--model", TINY, *ENGINE, "--tensor-parallel-size", "2"]
    with serve_process(args, env=env) as (_, url):
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        want, _, margin = hf_greedy(hf_tiny, PROMPT, 6)
        assert margin > 1e-3, margin
        assert r.json()["choices"][0]["token_ids"] == want
