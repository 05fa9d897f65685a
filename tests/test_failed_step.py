"""A failed step loses nothing else. A fault is injected where a step can fail: scheduling it,
building its inputs, in the runner before the device took its state, handing its tokens to
their requests (the state intact), in the runner after the device consumed its donated state,
or reading its tokens back (the state lost). The requests the step carried end with
finish_reason "error" and the exception in `RequestOutput.error`; with the state lost, so do
all whose state was on the device. Every other request finishes with the tokens an engine that
never failed gives, every slot, page and prefix-cache node comes back, and `LLMEngine`, `LLM`
and the server go on serving, with the compiled programs they had (a live model's runner, and
an exported artifact's)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.export.writer import export_artifact
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params
from jaxmamba.serve.api_server import ServerConfig

from model_helpers import assert_nothing_leaks
from server_helpers import ServerThread, sse_events

TINY = "nemotron-h-tiny"
# test_engine's shapes and token budget: the same compiled programs
SHAPES = {"max_num_seqs": 4, "max_model_len": 160, "num_state_slots": 6, "num_pages": 44,
          "max_num_batched_tokens": 64}  # fmt: skip
# where a fault leaves the device state intact
INTACT = ("schedule", "build", "dispatch", "postprocess")
LOST = ("donated", "read")  # ... and where it loses it


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(config_from_preset(TINY), seed=0)


@pytest.fixture(scope="module")
def reference(tiny_params):
    """An engine that never fails, on the same shapes."""
    return tiny_llm(tiny_params)


def tiny_llm(params, **kw):
    return LLM(TINY, params=params, **{**SHAPES, **kw})


def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def token_ids(llm, prompts, n=6):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(n), use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def delete_state(runner) -> None:
    """What a dispatch that consumed the donated state leaves: its buffers deleted."""
    for leaf in jax.tree.leaves((runner.cache, runner.slot_state)):
        leaf.delete()


def state_layout(runner) -> list[tuple]:
    """What the compiled programs key on, per buffer of the runner's device state (readable
    on a deleted buffer too)."""
    leaves = jax.tree.leaves((runner.cache, runner.slot_state))
    return [(x.shape, x.dtype, x.sharding, x.committed) for x in leaves]


def inject_fault(monkeypatch, llm, where: str, fires=lambda: True) -> dict:
    """Fail one call of a step's part `where` (the first for which `fires()` is true); returns
    `{"fired": bool, "running": [...], "layout": [...], "resets": [...], "freed": [...]}`:
    the ids of the running requests and the `state_layout` when it fired; for each state the
    runner re-created, its `state_layout`, and whether every buffer of the one it replaced was
    freed by then."""
    engine = llm.engine
    scheduler, runner = engine.scheduler, engine.runner
    state = {"fired": False, "running": [], "layout": [], "resets": [], "freed": []}
    real_reset = runner.reset_state

    def reset_state():
        old = jax.tree.leaves((runner.cache, runner.slot_state))
        real_reset()
        state["resets"].append(state_layout(runner))
        state["freed"].append(all(x.is_deleted() for x in old))

    monkeypatch.setattr(runner, "reset_state", reset_state)

    def firing() -> bool:
        if state["fired"] or not fires():
            return False
        state["fired"] = True
        state["running"] = [r.request_id for r in scheduler.running]
        state["layout"] = state_layout(runner)
        return True

    def wrap(owner, name, before=None, after=None):
        real = getattr(owner, name)

        def faulty(*args, **kwargs):
            if before is not None and firing():
                before()
                raise InjectedFault(f"injected fault in {where}")
            out = real(*args, **kwargs)
            if after is not None and firing():
                return after(out)
            return out

        monkeypatch.setattr(owner, name, faulty)

    def boom(_=None):
        raise InjectedFault(f"injected fault in {where}")

    def unreadable(out):  # the step's samples are gone: reading them back raises
        out.packed.delete()
        return out

    if where == "schedule":  # after admitting a request, mid-schedule
        wrap(scheduler, "_admit", after=boom)
    elif where == "build":
        wrap(engine.builder, "build", before=lambda: None)
    elif where == "dispatch":  # in the runner, before the jitted step
        wrap(runner, "_run_step", before=lambda: None)
    elif where == "donated":  # the jitted step consumed the state it was donated, and raised
        wrap(runner, "_run_step", before=lambda: delete_state(runner))
    elif where == "ran":  # the step ran (the state replaced), then the runner raised
        wrap(runner, "_run_step", after=boom)
    elif where == "read":
        wrap(runner, "step", after=unreadable)
    elif where == "postprocess":  # handing a sampled token to its request
        wrap(engine, "_advance", before=lambda: None)
    else:
        raise ValueError(where)
    return state


@contextlib.contextmanager
def counting_compiles(llm):
    """{"traces", "compiles"}: the step programs traced (`num_compiles`) and the programs XLA
    compiled in the block."""
    counts = {"traces": llm.engine.runner.num_compiles, "compiles": 0}

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            counts["compiles"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        counts["traces"] = llm.engine.runner.num_compiles - counts["traces"]


def assert_failed(out, where: str) -> None:
    assert out.finished and out.error is not None
    assert all(c.finish_reason == "error" for c in out.outputs)
    message = f"InjectedFault: injected fault in {where}"
    if where == "read":
        message = "RuntimeError: Array has been deleted"
    assert out.error.startswith(f"the engine step failed: {message}"), out.error


@pytest.mark.parametrize("where", INTACT + LOST)
def test_generate_fails_the_carried_requests_and_the_next_generate_matches_a_fresh_engine(
    tiny_params, reference, monkeypatch, where
):
    prompts = prompts_of([9, 23, 5, 40, 17, 12, 30], seed=1)  # 4 rows: some wait
    expected = token_ids(reference, prompts)
    llm = tiny_llm(tiny_params)
    # a call of `where` after the first step: some requests run, some wait; handing out
    # tokens, the 6th: a row in the middle of the second step's (those before it moved)
    calls = itertools.count(1)

    def fires() -> bool:
        return next(calls) == 6 if where == "postprocess" else llm.engine.stats.steps > 0

    fault = inject_fault(monkeypatch, llm, where, fires=fires)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), use_tqdm=False)
    assert fault["fired"]
    failed = {o.request_id for o in outs if o.error is not None}
    assert failed and len(failed) < len(prompts)
    if where == "postprocess":  # the rows before the failing one gave their tokens
        assert any(o.outputs[0].token_ids for o in outs if o.request_id in failed)
    for out, tokens in zip(outs, expected, strict=True):
        if out.request_id in failed:  # with the tokens it had before
            assert_failed(out, where)
            assert out.outputs[0].token_ids == tokens[: len(out.outputs[0].token_ids)]
        else:  # unaffected: as if no step had failed
            assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == "length"
    if where in LOST:  # every request whose state was on the device failed with it
        assert set(fault["running"]) <= failed
    assert llm.stats()["failed_steps"] == 1 and llm.stats()["failed_requests"] == len(failed)
    # a re-created state is laid out as the one it replaced (the programs take it as they
    # are), and that one's buffers were freed before it was made
    assert fault["resets"] == ([fault["layout"]] if where in LOST else [])
    assert fault["freed"] == ([True] if where in LOST else [])
    assert_nothing_leaks(llm)
    monkeypatch.undo()
    with counting_compiles(llm) as counts:  # the reference ran this workload: all compiled
        assert token_ids(llm, prompts) == expected
    assert counts == {"traces": 0, "compiles": 0}
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("where", ["dispatch", "ran"])
def test_engine_step_returns_the_failed_requests_and_goes_on(
    tiny_params, reference, monkeypatch, where
):
    """Through `LLMEngine`: the failing `step()` returns the failed requests' outputs (the
    rows the step carried, or with the state lost every running request) instead of raising;
    the next steps finish the others as a fresh engine would."""
    prompts = prompts_of([11, 30, 7, 19, 25, 40], seed=2)
    expected = token_ids(reference, prompts)
    llm = tiny_llm(tiny_params)
    engine = llm.engine
    carried = []
    real_step = engine.runner.step

    def recording_step(inputs, *args, **kwargs):  # the rows' requests, by their slots
        slots = set(np.asarray(inputs.state_slots).tolist())
        carried[:] = [r.request_id for r in engine.scheduler.running if r.slot in slots]
        return real_step(inputs, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", recording_step)
    fault = inject_fault(monkeypatch, llm, where, fires=lambda: engine.stats.steps >= 3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy())
    tokens: dict[str, list[int]] = {}
    failed = set()
    cache = engine.scheduler.prefix_cache
    while engine.has_unfinished_requests():
        fired, checkpoints = fault["fired"], cache.num_checkpoints
        outs = engine.step()
        errors = {o.request_id for o in outs if o.error is not None}
        if fault["fired"] and not fired:  # this step failed
            # (those that the previous step, read first, finished, finished normally)
            finished = {o.request_id for o in outs if o.finished and o.error is None}
            assert errors | finished == set(carried if where == "dispatch" else fault["running"])
            assert engine.has_unfinished_requests()
            failed = errors
            if where == "dispatch":  # the checkpoints are on the device still
                assert cache.num_checkpoints >= checkpoints > 0
            else:  # they were in the lost state, whose buffers are freed
                assert cache.num_nodes == cache.num_checkpoints == 0
                assert fault["freed"] == [True]
        else:
            assert not errors
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert failed and len(failed) < len(prompts)
    for i, expect in enumerate(expected):
        if str(i) not in failed:
            assert tokens[str(i)] == expect
    assert_nothing_leaks(llm)


def test_an_artifact_runner_re_creates_its_state_as_it_made_it(tiny_params, tmp_path, monkeypatch):
    """The same with the state lost, through an exported artifact's runner (one row, so the
    requests after the first wait)."""
    engine = dict(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=8, max_prefill_seqs=1)
    artifact = str(export_artifact(TINY, tmp_path / "art", engine=engine, weights=False))
    prompts = [[3, 90, 17, 41, 5, 200, 11, 64, 9, 33, 120], [7, 8], [50, 60, 70]]
    expected = token_ids(LLM(artifact, params=tiny_params), prompts)
    llm = LLM(artifact, params=tiny_params)
    fault = inject_fault(monkeypatch, llm, "donated", fires=lambda: llm.engine.stats.steps > 0)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), use_tqdm=False)
    assert fault["fired"] and fault["running"] == [outs[0].request_id]
    assert_failed(outs[0], "donated")
    assert [o.outputs[0].token_ids for o in outs[1:]] == expected[1:]
    assert fault["resets"] == [fault["layout"]] and fault["freed"] == [True]
    assert_nothing_leaks(llm)
    monkeypatch.undo()
    with counting_compiles(llm) as counts:
        assert token_ids(llm, prompts) == expected
    assert counts == {"traces": 0, "compiles": 0}


def test_a_failure_no_request_carried_propagates_and_the_step_can_be_retried(
    tiny_params, reference, monkeypatch
):
    """`schedule()` raising before it began to schedule any request: nothing to fail, so
    `step()` raises, with the scheduler as it was; the next `step()` carries on."""
    prompts = prompts_of([14, 50, 6], seed=4)
    expected = token_ids(reference, prompts)
    llm = tiny_llm(tiny_params)
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy())
    engine.step()
    real_schedule = scheduler.schedule
    raised = []

    def schedule():
        if not raised:
            raised.append(True)
            raise InjectedFault("injected fault in schedule")
        return real_schedule()

    monkeypatch.setattr(scheduler, "schedule", schedule)
    free = (scheduler.slots.num_free, scheduler.pages.num_free)
    running = list(scheduler.running)
    with pytest.raises(InjectedFault):
        engine.step()
    assert (scheduler.slots.num_free, scheduler.pages.num_free) == free
    assert scheduler.running == running and engine.stats.failed_steps == 0
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert_nothing_leaks(llm)


def test_server_answers_500_and_an_sse_error_for_a_failed_step_and_serves_the_rest(
    tiny_params, reference, monkeypatch
):
    """Request B's first step fails (its 100-token prompt fills the step's 64-token budget, so
    the step carries B alone); A, queued behind B in the same engine iteration, is served as a
    fresh engine serves it. Once with the device state intact (a fault building B's step; B
    non-streaming: 500 in OpenAI's shape), once lost (the runner consumed the state and
    raised; B streaming: an error event, then `[DONE]`). Then the server goes on serving."""
    llm = tiny_llm(tiny_params)
    s = ServerThread(llm, ServerConfig(served_model_names=("tiny",)))
    poison, plain = prompts_of([100, 21], seed=3)
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    (expected,) = reference.generate(prompt_token_ids=[plain], sampling_params=greedy(),
                                     use_tqdm=False)  # fmt: skip

    def carries_poison(rows) -> bool:
        return any(list(r.tokens[:16]) == poison[:16] for r in rows)

    def both_queued(http, b_body):
        """B then A, added to the engine in one iteration: the engine thread waits in a call
        until both handlers queued their requests (each takes its seats just before)."""
        gate = threading.Event()
        with ThreadPoolExecutor(3) as pool:
            pool.submit(s.server.loop.call_blocking, lambda engine: gate.wait(60))
            b = pool.submit(b_body)
            _wait_for(lambda: s.server.seats_taken == 1)
            a = pool.submit(http.post, "/v1/completions", json={**body, "prompt": plain})
            _wait_for(lambda: s.server.seats_taken == 2)
            gate.set()
            return b.result(), a.result()

    try:
        with httpx.Client(base_url=s.url, timeout=120) as http:
            engine = llm.engine
            real_build = engine.builder.build
            fired = []

            def build(rows, *args, **kwargs):
                if not fired and carries_poison(rows):
                    fired.append("build")
                    raise InjectedFault("injected fault building the step")
                return real_build(rows, *args, **kwargs)

            monkeypatch.setattr(engine.builder, "build", build)
            b, a = both_queued(
                http, lambda: http.post("/v1/completions", json={**body, "prompt": poison})
            )
            assert fired == ["build"]
            assert b.status_code == 500
            assert b.json() == internal_error("injected fault building the step")
            assert a.status_code == 200
            assert a.json()["choices"][0]["text"] == expected.outputs[0].text
            monkeypatch.undo()

            runner = engine.runner
            real_step = runner.step

            def step(inputs, *args, **kwargs):
                first = np.asarray(inputs.input_ids)[:16].tolist()
                if not fired[1:] and first == poison[:16]:
                    fired.append("donated")
                    delete_state(runner)
                    raise InjectedFault("injected fault after the state was donated")
                return real_step(inputs, *args, **kwargs)

            monkeypatch.setattr(runner, "step", step)

            def stream_b():
                with http.stream("POST", "/v1/completions",
                                 json={**body, "prompt": poison, "stream": True}) as r:  # fmt: skip
                    return r.status_code, sse_events(r.iter_lines())

            (status, events), a = both_queued(http, stream_b)
            assert fired == ["build", "donated"] and status == 200
            assert events[-1] == "[DONE]"
            assert events[-2] == internal_error("injected fault after the state was donated")
            assert a.status_code == 200
            assert a.json()["choices"][0]["text"] == expected.outputs[0].text
            monkeypatch.undo()

            for prompt in (poison, plain):  # the server serves B too now
                r = http.post("/v1/completions", json={**body, "prompt": prompt})
                assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == expected.outputs[0].text
            assert http.get("/health").status_code == 200
            metrics = http.get("/metrics").text
            assert 'jaxmamba_request_finished_total{finish_reason="error"} 2.0' in metrics
            assert "jaxmamba_engine_failed_steps 2.0" in metrics
        snapshot = s.server.loop.snapshot
        assert snapshot["num_requests_running"] == 0 and snapshot["num_requests_waiting"] == 0
        assert s.server.seats_taken == 0
    finally:
        s.stop()
    assert_nothing_leaks(llm)


def internal_error(fault: str) -> dict:
    """The body of a 500 for a request whose step raised `InjectedFault(fault)`."""
    message = f"the engine step failed: InjectedFault: {fault}"
    return {"error": {"message": message, "type": "InternalServerError", "param": None,
                      "code": 500}}  # fmt: skip


def _wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
