"""The CLI's success paths: `jaxmamba bench` prints a row per phase and shape whose numbers
agree with each other, and `jaxmamba serve` as its own process honours --api-key (401 without
it), --chat-template FILE (the prompt is the file's template rendered by Jinja), and
--tensor-parallel-size 2 on two forced host devices (greedy tokens equal HF transformers on
the same weights)."""

from __future__ import annotations

import re

import httpx
import jax.numpy as jnp
import jinja2
import pytest

from jaxmamba.cli import main
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

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
