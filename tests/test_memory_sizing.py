"""Cache sizing from memory (vLLM's gpu_memory_utilization): bytes per slot/page, the split of
a budget, clear errors that say what fits, and the LLM wired to it."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.config import list_presets
from jaxmamba.engine import memory
from jaxmamba.engine import runner as runner_mod
from jaxmamba.engine.batch import StepBuilder
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.scheduler import Scheduler
from jaxmamba.model.cache import CacheSpec, cache_bytes
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params
from jaxmamba.model.sampling import init_penalty_state
from jaxmamba.step_contract import MAX_LOGPROBS

# Mamba2 hybrids, and a Gated DeltaNet one (its delta-rule states share the slot pools)
# where its preset is installed.
PRESETS = ["nemotron-h-tiny", "nemotron-nano-9b-v2"] + [
    p for p in ["qwen3-next-tiny"] if p in list_presets()
]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_slot_and_page_bytes_equal_the_cache_arrays(preset, dtype, ssm_dtype):
    cfg = config_from_preset(preset)
    itemsize = jnp.dtype(dtype).itemsize
    ssm_itemsize = jnp.dtype(ssm_dtype).itemsize

    def total(slots, pages):
        sampler = jax.eval_shape(lambda: init_penalty_state(slots, cfg.vocab_size))
        sampler_bytes = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(sampler))
        last_tokens = 4 * (slots + 1)
        spec = CacheSpec(slots, pages, 16, ssm_dtype)
        return cache_bytes(cfg, spec, dtype) + sampler_bytes + last_tokens

    assert memory.slot_bytes(cfg, itemsize, ssm_itemsize) == total(3, 5) - total(2, 5)
    assert memory.page_bytes(cfg, 16, itemsize) == total(3, 5) - total(3, 4)
    _, state = cfg.slot_state_elements()
    assert memory.slot_bytes(cfg, itemsize, 4) - memory.slot_bytes(cfg, itemsize, 2) == 2 * state


def plan(budget, **kw):
    args = dict(per_slot=1000, per_page=10, max_num_seqs=4, max_pages_per_seq=8, page_size=16,
                pages_per_checkpoint=16, prefix_caching=True)  # fmt: skip
    return memory.plan_cache(budget=budget, **(args | kw))


@pytest.mark.parametrize("budget", [5_100, 5_330, 20_000, 123_457])
@pytest.mark.parametrize("caching", [True, False])
def test_the_split_runs_rows_first_then_their_pages_then_checkpoints(budget, caching):
    p = plan(budget, prefix_caching=caching)
    assert p.cache_bytes <= budget  # pad slot and page included
    assert p.state_slots >= 4 and p.pages >= 8  # every running row, one full sequence
    full = 4 * 8
    if p.pages < full or not caching:
        assert p.state_slots == 4  # no checkpoint slot before the running rows' pages
        assert p.pages == min(full, (budget - 1010 - 4000) // 10)
    else:  # the rest: checkpoint slots with one interval's pages each, leftovers to pages
        unit = 1000 + 16 * 10
        rest = budget - 1010 - 4000 - full * 10
        assert p.checkpoint_slots == rest // unit
        assert p.pages == full + 16 * p.checkpoint_slots + (rest % unit) // 10
        assert budget - p.cache_bytes < 10  # nothing a page would fit in is left
    assert p.max_concurrency == p.pages // 8


@pytest.mark.parametrize("caching", [True, False])
def test_a_model_without_attention_pays_nothing_for_its_pages(caching):
    """Pure Mamba2 models (`mamba2-*`) have no KV pages to store: a page is a block-table
    entry and costs 0 bytes. The budget goes to slots; the pages cover every running row at
    max_model_len and each checkpoint's interval."""
    budget = 1000 + 10 * 1000 + 500  # the pad slot, 10 slots, a remainder
    p = plan(budget, per_page=0, prefix_caching=caching)
    slots = 10 if caching else 4
    assert (p.state_slots, p.pages) == (slots, 4 * 8 + 16 * (slots - 4))
    assert p.cache_bytes == (slots + 1) * 1000 <= budget
    assert plan(budget, per_page=0, num_pages=9).pages == 9
    assert plan(budget, per_page=0, num_state_slots=6).state_slots == 6
    with pytest.raises(ValueError, match=r"at most max_num_seqs=2"):
        plan(3 * 1000 + 500, per_page=0)


def test_too_long_max_model_len_says_how_long_fits():
    budget = 1010 + 4000 + 50 * 10  # pad + 4 slots + 50 pages
    with pytest.raises(ValueError, match=r"at most max_model_len=800 fits"):
        plan(budget, max_pages_per_seq=51)
    assert plan(budget, max_pages_per_seq=50).pages == 50  # exactly what it said


def test_explicit_sizes_that_do_not_fit_say_how_many_do():
    budget = 1010 + 6000 + 100 * 10
    assert plan(budget, num_state_slots=6, num_pages=100).cache_bytes == budget
    with pytest.raises(ValueError, match=r"with 6 slots at most 100 pages fit"):
        plan(budget, num_state_slots=6, num_pages=101)
    with pytest.raises(ValueError, match=r"at most 6 state slots fit"):  # beside 8 pages
        plan(budget, num_state_slots=7)
    with pytest.raises(ValueError, match=r"at most 300 pages fit"):
        plan(budget, num_pages=301)
    with pytest.raises(ValueError, match=r"num_state_slots=3 < max_num_seqs=4"):
        plan(budget, num_state_slots=3)
    with pytest.raises(ValueError, match=r"at most max_num_seqs=1 "):  # nothing else fits either
        plan(1010 + 1500 + 8 * 10)


@pytest.mark.parametrize("bad", [0.0, 1.5, float("nan"), True, "0.9"])
def test_gpu_memory_utilization_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
        EngineConfig(gpu_memory_utilization=bad)


# Two rows and one 16-token chunk: 5 buckets, 9 step programs with the decode variants, and
# the 2 side programs. Sizing from device memory compiles every one of them for each cache it
# plans (up to four plans before a cache settles), so their count is what the tests below
# cost; none of what they assert depends on more rows or larger steps.
TINY = dict(max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def params():
    return init_params(config_from_preset("nemotron-h-tiny"), seed=0)


def device_bytes(llm) -> int:
    leaves = jax.tree.leaves((llm.runner.cache, llm.runner.slot_state))
    return sum(x.nbytes for x in leaves)


LIMIT, IN_USE = 40 << 20, 1 << 20  # the made-up device's memory_stats


@pytest.fixture
def fake_device(monkeypatch):
    fake = memory.DeviceMemory(LIMIT, IN_USE, "memory_stats")
    monkeypatch.setattr(memory, "device_memory", lambda device: fake)


def xla_program_bytes(llm) -> dict[tuple, int]:
    """What each program the engine can run needs beyond its arguments, from XLA's memory
    analysis of the program compiled here on the engine's live (donated) arrays: every
    bucket's step with each sampler program it runs (FULL with the token bitmask), `fork_fn`
    and `score_fn`. The step programs need at least their packed samples."""
    cfg, runner = llm.model_cfg, llm.runner
    builder = StepBuilder(runner.cache_spec, llm.engine_cfg.max_pages_per_seq, cfg.vocab_size,
                          cfg.chunk_size)  # fmt: skip
    buckets = llm.engine.scheduler.all_buckets()
    out = {}

    def need(compiled) -> int:
        analysis = compiled.memory_analysis()
        unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        return analysis.temp_size_in_bytes + max(unaliased, 0)

    for bucket, sampler in runner.programs(buckets):
        inputs = runner.program_inputs((bucket, sampler), builder.padding)  # FULL: + bitmask
        args, kwargs = runner.step_args(inputs, bucket.num_decode, sampler)
        out[bucket, sampler] = need(runner_mod.jitted_step.lower(*args, **kwargs).compile())
        packed_samples = (
            bucket.num_rows * (3 + 2 * MAX_LOGPROBS) * 4
        )  # i32[B, 3 + 2 * MAX_LOGPROBS]
        assert out[bucket, sampler] >= packed_samples, (bucket, sampler, out[bucket, sampler])
    padding = builder.padding(next(b for b in buckets if b.num_rows > b.num_decode))
    static = dict(model=runner.model, spec=runner.cache_spec)
    fork = runner_mod.jitted_fork.lower(runner.cache, *runner_mod.fork_inputs(padding), **static)
    out["fork",] = need(fork.compile())
    score = runner_mod.jitted_score.lower(runner.params, runner.slot_state.prompt_hidden,
                                          runner_mod.padding_targets(), **static)  # fmt: skip
    out["score",] = need(score.compile())
    return out


def reserved_temporaries(llm) -> int:
    """The bytes the plan left beside the cache: 0.5 x limit - in use - its budget."""
    return int(0.5 * LIMIT) - IN_USE - llm.cache_plan.budget


@pytest.fixture(scope="module")
def given_sizes(params):
    """An engine whose cache sizes are given (the plan reserves its programs' temporaries
    and checks the sizes fit), and what XLA says each of its programs needs. The sizes are
    the smallest cache (a slot a row, one sequence's pages), where the refusal test below
    compiles the same steps: the run's compilation cache hands them over."""
    with pytest.MonkeyPatch.context() as mp:
        fake = memory.DeviceMemory(LIMIT, IN_USE, "memory_stats")
        mp.setattr(memory, "device_memory", lambda device: fake)
        llm = LLM("nemotron-h-tiny", gpu_memory_utilization=0.5, params=params,
                  num_state_slots=2, num_pages=6, **TINY)  # fmt: skip
    return llm, xla_program_bytes(llm)


@pytest.fixture(scope="module")
def sized_from_memory(params):
    """An engine whose cache is sized from the made-up device's memory (the GPU/TPU path),
    how many programs its first `generate` compiled, and what XLA says each of its programs
    needs. Built once for the two tests that read it: sizing compiles every program at each
    cache it plans, the most expensive thing in this file."""
    with pytest.MonkeyPatch.context() as mp:
        fake = memory.DeviceMemory(LIMIT, IN_USE, "memory_stats")
        mp.setattr(memory, "device_memory", lambda device: fake)
        llm = LLM("nemotron-h-tiny", gpu_memory_utilization=0.5, params=params, **TINY)
    before = llm.runner.num_compiles
    prompts = [[256, *range(1, n)] for n in (3, 40, 70)]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4),
                 use_tqdm=False)  # fmt: skip
    return llm, llm.runner.num_compiles - before, xla_program_bytes(llm)


def test_the_budget_leaves_what_the_hungriest_program_needs(given_sizes):
    """The plan reserves the most any program of this engine needs at its cache's shapes,
    as XLA's analysis of each program compiled here says: not only the largest buckets'
    (a program that copies a cache array needs more, and a small bucket may)."""
    llm, needs = given_sizes
    assert reserved_temporaries(llm) == max(needs.values())
    assert len(needs) == len(llm.runner.programs(llm.engine.scheduler.all_buckets())) + 2


def test_llm_sized_from_device_memory_leaves_room_for_every_program(
    fake_device, params, sized_from_memory
):
    """The GPU/TPU path, on CPU with made-up memory_stats: the cache planned from the
    memory left after the weights leaves room for every program at the planned cache's
    shapes (XLA's analysis of each, compiled here on the engine's own arrays), and the
    arrays the runner allocates are the plan's."""
    llm, _, needs = sized_from_memory
    p = llm.cache_plan
    assert max(needs.values()) <= reserved_temporaries(llm)
    assert device_bytes(llm) == p.cache_bytes <= p.budget
    assert device_bytes(llm) + max(needs.values()) <= 0.5 * LIMIT - IN_USE
    assert llm.engine_cfg.state_slots == llm.runner.cache_spec.num_slots == p.state_slots
    assert llm.engine_cfg.pages == llm.runner.cache_spec.num_pages == p.pages
    assert p.checkpoint_slots > 0  # and more pages than the running rows at max_model_len:
    assert p.pages > llm.engine_cfg.max_num_seqs * llm.engine_cfg.max_pages_per_seq
    sp = SamplingParams(max_tokens=3)
    out = llm.generate(prompt_token_ids=[[256, 1, 2, 3]], sampling_params=sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"at most max_model_len=\d+ fits"):
        LLM("nemotron-h-tiny", gpu_memory_utilization=0.5, max_model_len=10**7, params=params)


def test_the_programs_compiled_for_sizing_are_the_ones_the_engine_runs(sized_from_memory):
    """Sizing compiles every program at the planned cache's shapes before the cache is
    allocated; the engine's runner takes them from the jit's cache: generating (prompts of
    3, 40 and 70 tokens: prefill chunks, mixed and decode steps) compiles nothing more."""
    _, compiled_by_generate, _ = sized_from_memory
    assert compiled_by_generate == 0


@pytest.fixture(autouse=True)
def release_executables():
    """Each test here compiles every program of several engines: freeing them after each
    test, not only after the module (tests/conftest.py), keeps this module's XLA:CPU
    executables under Linux's memory-map limit (without it, a compile late in this file
    crashed the process: SIGSEGV or SIGABRT inside XLA)."""
    yield
    jax.clear_caches()
    gc.collect()


def test_too_many_batched_tokens_are_refused_naming_the_largest_that_fits(monkeypatch, params):
    """A device with room for the smallest cache and the steps of 64 tokens, not 128: LLM
    refuses max_num_batched_tokens=128 at start-up, saying at most 64 fits (from XLA's
    analysis of every program), and starts with 64."""
    cfg = config_from_preset("nemotron-h-tiny")
    engine = dict(TINY, max_num_batched_tokens=128)
    small = EngineConfig(**TINY).for_chunk_size(cfg.chunk_size)
    spec = CacheSpec(small.max_num_seqs, small.max_pages_per_seq, small.page_size, "float32")
    builder = StepBuilder(spec, small.max_pages_per_seq, cfg.vocab_size, cfg.chunk_size)

    def most(max_tokens):  # the hungriest step of an engine with this token limit
        sized = EngineConfig(**dict(TINY, max_num_batched_tokens=max_tokens),
                             num_state_slots=spec.num_slots, num_pages=spec.num_pages)  # fmt: skip
        buckets = Scheduler(cfg, sized.for_chunk_size(cfg.chunk_size)).all_buckets()
        return max(runner_mod.step_temporary_bytes(cfg, params, spec, builder.padding(b),
                                                   b.num_decode) for b in buckets)  # fmt: skip

    fits, too_big = most(64), most(128)
    assert too_big > fits
    per_slot = memory.slot_bytes(cfg, 4, 4)
    per_page = memory.page_bytes(cfg, small.page_size, 4)
    smallest = ((spec.num_slots + 1) * per_slot + (spec.num_pages + 1) * per_page
                + memory.fixed_bytes(cfg, 4))  # fmt: skip
    room = smallest + (fits + too_big) // 2  # the smallest cache and the 64-token steps
    fake = memory.DeviceMemory(2 * (room + IN_USE), IN_USE, "memory_stats")
    monkeypatch.setattr(memory, "device_memory", lambda device: fake)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=128: .* at most "
                                         r"max_num_batched_tokens=64 fits"):  # fmt: skip
        LLM("nemotron-h-tiny", gpu_memory_utilization=0.5, params=params, **engine)
    llm = LLM("nemotron-h-tiny", gpu_memory_utilization=0.5, params=params,
              **dict(engine, max_num_batched_tokens=64))  # fmt: skip
    assert llm.cache_plan.state_slots >= TINY["max_num_seqs"]


def test_kv_cache_memory_bytes_sizes_the_cache(params):
    budget = 3 << 20
    llm = LLM("nemotron-h-tiny", kv_cache_memory_bytes=budget, enable_prefix_caching=False,
              params=params, **TINY)  # fmt: skip
    p = llm.cache_plan
    rows = TINY["max_num_seqs"]
    assert p.state_slots == rows and p.pages == rows * 6  # no caching: the running rows' needs
    assert device_bytes(llm) == p.cache_bytes <= budget
    with pytest.raises(ValueError, match=r"num_pages=100000 .* at most \d+ pages fit"):
        LLM("nemotron-h-tiny", kv_cache_memory_bytes=budget, num_pages=100_000, params=params,
            **TINY)  # fmt: skip


def test_bfloat16_state_counts_two_bytes_so_more_slots_fit(params):
    """mamba_ssm_cache_dtype="bfloat16": every recurrent state is bf16 (conv windows keep the
    model dtype), a slot is 2 bytes a state element smaller, and a budget holds more slots."""
    cfg = config_from_preset("nemotron-h-tiny")
    budget = 2 << 20
    llms = {
        ssm: LLM(
            "nemotron-h-tiny",
            kv_cache_memory_bytes=budget,
            num_pages=24,
            params=params,
            mamba_ssm_cache_dtype=ssm,
            **TINY,
        )
        for ssm in ("float32", "bfloat16")
    }
    f32, bf16 = (llms[k].cache_plan for k in ("float32", "bfloat16"))
    _, state = cfg.slot_state_elements()
    assert f32.per_slot - bf16.per_slot == 2 * state
    # The budget beside the pad slot, the pad page and the 24 pages goes to slots.
    rest = budget - bf16.fixed - bf16.per_slot - 25 * bf16.per_page
    assert bf16.state_slots == rest // bf16.per_slot > f32.state_slots
    cache = llms["bfloat16"].runner.cache
    assert {x.dtype for x in cache.ssm} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in cache.conv} == {jnp.dtype(jnp.float32)}
    assert llms["bfloat16"].runner.cache_spec.ssm_dtype == "bfloat16"
    assert {x.dtype for x in llms["float32"].runner.cache.ssm} == {jnp.dtype(jnp.float32)}
    assert device_bytes(llms["bfloat16"]) == bf16.cache_bytes <= budget


@pytest.mark.cpu_only
def test_cpu_max_model_len_beyond_host_memory_is_an_error_not_an_oom(params):
    cfg = config_from_preset("nemotron-h-tiny")
    need = 16 * (10**7 // 16) * memory.page_bytes(cfg, 16, 4)  # default pages, 8 rows x 2
    available = memory.host_available_bytes()
    if available is None or 0.9 * available > need:
        pytest.skip(f"this host has {available} bytes available: 10**7 tokens would fit")
    with pytest.raises(ValueError, match=r"max_model_len=10000000 .* at most max_model_len=\d+"):
        LLM("nemotron-h-tiny", max_model_len=10**7, params=params)


def test_host_meminfo_is_read(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemAvailable:    512 kB\n")
    assert memory.host_available_bytes(str(f)) == 512 * 1024
    assert memory.host_available_bytes(str(tmp_path / "missing")) is None
    assert np.isclose(memory.cache_budget(limit=100, in_use=10, utilization=0.9, temporaries=5), 75)
