"""The persistent compilation cache: a second process that precompiles the same engine loads
every bucket's executable from the cache instead of compiling it (JAX's own cache-hit and
miss events, counted in each process), the cache's folder is named at start-up, and
`compilation_cache=False` writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, time
import jax
events = {}
jax.monitoring.register_event_listener(lambda name, **kw: events.__setitem__(
    name, events.get(name, 0) + 1))
saved = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: saved.append(secs) if name.endswith("compile_time_saved_sec")
    else None)
from jaxmamba import LLM
start = time.perf_counter()
llm = LLM("nemotron-h-tiny", max_num_seqs=1, max_model_len=32, max_num_batched_tokens=8,
          max_prefill_seqs=1, compilation_cache=sys.argv[2] == "on",
          compilation_cache_dir=sys.argv[1])
# The decode bucket only (XLA:CPU takes ~10 s a prefill bucket of even this model).
buckets = llm.engine.scheduler.all_buckets()[: int(sys.argv[3])]
llm.runner.precompile(buckets, llm.engine.builder.padding)
print(json.dumps({
    "seconds": time.perf_counter() - start,
    "buckets": len(buckets),
    "programs": len(llm.runner.programs(buckets)),
    "traces": llm.runner.num_compiles,
    "hits": events.get("/jax/compilation_cache/cache_hits", 0),
    "misses": events.get("/jax/compilation_cache/cache_misses", 0),
    "saved_s": sum(saved),
}))
"""


def _run(cache_dir: Path, mode: str = "on", buckets: int = 1) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache_dir), mode, str(buckets)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_second_process_loads_every_bucket_from_the_cache(tmp_path):
    cache = tmp_path / "xla"
    cold, stderr = _run(cache)
    assert f"XLA compilation cache at {cache}" in stderr
    # One decode bucket: its step and its two sampler variants (`ModelRunner.programs`).
    assert cold["buckets"] == 1 and cold["programs"] == 3
    assert cold["traces"] == cold["programs"]
    assert cold["hits"] == 0 and cold["misses"] >= cold["programs"]
    entries = sorted(p.name for p in cache.iterdir())
    assert sum("step_fn" in e for e in entries) >= cold["programs"], entries
    warm, _ = _run(cache)
    # The model is traced and lowered again (the cache key is the lowered module), but no
    # step compiles: every executable comes from the cache.
    assert warm["traces"] == warm["programs"]
    assert warm["misses"] == 0 and warm["hits"] >= warm["programs"], warm
    assert warm["saved_s"] > 0
    print(f"precompile of {cold['buckets']} bucket(s): cold {cold['seconds']:.1f} s, warm "
          f"{warm['seconds']:.1f} s (XLA compile time saved {warm['saved_s']:.1f} s)")  # fmt: skip


def test_cache_off_writes_nothing(tmp_path):
    cache = tmp_path / "off"
    off, stderr = _run(cache, "off", buckets=0)
    assert off["hits"] == 0 and off["misses"] == 0
    assert not cache.exists() or not any(cache.iterdir())
    assert "XLA compilation cache at" not in stderr


def test_precompile_reuses_the_memory_probes_executables():
    """GPU memory sizing compiles the largest decode and prefill steps for XLA's memory
    analysis; with the cache sizes given, those probes have the engine's own shapes, and
    `precompile` takes their executables instead of tracing or compiling them again. It
    compiles only the programs the probes lack: the decode bucket's sampler variants (the
    probes are FULL programs with the token bitmask, as the runner's are)."""
    import jax
    import jax.numpy as jnp

    from jaxmamba.engine.batch import StepBuilder
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.engine.runner import ModelRunner
    from jaxmamba.engine.scheduler import Scheduler
    from jaxmamba.llm import _largest_step_temporaries
    from jaxmamba.model.cache import CacheSpec
    from jaxmamba.model.families import config_from_preset
    from jaxmamba.model.params import init_params

    cfg = config_from_preset("nemotron-h-tiny")
    engine = EngineConfig(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=16,
                          max_prefill_seqs=1, num_state_slots=3, num_pages=5)  # fmt: skip
    engine = engine.for_chunk_size(cfg.chunk_size)
    params = init_params(cfg, seed=1)
    assert _largest_step_temporaries(cfg, engine, params, jnp.float32, "auto") > 0
    spec = CacheSpec(engine.state_slots, engine.pages, engine.page_size)
    runner = ModelRunner(cfg, params, spec)
    probes = runner.num_compiles  # the probes' traces: same model and cache shapes
    assert probes >= 2
    buckets = Scheduler(cfg, engine).all_buckets()
    largest = [max((b for b in buckets if (b.num_decode == b.num_rows) == d),
                   key=lambda b: (b.num_tokens, b.num_rows)) for d in (True, False)]  # fmt: skip
    compiles = []
    listener = lambda name, secs, **kw: compiles.append(name) if name.endswith(  # noqa: E731
        "backend_compile_duration") else None  # fmt: skip
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        builder = StepBuilder(spec, engine.max_pages_per_seq, cfg.vocab_size, cfg.chunk_size)
        runner.precompile(largest, builder.padding)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    variants = [p for p in runner.programs(largest) if p[1] != "full"]
    # the decode bucket's sort-free and argmax-only samplers
    assert len(variants) == 2
    side = 2  # with a prefill bucket: the fork and prompt_logprobs programs (run_side_programs)
    assert runner.num_compiles == probes + len(variants) + side, (
        "precompile traced a probed bucket again")  # fmt: skip
    assert len(compiles) == len(variants) + side, f"precompile compiled {len(compiles)} programs"
