"""The server as real clients drive it, on a random HF checkpoint: lm-evaluation-harness's
loglikelihood request (`local-completions`: echo + logprobs) scored as HF transformers scores
it, echo with max_tokens 0, vLLM's `prompt_logprobs` on both routes against HF's logits,
streamed chat's `prompt_token_ids`, vLLM's request rules (stream_options, response_format,
int64 seeds), lone surrogates as a 400, aborts in `request_finished_total`, and a shutdown
whose grace runs out ending open streams with an error event."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from jaxmamba import LLM
from jaxmamba.serve.api_server import ServerConfig

from hf_fixtures import make_nemotron_h_checkpoint
from server_helpers import ServerThread, sse_events

NAME = "random-nemotron-h"
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "the quick brown fox jumps over the lazy dog"
TOL = 2e-4  # float32 engine against float64 log-softmax of HF's float32 logits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, model = make_nemotron_h_checkpoint(
        tmp_path_factory.mktemp("clients"), pattern="M*M-", with_tokenizer=True, seed=11
    )
    return path, model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint[0]), **ENGINE)


@pytest.fixture(scope="module")
def server(llm):
    s = ServerThread(llm, ServerConfig(served_model_names=(NAME,), chat_template=TEMPLATE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def hf_next_token_logprobs(model, ids: list[int]) -> np.ndarray:
    """[T, V] float64: row j is log p(next token | ids[: j + 1])."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def random_ids(rng, n: int) -> list[int]:
    return [1, *rng.integers(4, 97, n - 1).tolist()]


def post(http, route: str, body: dict) -> dict:
    r = http.post(f"/v1/{route}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, route: str, body: dict) -> list:
    with http.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def assert_same_logprobs(got: dict, want: dict) -> None:
    """Two legacy-completions logprobs objects, equal up to float noise (None where None)."""
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    for a, b in zip(got["token_logprobs"], want["token_logprobs"], strict=True):
        assert (a is None and b is None) or a == pytest.approx(b, abs=1e-5)


def check_prompt_logprobs(entries, ids, ref, k: int) -> None:
    """vLLM's `prompt_logprobs` JSON against HF: None first, then per prompt token {id:
    {logprob, rank, decoded_token}} with the prompt token first and the top k beside it."""
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row, token, entry = ref[p - 1], ids[p], entries[p]
        assert int(next(iter(entry))) == token
        assert entry[str(token)]["logprob"] == pytest.approx(row[token], abs=TOL)
        assert entry[str(token)]["rank"] == int(np.sum(row >= row[token]))
        assert {int(t) for t in entry} - {token} == set(np.argsort(-row)[:k].tolist()) - {token}
        for t, lp in entry.items():
            assert lp["logprob"] == pytest.approx(row[int(t)], abs=TOL)


# -- lm-evaluation-harness ----------------------------------------------------------------------
def lm_eval_loglikelihood(http, requests: list[tuple[list[int], list[int]]]):
    """What lm-eval's `local-completions` does for a batch of loglikelihood requests
    (lm_eval/models/openai_completions.py, 0.4.x): this payload, then `parse_logprobs`."""
    payload = {"model": NAME, "prompt": [ctx + cont for ctx, cont in requests],
               "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}  # fmt: skip
    out = post(http, "completions", payload)
    results = []
    for choice, (ctx, _) in zip(sorted(out["choices"], key=lambda c: c["index"]), requests,
                                strict=True):  # fmt: skip
        token_logprobs = choice["logprobs"]["token_logprobs"][len(ctx) : -1]
        top_logprobs = choice["logprobs"]["top_logprobs"][len(ctx) : -1]
        is_greedy = all(
            tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True)
        )
        results.append((sum(token_logprobs), is_greedy))
    return out, results


def test_lm_eval_loglikelihood_request_scores_as_hf_does(http, checkpoint):
    _, model = checkpoint
    rng = np.random.default_rng(0)
    requests = [(random_ids(rng, n), rng.integers(4, 97, m).tolist())
                for n, m in ((3, 1), (20, 4), (37, 9))]  # fmt: skip
    # The continuation of the first is the model's greedy pick: is_greedy must say so.
    ctx = requests[0][0]
    requests[0] = (ctx, [int(np.argmax(hf_next_token_logprobs(model, ctx)[-1]))])
    out, results = lm_eval_loglikelihood(http, requests)
    for choice, (ctx, cont), (logprob, is_greedy) in zip(out["choices"], requests, results,
                                                         strict=True):  # fmt: skip
        ids = ctx + cont
        ref = hf_next_token_logprobs(model, ids)
        want = [ref[j - 1, ids[j]] for j in range(len(ctx), len(ids))]
        assert logprob == pytest.approx(sum(want), abs=TOL * len(want))
        assert is_greedy == all(np.argmax(ref[j - 1]) == ids[j] for j in range(len(ctx), len(ids)))
        lp = choice["logprobs"]
        # the prompt's tokens, then the one generated token (which lm-eval drops)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0
        assert lp["text_offset"] == sorted(lp["text_offset"])
        check_prompt_logprobs(choice["prompt_logprobs"], ids, ref, 1)
    assert results[0][1] is True


def test_echo_with_max_tokens_0_returns_the_prompt_alone(http, checkpoint):
    path, model = checkpoint
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(TEXT).ids
    ref = hf_next_token_logprobs(model, ids)
    body = {"model": NAME, "prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    out = post(http, "completions", body)
    (choice,) = out["choices"]
    assert choice["text"] == TEXT
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == []
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([ref[j - 1, ids[j]] for j in
                                                      range(1, len(ids))], abs=TOL)  # fmt: skip
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])

    # Streamed: the same prompt text and logprobs, then only the finish.
    events = stream(http, "completions", body)
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == TEXT
    got = [c["logprobs"] for c in choices if c["logprobs"]]
    assert len(got) == 1
    assert_same_logprobs(got[0], lp)
    assert choices[-1]["finish_reason"] == "length"
    assert [t for c in choices for t in c.get("token_ids", [])] == []


def test_streamed_echo_with_logprobs_equals_the_whole_response(http):
    body = {"model": NAME, "prompt": [TEXT, "hello world"], "echo": True, "max_tokens": 5,
            "logprobs": 1, "temperature": 0, "ignore_eos": True, "n": 2}  # fmt: skip
    whole = post(http, "completions", body)
    events = stream(http, "completions", body)
    by_index: dict[int, dict] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            acc = by_index.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [],
                                                   "text_offset": []})  # fmt: skip
            acc["text"] += c["text"]
            for key in ("tokens", "token_logprobs", "text_offset"):
                acc[key] += (c["logprobs"] or {}).get(key, [])
    assert len(whole["choices"]) == len(by_index) == 4
    for choice in whole["choices"]:
        acc = by_index[choice["index"]]
        assert acc["text"] == choice["text"]
        assert acc["text"].startswith([TEXT, "hello world"][choice["index"] // 2])
        assert_same_logprobs(acc, choice["logprobs"])


# -- vLLM's prompt_logprobs ---------------------------------------------------------------------
def test_prompt_logprobs_on_completions_and_chat_match_hf_and_are_null_unasked(
    server, http, checkpoint
):
    _, model = checkpoint
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 30)
    body = {"model": NAME, "prompt": ids, "max_tokens": 2, "n": 2}
    plain = post(http, "completions", body)
    assert all(c["prompt_logprobs"] is None for c in plain["choices"])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    via_client = client.completions.create(**body, extra_body={"prompt_logprobs": 1})
    assert len(via_client.choices[0].model_extra["prompt_logprobs"]) == len(ids)
    echoed = client.completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    asked = post(http, "completions", {**body, "prompt_logprobs": 4})
    ref = hf_next_token_logprobs(model, ids)
    for choice in asked["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], ids, ref, 4)
        assert choice["logprobs"] is None

    messages = [{"role": "user", "content": "hello world"}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 2, "return_token_ids": True}
    assert post(http, "chat/completions", chat)["prompt_logprobs"] is None
    out = post(http, "chat/completions", {**chat, "prompt_logprobs": 0})
    prompt = out["prompt_token_ids"]
    check_prompt_logprobs(out["prompt_logprobs"], prompt, hf_next_token_logprobs(model, prompt), 0)

    for route, streamed in (("completions", body), ("chat/completions", chat)):
        r = http.post(f"/v1/{route}", json={**streamed, "prompt_logprobs": 2, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


# -- streamed chat's prompt_token_ids -----------------------------------------------------------
def test_streamed_chat_sends_prompt_token_ids_in_its_opening_chunks(http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 4, "n": 2,
            "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
    prompt = post(http, "chat/completions", {**body, "stream_options": None})["prompt_token_ids"]
    events = stream(http, "chat/completions", body)
    opening = [e for e in events[:-1] if "prompt_token_ids" in e]
    assert [e["choices"][0]["index"] for e in opening] == [0, 1]
    assert all(e["prompt_token_ids"] == prompt for e in opening)
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in opening)
    assert events[: len(opening)] == opening  # they come first
    assert events[-2]["usage"]["prompt_tokens"] == len(prompt)


# -- vLLM's request rules -----------------------------------------------------------------------
INT64_MAX = 2**63 - 1
COMPLETION = {"model": NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
REFUSED = [
    # (case, route, body, param, words in the message)
    ("stream_options without stream", "completions",
     {**COMPLETION, "stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    ("chat stream_options without stream", "chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ("json_schema without a schema", "chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ("seed past int64", "completions", {**COMPLETION, "seed": INT64_MAX + 1}, "seed",
     "less than or equal to 9223372036854775807"),
    ("seed below int64", "chat/completions", {**CHAT, "seed": -INT64_MAX - 2}, "seed",
     "greater than or equal to -9223372036854775808"),
    ("lone surrogate", "completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt",
     "lone surrogate '\\ud800' at character 1"),
    ("lone surrogate in a list", "completions", {**COMPLETION, "prompt": ["ok", "\udc00"]},
     "prompt", "lone surrogate"),
    ("lone surrogate in chat", "chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "x\udfffy"}]}, "messages",
     "lone surrogate"),
]  # fmt: skip


@pytest.mark.parametrize("case,route,body,param,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_vllm_request_rules_are_400s(http, case, route, body, param, words):
    # json.dumps writes a lone surrogate as its \ud800 escape, as a client's JSON would.
    r = http.post(f"/v1/{route}", content=json.dumps(body),
                  headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_text_response_format_and_int64_edge_seeds_are_accepted(http):
    base = {**COMPLETION, "temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    want = post(http, "completions", base)["choices"][0]["text"]
    got = post(http, "completions", {**base, "response_format": {"type": "text"}})
    assert got["choices"][0]["text"] == want
    chat = post(http, "chat/completions", {**CHAT, "response_format": {"type": "text"}})
    assert chat["choices"][0]["message"]["content"] is not None
    for seed in (INT64_MAX, -INT64_MAX - 1):
        sampled = {**COMPLETION, "temperature": 1.0, "seed": seed}
        first = post(http, "completions", sampled)["choices"]
        assert post(http, "completions", sampled)["choices"] == first


def test_a_lone_surrogate_in_an_error_message_is_not_a_500(http):
    r = http.post("/v1/completions", content=json.dumps({**COMPLETION, "model": "m\ud800"}),
                  headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 404 and "\ud800" in r.json()["error"]["message"]


# -- metrics and shutdown -----------------------------------------------------------------------
def finished(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        s.labels["finish_reason"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "jaxmamba_request_finished_total"
    }


def test_aborted_sequences_count_in_request_finished_total(server, http):
    before = finished(server.url).get("abort", 0)
    body = {"model": NAME, "prompt": "abort me", "max_tokens": 50, "n": 3, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream
    for _ in range(200):  # bounded wait for the server to see the disconnect
        if finished(server.url).get("abort", 0) == before + 3:
            break
        time.sleep(0.05)
    assert finished(server.url).get("abort", 0) == before + 3


def test_a_shutdown_whose_grace_runs_out_ends_open_streams_with_an_error_event(llm, checkpoint):
    shared = LLM(str(checkpoint[0]), params=llm.runner.params, **ENGINE)
    s = ServerThread(shared, ServerConfig(served_model_names=(NAME,)), grace_s=0.5)
    gate, events, lines = threading.Event(), [], []
    body = {"model": NAME, "prompt": "never finished", "max_tokens": 50, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip

    def hold_engine():
        s.server.loop.call_blocking(lambda _engine: gate.wait(60))

    try:
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and not events:
                    events.append(line)
                    # Hold the engine between steps, so the stream cannot finish in the grace.
                    threading.Thread(target=hold_engine, daemon=True).start()
                    s.stop(wait=False)
        got = sse_events(lines)
        assert got[-1] == "[DONE]"
        err = got[-2]["error"]
        assert err["code"] == "shutting_down" and "grace period 0.5 s" in err["message"], got[-2]
        assert sum(len(c.get("token_ids", [])) for e in got[:-2] for c in e["choices"]) < 50
        abort = 'jaxmamba_request_finished_total{finish_reason="abort"}'
        values = [line.split()[-1] for line in s.server.metrics.render().decode().splitlines()
                  if line.startswith(abort)]  # fmt: skip
        assert values == ["1.0"]
    finally:
        gate.set()
        s.stop()
    assert not s.thread.is_alive() and not s.server.loop.alive
