"""Start-up of the engine with every bucket ready, cold vs warm compilation cache vs an
exported artifact, and where the time goes (tracing, lowering, XLA compile, cache reads).

Each phase runs in a fresh process, sharing one compilation-cache folder:

  cold      live engine, empty cache: trace + lower + compile every bucket
  warm      live engine again: trace + lower, executables read from the cache
  export    `jaxmamba export` of the same engine for this platform (not a start-up)
  art-cold  LLM(artifact): deserialize + compile (its modules are not the live ones)
  art-warm  LLM(artifact) again: deserialize, executables read from the cache

    python scripts/bench_cold_start.py --model nemotron-h-tiny --out /tmp/cold \
        [--max-num-seqs 4 --max-num-batched-tokens 128] [--phases cold,warm,...]

Prints one JSON line a phase and a table last. Per phase: seconds to import, to build the
LLM (weights, cache), to precompile, to the first token; the sums of JAX's own durations
(`/jax/core/compile/*` and `/jax/compilation_cache/*` monitoring events) over the process.
"""

from __future__ import annotations

import argparse
import json
import os
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


def child(args) -> None:
    t0 = time.perf_counter()
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

    t_import = time.perf_counter() - t0
    cache = dict(compilation_cache_dir=args.cache_dir)
    engine = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    phase = args.child
    if phase == "export":
        from jaxmamba.export.artifact import runtime_platform
        from jaxmamba.export.writer import export_artifact

        export_artifact(args.model, args.artifact, platforms=(runtime_platform(),),
                        engine=engine, dtype=args.dtype, overwrite=True)  # fmt: skip
        print(json.dumps({"phase": phase, "export_s": time.perf_counter() - t0, **sums}))
        return
    t1 = time.perf_counter()
    model = args.artifact if phase.startswith("art") else args.model
    kwargs = {} if phase.startswith("art") else dict(engine, dtype=args.dtype)
    llm = LLM(model, **kwargs, **cache)
    t_build = time.perf_counter() - t1
    t2 = time.perf_counter()
    n = llm.engine.precompile(show_progress=False)
    t_pre = time.perf_counter() - t2
    t3 = time.perf_counter()
    n_prompt = min(37, llm.engine_cfg.max_model_len // 2)
    prompt = [[(3 + i) % llm.model_cfg.vocab_size for i in range(n_prompt)]]
    out = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=16, temperature=0.0,
                                                      ignore_eos=True))  # fmt: skip
    t_first = time.perf_counter() - t3
    print(json.dumps({
        "phase": phase, "buckets": n, "import_s": t_import, "build_s": t_build,
        "precompile_s": t_pre, "generate_s": t_first,
        "start_to_ready_s": time.perf_counter() - t0 - t_first,
        "traces": llm.runner.num_compiles, **counts, **sums,
        "tokens": out[0].outputs[0].token_ids,
    }))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-h-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="/tmp/jaxmamba-cold-start")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--phases", default="cold,warm,export,art-cold,art-warm")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--artifact", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    cache_dir, artifact = os.path.join(args.out, "xla"), os.path.join(args.out, "artifact")
    shutil.rmtree(cache_dir, ignore_errors=True)
    rows = []
    for phase in args.phases.split(","):
        cmd = [sys.executable, __file__, "--child", phase, "--cache-dir", cache_dir,
               "--artifact", artifact, "--model", args.model, "--dtype", args.dtype,
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
               str(args.max_model_len), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens)]  # fmt: skip
        start = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if run.returncode != 0:
            print(f"{phase} failed:\n{run.stderr[-4000:]}", flush=True)
            break
        row = json.loads(run.stdout.strip().splitlines()[-1])
        row["process_s"] = wall
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = ["phase", "buckets", "process_s", "import_s", "build_s", "precompile_s",
            "start_to_ready_s", "trace_s", "lower_s", "compile_s", "cache_read_s", "hits",
            "misses"]  # fmt: skip
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                         for c in cols))  # fmt: skip
    live = [r["tokens"] for r in rows if r["phase"] in ("cold", "warm")]
    art = [r["tokens"] for r in rows if r["phase"].startswith("art")]
    if live and art:
        print("artifact tokens == live tokens:", all(t == live[0] for t in live + art))


if __name__ == "__main__":
    main()
