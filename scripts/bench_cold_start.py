"""Start-up of the engine with every bucket ready, from a live model, an exported artifact
(warm or cold compilation cache) and stored executables, and where the time goes (tracing,
lowering, XLA compile, cache reads).

Each phase runs in a fresh process, sharing one compilation-cache folder:

  cold      live engine, empty cache: trace + lower + compile every bucket
  warm      live engine again: trace + lower, executables read from the cache
  export    `jaxmamba export` of the same engine for this platform, --workers processes
            tracing and lowering (not a start-up)
  art-cold  LLM(artifact): deserialize + compile (its modules are not the live ones); with
            --save-executables it then stores what it compiled (ARTIFACT-exec)
  art-warm  LLM(artifact) again: deserialize, executables read from the cache
  art-exec  LLM(ARTIFACT-exec): load the stored executables, compile nothing
  live      the live engine without precompile: the greedy tokens every phase must give

    python scripts/bench_cold_start.py --model nemotron-h-tiny --out /tmp/cold \
        [--max-num-seqs 4 --max-num-batched-tokens 128] [--phases cold,warm,...]

Weights are random (`random_params`: a normal draw per tensor, the same in every process),
passed to every phase, so the artifact carries none. Prints one JSON line a phase and a
table last. Per phase: seconds to import, to build the LLM (weights, cache), to precompile,
to the first token; the sums of JAX's own durations (`/jax/core/compile/*` and
`/jax/compilation_cache/*` monitoring events) over the process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

EVENTS = {
    "trace_s": "/jax/core/compile/jaxpr_trace_duration",
    "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile_s": "/jax/core/compile/backend_compile_duration",
    "cache_read_s": "/jax/compilation_cache/cache_retrieval_time_sec",
    "saved_s": "/jax/compilation_cache/compile_time_saved_sec",
}


def random_params(model: str, dtype: str, seed: int = 0):
    """Random weights of `model`'s shapes: 0.02 x a standard normal per tensor, drawn on the
    device from `seed` (the same in every process). One small jit per tensor shape, so this
    costs seconds where `init_params` (Flax's init, which traces the model) compiles the
    whole model once more."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxmamba.llm import DTYPES, resolve_dtype
    from jaxmamba.model.families import load_config
    from jaxmamba.model.params import param_shapes

    name = {"bf16": "bfloat16", "fp32": "float32"}.get(d := resolve_dtype(dtype, model), d)
    leaves, tree = jax.tree.flatten(param_shapes(load_config(model), DTYPES[name]))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [normal(k, tuple(x.shape), x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )


def engine_settings(args) -> dict:
    """The engine of every phase; the cache sizes are given, so the live engine's memory
    probes compile steps precompile reuses and every phase has the artifact's cache."""
    from jaxmamba.engine.config import EngineConfig

    pages = EngineConfig(max_model_len=args.max_model_len).max_pages_per_seq
    return dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=False, num_state_slots=args.max_num_seqs,
                num_pages=args.max_num_seqs * pages)  # fmt: skip


def child(args) -> None:
    t0 = time.perf_counter()

    def mark(what: str) -> None:  # on stderr (the phase's log): where a slow phase was
        print(f"[{time.perf_counter() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    import jax

    sums = dict.fromkeys(EVENTS, 0.0)
    counts = {"hits": 0, "misses": 0}
    names = {v: k for k, v in EVENTS.items()}

    def on_duration(name, secs, **kw):
        if name in names:
            sums[names[name]] += secs

    def on_event(name, **kw):
        if name.endswith("cache_hits"):
            counts["hits"] += 1
        elif name.endswith("cache_misses"):
            counts["misses"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.export.compile_cache import setup_compilation_cache

    setup_compilation_cache(args.cache_dir)
    t_import = time.perf_counter() - t0
    mark("imported")
    engine = engine_settings(args)
    phase = args.child
    if phase == "export":
        from jaxmamba.export.artifact import runtime_platform
        from jaxmamba.export.writer import export_artifact

        per_bucket = {"worker": [], "here": []}  # seconds to trace and lower each step

        def record(msg: str) -> None:
            if m := re.search(r"in a worker \(([\d.]+) s\)$", msg):
                per_bucket["worker"].append(float(m[1]))
            elif m := re.match(r"exported .* in ([\d.]+) s$", msg):
                per_bucket["here"].append(float(m[1]))

        export_artifact(args.model, args.artifact, platforms=(runtime_platform(),),
                        engine=engine, dtype=args.dtype, weights=False, overwrite=True,
                        workers=args.workers, progress=record)  # fmt: skip
        secs = per_bucket["worker"] or per_bucket["here"]
        print(json.dumps({"phase": phase, "export_s": time.perf_counter() - t0,
                          "buckets": len(secs), "trace_lower_sum_s": sum(secs),
                          "trace_lower_per_bucket_s": sum(secs) / max(len(secs), 1),
                          "workers": args.workers, **sums}))  # fmt: skip
        return
    t1 = time.perf_counter()
    params = random_params(args.model, args.dtype)
    jax.block_until_ready(params)
    t_weights = time.perf_counter() - t1
    mark("weights ready")
    artifact = {"art-cold": args.artifact, "art-warm": args.artifact,
                "art-exec": args.artifact + "-exec"}.get(phase)  # fmt: skip
    if artifact is not None:
        llm = LLM(artifact, params=params)
    else:
        # The cache budget given: no memory probes (two compiles of the largest steps).
        llm = LLM(args.model, dtype=args.dtype, params=params, **engine,
                  kv_cache_memory_bytes=args.kv_cache_gib << 30)  # fmt: skip
    t_build = time.perf_counter() - t1
    mark(f"LLM built ({getattr(llm.runner, 'loaded_executables', 0)} executables loaded)")
    t2 = time.perf_counter()
    n = 0
    if phase != "live":
        buckets = llm.engine.scheduler.all_buckets()

        def progress(i, total, _bucket):
            if i == total or i % max(1, total // 8) == 0:
                mark(f"precompiled {i}/{total}")

        # `engine.precompile`, with the number of compile threads given.
        llm.runner.precompile(buckets, llm.engine.builder.padding, progress,
                              workers=args.compile_workers)  # fmt: skip
        n = len(llm.runner.programs(buckets))  # a decode bucket's sampler variant counts
    t_pre = time.perf_counter() - t2
    mark("every bucket ready")
    t3 = time.perf_counter()
    n_prompt = min(37, llm.engine_cfg.max_model_len // 2)
    prompt = [[(3 + 7 * i) % llm.model_cfg.vocab_size for i in range(n_prompt)]]
    out = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=16, temperature=0.0,
                                                      ignore_eos=True))  # fmt: skip
    t_first = time.perf_counter() - t3
    row = {
        "phase": phase, "buckets": n, "import_s": t_import, "weights_s": t_weights,
        "build_s": t_build, "precompile_s": t_pre, "generate_s": t_first,
        "start_to_ready_s": time.perf_counter() - t0 - t_first,
        "traces": llm.runner.num_compiles, **counts, **sums,
        "loaded_executables": getattr(llm.runner, "loaded_executables", 0),
        "tokens": out[0].outputs[0].token_ids,
    }  # fmt: skip
    if phase == "art-cold" and args.save_executables:
        from jaxmamba.export.writer import add_executables

        print(json.dumps(row), flush=True)  # the start-up's figures, before the copy
        t4 = time.perf_counter()
        shutil.rmtree(args.artifact + "-exec", ignore_errors=True)
        add_executables(args.artifact, args.artifact + "-exec", llm.runner)
        row["save_executables_s"] = time.perf_counter() - t4
        row["fresh_compiles"] = sum(fresh for _, fresh in llm.runner.compiled.values())
    print(json.dumps(row))


COLS = ["phase", "buckets", "process_s", "import_s", "weights_s", "build_s", "precompile_s",
        "start_to_ready_s", "trace_s", "lower_s", "compile_s", "cache_read_s", "hits", "misses",
        "loaded_executables"]  # fmt: skip


def table_row(row: dict | None) -> str:
    """One phase's row of the table (None: the header)."""
    if row is None:
        return "| " + " | ".join(COLS) + " |"
    return "| " + " | ".join(f"{row[c]:.1f}" if isinstance(row.get(c), float)
                             else str(row.get(c, "-")) for c in COLS) + " |"  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-h-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="/tmp/jaxmamba-cold-start")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--phases", default="cold,warm,export,art-cold,art-warm,art-exec")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="export: processes that trace and lower")  # fmt: skip
    p.add_argument("--save-executables", action="store_true",
                   help="art-cold stores what it compiled for art-exec")  # fmt: skip
    p.add_argument("--kv-cache-gib", type=int, default=48, help="live phases' cache budget")
    p.add_argument(
        "--compile-workers",
        type=int,
        help="precompile's threads (default: the runner's, one per core up to 8)",
    )
    p.add_argument(
        "--phase-timeout-s",
        type=float,
        default=float("inf"),
        help="stop a phase's process after this long (its log says where it was)",
    )
    p.add_argument(
        "--end-s",
        type=float,
        default=float("inf"),
        help="stop the running phase this many seconds after the start",
    )
    p.add_argument("--deadline-s", type=float, default=float("inf"),
                   help="start no phase after this many seconds")  # fmt: skip
    p.add_argument("--keep-cache", action="store_true", help="start from the cache there is")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--artifact", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    begin = time.monotonic()
    cache_dir, artifact = os.path.join(args.out, "xla"), os.path.join(args.out, "artifact")
    if not args.keep_cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    rows = []
    for phase in args.phases.split(","):
        if time.monotonic() - begin > args.deadline_s:
            print(f"deadline: skipping {phase}", flush=True)
            continue
        cmd = [sys.executable, __file__, "--child", phase, "--cache-dir", cache_dir,
               "--artifact", artifact, "--model", args.model, "--dtype", args.dtype,
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
               str(args.max_model_len), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens), "--workers", str(args.workers),
               "--kv-cache-gib", str(args.kv_cache_gib)]  # fmt: skip
        if args.save_executables:
            cmd.append("--save-executables")
        if args.compile_workers:
            cmd += ["--compile-workers", str(args.compile_workers)]
        timeout = min(args.phase_timeout_s, args.end_s - (time.monotonic() - begin))
        timeout = None if math.isinf(timeout) else max(1.0, timeout)
        log_path = os.path.join(args.out, f"{phase}.log")
        os.makedirs(args.out, exist_ok=True)
        start = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                     timeout=timeout)  # fmt: skip
                stdout, code = run.stdout, run.returncode
            except subprocess.TimeoutExpired as err:
                stdout, code = err.stdout or "", None
                if isinstance(stdout, bytes):
                    stdout = stdout.decode(errors="replace")
        wall = time.perf_counter() - start
        with open(log_path) as log:
            marks = [line.rstrip() for line in log if line.startswith("[")]
        lines = [line for line in stdout.strip().splitlines() if line.startswith("{")]
        if code != 0:
            why = f"timed out after {wall:.0f} s" if code is None else f"exited {code}"
            with open(log_path) as log:
                tail = log.read()[-3000:]
            print(f"{phase} {why}; its marks: {marks}\n{tail if code else ''}", flush=True)
            if not lines:
                continue
        row = json.loads(lines[-1])
        row["process_s"] = wall
        row["marks"] = marks
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(table_row(row), flush=True)
    print(table_row(None))
    for r in rows:
        print(table_row(r))
    tokens = {r["phase"]: r["tokens"] for r in rows if "tokens" in r}
    if len(tokens) > 1:
        first = next(iter(tokens.values()))
        same = {phase: t == first for phase, t in tokens.items()}
        print("greedy tokens equal across phases:", all(same.values()), same)


if __name__ == "__main__":
    main()
