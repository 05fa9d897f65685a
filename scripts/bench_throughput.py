"""Offline throughput through `LLM.generate`, as `vllm bench throughput` runs it on its random
dataset (`jaxmamba bench throughput` is that command; this script adds the profiled pass):
every request at once, prompt and output lengths uniform over `--input-len LOW HIGH` and
`--output-len LOW HIGH`, `ignore_eos`, temperature 1.

Prefix caching is off unless asked for (the prompts share nothing) and the cache is sized by
`--kv-cache-gib` (no memory probing at start-up). Three passes over requests of the same
lengths (fresh random tokens each time): a warm-up that compiles every bucket the schedule
meets, the timed pass (`jaxmamba.bench_throughput.timed_generate`: output tokens/s), and a
pass driven step by step through the engine whose steps `--profile-from`..+`--profile-steps`
run under the JAX profiler: the device's busy time over that window's span shows how much of
a step the host costs (a host-bound loop leaves the device idle).
That pass also times the host's share of each step: dispatching (schedule, build the inputs,
transfer them, launch) and post-processing (after the wait for the step's output), and counts
the host-to-device transfers of a step (one per input array).

    python3 scripts/bench_throughput.py [--model nemotron-nano-9b-v2] [--num-prompts 64]
        [--input-len 256 1024] [--output-len 64 256] [--out throughput.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
from trace_summary import (
    device_kernel_events,
    format_trace_summary,
    kernel_table,
    load_trace_events,
)

from jaxmamba import LLM
from jaxmamba.bench_throughput import (
    bench_sampling_params,
    random_requests,
    redraw_prompts,
    timed_generate,
    token_pool,
)


def busy_seconds(kernels: list[dict]) -> float:
    """The time some stream of the device is running something (overlaps counted once)."""
    busy, end = 0.0, -float("inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy * 1e-6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-nano-9b-v2")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[256, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 256])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kv-cache-gib", type=float, default=40.0, help="cache size (no probing)")
    p.add_argument("--prefix-caching", action="store_true", help="random prompts share nothing")
    p.add_argument("--profile-from", type=int, default=40)
    p.add_argument("--profile-steps", type=int, default=24)
    p.add_argument("--profile-top", type=int, default=0, help="kernels to list of the window")
    p.add_argument("--trace-dir", default="/tmp/jaxmamba-throughput-trace")
    p.add_argument("--out", default="throughput.json")
    p.add_argument("--fast-weights", action="store_true",
                   help="random weights from bench_cold_start.random_params (seconds)")  # fmt: skip
    args = p.parse_args()
    t0 = time.perf_counter()
    weights = {}
    if args.fast_weights:
        from bench_cold_start import random_params  # scripts/ is on the path

        weights["params"] = random_params(args.model, "bf16")
    llm = LLM(
        args.model,
        **weights,
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.input_len[1] + args.output_len[1] + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
    )
    pool = token_pool(llm.model_cfg.vocab_size, llm.get_tokenizer())
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, pool)
    run = dict(temperature=args.temperature, use_tqdm=False)

    print(
        f"{jax.devices()[0].device_kind}: LLM ready in {time.perf_counter() - t0:.0f} s", flush=True
    )
    record = {
        "args": vars(args),
        "input_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }
    warmup, _ = timed_generate(llm, redraw_prompts(requests, 0, pool, seed=1), **run)
    record["warmup_s"] = warmup.elapsed_time
    before = llm.engine.counters()
    result, _ = timed_generate(llm, requests, **run)
    after = llm.engine.counters()
    elapsed = result.elapsed_time
    record.update(
        timed_s=elapsed,
        output_tokens_per_s=result.output_tokens_per_second,
        total_tokens_per_s=result.tokens_per_second,
        requests_per_s=result.requests_per_second,
        compiles_in_timed_pass=result.compilations,
        steps={k: after[k] - before[k] for k in after if k.endswith("steps")},
    )
    print(json.dumps(record), flush=True)

    # The profiled window: the same schedule again, step by step, its host phases timed.
    engine = llm.engine
    host = {"dispatch_s": 0.0, "wait_s": 0.0, "postprocess_s": 0.0, "steps": 0, "h2d": 0}
    dispatch, postprocess, put = engine._dispatch, engine._postprocess, engine.runner._put_inputs

    def timed_dispatch():
        start = time.perf_counter()
        out = dispatch()
        host["dispatch_s"] += time.perf_counter() - start
        host["steps"] += out is not None
        return out

    def timed_postprocess(step, packed):
        start = time.perf_counter()
        jax.block_until_ready(packed)
        waited = time.perf_counter()
        out = postprocess(step, packed)
        host["wait_s"] += waited - start
        host["postprocess_s"] += time.perf_counter() - waited
        return out

    def counted_put(inputs):
        host["h2d"] += len(jax.tree.leaves(inputs))
        return put(inputs)

    engine._dispatch, engine._postprocess = timed_dispatch, timed_postprocess
    engine.runner._put_inputs = counted_put
    profiled = redraw_prompts(requests, 0, pool, seed=3)
    params = bench_sampling_params(profiled, temperature=args.temperature)
    for i, (r, sp) in enumerate(zip(profiled, params, strict=True)):
        engine.add_request(
            f"profiled-{i}", {"prompt": None, "prompt_token_ids": r.prompt_token_ids}, sp
        )
    step = 0
    window = None
    while engine.has_unfinished_requests():
        if step == args.profile_from:
            jax.profiler.start_trace(args.trace_dir)
            window = time.perf_counter()
        engine.step()
        step += 1
        if window is not None and step == args.profile_from + args.profile_steps:
            jax.block_until_ready(engine.runner.cache)
            span = time.perf_counter() - window
            jax.profiler.stop_trace()
            window = None
            kernels = device_kernel_events(load_trace_events(args.trace_dir))
            busy = busy_seconds(kernels)
            record["profiled_window"] = {
                "steps": args.profile_steps,
                "wall_s": span,
                "device_busy_s": busy,
                "busy_fraction": busy / span,
                "wall_ms_per_step": span / args.profile_steps * 1e3,
                "kernels": kernel_table(kernels, args.profile_steps, top=args.profile_top),
            }
    engine._dispatch, engine._postprocess, engine.runner._put_inputs = dispatch, postprocess, put
    n = max(host["steps"], 1)
    record["host_per_step"] = {
        "dispatch_ms": host["dispatch_s"] / n * 1e3,
        "postprocess_ms": host["postprocess_s"] / n * 1e3,
        "wait_ms": host["wait_s"] / n * 1e3,
        "h2d_transfers": host["h2d"] / n,
        "steps": host["steps"],
        "sampler_steps": dict(getattr(engine.runner, "variant_steps", {})),
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    window = record.get("profiled_window", {})
    if window:
        last = args.profile_from + args.profile_steps - 1
        print(format_trace_summary(f"profiled window, steps {args.profile_from}..{last}",
                                   window["kernels"]))  # fmt: skip
    print(json.dumps({k: v for k, v in window.items() if k != "kernels"}))
    print("host per step:", json.dumps(record["host_per_step"]), flush=True)
    print(
        f"throughput: {args.num_prompts} requests, {record['input_tokens']} prompt + "
        f"{record['output_tokens']} output tokens in {elapsed:.2f} s: "
        f"{record['output_tokens_per_s']:,.0f} output tok/s, "
        f"{record['total_tokens_per_s']:,.0f} total tok/s; steps {record['steps']}"
    )


if __name__ == "__main__":
    main()
