"""The serving engine: continuous batching, chunked prefill, mixed steps, prefix caching."""

from __future__ import annotations

import contextlib
from collections import Counter

import jax
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from hf_fixtures import make_nemotron_h_checkpoint
from hf_oracle import hf_greedy, hf_model_of
from model_helpers import assert_nothing_leaks

TINY = "nemotron-h-tiny"


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(config_from_preset(TINY), seed=0)


# Every engine of this module gets the same shapes: rows, max_model_len and a pool small
# enough that the shared-prefix workloads evict (on CPU, caching on would default to twice
# max_num_seqs slots and twice its pages), with the prefix cache on or off. The cache shape
# and the page table are static in the jitted step, so equal shapes share one compiled
# program per bucket, and a token budget at or under 64 (a ladder 16, 32, 64) reuses the
# buckets of the 64 one: the module compiles each program of the tiny model once (most of
# its time on CPU is XLA compiling).
SHAPES = {"max_num_seqs": 4, "max_model_len": 160, "num_state_slots": 6, "num_pages": 44}


def tiny_llm(params, **kw):
    return LLM(TINY, params=params, **{"max_num_batched_tokens": 64, **SHAPES, **kw})


def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def prompts_of(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@contextlib.contextmanager
def counting_device_reads(llm):
    """Counts the distinct jax arrays whose values are copied to the host (every such read,
    `jax.device_get`, `np.asarray`, `.tolist()` or `int()`, goes through `ArrayImpl._value`),
    and the steps dispatched to the runner."""
    from jax._src.array import ArrayImpl

    read: dict[int, jax.Array] = {}  # held, so that no id is reused
    counts = {"arrays_read": 0, "steps_dispatched": 0}
    value = ArrayImpl._value.fget
    runner = llm.engine.runner
    step = runner.step

    def counted_value(self):
        read.setdefault(id(self), self)
        counts["arrays_read"] = len(read)
        return value(self)

    def counted_step(*args, **kwargs):
        counts["steps_dispatched"] += 1
        return step(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ArrayImpl, "_value", property(counted_value))
        mp.setattr(runner, "step", counted_step)
        yield counts


@pytest.fixture(scope="module")
def tiny_hf(tiny_params, tmp_path_factory):
    """HF transformers on the tiny preset's weights: the oracle of its greedy tokens."""
    return hf_model_of(tiny_params, config_from_preset(TINY), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["tiny", "hf"])
def model_and_params(request, tmp_path_factory, tiny_params, tiny_hf):
    """(model, params, the HF transformers model of the same weights)."""
    if request.param == "tiny":
        return TINY, tiny_params, tiny_hf
    path, hf = make_nemotron_h_checkpoint(tmp_path_factory.mktemp("hf"), pattern="M*-M-", seed=5)
    return str(path), None, hf


def test_16_requests_through_4_rows_match_hf_greedy_of_each(model_and_params):
    model, params, hf = model_and_params
    llm = LLM(model, params=params, max_num_batched_tokens=64, **SHAPES)
    if params is None:  # the HF model's programs are all its own: a shorter ladder, 10 not 18
        llm.engine.scheduler.use_buckets(decode=[1, 4], tokens=[32, 64])
    vocab = min(llm.model_cfg.vocab_size, 256)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 90, size=16)
    prompts = prompts_of(lengths, seed=1, vocab=vocab)
    sps = [greedy(int(n)) for n in rng.integers(1, 9, size=16)]
    with counting_device_reads(llm) as counts:
        together = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=sps))
    stats = llm.stats()
    assert stats["mixed_steps"] > 0 and stats["decode_steps"] > 0  # continuous batching mixed
    # One device→host read per step: the arrays whose values reached the host, counted where
    # jax makes the copy, against the steps the runner dispatched.
    assert counts["arrays_read"] == counts["steps_dispatched"] == stats["steps"] > 0
    assert stats["device_reads"] == counts["arrays_read"]
    for prompt, sp, got in zip(prompts, sps, together, strict=True):
        assert got == hf_greedy(hf, prompt, sp.max_tokens)[0]
    assert_nothing_leaks(llm)


def test_chunked_prefill_matches_unchunked_and_hf(tiny_params, tiny_hf):
    # A 16- and a 64-token budget (shared by a step's rows) cut the prompts, two of them near
    # max_model_len, at different places; the 64 one prefills the short ones whole when they
    # get a step to themselves. Against one whole prefill of each prompt, at the step level:
    # test_step_semantics.py::test_chunked_prefill_matches_full_prefill.
    prompts = prompts_of([150, 77, 16, 130, 61, 40], seed=2)
    small = tiny_llm(tiny_params, max_num_batched_tokens=16)
    big = tiny_llm(tiny_params, max_num_batched_tokens=64)
    a = token_ids(small.generate(prompt_token_ids=prompts, sampling_params=greedy(8)))
    b = token_ids(big.generate(prompt_token_ids=prompts, sampling_params=greedy(8)))
    assert a == b == [hf_greedy(tiny_hf, p, 8)[0] for p in prompts]
    assert small.stats()["steps"] > big.stats()["steps"]


def test_prefix_cache_hit_reuses_checkpoint_and_matches_cache_off(tiny_params):
    block = 16  # lcm(chunk_size 16, page_size 16) of the tiny preset
    (base,) = prompts_of([70], seed=3)
    extended = base + prompts_of([25], seed=4)[0]
    on = tiny_llm(tiny_params, track_interval=32)
    off = tiny_llm(tiny_params, enable_prefix_caching=False)
    first = on.generate(prompt_token_ids=[base], sampling_params=greedy(30))[0]
    assert first.num_cached_tokens == 0
    # The prefill checkpointed at 64 (last block multiple of the 70-token prompt); decode
    # crossed 96 (a multiple of track_interval) before the prompt was extended... but the
    # extension diverges at 70, so 64 is the longest usable checkpoint.
    second = on.generate(prompt_token_ids=[extended], sampling_params=greedy(8))[0]
    assert second.num_cached_tokens == 64 == (len(base) // block) * block
    # Continuing the first request's own output reuses a decode-time checkpoint (at 96).
    continued = base + first.outputs[0].token_ids + [7]
    third = on.generate(prompt_token_ids=[continued], sampling_params=greedy(8))[0]
    assert third.num_cached_tokens == 96
    for prompt, out in ((extended, second), (continued, third)):
        ref = off.generate(prompt_token_ids=[prompt], sampling_params=greedy(8))[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert on.stats()["prefix_cache_hit_rate"] > 0
    assert_nothing_leaks(on)


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_params):
    """A prompt sent twice, with a checkpoint at every block of it (16-token chunks): the
    second lookup stops at the last block boundary before the prompt's last token, so that
    token is computed again and its logits give the first sample, which is then the same
    token, with the same logprob, as with caching off."""
    block = 16  # lcm(chunk_size 16, page_size 16) of the tiny preset
    on = tiny_llm(tiny_params, max_num_batched_tokens=16)
    off = tiny_llm(tiny_params, max_num_batched_tokens=16, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)

    def sampled_logprobs(c):
        return [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]

    for n in (64, 16, 41):
        (prompt,) = prompts_of([n], seed=20 + n)
        first, again = (on.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
                        for _ in range(2))  # fmt: skip
        (ref,) = off.generate(prompt_token_ids=[prompt], sampling_params=sp)
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == (n - 1) // block * block
        for out in (first, again):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            np.testing.assert_allclose(
                sampled_logprobs(out.outputs[0]), sampled_logprobs(ref.outputs[0]), atol=1e-5
            )
    assert_nothing_leaks(on)


def test_shared_prefix_workload_under_eviction_pressure_returns_everything(tiny_params):
    llm = tiny_llm(tiny_params, track_interval=32)
    system = prompts_of([48], seed=5)[0]
    prompts = [system + p for p in prompts_of([5, 40, 17, 33, 2, 60, 9, 21], seed=6)]
    prompts += prompts_of([70, 3, 90], seed=7)  # unrelated ones push the cache out
    off = tiny_llm(tiny_params, enable_prefix_caching=False)
    refs = token_ids(off.generate(prompt_token_ids=prompts, sampling_params=greedy(10)))
    for _ in range(2):  # the second pass meets the checkpoints (and evictions) of the first
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(10))
        assert token_ids(outs) == refs
    assert sum(o.num_cached_tokens for o in outs) > 0
    scheduler = llm.engine.scheduler
    cache = scheduler.prefix_cache
    held_slots = sum(1 for _ in _nodes_with_slots(cache.root))
    assert scheduler.slots.num_free + held_slots == scheduler.slots.capacity
    assert_nothing_leaks(llm)


def _nodes_with_slots(node):
    for child in node.children.values():
        if child.slot is not None:
            yield child
        yield from _nodes_with_slots(child)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_params):
    llm = tiny_llm(tiny_params)
    prompts = prompts_of([12, 40, 3], seed=8)
    sps = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True)
           for s in (11, 12, 13)]  # fmt: skip
    together = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=sps))
    alone = [token_ids(llm.generate(prompt_token_ids=[p], sampling_params=sp))[0]
             for p, sp in zip(prompts, sps, strict=True)]  # fmt: skip
    assert together == alone
    other = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert (
        token_ids(llm.generate(prompt_token_ids=[prompts[0]], sampling_params=other))[0]
        != (together[0])
    )


def test_generation_under_transfer_guard_compiles_nothing_after_precompile(tiny_params):
    llm = tiny_llm(tiny_params, precompile=True)
    compiled = llm.stats()["compilations"]
    assert compiled >= len(llm.engine.scheduler.all_buckets()) > 0
    llm.engine.precompile(show_progress=False)  # every bucket is already compiled
    assert llm.stats()["compilations"] == compiled
    rng = np.random.default_rng(9)
    with jax.transfer_guard("disallow"):
        for round_ in range(3):
            lengths = rng.integers(1, 100, size=int(rng.integers(1, 6)))
            max_tokens = rng.integers(1, 12, len(lengths))
            temperatures = rng.uniform(0, 1.5, len(lengths))
            sps = [
                SamplingParams(max_tokens=int(m), temperature=float(t), seed=round_)
                for m, t in zip(max_tokens, temperatures, strict=True)
            ]
            llm.generate(prompt_token_ids=prompts_of(lengths, seed=round_), sampling_params=sps)
    assert llm.stats()["compilations"] == compiled
    assert llm.stats()["mixed_steps"] > 0


def test_request_stats_and_engine_counters(tiny_params):
    llm = tiny_llm(tiny_params)
    outs = llm.generate(prompt_token_ids=prompts_of([20, 30], seed=10), sampling_params=greedy(5))
    for out in outs:
        assert out.metrics["ttft_s"] > 0 and out.metrics["decode_s_per_token"] > 0
        assert out.metrics["e2e_s"] >= out.metrics["ttft_s"]
    stats = llm.stats()
    assert stats["prefill_tokens"] == 50 and stats["decode_tokens"] >= 8
    assert stats["finished_requests"] == 2


def scheduler_state(scheduler):
    """Everything a step's bookkeeping can change, as plain values."""
    cache = scheduler.prefix_cache

    def tree(node):
        return [(key, child.slot, child.pages, child.refs, tree(child))
                for key, child in sorted(node.children.items())]  # fmt: skip

    fields = ("num_computed", "num_scheduled_outputs", "num_cached_tokens", "slot", "init_slot",
              "pages", "owned_pages", "cached_len", "branch_len", "was_held")  # fmt: skip
    requests = [
        (r.request_id, r.index, *(getattr(r, f) for f in fields), [id(n) for n in r.node_refs])
        for r in [*scheduler.running, *scheduler.waiting]
    ]
    return dict(
        slots=list(scheduler.slots._free),
        pages=list(scheduler.pages._free),
        running=[id(r) for r in scheduler.running],
        waiting=[id(r) for r in scheduler.waiting],
        requests=requests,
        tree=tree(cache.root),
        counts=(cache.num_nodes, dict(cache.stats), scheduler.held_admissions),
        branches=dict(scheduler.pending_branches),
    )


def tree_blocks(cache) -> dict[tuple, tuple[int | None, list[int]]]:
    """Every node of the prefix cache, by its path of token blocks: (slot, pages)."""
    out, stack = {}, [((), cache.root)]
    while stack:
        path, node = stack.pop()
        for key, child in node.children.items():
            out[(*path, key)] = (child.slot, list(child.pages))
            stack.append(((*path, key), child))
    return out


def assert_accounted(engine):
    """Every state slot and KV page is free or held exactly once: by a running request, a
    prefix-cache node, or the step in flight (its output checkpoints); each node's references
    are the running requests that hold it."""
    scheduler, cache = engine.scheduler, engine.scheduler.prefix_cache
    nodes = tree_blocks(cache)
    inflight = [] if engine._inflight is None else engine._inflight[0].rows
    slots = [r.slot for r in scheduler.running] + [s for s, _ in nodes.values() if s is not None]
    slots += [slot for row in inflight for slot, _ in row.output_checkpoints]
    pages = [p for r in scheduler.running for p in r.owned_pages]
    pages += [p for _, node_pages in nodes.values() for p in node_pages]
    assert sorted(slots + scheduler.slots._free) == list(range(scheduler.slots.capacity))
    assert sorted(pages + scheduler.pages._free) == list(range(scheduler.pages.capacity))
    holders = Counter(id(n) for r in scheduler.running for n in r.node_refs)
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        assert node.refs == holders[id(node)]


@pytest.mark.parametrize("where", ["build", "dispatch"])
def test_a_step_that_raises_fails_the_requests_it_carried_and_no_other(
    tiny_params, monkeypatch, where
):
    """A step that raises while building its inputs, or in the runner before the device took
    its state: the scheduler rolls back to exactly where it was (the evictions it made
    included), the requests the step carried end with finish_reason "error" and give back their
    slots and pages, and every other request (waiting, or running without a row in that step)
    finishes with the tokens of an engine that never failed."""
    llm = tiny_llm(tiny_params, track_interval=32)
    engine, scheduler = llm.engine, llm.engine.scheduler
    system = prompts_of([48], seed=5)[0]
    warm = [system + p for p in prompts_of([5, 40, 17], seed=6)]
    llm.generate(prompt_token_ids=warm, sampling_params=greedy(10), use_tqdm=False)
    assert scheduler.prefix_cache.num_nodes > 0  # a full cache: admitting evicts
    prompts = prompts_of([70, 3, 90, 33, 60, 25, 12, 45, 8], seed=7)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(12))
    evicted = []
    real_evict = scheduler.prefix_cache.evict

    def evict(*args, **kw):  # counts the slots and pages evicting freed
        free = scheduler.slots.num_free + scheduler.pages.num_free
        real_evict(*args, **kw)
        evicted.append(scheduler.slots.num_free + scheduler.pages.num_free - free)

    # Two steps fail: the first that evicted while scheduling, then the first after it that
    # leaves a running request without a row.
    faults = {"evicting": None, "uncarried": None}
    target = (engine.builder, "build") if where == "build" else (engine.runner, "step")
    real = getattr(*target)

    def faulty(first, *args, **kwargs):
        slots = {row.state_slot for row in first} if where == "build" else set(first.state_slots)
        uncarried = [r.request_id for r in scheduler.running if r.slot not in slots]
        if faults["evicting"] is None and sum(evicted) > 0:
            faults["evicting"] = uncarried
        elif faults["evicting"] is not None and faults["uncarried"] is None and uncarried:
            faults["uncarried"] = uncarried
        else:
            return real(first, *args, **kwargs)
        raise RuntimeError("injected failure")

    rollbacks = []  # whether each failed transaction put everything back
    real_transaction = scheduler.transaction

    @contextlib.contextmanager
    def checked_transaction():
        before = scheduler_state(scheduler)
        try:
            with real_transaction():
                yield
        except RuntimeError:
            rollbacks.append(scheduler_state(scheduler) == before)
            raise

    monkeypatch.setattr(scheduler.prefix_cache, "evict", evict)
    monkeypatch.setattr(scheduler, "transaction", checked_transaction)
    monkeypatch.setattr(*target, faulty)
    outputs, errors, failed_steps = {}, {}, 0
    while engine.has_unfinished_requests():
        tree_before = tree_blocks(scheduler.prefix_cache)
        evicted.clear()
        outs = engine.step()
        for out in outs:
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.error is not None:
                assert out.finished and out.outputs[0].finish_reason == "error"
                assert out.error == "the engine step failed: RuntimeError: injected failure"
                errors[out.request_id] = failed_steps
        if engine.stats.failed_steps > failed_steps:  # this step failed and rolled back
            failed_steps = engine.stats.failed_steps
            tree_after = tree_blocks(scheduler.prefix_cache)
            for path, (slot, pages) in tree_before.items():  # every eviction undone
                assert tree_after[path][1] == pages and slot in (None, tree_after[path][0])
            assert not any(r.request_id in errors for r in scheduler.running)
            assert not any(r.request_id in errors for r in scheduler.waiting)
        assert_accounted(engine)
    assert failed_steps == 2 and faults["uncarried"] and rollbacks == [True, True]
    # the requests running without a row in the failed step finished normally
    assert not set(faults["uncarried"]) & set(errors)
    survivors = [i for i in range(len(prompts)) if f"r{i}" not in errors]
    assert len(survivors) >= 3 and len(errors) >= 2
    off = tiny_llm(tiny_params, enable_prefix_caching=False)
    refs = off.generate(prompt_token_ids=[prompts[i] for i in survivors],
                        sampling_params=greedy(12), use_tqdm=False)  # fmt: skip
    assert [outputs[f"r{i}"] for i in survivors] == token_ids(refs)
    assert_nothing_leaks(llm)
