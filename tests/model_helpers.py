"""Test helpers: build runners and steps directly, below the LLM API; and check that an `LLM`
gave back every slot, page and prefix-cache node."""

from __future__ import annotations

import jax.extend
import jax.numpy as jnp
import numpy as np

from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.model.cache import CacheSpec

PAGE_SIZE = 4
MAX_PAGES = 32


def make_runner(cfg, params, *, num_slots=8, dtype=jnp.float32) -> ModelRunner:
    spec = CacheSpec(num_slots=num_slots, num_pages=num_slots * MAX_PAGES, page_size=PAGE_SIZE)
    return ModelRunner(cfg, params, spec, dtype=dtype)


def builder(runner: ModelRunner) -> StepBuilder:
    cfg = runner.cfg
    return StepBuilder(runner.cache_spec, MAX_PAGES, cfg.vocab_size, cfg.chunk_size)


def pages_for(slot: int, length: int) -> list[int]:
    """A fixed page range per slot, enough for `length` tokens."""
    return [slot * MAX_PAGES + i for i in range(-(-length // PAGE_SIZE))]


def row(tokens, prefix_len, slot, **kw) -> RowSpec:
    return RowSpec(
        tokens=list(tokens),
        prefix_len=prefix_len,
        state_slot=slot,
        pages=pages_for(slot, prefix_len + len(tokens)),
        **kw,
    )


def prefill_logits(runner: ModelRunner, rows: list[RowSpec], num_tokens: int | None = None):
    """Run one prefill step over `rows`; returns per-row logits arrays `[len, V]` (numpy)."""
    total = sum(len(r.tokens) for r in rows)
    bucket = Bucket(num_tokens or total, len(rows), 0)
    inputs = builder(runner).build(rows, bucket)
    logits = np.asarray(runner.forward_logits(inputs, 0))
    out, start = [], 0
    for r in rows:
        out.append(logits[start : start + len(r.tokens)])
        start += len(r.tokens)
    return out


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


# Primitives a step must not contain: each waits for the host.
FORBIDDEN = ("callback", "infeed", "outfeed")


def primitive_names(jaxpr) -> set[str]:
    """Every primitive of `jaxpr`, sub-jaxprs included, except inside a Pallas kernel: a
    `cond` there is a branch of the kernel's own code on the device (Triton's `scf.if`), not
    an XLA conditional (the GPU conv kernel branches on whether a tile is interior)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= primitive_names(sub)
    return names


def assert_nothing_leaks(llm) -> None:
    """No request is left in `llm`'s engine, every state slot not free holds a prefix-cache
    checkpoint, and resetting the prefix cache frees every slot, page and node."""
    engine = llm.engine
    scheduler = engine.scheduler
    assert not engine.has_unfinished_requests()
    assert not scheduler.running and not scheduler.waiting and not scheduler.pending_branches
    cache = scheduler.prefix_cache
    checkpoints = cache.num_checkpoints if cache is not None else 0
    assert scheduler.slots.num_free + checkpoints == scheduler.slots.capacity
    llm.reset_prefix_cache()
    assert scheduler.slots.num_free == scheduler.slots.capacity
    assert scheduler.pages.num_free == scheduler.pages.capacity
    if cache is not None:
        assert cache.num_nodes == 0 and cache.num_checkpoints == 0


def assert_same_token_distribution(a: np.ndarray, b: np.ndarray, positions) -> None:
    """Two runs' sampled tokens ``[samples, tokens]`` follow one distribution at each of
    `positions`: a chi-square test of homogeneity (tokens seen fewer than 10 times pooled)."""
    from scipy import stats

    for position in positions:
        x, y = a[:, position], b[:, position]
        table = np.array([[np.sum(x == c), np.sum(y == c)] for c in np.union1d(x, y)])
        big = table.sum(1) >= 10  # pool the rare tokens
        table = np.vstack([table[big], table[~big].sum(0)]) if (~big).any() else table[big]
        table = table[table.sum(1) > 0]
        if len(table) > 1:
            assert stats.chi2_contingency(table).pvalue > 1e-4, (position, table)
