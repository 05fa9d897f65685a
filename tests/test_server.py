"""The OpenAI-compatible server, on a real socket: parity with LLM.generate / LLM.chat through
the `openai` client and raw HTTP, every bad input → its 4xx and OpenAI error body, 64
concurrent streams and 16 mid-stream disconnects leaving the slot and page pools as they were,
/metrics in Prometheus text format, and the published OpenAPI schema fuzzed with no 5xx.
(SIGTERM, back-pressure and the CLI are in test_server_process.py.)"""

from __future__ import annotations

import asyncio
import json
import string
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxmamba import LLM, SamplingParams
from jaxmamba.serve.api_server import ServerConfig

from hf_oracle import hf_greedy, hf_model_of
from server_helpers import ServerThread, sse_events

TINY = "nemotron-h-tiny"
ENGINE = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16)
API_KEY = "sk-test-key"
NAME = "tiny"
BODY_LIMIT = 32 << 10
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = ["def main(", "import numpy as np\nx = ", "naïve café ✓ "]


@pytest.fixture(scope="module")
def oracle():
    return LLM(TINY, **ENGINE)


@pytest.fixture(scope="module")
def hf(oracle, tmp_path_factory):
    """HF transformers on the served weights."""
    return hf_model_of(oracle.runner.params, oracle.model_cfg, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def server(oracle):
    # Same weights and shapes as the oracle: the two share compiled steps.
    llm = LLM(TINY, params=oracle.runner.params, **ENGINE)
    config = ServerConfig(served_model_names=(NAME,), api_key=API_KEY, max_queued_requests=128,
                          max_body_bytes=BODY_LIMIT, chat_template=TEMPLATE)  # fmt: skip
    s = ServerThread(llm, config)
    yield s
    s.stop()
    assert not s.server.loop.alive, "the engine thread outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:  # fmt: skip
        yield c


def engine_gauges(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("jaxmamba_engine_")
    }


def pools(http) -> tuple[float, float]:
    """Free slots and pages once every request is gone and the prefix cache is emptied."""
    for _ in range(600):  # bounded wait for aborted/finished requests to leave the engine
        g = engine_gauges(http)
        if (
            g["jaxmamba_engine_num_requests_running"]
            == g["jaxmamba_engine_num_requests_waiting"]
            == 0
        ):
            break
        time.sleep(0.05)
    assert http.post("/reset_prefix_cache").status_code == 200
    g = engine_gauges(http)
    return g["jaxmamba_engine_free_slots"], g["jaxmamba_engine_free_pages"]


# -- parity -------------------------------------------------------------------------------------
SAMPLING = [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.8, seed=11),
    dict(temperature=1.2, top_k=20, min_p=0.02, presence_penalty=0.5, frequency_penalty=0.3,
         seed=5),
]  # fmt: skip


def _params(kw, max_tokens, **extra):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw, **extra)


def _extra(kw):
    """The fields the openai client has no argument for go in extra_body."""
    return {k: kw[k] for k in ("top_k", "min_p") if k in kw}


def _std(kw):
    return {k: v for k, v in kw.items() if k not in ("top_k", "min_p")}


@pytest.mark.parametrize("kw", SAMPLING)
def test_completions_match_llm_generate(client, oracle, kw):
    expected = oracle.generate(PROMPTS, _params(kw, 12, n=2), use_tqdm=False)
    resp = client.completions.create(
        model=NAME, prompt=PROMPTS, max_tokens=12, n=2, **_std(kw),
        extra_body={"ignore_eos": True, "return_token_ids": True, **_extra(kw)},
    )  # fmt: skip
    assert len(resp.choices) == len(PROMPTS) * 2
    for choice in resp.choices:
        want = expected[choice.index // 2].outputs[choice.index % 2]
        assert choice.text == want.text
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12 * 2 * len(PROMPTS)
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)

    stream = client.completions.create(
        model=NAME, prompt=PROMPTS, max_tokens=12, n=2, stream=True,
        stream_options={"include_usage": True}, **_std(kw),
        extra_body={"ignore_eos": True, **_extra(kw)},
    )  # fmt: skip
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert usage.completion_tokens == 12 * 2 * len(PROMPTS)
    for index, text in texts.items():
        assert text == expected[index // 2].outputs[index % 2].text
        assert reasons[index] == "length"


def test_completion_token_id_prompts_and_logprobs_match(client, oracle):
    ids = [[1, 2, 3, 200, 17], [40, 41, 42]]
    expected = oracle.generate(prompt_token_ids=ids, sampling_params=_params(
        dict(temperature=0.7, seed=3), 6, logprobs=2), use_tqdm=False)  # fmt: skip
    resp = client.completions.create(
        model=NAME,
        prompt=ids,
        max_tokens=6,
        temperature=0.7,
        seed=3,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    for choice, want in zip(resp.choices, expected, strict=True):
        out = want.outputs[0]
        assert choice.text == out.text
        lp = choice.logprobs
        assert lp.token_logprobs == pytest.approx(
            [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]
        )
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset)


def test_chat_matches_llm_chat(client, oracle):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=21, ignore_eos=True, logprobs=3)
    (want,) = oracle.chat(messages, sp, chat_template=TEMPLATE)
    resp = client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=10, temperature=0.8, seed=21,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    out = want.outputs[0]
    assert resp.choices[0].message.content == out.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    content = resp.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]
    )
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(
        c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
        for c in content
    )

    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0.8, seed=21, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stop_strings_and_cached_tokens(client, oracle, hf):
    prompt = "the state of a mamba layer is a fixed size summary of the past, " * 1
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=9, stop=["e", "a"])
    (want,) = oracle.generate([prompt], sp, use_tqdm=False)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, seed=9,
                                      temperature=1.0, stop=["e", "a"])  # fmt: skip
    assert first.choices[0].text == want.outputs[0].text
    assert first.choices[0].finish_reason == want.outputs[0].finish_reason
    # Greedy, against HF transformers on the same weights: the tiny preset's ids are <s> (256)
    # and UTF-8 bytes, so HF's tokens decode by hand. Two stop strings (printable ASCII) from
    # the reference text, the earlier one ends it.
    ref, _, _ = hf_greedy(hf, [256, *prompt.encode()], 16)
    text = bytes(t for t in ref if t < 256).decode("utf-8", errors="replace")
    fresh = [
        i for i in range(2, len(text)) if text[i] not in text[:i] and text[i] in string.printable
    ]
    assert len(fresh) >= 2, text
    stops = [text[fresh[1]], text[fresh[0]]]
    greedy = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0.0,
                                       stop=stops, extra_body={"ignore_eos": True})  # fmt: skip
    assert greedy.choices[0].text == text[: fresh[0]]
    assert greedy.choices[0].finish_reason == "stop"
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens  # the aligned prefix came from the cache


def test_models_health_and_metrics(server, http, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # no key needed
    client.completions.create(
        model=NAME, prompt="abc", max_tokens=3, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("jaxmamba_http_requests", "jaxmamba_prompt_tokens", "jaxmamba_generation_tokens",
                 "jaxmamba_time_to_first_token_seconds", "jaxmamba_inter_token_latency_seconds",
                 "jaxmamba_e2e_request_latency_seconds", "jaxmamba_engine_free_slots",
                 "jaxmamba_engine_free_pages", "jaxmamba_engine_compilations",
                 "jaxmamba_engine_num_requests_waiting", "jaxmamba_engine_num_requests_running",
                 "jaxmamba_engine_prefix_cache_hit_rate"):  # fmt: skip
        assert name in families, name
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert samples["jaxmamba_generation_tokens_total"].value >= 3
    ttft_count = samples["jaxmamba_time_to_first_token_seconds_count"].value
    assert ttft_count >= 1
    ok = [s for s in families["jaxmamba_http_requests"].samples
          if s.labels == {"route": "/v1/completions", "status": "200"}]  # fmt: skip
    assert ok and ok[0].value >= 1


# -- bad input ----------------------------------------------------------------------------------
GOOD = {"model": NAME, "prompt": "ok", "max_tokens": 2}
LONG = list(range(1, 101))  # 100 ids > max_model_len 96
BAD = [
    # (case, route, raw body, status, param, words the message must hold)
    ("malformed JSON", "completions", '{"prompt": "x",', 400, None, "not valid JSON"),
    ("not an object", "completions", "[1, 2]", 400, None, "JSON object"),
    ("wrong type", "completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "number"),
    ("bool as int", "completions", {**GOOD, "max_tokens": True}, 400, "max_tokens", "integer"),
    ("unknown field", "completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate",
     "Unrecognized request argument supplied: frobnicate"),
    ("missing prompt", "completions", {"model": NAME}, 400, "prompt", "Missing"),
    ("unknown model", "completions", {**GOOD, "model": "gpt-5"}, 404, "model", "gpt-5"),
    ("prompt too long", "completions", {**GOOD, "prompt": LONG}, 400, "prompt", "max_model_len"),
    ("prompt + max_tokens too long", "completions", {**GOOD, "max_tokens": 95}, 400,
     "max_tokens", "maximum context length is 96"),
    ("negative temperature", "completions", {**GOOD, "temperature": -0.5}, 400, "temperature",
     "temperature must be >= 0"),
    ("top_p out of range", "completions", {**GOOD, "top_p": 3.0}, 400, "top_p", "(0, 1]"),
    ("absurd penalty", "completions", {**GOOD, "presence_penalty": 1e9}, 400,
     "presence_penalty", "[-2, 2]"),
    ("zero max_tokens", "completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("n = 0", "completions", {**GOOD, "n": 0}, 400, "n", "n must be"),
    ("n huge", "completions", {**GOOD, "n": 100000}, 400, "n", "n must be"),
    ("logprobs > 20", "completions", {**GOOD, "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("token id outside the vocab", "completions", {**GOOD, "prompt": [5, 99999]}, 400, "prompt",
     "outside the vocab"),
    ("empty prompt", "completions", {**GOOD, "prompt": []}, 400, "prompt", "empty"),
    ("logit_bias key", "completions", {**GOOD, "logit_bias": {"abc": 1.0}}, 400, "logit_bias",
     "token ids"),
    ("empty stop string", "completions", {**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
    ("no messages", "chat/completions", {"model": NAME, "messages": []}, 400, "messages",
     "at least 1"),
    ("message content type", "chat/completions",
     {"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400, "content", "content"),
    ("top_logprobs without logprobs", "chat/completions",
     {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "logprobs"),
]  # fmt: skip


@pytest.mark.parametrize("case,route,body,status,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_then_the_server_still_serves(
    http, case, route, body, status, param, words
):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = http.post(f"/v1/{route}", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err
    assert err["param"] == param, err
    good = http.post("/v1/completions", json=GOOD)
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"]


def test_body_over_the_limit_is_413(http):
    r = http.post("/v1/completions", json={**GOOD, "prompt": "x" * (BODY_LIMIT + 10)})
    assert r.status_code == 413
    assert str(BODY_LIMIT) in r.json()["error"]["message"]
    assert http.post("/v1/completions", json=GOOD).status_code == 200


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]
)
def test_missing_or_wrong_api_key_is_401(server, headers):
    r = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_and_method_are_openai_errors(http):
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# -- load and disconnects -----------------------------------------------------------------------
def test_64_concurrent_streams_complete_and_free_every_slot_and_page(server, http):
    start = pools(http)
    n_req, max_tokens = 64, 10

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": NAME, "prompt": f"request {i}: " + "ab" * (i % 7),
                "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}  # fmt: skip
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        tokens = [t for e in events[:-1] for ch in e["choices"] for t in ch.get("token_ids", [])]
        return len(tokens), events[-2]["usage"]["completion_tokens"]

    async def run():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=n_req)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120,
                                     limits=limits) as c:  # fmt: skip
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(n_req))), 240)

    results = asyncio.run(run())
    assert results == [(max_tokens, max_tokens)] * n_req
    assert pools(http) == start


def test_16_mid_stream_disconnects_abort_and_free_everything(server, http):
    start = pools(http)
    before = engine_gauges(http)["jaxmamba_engine_finished_requests"]
    max_tokens = 80

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": NAME, "prompt": f"disconnect {i}", "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "seed": i}  # fmt: skip
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream

    async def run():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120,
                                     limits=httpx.Limits(max_connections=16)) as c:  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(16))), 240)

    asyncio.run(run())
    assert pools(http) == start
    # None of the 16 ran to its max_tokens: each was aborted, not finished.
    assert engine_gauges(http)["jaxmamba_engine_finished_requests"] == before
    assert http.post("/v1/completions", json=GOOD).status_code == 200


# -- fuzzing ------------------------------------------------------------------------------------
def test_openapi_schema_fuzzed_without_server_errors(server, http):
    import hypothesis
    import schemathesis

    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    schema = schemathesis.openapi.from_dict(spec)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    seen: dict[int, int] = {}

    def bounded(case):
        # Generation cost is bounded (the point is the parser and validation, not decode).
        if isinstance(case.body, dict):
            for key in ("n", "max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(key), int) and not isinstance(case.body[key], bool):
                    case.body[key] = max(min(case.body[key], 4), -4)
        return case

    def fuzz_operation(op):
        @hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
        @hypothesis.given(case=op.as_strategy())
        def fuzz(case):
            response = bounded(case).call(base_url=server.url, headers=headers, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (op.label, case.body, response.text)

        fuzz()

    for result in schema.get_all_operations():
        op = result.ok()
        if op.path != "/reset_prefix_cache":
            fuzz_operation(op)
    print("fuzzed status codes:", seen)
    assert any(code < 300 for code in seen) and any(400 <= code < 500 for code in seen), seen
