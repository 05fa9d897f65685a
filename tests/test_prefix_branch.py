"""Prefix caching where prompts branch: checkpoints at branch points, simultaneous arrivals,
few-shot, multi-turn, eviction pressure and n > 1, on a random HF NemotronH hybrid; greedy
tokens against HF `generate` and against the same engine with caching off. Also the
multi-checkpoint metadata against a float64 numpy recurrence."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.kernels.conv1d import windows_at
from jaxmamba.kernels.ssd import ssd_varlen
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.step_contract import MAX_PREFILL_CHECKPOINTS

from hf_fixtures import make_nemotron_h_checkpoint
from model_helpers import assert_nothing_leaks

BLOCK = 16  # lcm(chunk_size 16, page_size 16)
SHARED = 200  # the shared prefix: its aligned part is 192 tokens
ALIGNED = SHARED - SHARED % BLOCK
NEW = 6


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path, model = make_nemotron_h_checkpoint(
        tmp_path_factory.mktemp("branch") / "m", pattern="M*M", chunk_size=16, seed=7
    )
    model.generation_config.eos_token_id = None  # the engine's requests ignore eos too
    return str(path), model.eval()


def make_llm(path, **kw):
    # Every engine here (caching on or off) has the same pools, so they share compiled steps;
    # XLA:CPU compiles dominate this file's time, so the workloads reuse a few buckets: one
    # row or all six decoding, 64 or 256 step tokens (10 programs, not the ladders' 33).
    # Buckets only pad a step; what the scheduler admits, feeds and caches is the same.
    kw = {"max_num_seqs": 6, "max_model_len": 320, "max_num_batched_tokens": 256,
          "max_prefill_seqs": 6, "page_size": 16, "num_state_slots": 12, "num_pages": 240,
          "compilation_cache": False, **kw}  # fmt: skip
    llm = LLM(path, **kw)
    llm.engine.scheduler.use_buckets(decode=[1, 6], tokens=[64, 256])
    return llm


@pytest.fixture(scope="module")
def llm_off(hf_model):
    return make_llm(hf_model[0], enable_prefix_caching=False)


@pytest.fixture(scope="module")
def shared_llm(hf_model):
    return make_llm(hf_model[0])


@pytest.fixture
def llm(shared_llm):
    """The module's caching engine with an empty tree (its counters run on: use `since`)."""
    shared_llm.reset_prefix_cache()
    assert_nothing_leaks(shared_llm)
    return shared_llm


def since(llm, before: dict) -> dict:
    """The engine's counters now, less `before` where they count events."""
    now = llm.stats()
    gauges = ("free_slots", "free_pages", "state_slots", "state_slots_running",
              "state_slots_checkpoints", "prefix_cache_nodes", "prefix_cache_hit_rate",
              "prefix_cache_checkpoint_slots_in_use")  # fmt: skip
    return {k: v if k in gauges else v - before.get(k, 0) for k, v in now.items()}


def greedy(max_tokens=NEW, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def random_ids(rng, n):
    return rng.integers(3, 97, n).tolist()


HF_CACHE: dict[tuple, list[int]] = {}


def hf_greedy(model, prompt, n=NEW):
    key = (tuple(prompt), n)
    if key not in HF_CACHE:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0
            )
        HF_CACHE[key] = out[0, len(prompt) :].tolist()
    return HF_CACHE[key]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def one_by_one(llm, prompts, params=None):
    """Each prompt in its own `generate` call."""
    params = params or greedy()
    return [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]


TIE = 2e-3  # logit gap under which float32 rounding may pick either token
# HF is the oracle for every token, and the engine with caching off besides. (These tests
# found the sampler masking the last vocabulary id, 96 here: fixed in jaxmamba/model/sampling.py.)
HF_TOKENS = NEW


def assert_greedy_under_hf(model, prompt, ours):
    """`ours` is HF's greedy continuation: every token is the argmax of HF's logits given
    the tokens before it (ties within TIE allowed); where no step is that close, it is exactly
    what HF `generate` returns."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
    picked = logits[torch.arange(len(ours)), torch.tensor(ours)]
    gap = logits.max(dim=-1).values - picked
    assert float(gap.max()) <= TIE, (ours, gap.tolist())
    top2 = torch.topk(logits, 2).values
    if float((top2[:, 0] - top2[:, 1]).min()) > TIE:
        assert ours == hf_greedy(model, prompt, len(ours))


def assert_matches_oracles(model, llm_off, prompts, outs):
    """HF's greedy tokens, and those of the engine with caching off (each prompt sent alone:
    the same compiled steps as the sequential workloads, and the tokens do not depend on
    what else runs)."""
    got = tokens(outs)
    for prompt, ours in zip(prompts, got, strict=True):
        assert_greedy_under_hf(model, prompt, ours[:HF_TOKENS])
    assert got == tokens(one_by_one(llm_off, prompts))


def block_floor(n: int) -> int:
    return n - n % BLOCK


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def shared_prompts(seed, n=6, shared=SHARED, own=(10, 60)):
    rng = np.random.default_rng(seed)
    system = random_ids(rng, shared)
    return [system + random_ids(rng, int(k)) for k in rng.integers(*own, n)]


def test_requests_sent_one_after_another_hit_from_the_third(hf_model, llm_off, llm):
    model = hf_model[1]
    before = llm.stats()
    prompts = shared_prompts(0, own=(25, 57))  # one step each; the hits' tails in one bucket
    outs = one_by_one(llm, prompts)
    cached = [o.num_cached_tokens for o in outs]
    # The first checkpoints at its own end (in its unique part); the second finds the KV of the
    # shared part but no state, recomputes it and checkpoints at the branch point; the rest hit.
    # From the block layout: a hit resumes at the deepest block boundary that it shares with
    # an earlier prompt (the branch point's checkpoint; the earlier prompts' own checkpoints
    # lie in parts no other prompt shares), short of its own last token.
    expected = [0, 0] + [
        block_floor(min(max(common_prefix(p, q) for q in prompts[:i]), len(p) - 1))
        for i, p in enumerate(prompts) if i >= 2
    ]  # fmt: skip
    assert expected[2:] == [ALIGNED] * 4
    assert cached == expected
    stats = since(llm, before)
    assert stats["prefix_cache_partial_hits"] == 1
    assert stats["prefix_cache_recomputed_tokens"] == ALIGNED
    assert stats["prefix_cache_branch_checkpoints"] == 1
    assert stats["prefix_cache_hits"] == 4
    assert stats["prefix_cache_hit_tokens"] == sum(expected)
    assert stats["prefix_cache_query_tokens"] == sum(len(p) - 1 for p in prompts)
    assert_matches_oracles(model, llm_off, prompts, outs)
    assert_nothing_leaks(llm)


def test_requests_sent_together_compute_the_shared_prefix_once(hf_model, llm_off, llm):
    model = hf_model[1]
    before = llm.stats()
    prompts = shared_prompts(1)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy())
    # Best achievable: the first computes the shared prefix and checkpoints at its aligned
    # end; the other five wait for that checkpoint and resume from it.
    assert [o.num_cached_tokens for o in outs] == [0] + [ALIGNED] * 5
    stats = since(llm, before)
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) - 5 * ALIGNED
    assert stats["prefix_cache_held_requests"] == 5
    assert llm.stats()["compilations"] > 0
    assert_matches_oracles(model, llm_off, prompts, outs)
    # The same workload again (a new suffix each) hits from the tree at once, nobody waits.
    rng = np.random.default_rng(2)
    again = [p[:SHARED] + random_ids(rng, 9 + i) for i, p in enumerate(prompts)]
    outs = llm.generate(prompt_token_ids=again, sampling_params=greedy())
    assert [o.num_cached_tokens for o in outs] == [ALIGNED] * 6
    assert since(llm, before)["prefix_cache_held_requests"] == 5
    assert_matches_oracles(model, llm_off, again, outs)
    assert_nothing_leaks(llm)


def test_a_request_arriving_while_a_peer_prefills_waits_for_its_branch_point(
    hf_model, llm_off, llm
):
    model = hf_model[1]
    rng = np.random.default_rng(9)
    system = random_ids(rng, SHARED)
    # `first` takes 250 of the first step's 256 tokens, so `lead` feeds only its first 6 then
    # and the shared prefix in the next step; `late` arrives after that first step.
    prompts = {"first": random_ids(rng, 250), "lead": system + random_ids(rng, 50),
               "late": system + random_ids(rng, 54)}  # fmt: skip
    engine, before, outs = llm.engine, llm.stats(), {}

    def collect(deltas):
        for d in deltas:
            if d.request_id in outs:
                outs[d.request_id].add(d)
            else:
                outs[d.request_id] = d

    # `first` and `lead` sample one token each, so `late`'s step has no decode rows (a bucket
    # the other tests compile too).
    engine.add_request("first", prompts["first"], greedy(max_tokens=1))
    engine.add_request("lead", prompts["lead"], greedy(max_tokens=1))
    collect(engine.step())
    (lead,) = [r for r in engine.scheduler.running if r.request_id == "lead"]
    assert lead.num_computed == 6
    engine.add_request("late", prompts["late"], greedy())
    while engine.has_unfinished_requests():
        collect(engine.step())
    # Best achievable: `lead` has not fed the shared prefix yet when `late` arrives, so it
    # checkpoints at the branch point and `late` resumes there, feeding only its own part.
    assert [outs[k].num_cached_tokens for k in prompts] == [0, 0, ALIGNED]
    stats = since(llm, before)
    assert stats["prefill_tokens"] == sum(map(len, prompts.values())) - ALIGNED
    assert stats["prefix_cache_branch_checkpoints"] == 1
    assert stats["prefix_cache_held_requests"] == 1
    for k in ("first", "lead"):
        assert outs[k].outputs[0].token_ids == hf_greedy(model, prompts[k], 1)
    assert_matches_oracles(model, llm_off, [prompts["late"]], [outs["late"]])
    assert_nothing_leaks(llm)


def test_few_shot_prompts_sharing_two_of_three_examples(hf_model, llm_off, llm):
    model = hf_model[1]
    rng = np.random.default_rng(3)
    examples = [random_ids(rng, 70) for _ in range(2)]
    prompts = [examples[0] + examples[1] + random_ids(rng, 50) + random_ids(rng, 12)
               for _ in range(5)]  # fmt: skip
    shared = 140 - 140 % BLOCK
    outs = one_by_one(llm, prompts)
    assert all(o.num_cached_tokens >= shared for o in outs[2:]), [o.num_cached_tokens for o in outs]
    assert_matches_oracles(model, llm_off, prompts, outs)
    assert_nothing_leaks(llm)
    # Sent together, only the first computes the two shared examples.
    together = [examples[0] + examples[1] + random_ids(rng, 40) for _ in range(4)]
    outs_t = llm.generate(prompt_token_ids=together, sampling_params=greedy())
    assert [o.num_cached_tokens for o in outs_t] == [0] + [shared] * 3
    assert_matches_oracles(model, llm_off, together, outs_t)
    assert_nothing_leaks(llm)


def test_multi_turn_chat_keeps_hitting(hf_model, llm_off, llm):
    model = hf_model[1]
    rng = np.random.default_rng(4)
    prompt = random_ids(rng, 37)
    previous, prompts, outs = 0, [], []
    for _ in range(5):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy())[0]
        assert out.num_cached_tokens >= previous - previous % BLOCK
        prompts.append(prompt)
        outs.append(out)
        previous = len(prompt)
        # The next user turn: 35-45 tokens, so every uncached tail is 41-66 tokens and every
        # prompt fits one step.
        prompt = prompt + out.outputs[0].token_ids + random_ids(rng, int(rng.integers(35, 46)))
    assert all(o.num_cached_tokens > 0 for o in outs[1:])
    assert_matches_oracles(model, llm_off, prompts, outs)
    assert_nothing_leaks(llm)


def test_eviction_pressure_gives_every_slot_and_page_back(hf_model, llm_off, llm):
    model = hf_model[1]
    before = llm.stats()
    # 12 slots (6 for running requests, 6 for checkpoints) and 240 pages: 15 prompts from 4
    # families and 3 loners, each family's three sent together, overflow both.
    rng = np.random.default_rng(5)
    families = [shared_prompts(10 + f, n=3, shared=int(rng.integers(48, 120)), own=(30, 70))
                for f in range(4)]  # fmt: skip
    loners = [random_ids(rng, 250) for _ in range(3)]
    outs = []
    for family in families:
        outs += llm.generate(prompt_token_ids=family, sampling_params=greedy())
    outs += one_by_one(llm, loners)
    prompts = [p for family in families for p in family] + loners
    assert tokens(outs) == tokens(one_by_one(llm_off, prompts))
    stats = since(llm, before)
    assert stats["prefix_cache_evicted_checkpoints"] > 0
    assert stats["prefix_cache_evicted_nodes"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert (stats["state_slots"], stats["state_slots_running"]) == (12, 6)
    # Nothing runs now: every slot is free or holds a checkpoint.
    assert stats["prefix_cache_checkpoint_slots_in_use"] + stats["free_slots"] == 12
    for prompt, ours in zip(prompts[:3], tokens(outs[:3]), strict=True):
        assert_greedy_under_hf(model, prompt, ours[:HF_TOKENS])
    assert_nothing_leaks(llm)


def test_cost_aware_eviction_keeps_the_checkpoint_that_saves_most():
    from jaxmamba.engine.allocator import BlockAllocator, UndoLog
    from jaxmamba.engine.prefix_cache import PrefixCache

    undo = UndoLog()
    slots, pages = BlockAllocator(3, "slot", undo), BlockAllocator(64, "page", undo)
    cache = PrefixCache(4, 4, slots, pages, slot_cost=10.0)
    rng = np.random.default_rng(6)
    long, short = random_ids(rng, 32), random_ids(rng, 4)
    # The long prefix's checkpoint is older but saves 32 tokens; the short one saves 4.
    for tokens_, n in ((long, 32), (short, 4)):
        own = pages.allocate(n // 4)
        cache.insert(tokens_, n, own, slots.allocate(1)[0])
    cache.evict(need_slots=2)
    assert cache.match(long, 32).length == 32
    assert cache.match(short, 4).length == 0
    assert cache.stats["evicted_checkpoints"] == 1


def test_shared_pages_are_reference_counted():
    from jaxmamba.engine.allocator import BlockAllocator, UndoLog

    undo = UndoLog()
    pages = BlockAllocator(4, "page", undo)
    a = pages.allocate(2)
    pages.share(a)
    pages.free(a)
    assert pages.num_free == 2 and [pages.refs(p) for p in a] == [1, 1]
    undo.begin()
    pages.free(a[:1])
    pages.share(a[1:])
    assert pages.num_free == 3
    undo.rollback()
    assert pages.num_free == 2 and [pages.refs(p) for p in a] == [1, 1]
    pages.free(a)
    assert pages.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        pages.free(a[:1])


def test_n_samples_prefill_the_prompt_once_and_fork_inside_the_step(hf_model, llm_off, llm):
    from jaxmamba.engine.engine import sibling_seed

    model = hf_model[1]
    rng = np.random.default_rng(7)
    # 90 tokens end inside a page (the partial page is copied to each sample); 96 on a page
    # boundary (nothing to copy), with caching off.
    for engine_llm, prompt in ((llm, random_ids(rng, 90)), (llm_off, random_ids(rng, 96))):
        before = engine_llm.stats()
        (out,) = engine_llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(n=4))
        stats = since(engine_llm, before)
        assert stats["prefill_tokens"] == len(prompt)  # the samples compute no prompt token
        assert stats["forked_samples"] == 3
        assert_greedy_under_hf(model, prompt, out.outputs[0].token_ids)
        assert [c.token_ids for c in out.outputs] == [out.outputs[0].token_ids] * 4
        assert_nothing_leaks(engine_llm)
    # Seeded sampling: sample i of a request seeded s draws as a lone request seeded
    # sibling_seed(s, i) does (its own stream, from the same prompt state).
    prompt = random_ids(rng, 90)
    seeded = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(n=4, max_tokens=NEW, temperature=1.0, seed=3),
    )[0]
    alone = [
        one_by_one(llm_off, [prompt], SamplingParams(max_tokens=NEW, temperature=1.0,
                                                     seed=sibling_seed(3, i)))[0]
        for i in range(4)
    ]  # fmt: skip
    got = [c.token_ids for c in seeded.outputs]
    assert got == tokens(alone)
    assert len({tuple(t) for t in got}) > 1  # the samples did draw differently
    # The repetition penalty reads every prompt token: the forks get sample 0's prompt mask.
    penalised = greedy(repetition_penalty=1.5)
    before = llm.stats()
    (out,) = llm.generate(
        prompt_token_ids=[prompt], sampling_params=greedy(n=2, repetition_penalty=1.5)
    )
    assert since(llm, before)["prefill_tokens"] == len(prompt)
    expected = one_by_one(llm_off, [prompt], penalised)[0].outputs[0].token_ids
    assert [c.token_ids for c in out.outputs] == [expected] * 2
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=NEW,
            repetition_penalty=1.5,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert expected == hf
    assert_nothing_leaks(llm)
    assert_nothing_leaks(llm_off)


# -- the metadata: several checkpoints per row ------------------------------------------------


def _softplus(v):
    return np.log1p(np.exp(-np.abs(v))) + np.maximum(v, 0)


def test_multi_checkpoint_states_equal_a_float64_recurrence():
    rng = np.random.default_rng(8)
    c, H, P, G, N, D, K = 4, 4, 3, 2, 5, 7, 4
    spec = CacheSpec(num_slots=24, num_pages=64, page_size=c)
    builder = StepBuilder(spec, max_pages_per_seq=16, vocab_size=100, chunk_size=c)
    # (prefix_len, new tokens, checkpoint lengths): two per row, one, at the end, none.
    layout = [(0, 13, (4, 12)), (6, 11, (8, 17)), (3, 5, (8,)), (0, 7, ()), (5, 12, (16, 12))]
    rows, slot = [], 0
    for i, (prefix, n, lengths) in enumerate(layout):
        tracks = [(10 + 2 * i + k, length) for k, length in enumerate(lengths)]
        rows.append(RowSpec(random_ids(rng, n), prefix, slot, list(range(4 * i, 4 * i + 5)),
                            tracks=tracks))  # fmt: skip
        slot += 1
    total = sum(n for _, n, _ in layout)
    inputs = builder.build(rows, Bucket(total + 5, len(rows), 0))
    assert inputs.track_slots.shape == (len(rows), MAX_PREFILL_CHECKPOINTS)
    T = total + 5
    x = rng.standard_normal((T, H, P)).astype(np.float32)
    dt = rng.standard_normal((T, H)).astype(np.float32)
    A = -rng.uniform(0.5, 2.0, H).astype(np.float32)
    B = rng.standard_normal((T, G, N)).astype(np.float32)
    C = rng.standard_normal((T, G, N)).astype(np.float32)
    dt_bias = rng.standard_normal(H).astype(np.float32) * 0.3
    init = rng.standard_normal((len(rows), H, P, N)).astype(np.float32)
    init[[0, 3]] = 0  # rows without a prefix start from zeros
    xbc = rng.standard_normal((T, D)).astype(np.float32)
    conv_init = rng.standard_normal((len(rows), K - 1, D)).astype(np.float32)

    @jax.jit  # one compile, not one per op
    def checkpoints(inputs, x, dt, A, B, C, dt_bias, init, xbc, conv_init):
        meta = ForwardMetadata.build(
            inputs, num_decode=0, chunk_size=c, page_size=c, pad_page=spec.pad_page,
            pad_slot=spec.pad_slot,
        ).prefill  # fmt: skip
        _, _, tracked = ssd_varlen(
            x, dt, A, B, C, meta.cu_seqlens, chunk_size=c, dt_bias=dt_bias, initial_states=init,
            start_positions=meta.start_positions, layout=meta.layout,
            state_chunks=meta.track_chunks, impl="ref",
        )  # fmt: skip
        windows = windows_at(
            xbc, conv_init, meta.cu_seqlens, meta.track_rows, meta.track_ends, K - 1
        )
        return tracked, windows, meta.track_slots, meta.cu_seqlens

    tracked, windows, slots, cu = checkpoints(inputs, x, dt, A, B, C, dt_bias, init, xbc,
                                              conv_init)  # fmt: skip
    tracked, windows = np.asarray(tracked), np.asarray(windows)
    slots, cu = np.asarray(slots), np.asarray(cu)
    checked = 0
    for i, (prefix, n, lengths) in enumerate(layout):
        start = cu[i]
        for k, length in enumerate(lengths):
            e = i * MAX_PREFILL_CHECKPOINTS + k
            assert slots[e] == 10 + 2 * i + k
            # SSM: the recurrence in float64 from the row's initial state to `length`.
            h = init[i].astype(np.float64)
            for t in range(start, start + length - prefix):
                d = _softplus(dt[t].astype(np.float64) + dt_bias)
                bt = np.repeat(B[t], H // G, axis=0).astype(np.float64)  # [H, N]
                h = np.exp(d * A)[:, None, None] * h + (d[:, None] * x[t])[..., None] * bt[:, None]
            np.testing.assert_allclose(tracked[e], h, rtol=2e-4, atol=2e-4)
            # Conv: the K-1 inputs before `length` (the initial state's rows before the row).
            seq_inputs = np.concatenate([conv_init[i], xbc[start : start + n]])
            rel = length - prefix + K - 1
            np.testing.assert_array_equal(windows[e], seq_inputs[rel - (K - 1) : rel])
            checked += 1
    assert checked == 7
    unused = [e for e in range(len(slots)) if slots[e] == spec.pad_slot]
    assert len(unused) == len(rows) * MAX_PREFILL_CHECKPOINTS - checked
