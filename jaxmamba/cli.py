"""Command line: `jaxmamba generate`, `bench`, `serve`, `export`, `aot` and `convert`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

DEMO_MODEL = "nemotron-h-demo"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEMO_MODEL,
        help=f"preset name, YAML path or HF checkpoint directory (default: {DEMO_MODEL}, the "
        "built-in model trained on Python's standard library)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: the checkpoint's torch_dtype; float32 for random-weight presets",
    )
    p.add_argument("--seed", type=int, default=0)


def _add_state_dtype_arg(p: argparse.ArgumentParser) -> None:
    from jaxmamba.engine.config import MAMBA_SSM_CACHE_DTYPES, EngineConfig

    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == "mamba_ssm_cache_dtype")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default=field.default,
        choices=list(MAMBA_SSM_CACHE_DTYPES),
        help=f"{field.metadata['help']} (default: {field.default})",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=_positive_int, default=8)
    p.add_argument("--max-model-len", type=_positive_int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the device's memory for weights, step temporaries and the cache, "
        "which gets the rest (GPU/TPU; on CPU the cache's sizes are checked against it x the "
        "host's available memory)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=_positive_int,
        help="the cache's size in bytes (state slots and KV pages), instead of sizing it from "
        "--gpu-memory-utilization",
    )
    p.add_argument(
        "--num-state-slots",
        type=_positive_int,
        help="state slots (running rows + prefix-cache checkpoints); default: sized",
    )
    p.add_argument("--num-pages", type=_positive_int, help="KV pages; default: sized")
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="split the model over this many devices (docs/tensor_parallel.md)",
    )
    _add_state_dtype_arg(p)


def _llm(args):
    from jaxmamba import LLM
    from jaxmamba.export.cli import cache_kwargs

    return LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_state_slots=args.num_state_slots,
        num_pages=args.num_pages,
        tensor_parallel_size=args.tensor_parallel_size,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        seed=args.seed,
        **cache_kwargs(args),
    )


def cmd_generate(args) -> int:
    from jaxmamba import SamplingParams

    llm = _llm(args)
    plan = getattr(llm, "cache_plan", None)  # an exported artifact's LLM brings its own sizes
    if plan is not None:
        print(plan.describe(), file=sys.stderr)
    prompts = args.prompt or ["def main(", "import os\n", "class Config:\n    def "]
    # One seed per prompt: with a shared seed, requests draw the same random numbers.
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed + i,
            ignore_eos=args.ignore_eos,
        )
        for i in range(len(prompts))
    ]
    # The second pass reuses the compiled buckets; its prompts hit the prefix cache, so its
    # prefills are shorter and may meet a bucket the first pass did not (one more compile).
    for run in ("first pass, compiles buckets as it meets them", "second pass, same prompts"):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        print(
            f"[{run}] {len(outs)} requests, {prompt_tokens} prompt ({cached} from the prefix "
            f"cache) + {generated} generated tokens in {elapsed:.2f} s: "
            f"{generated / elapsed:.1f} generated tokens/s "
            f"({llm.runner.num_compiles} compilations so far)"
        )
    for out in outs:
        completion = out.outputs[0]
        print(f"\n--- {out.prompt!r} [{completion.finish_reason}]\n{out.prompt}{completion.text}")
    return 0


def cmd_bench(args) -> int:
    import jax.numpy as jnp

    from jaxmamba.bench import bench_one_batch, format_results
    from jaxmamba.config import ModelConfig
    from jaxmamba.engine.config import ssm_cache_dtype
    from jaxmamba.llm import DTYPES, load_params, resolve_dtype

    ssm_dtype = ssm_cache_dtype(args.mamba_ssm_cache_dtype)
    cfg = ModelConfig.load(args.model)
    dtype = DTYPES[resolve_dtype(args.dtype, args.model)]
    params = load_params(args.model, cfg, dtype, args.seed)
    results = []
    for batch in args.batch_size:
        for input_len in args.input_len:
            print(
                f"bench {cfg.name or args.model}: batch {batch}, input {input_len}, "
                f"output {args.output_len}, {jnp.dtype(dtype).name}, impl={args.impl}, "
                f"small_m_impl={args.small_m_impl}, state {ssm_dtype}"
            )
            results += bench_one_batch(
                cfg, params, batch=batch, input_len=input_len, output_len=args.output_len,
                dtype=dtype, impl=args.impl, small_m_impl=args.small_m_impl, ssm_dtype=ssm_dtype,
            )  # fmt: skip
    print(format_results(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxmamba", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions and print tokens/s")
    _add_model_args(gen)
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)
    from jaxmamba.export.cli import add_cache_args
    from jaxmamba.export.cli import add_parsers as add_export_parsers

    add_cache_args(gen)
    # One static batch on the model runner: no scheduler, so no engine limits to set.
    bench = sub.add_parser("bench", help="prefill/decode throughput of one static batch")
    _add_model_args(bench)
    bench.add_argument("--batch-size", type=_positive_int, nargs="+", default=[1, 8])
    bench.add_argument("--input-len", type=_positive_int, nargs="+", default=[512])
    bench.add_argument("--output-len", type=_positive_int, default=32)
    bench.add_argument("--impl", default="auto", choices=["auto", "ref", "pallas"])
    bench.add_argument(
        "--small-m-impl",
        choices=["auto", "ref", "pallas", "xla"],
        help="the projections of decode-sized steps (<= 32 tokens): small_m_matmul with this "
        "impl, or XLA's dot ('xla'); default: the Pallas kernel where --impl runs the GPU "
        "kernels, else XLA's dot",
    )
    _add_state_dtype_arg(bench)
    bench.set_defaults(func=cmd_bench)
    from jaxmamba.serve.cli import add_parser as add_serve_parser

    add_serve_parser(sub, _add_model_args, _add_engine_args)
    add_export_parsers(sub, _add_model_args, _add_engine_args)  # export, aot, convert
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
