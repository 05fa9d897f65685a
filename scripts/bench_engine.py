"""Whole-model benchmark on an accelerator: `jaxmamba.bench.bench_one_batch` over a sweep,
one process (the parameters are initialised once), each case guarded so one failure does
not lose the others; stops starting cases when the time budget runs out.

    python scripts/bench_engine.py --model nemotron-nano-9b-v2 --budget-s 480 \
        --cases p8x2048 d1 d128 --compare-tokens 8192 --out $OUT/bench.json \
        --profile-cases p8x2048 d1

A prefill case times one step of B x L tokens; a decode case fills the cache in prefills of at
most 32k tokens, then times decode steps (greedy rows that ask no logprobs: the argmax-only
sampler; `--plain-sampler-too` and `--full-sampler-too` time the sort-free sampler that draws
and ranks and the full sampler on the same steps as well, rows `decode-plain`, `decode-full`).
`--profile-cases` runs those cases once more under the JAX profiler and prints where the device
time goes (kernels per step, busy vs span, top kernels). `--command-buffer-cases d1 d32` runs
those decode cases again for each `--command-buffer-values` entry, the step compiled with
`xla_gpu_enable_command_buffer` set to it (row `decode cb=VALUE`; '' turns CUDA graphs off).
Every case prints its result row when it finishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from trace_summary import format_trace_summary, summarize_trace

from jaxmamba.bench import BenchResult, bench_one_batch, format_results
from jaxmamba.engine import runner as runner_module
from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.kernels.mamba_decode import FUSED_ENV
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.families import load_config
from jaxmamba.model.params import init_params


def pallas_vs_ref_logits(cfg, params, num_tokens: int, dtype) -> dict:
    """One prefill of `num_tokens` with the references and with the platform's kernels."""
    spec = CacheSpec(num_slots=1, num_pages=-(-num_tokens // 16), page_size=16)
    builder = StepBuilder(spec, spec.num_pages, cfg.vocab_size, cfg.chunk_size)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, num_tokens).tolist()
    inputs = builder.build([RowSpec(tokens, 0, 0, list(range(spec.num_pages)))],
                           Bucket(num_tokens, 1, 0))  # fmt: skip
    out = {}
    for impl in ("ref", "auto"):
        runner = ModelRunner(cfg, params, spec, dtype=dtype, impl=impl)
        logits = runner.forward_logits(inputs, 0)
        jax.block_until_ready(logits)
        start = time.perf_counter()
        for _ in range(3):
            runner.cache = jax.tree.map(jnp.zeros_like, runner.cache)
            logits = jax.block_until_ready(runner.forward_logits(inputs, 0))
        out[f"{impl}_s"] = (time.perf_counter() - start) / 3
        out[impl] = np.asarray(logits[-64:], np.float32)
    diff = np.abs(out["auto"] - out["ref"])
    scale = float(np.abs(out["ref"]).max())
    return {"tokens": num_tokens, "max_abs_diff": float(diff.max()), "logit_scale": scale,
            "argmax_agree": float(np.mean(out["auto"].argmax(-1) == out["ref"].argmax(-1))),
            "ref_s": out["ref_s"], "kernels_s": out["auto_s"]}  # fmt: skip


def command_buffer_jit(value: str):
    """`runner.jitted_step` compiled with `xla_gpu_enable_command_buffer=value`."""
    return jax.jit(
        runner_module.step_fn,
        static_argnames=("model", "spec", "num_decode", "sampler"),
        donate_argnames=("cache", "slot_state"),
        compiler_options={"xla_gpu_enable_command_buffer": value},
    )


def command_buffers_in_hlo(value: str | None) -> int:
    """How many command-buffer calls XLA puts in a program of 8 dependent fusions (a check
    that the option reaches the compiler; 0 off the GPU)."""

    def chain(x):
        for i in range(8):
            x = jnp.sin(x @ x) + i
        return x

    options = {} if value is None else {"xla_gpu_enable_command_buffer": value}
    text = jax.jit(chain).lower(jnp.ones((64, 64))).compile(options).as_text()
    return text.count("command_buffer")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-nano-9b-v2")
    p.add_argument(
        "--cases",
        nargs="*",
        default=[
            "p8x2048",
            "d1",
            "d128",
            "p1x2048",
            "d32",
            "d256",
            "p8x512",
            "p1x512",
            "p32x512",
            "p32x2048",
        ],  # fmt: skip
        help="pBxL: prefill of B rows of L tokens; dB: decode at batch B (in this order)",
    )
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--impl", default="auto")
    p.add_argument(
        "--small-m-impls",
        nargs="+",
        default=["default"],
        help="run every case once per value: 'default' (the model's choice for --impl), 'xla' "
        "(XLA's dot) or the impl of small_m_matmul "
        "for the projections of decode-sized steps (e.g. 'auto')",
    )
    p.add_argument(
        "--fused-mamba-decode",
        nargs="+",
        default=["default"],
        choices=["default", "1", "0"],
        help="run every case once per value: $JAXMAMBA_FUSED_MAMBA_DECODE for the decode "
        "step (1: the fused kernels, 0: the conv and state-update chain, default: unset)",
    )
    p.add_argument(
        "--prefill-steps",
        nargs="+",
        type=int,
        default=[1],
        help="time each prefill case once per value: that many steps back to back, their time "
        "divided by their number (1: one call to its output on the host; N > 1: the device's "
        "time a step, row 'prefill xN')",
    )
    p.add_argument(
        "--no-fill-cache",
        action="store_true",
        help="decode cases skip the set-up prefills (bench_one_batch fill_cache=False)",
    )
    p.add_argument("--compare-tokens", type=int, default=0, help="pallas-vs-ref prefill check")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--out", default="bench.json")
    p.add_argument("--profile-cases", nargs="*", default=[], help="cases to profile too")
    p.add_argument("--profile-top", type=int, default=15,
                   help="kernels listed per profile (every one goes to --out)")  # fmt: skip
    p.add_argument("--trace-dir", default="/tmp/jaxmamba-bench-traces")
    p.add_argument("--fast-weights", action="store_true",
                   help="random weights from bench_cold_start.random_params (seconds) instead "
                   "of init_params (which compiles Flax's init of the whole model)")  # fmt: skip
    p.add_argument("--plain-sampler-too", action="store_true",
                   help="decode cases: time the sort-free sampler that draws and ranks too "
                   "(row decode-plain)")  # fmt: skip
    p.add_argument("--full-sampler-too", action="store_true",
                   help="decode cases: time the full sampler too (row decode-full)")  # fmt: skip
    p.add_argument("--command-buffer-cases", nargs="*", default=[],
                   help="decode cases to run again per --command-buffer-values")  # fmt: skip
    p.add_argument("--command-buffer-values", nargs="*", default=[""],
                   help="values of xla_gpu_enable_command_buffer ('' = off)")  # fmt: skip
    args = p.parse_args()
    t0 = time.perf_counter()
    cfg = load_config(args.model)
    dtype = jnp.bfloat16
    if args.fast_weights:
        from bench_cold_start import random_params  # scripts/ is on the path

        params = jax.block_until_ready(random_params(args.model, "bf16"))
    else:
        params = jax.block_until_ready(init_params(cfg, dtype, seed=0))
    print(f"{jax.devices()[0].device_kind}: {args.model} random bf16 weights "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    cases = [
        ("prefill", *map(int, c[1:].split("x"))) if c[0] == "p"
        else ("decode", int(c[1:]), args.decode_context)
        for c in args.cases
    ]  # fmt: skip
    if args.command_buffer_cases:
        for value in [None, *args.command_buffer_values]:
            print(f"command buffers in a test program, option {value!r}: "
                  f"{command_buffers_in_hlo(value)}", flush=True)  # fmt: skip
    results: list[BenchResult] = []
    profiles: list[str] = []
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": []}
    runs = [(*case, small_m, fused, None, steps) for case in cases
            for small_m in args.small_m_impls for fused in args.fused_mamba_decode
            for steps in (args.prefill_steps if case[0] == "prefill" else [1])]  # fmt: skip
    runs += [
        ("decode", int(c[1:]), args.decode_context, args.small_m_impls[0],
         args.fused_mamba_decode[0], value, 1)
        for value in args.command_buffer_values
        for c in args.command_buffer_cases
    ]  # fmt: skip
    default_jit = runner_module.jitted_step
    for phase, batch, length, small_m, fused, command_buffer, prefill_steps in runs:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: skipping {phase} {batch}x{length}")
            continue
        start = time.perf_counter()
        case = f"{phase[0]}{batch}" + (f"x{length}" if phase == "prefill" else "")
        name = case + (f"-small_m_{small_m}" if len(args.small_m_impls) > 1 else "")
        name += f"-fused_{fused}" if len(args.fused_mamba_decode) > 1 else ""
        os.environ.pop(FUSED_ENV, None)
        if fused != "default":
            os.environ[FUSED_ENV] = fused
        if len(args.fused_mamba_decode) > 1:
            jax.clear_caches()  # the step's jit is module-level: retrace, reading the switch
        if command_buffer is not None:
            name += f"-cb={command_buffer}"
        if prefill_steps > 1:
            name += f"-x{prefill_steps}"
        print(f"{name}: small_m_impl={small_m}", flush=True)
        trace_dir = f"{args.trace_dir}/{name}" if case in args.profile_cases else None
        try:
            runner_module.jitted_step = default_jit
            if command_buffer is not None:  # a jit of its own: the runner picks it up
                runner_module.jitted_step = command_buffer_jit(command_buffer)
            res = bench_one_batch(cfg, params, batch=batch, input_len=length,
                                  output_len=args.output_len, dtype=dtype, impl=args.impl,
                                  small_m_impl=None if small_m == "default" else small_m,
                                  repeats=3, phases=(phase,), trace_dir=trace_dir,
                                  fill_cache=not args.no_fill_cache,
                                  log=lambda m: print(m, flush=True),
                                  time_plain_sampler=args.plain_sampler_too and
                                  command_buffer is None,
                                  prefill_steps=prefill_steps,
                                  time_full_sampler=args.full_sampler_too and
                                  command_buffer is None)  # fmt: skip
            if command_buffer is not None:
                res = [dataclasses.replace(r, phase=f"{r.phase} cb={command_buffer or 'off'}")
                       for r in res]  # fmt: skip
            if prefill_steps > 1:
                res = [dataclasses.replace(r, phase=f"{r.phase} x{prefill_steps}") for r in res]
            results += res
            print(format_results(res), flush=True)
            record["cases"] += [dict(r.__dict__, small_m_impl=small_m, fused_mamba_decode=fused)
                                for r in res]  # fmt: skip
            if trace_dir:
                steps = 1 if phase == "prefill" else args.output_len
                summary = summarize_trace(f"{trace_dir}/{phase}", steps, top=None)
                record.setdefault("profiles", {})[name] = summary
                shown = dict(summary, top=summary["top"][: args.profile_top])
                profiles.append(format_trace_summary(f"{name} ({args.impl})", shown))
        except Exception:  # noqa: BLE001 - report and carry on with the next case
            traceback.print_exc()
            record["cases"].append(
                {"phase": phase, "batch": batch, "error": traceback.format_exc()}
            )
        finally:
            runner_module.jitted_step = default_jit
        print(f"{phase} {batch}x{length}: {time.perf_counter() - start:.0f} s", flush=True)
    if args.compare_tokens and time.perf_counter() - t0 < args.budget_s:
        try:
            record["pallas_vs_ref"] = pallas_vs_ref_logits(cfg, params, args.compare_tokens, dtype)
            print("pallas vs ref:", record["pallas_vs_ref"])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("\n\n".join(profiles))
    print(format_results(results))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
