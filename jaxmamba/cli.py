"""Command line: `jaxmamba generate`, `bench` (`throughput`, `one-batch`), `serve`, `export`,
`aot` and `convert`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxmamba.bench_throughput import DATASETS
from jaxmamba.cli_args import (
    add_engine_args,
    add_model_arg,
    add_setting_args,
    llm_from_args,
    positive_int,
)
from jaxmamba.engine.config import EngineConfig, RunConfig
from jaxmamba.export.cli import add_parsers as add_export_parsers
from jaxmamba.serve.cli import add_parser as add_serve_parser


def cmd_generate(args) -> int:
    from jaxmamba import SamplingParams

    llm = llm_from_args(args)
    plan = getattr(llm, "cache_plan", None)  # an exported artifact's LLM brings its own sizes
    if plan is not None:
        print(plan.describe(), file=sys.stderr)
    prompts = args.prompt or ["def main(", "import os\n", "class Config:\n    def "]
    # One seed per prompt: with a shared seed, requests draw the same random numbers.
    params = [
        SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed + i,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
        for i in range(len(prompts))
    ]
    # The second pass reuses the compiled buckets; its prompts hit the prefix cache, so its
    # prefills are shorter and may meet a bucket the first pass did not (one more compile).
    for run in ("first pass, compiles buckets as it meets them", "second pass, same prompts"):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        print(
            f"[{run}] {len(outs)} requests, {prompt_tokens} prompt ({cached} from the prefix "
            f"cache) + {generated} generated tokens in {elapsed:.2f} s: "
            f"{generated / elapsed:.1f} generated tokens/s "
            f"({llm.runner.num_compiles} compilations so far)"
        )
    for out in outs:
        for completion in out.outputs:
            _print_completion(out.prompt, completion, args.n)
    return 0


def _print_completion(prompt: str, completion, n: int) -> None:
    which = f" #{completion.index}" if n > 1 else ""
    why = completion.finish_reason
    if isinstance(completion.stop_reason, str):
        why += f" at {completion.stop_reason!r}"
    print(f"\n--- {prompt!r}{which} [{why}]\n{prompt}{completion.text}")
    if completion.logprobs is None:
        return
    print(f"logprobs (cumulative {completion.cumulative_logprob:.4f}):")
    for token_id, top in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = top[token_id]
        others = ", ".join(
            f"{lp.decoded_token!r} {lp.logprob:.4f}"
            for t, lp in sorted(top.items(), key=lambda kv: -kv[1].logprob)
            if t != token_id
        )
        print(
            f"  {chosen.decoded_token!r:>14} {chosen.logprob:9.4f}"
            + (f"  [{others}]" if others else "")
        )


def cmd_bench(args) -> int:
    import jax.numpy as jnp

    from jaxmamba.bench import bench_one_batch, format_results
    from jaxmamba.engine.config import ssm_cache_dtype
    from jaxmamba.llm import DTYPES, load_params, resolve_dtype
    from jaxmamba.model.families import load_config

    ssm_dtype = ssm_cache_dtype(args.mamba_ssm_cache_dtype)
    cfg = load_config(args.model)
    dtype = DTYPES[resolve_dtype(args.dtype, args.model)]
    params = load_params(args.model, cfg, dtype, args.seed, args.quantization)
    results = []
    for batch in args.batch_size:
        for input_len in args.input_len:
            print(
                f"bench {cfg.name or args.model}: batch {batch}, input {input_len}, "
                f"output {args.output_len}, {jnp.dtype(dtype).name}, impl={args.impl}, "
                f"small_m_impl={args.small_m_impl}, state {ssm_dtype}, "
                f"quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype}"
            )
            results += bench_one_batch(
                cfg, params, batch=batch, input_len=input_len, output_len=args.output_len,
                dtype=dtype, impl=args.impl, small_m_impl=args.small_m_impl, ssm_dtype=ssm_dtype,
                kv_dtype=args.kv_cache_dtype,
            )  # fmt: skip
    print(format_results(results))
    return 0


def cmd_bench_throughput(args) -> int:
    from jaxmamba.bench_throughput import (
        check_fits,
        redraw_prompts,
        sample_requests,
        timed_generate,
        token_pool,
    )

    llm = llm_from_args(args)
    pool = token_pool(llm.model_cfg.vocab_size, llm.get_tokenizer())
    requests = sample_requests(
        args.dataset_name, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len, token_ids=pool, seed=args.seed,
    )  # fmt: skip
    check_fits(requests, llm.engine_cfg.max_model_len)
    run = dict(n=args.n, detokenize=not args.disable_detokenize)
    if args.warmup:
        warmup = redraw_prompts(requests, args.prefix_len, pool, seed=args.seed + 1)
        print("warm-up pass (untimed; compiles the step buckets the schedule meets)",
              file=sys.stderr)  # fmt: skip
        timed_generate(llm, warmup, **run)
        llm.reset_prefix_cache()
    result, _ = timed_generate(llm, requests, **run)
    print(result.summary())
    print(f"Compilations in the timed pass: {result.compilations}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result.vllm_json(), f, indent=4)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxmamba", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions and print tokens/s")
    add_model_arg(gen)
    add_setting_args(gen, RunConfig)
    add_engine_args(gen)
    gen.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; default: three Python openings)"
    )
    gen.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per completion (default: %(default)s)"
    )
    gen.add_argument(
        "--n", type=positive_int, default=1, help="completions per prompt (default: %(default)s)"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)"
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=0.95,
        help="sample among the most likely tokens whose probabilities sum to this "
        "(default: %(default)s)",
    )
    gen.add_argument("--top-k", type=int, default=0, help="0: off (default: %(default)s)")
    gen.add_argument(
        "--stop",
        action="append",
        help="a string that ends a completion, left out of its text (repeatable)",
    )
    gen.add_argument(
        "--logprobs",
        type=int,
        help="print each generated token's logprob, and those of the N most likely tokens",
        metavar="N",
    )
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --max-tokens tokens even past the end-of-text token",
    )
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser(
        "bench",
        help="benchmarks: offline throughput (vllm bench throughput), one static batch",
        description="`jaxmamba bench FLAGS` (no subcommand) is `jaxmamba bench one-batch FLAGS`.",
    )
    benches = bench.add_subparsers(dest="bench", required=True, help="the benchmark")
    _add_bench_throughput_parser(benches)
    _add_bench_one_batch_parser(benches)
    add_serve_parser(sub)
    add_export_parsers(sub)  # export, aot, convert
    return parser


def _add_bench_throughput_parser(benches) -> None:
    p = benches.add_parser(
        "throughput",
        help="offline throughput through LLM.generate, as vllm bench throughput measures it",
        description="Offline throughput as `vllm bench throughput --dataset-name random` "
        "measures it, with its flags: every request queued at once, temperature 1, top-p 1, "
        "ignore_eos, max_tokens each request's output length; --seed also seeds the dataset. "
        "Prints vLLM's summary line.",
        allow_abbrev=False,  # vLLM's flags we lack (--dataset, --profile, ...) are errors
    )
    add_model_arg(p)
    add_setting_args(p, RunConfig)
    add_engine_args(p)
    p.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="the prompts; random is the one dataset supported (default: %(default)s)",
    )
    p.add_argument("--input-len", type=positive_int, required=True, help="prompt tokens")
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=128,
        help="output tokens of each request (default: %(default)s)",
    )
    p.add_argument(
        "--num-prompts", type=positive_int, default=1000, help="requests (default: %(default)s)"
    )
    p.add_argument(
        "--random-range-ratio",
        type=_range_ratio,
        default=0.0,
        help="input and output lengths uniform over the integers of [len*(1-r), len*(1+r)] "
        "(floor, ceil); r in [0, 1) (default: %(default)s)",
    )
    p.add_argument(
        "--prefix-len",
        "--random-prefix-len",
        dest="prefix_len",
        type=_non_negative_int,
        default=0,
        help="random tokens every prompt starts with, before its --input-len ones (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--n", type=positive_int, default=1, help="completions per prompt (default: %(default)s)"
    )
    p.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="leave the completions' text out (detokenizing is then not timed)",
    )
    p.add_argument("--output-json", help="write vLLM's JSON record of the results here")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the same lengths once, untimed, with other random tokens, so the timed "
        "pass compiles nothing: JAX compiles a step bucket when the schedule first meets it "
        "(vLLM captures its CUDA graphs at start-up; --precompile compiles every bucket then) "
        "(default: %(default)s)",
    )
    p.set_defaults(func=cmd_bench_throughput)


def _range_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def _add_bench_one_batch_parser(benches) -> None:
    # One static batch on the model runner: no scheduler, so no engine limits to set.
    p = benches.add_parser(
        "one-batch",
        help="prefill/decode throughput of one static batch (the default subcommand)",
        description="Prefill and decode step times of one static batch, like SGLang's "
        "bench_one_batch, with MFU and the fraction of the HBM roofline.",
    )
    add_model_arg(p)
    add_setting_args(p, RunConfig, ("dtype", "seed", "impl", "quantization"))
    add_setting_args(p, EngineConfig, ("mamba_ssm_cache_dtype", "kv_cache_dtype"))
    p.add_argument(
        "--batch-size",
        type=positive_int,
        nargs="+",
        default=[1, 8],
        help="batch sizes to measure (default: %(default)s)",
    )
    p.add_argument(
        "--input-len",
        type=positive_int,
        nargs="+",
        default=[512],
        help="prompt lengths to measure (default: %(default)s)",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=32,
        help="decode steps per measurement (default: %(default)s)",
    )
    p.add_argument(
        "--small-m-impl",
        choices=["auto", "ref", "pallas", "xla"],
        help="the projections of decode-sized steps (<= 32 tokens): small_m_matmul with this "
        "impl, or XLA's dot ('xla'); default: the Pallas kernel where --impl runs the GPU "
        "kernels, else XLA's dot",
    )
    p.set_defaults(func=cmd_bench)


def _bench_subcommand(argv: list[str]) -> list[str]:
    """`jaxmamba bench [FLAGS]` is `jaxmamba bench one-batch [FLAGS]`, the form from before
    `bench` had subcommands."""
    if argv[:1] == ["bench"] and (
        len(argv) == 1 or (argv[1].startswith("-") and argv[1] not in ("-h", "--help"))
    ):
        return ["bench", "one-batch", *argv[1:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = _bench_subcommand(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
