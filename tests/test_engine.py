"""The serving engine: continuous batching, chunked prefill, mixed steps, prefix caching."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from hf_fixtures import make_nemotron_h_checkpoint
from hf_oracle import hf_greedy, hf_model_of

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


def assert_nothing_leaks(llm):
    scheduler = llm.engine.scheduler
    assert not scheduler.running and not scheduler.waiting
    llm.reset_prefix_cache()
    assert scheduler.slots.num_free == scheduler.slots.capacity
    assert scheduler.pages.num_free == scheduler.pages.capacity
    if scheduler.prefix_cache is not None:
        assert scheduler.prefix_cache.num_nodes == 0


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
              "pages", "owned_pages", "cached_len")  # fmt: skip
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
        counts=(cache.num_nodes, cache.hit_tokens, cache.query_tokens),
    )


@pytest.mark.parametrize("where", ["build", "dispatch"])
def test_a_step_that_raises_leaves_every_slot_page_and_request_where_it_was(
    tiny_params, monkeypatch, where
):
    llm = tiny_llm(tiny_params, track_interval=32)
    engine, scheduler = llm.engine, llm.engine.scheduler
    system = prompts_of([48], seed=5)[0]
    warm = [system + p for p in prompts_of([5, 40, 17], seed=6)]
    llm.generate(prompt_token_ids=warm, sampling_params=greedy(10), use_tqdm=False)
    assert scheduler.prefix_cache.num_nodes > 0  # a full cache: admitting evicts
    prompts = prompts_of([70, 3, 90, 33, 60], seed=7)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(12))
    evicted = []
    real_evict = scheduler.prefix_cache.evict

    def evict(*args, **kw):  # counts the slots and pages evicting freed
        free = scheduler.slots.num_free + scheduler.pages.num_free
        real_evict(*args, **kw)
        evicted.append(scheduler.slots.num_free + scheduler.pages.num_free - free)

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(scheduler.prefix_cache, "evict", evict)
    target = (engine.builder, "build") if where == "build" else (engine.runner, "step")
    outputs, failures, failed_evictions = {}, 0, 0

    def collect(outs):
        for out in outs:
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)

    while engine.has_unfinished_requests():  # every step that dispatches fails twice first
        before = scheduler_state(scheduler)
        evicted.clear()
        with monkeypatch.context() as m:
            m.setattr(*target, boom)
            try:
                outs = engine.step()
            except RuntimeError as e:
                assert "injected failure" in str(e)
                assert scheduler_state(scheduler) == before
                with pytest.raises(RuntimeError, match="injected failure"):
                    engine.step()
                assert scheduler_state(scheduler) == before
                failures += 1
                failed_evictions += sum(evicted)
            else:  # nothing left to dispatch: the step only read the one in flight
                collect(outs)
                continue
        collect(engine.step())
    assert failures > 5 and failed_evictions > 0  # some failed steps had evicted, put back
    off = tiny_llm(tiny_params, enable_prefix_caching=False)
    refs = off.generate(prompt_token_ids=prompts, sampling_params=greedy(12), use_tqdm=False)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == token_ids(refs)
    assert_nothing_leaks(llm)
