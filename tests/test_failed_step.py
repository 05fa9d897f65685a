"""A failed step loses nothing: with a fault injected in the runner (dispatching a step, or
reading its tokens back), the requests that step carried end with finish_reason "error", every
slot and page is free again, and `LLM`, `LLMEngine` and the server go on serving exactly what a
fresh engine would."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params
from jaxmamba.serve.api_server import ServerConfig

from server_helpers import ServerThread, sse_events

TINY = "nemotron-h-tiny"
# test_engine's shapes: the same compiled programs
SHAPES = {"max_num_seqs": 4, "max_model_len": 160, "num_state_slots": 6, "num_pages": 44}


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(config_from_preset(TINY), seed=0)


@pytest.fixture(scope="module")
def reference(tiny_params):
    return tiny_llm(tiny_params)


def tiny_llm(params, **kw):
    return LLM(TINY, params=params, **{"max_num_batched_tokens": 64, **SHAPES, **kw})


def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def inject_fault(monkeypatch, runner, k: int, where: str) -> dict:
    """The runner's k-th `step` call from now fails once: `where="dispatch"` raises after the
    real step ran (its donated state consumed), `"read"` hands back outputs that fail to read."""
    step, calls = runner.step, {"n": 0, "fired": False}

    def faulty(*args, **kwargs):
        calls["n"] += 1
        out = step(*args, **kwargs)
        if calls["n"] == k:
            calls["fired"] = True
            if where == "dispatch":
                raise InjectedFault("injected fault in the step")
            out.packed.delete()  # reading it back raises
        return out

    monkeypatch.setattr(runner, "step", faulty)
    return calls


def assert_pools_free(llm):
    scheduler = llm.engine.scheduler
    assert not scheduler.running and not scheduler.waiting
    assert not llm.engine.has_unfinished_requests()
    llm.reset_prefix_cache()
    assert scheduler.slots.num_free == scheduler.slots.capacity
    assert scheduler.pages.num_free == scheduler.pages.capacity


@pytest.mark.parametrize("where", ["dispatch", "read"])
def test_generate_fails_the_carried_requests_and_the_next_generate_matches_a_fresh_engine(
    tiny_params, reference, monkeypatch, where
):
    prompts = prompts_of([9, 23, 5, 40, 17, 12], seed=1)  # 6 requests, 4 rows: 2 wait
    expected = [
        o.outputs[0].token_ids
        for o in reference.generate(
            prompt_token_ids=prompts, sampling_params=greedy(), use_tqdm=False
        )
    ]
    llm = tiny_llm(tiny_params)
    calls = inject_fault(monkeypatch, llm.engine.runner, 2, where)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), use_tqdm=False)
    assert calls["fired"]
    failed = [i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "error"]
    assert failed, "the fault failed no request"
    for i, out in enumerate(outs):
        if i in failed:
            assert out.finished and ("InjectedFault" in out.error or "deleted" in out.error)
        else:  # queued when the step failed: prefilled afresh on a new device state
            assert out.error is None and out.outputs[0].token_ids == expected[i]
    assert_pools_free(llm)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.error is None for o in again)


def test_engine_step_fails_the_running_requests_and_the_queued_ones_go_on(
    tiny_params, reference, monkeypatch
):
    prompts = prompts_of([11, 30, 7, 19, 25], seed=2)
    expected = [
        o.outputs[0].token_ids
        for o in reference.generate(
            prompt_token_ids=prompts, sampling_params=greedy(), use_tqdm=False
        )
    ]
    llm = tiny_llm(tiny_params)
    engine = llm.engine
    calls = inject_fault(monkeypatch, engine.runner, 3, "dispatch")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy())
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert calls["fired"] and sorted(finished) == [str(i) for i in range(len(prompts))]
    errors = {rid for rid, out in finished.items() if out.error is not None}
    assert errors and len(errors) < len(prompts)
    for rid in errors:
        out = finished[rid]
        assert out.outputs[0].finish_reason == "error" and "InjectedFault" in out.error
    assert_pools_free(llm)
    for i, p in enumerate(prompts):
        engine.add_request(f"again-{i}", p, greedy())
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [tokens[f"again-{i}"] for i in range(len(prompts))] == expected
    assert_pools_free(llm)


def test_server_answers_500_and_an_sse_error_for_a_failed_step_then_serves(
    tiny_params, reference, monkeypatch
):
    llm = tiny_llm(tiny_params)
    s = ServerThread(llm, ServerConfig(served_model_names=("tiny",)))
    try:
        body = {"model": "tiny", "prompt": prompts_of([14], seed=3)[0], "max_tokens": 5,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        expected = reference.generate(
            prompt_token_ids=[body["prompt"]], sampling_params=greedy(5), use_tqdm=False
        )
        with httpx.Client(base_url=s.url, timeout=120) as http:
            inject_fault(monkeypatch, llm.engine.runner, 2, "read")
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["type"] == "server_error" and "engine step failed" in error["message"]

            inject_fault(monkeypatch, llm.engine.runner, 2, "dispatch")
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]"
            assert "InjectedFault" in events[-2]["error"]["message"]

            monkeypatch.undo()
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == expected[0].outputs[0].text
        snapshot = s.server.loop.snapshot
        assert snapshot["num_requests_running"] == 0 and snapshot["num_requests_waiting"] == 0
    finally:
        s.stop()
