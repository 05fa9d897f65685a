"""The server's sampling and rendering options, each checked for its effect against HF
transformers on the same random checkpoint (a Nemotron-H with a BPE tokenizer and a chat
template): `logit_bias`, `stop_token_ids`, `min_tokens`, `include_stop_str_in_output`,
`skip_special_tokens`, `echo` and `chat_template_kwargs`. The reference decoder is
`hf_oracle.hf_greedy`; text is the HF tokenizer's decode of the reference tokens."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from jaxmamba import LLM
from jaxmamba.serve.api_server import ServerConfig

from hf_fixtures import edit_tokenizer, make_nemotron_h_checkpoint
from hf_oracle import hf_greedy, hf_prompt_logprobs
from server_helpers import ServerThread

NAME = "m"
EOS, BOS = 2, 1
# `hint` is a template variable only chat_template_kwargs sets.
TEMPLATE = (
    "{% if hint %}{{ hint }}. {% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXT = "the quick brown fox jumps over the lazy dog"
# Float32 engine against float32 HF differ by ~1e-5 in a logit: a greedy pick is compared only
# where the reference's top-2 margin is well above that.
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, model = make_nemotron_h_checkpoint(
        tmp_path_factory.mktemp("hf"), pattern="M-M*-", with_tokenizer=True, seed=3
    )
    edit_tokenizer(path, bos_post_processor=False, chat_template=TEMPLATE)
    return path, model


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint[0])


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint[1]


@pytest.fixture(scope="module")
def http(checkpoint):
    llm = LLM(str(checkpoint[0]), max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16)
    server = ServerThread(llm, ServerConfig(served_model_names=(NAME,)))
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.stop()


def complete(http, prompt, **body) -> dict:
    body = {"model": NAME, "prompt": prompt, "temperature": 0.0, "return_token_ids": True,
            **body}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def random_prompt(seed: int, n: int = 12) -> list[int]:
    # ids from 4 on: no special tokens in the prompt
    return np.random.default_rng(seed).integers(4, 97, n).tolist()


def test_logit_bias_forces_and_bans_tokens_as_the_hf_logits_say(http, model):
    prompt = random_prompt(0)
    plain, _, _ = hf_greedy(model, prompt, 1)
    logits = model(torch.tensor([prompt])).logits[0, -1].detach().double().numpy()
    order = np.argsort(-logits)
    first, second, last = int(order[0]), int(order[1]), int(order[-1])
    assert plain == [first]
    gap = float(logits[first] - logits[second])
    cases = [
        {last: 100.0},  # forces the least likely token at every step
        {first: -100.0},  # bans the top token: the runner-up goes first
        {second: gap + 0.5},  # just enough to overtake the top token
        {second: gap - 0.5, first: -0.25},  # not enough: the top token stays
    ]
    for bias in cases:
        want, _, margin = hf_greedy(model, prompt, 5, logit_bias=bias)
        assert margin > MIN_MARGIN, margin
        got = complete(http, prompt, max_tokens=5, ignore_eos=True,
                       logit_bias={str(t): v for t, v in bias.items()})  # fmt: skip
        assert got["token_ids"] == want, bias
    assert want[0] == first
    forced = complete(http, prompt, max_tokens=5, ignore_eos=True, logit_bias={str(last): 100})
    assert forced["token_ids"] == [last] * 5


def _first_new(tokens: list[int], start: int = 1) -> int:
    """The first index from `start` whose token did not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_ids_end_at_the_first_stop_id_like_hf(http, model):
    prompt = random_prompt(1)
    ref, _, _ = hf_greedy(model, prompt, 10)
    k = _first_new(ref, 2)
    want, reason, margin = hf_greedy(model, prompt, 10, stop_token_ids=(ref[k],))
    assert reason == "stop" and want == ref[: k + 1] and margin > MIN_MARGIN
    got = complete(http, prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[ref[k]])
    assert got["token_ids"] == want
    assert got["finish_reason"] == "stop" and got["stop_reason"] == ref[k]


def test_min_tokens_masks_stop_ids_and_eos_until_reached_like_hf(http, model):
    prompt = random_prompt(2)
    ref, _, _ = hf_greedy(model, prompt, 8)
    # The first greedy token is a stop id: without min_tokens the request ends at once.
    stop = (ref[0],)
    got = complete(http, prompt, max_tokens=8, ignore_eos=True, stop_token_ids=list(stop))
    assert got["token_ids"] == ref[:1] and got["finish_reason"] == "stop"
    for min_tokens in (3, 8):
        want, reason, margin = hf_greedy(
            model, prompt, 8, stop_token_ids=stop, min_tokens=min_tokens
        )
        assert margin > MIN_MARGIN and len(want) >= min_tokens
        got = complete(http, prompt, max_tokens=8, ignore_eos=True, stop_token_ids=list(stop),
                       min_tokens=min_tokens)  # fmt: skip
        assert got["token_ids"] == want and got["finish_reason"] == reason
    # eos made the likeliest token by a bias: ends the request at once, or right at min_tokens.
    bias = {EOS: 50.0}
    for min_tokens in (0, 4):
        want, reason, _ = hf_greedy(model, prompt, 8, logit_bias=bias, eos_token_id=EOS,
                                    min_tokens=min_tokens)  # fmt: skip
        assert want[-1] == EOS and len(want) == min_tokens + 1 and reason == "stop"
        got = complete(http, prompt, max_tokens=8, min_tokens=min_tokens,
                       logit_bias={str(EOS): 50.0})  # fmt: skip
        assert got["token_ids"] == want and got["finish_reason"] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string_like_hf(http, model, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(TEXT, add_special_tokens=False)
    ref, _, margin = hf_greedy(model, prompt_ids, 12)
    assert margin > MIN_MARGIN
    text = hf_tokenizer.decode(ref)
    # A stop string from the middle of the reference text, first seen there.
    at = next(
        i for i in range(len(text) // 3, len(text) - 1) if text[i : i + 2] not in text[: i + 1]
    )
    stop = text[at : at + 2]
    for include, want in ((False, text[:at]), (True, text[: at + 2])):
        got = complete(http, TEXT, max_tokens=12, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=include)  # fmt: skip
        assert got["prompt_token_ids"] == prompt_ids
        assert got["text"] == want, (include, stop, text)
        assert got["finish_reason"] == "stop" and got["stop_reason"] == stop


def test_skip_special_tokens_decides_whether_special_tokens_show_like_hf(http, model, hf_tokenizer):
    prompt = random_prompt(3)
    # A bias on <s> that makes some picks <s> and some not (the smallest such, found with HF).
    for value in np.arange(0.5, 12.0, 0.5):
        bias = {BOS: float(value)}
        want, _, margin = hf_greedy(model, prompt, 8, logit_bias=bias)
        if 0 < want.count(BOS) < len(want) and margin > MIN_MARGIN:
            break
    else:
        raise AssertionError("no bias on <s> gives a mixed completion")
    for skip in (True, False):
        got = complete(http, prompt, max_tokens=8, ignore_eos=True, skip_special_tokens=skip,
                       logit_bias={str(BOS): bias[BOS]})  # fmt: skip
        assert got["token_ids"] == want
        assert got["text"] == hf_tokenizer.decode(want, skip_special_tokens=skip)
    assert "<s>" in got["text"]


def test_echo_returns_the_prompt_and_its_hf_logprobs(http, model, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(TEXT, add_special_tokens=False)
    ref, _, _ = hf_greedy(model, prompt_ids, 4)
    got = complete(http, TEXT, max_tokens=4, ignore_eos=True, echo=True)
    assert got["token_ids"] == ref
    assert got["text"] == TEXT + hf_tokenizer.decode(ref)
    # Token ids in, echo decodes them; max_tokens 0: the prompt alone, every token scored.
    got = complete(http, prompt_ids, max_tokens=0, echo=True, logprobs=1)
    assert got["text"] == hf_tokenizer.decode(prompt_ids)
    lp = got["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(prompt_ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], hf_prompt_logprobs(model, prompt_ids),
                               atol=1e-4, rtol=0)  # fmt: skip


def test_chat_template_kwargs_reach_the_template_like_transformers(http, model, hf_tokenizer):
    messages = [{"role": "user", "content": "hello world"}]
    prompts = []
    for kwargs in (None, {"hint": "be brief"}):
        want_ids = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False,
            **(kwargs or {}),
        )  # fmt: skip
        want, _, _ = hf_greedy(model, list(want_ids), 4)
        body = {"model": NAME, "messages": messages, "max_tokens": 4, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["prompt_token_ids"] == list(want_ids), kwargs
        assert out["choices"][0]["token_ids"] == want
        prompts.append(hf_tokenizer.decode(out["prompt_token_ids"]))
    assert not prompts[0].startswith("be brief.") and prompts[1].startswith("be brief.")
