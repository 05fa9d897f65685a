"""The `export`, `aot` and `convert` subcommands."""

from __future__ import annotations

import argparse
import sys
import time

from jaxmamba.cli_args import add_engine_args, add_model_arg, add_setting_args, settings_from_args
from jaxmamba.engine.config import EngineConfig, RunConfig


class _NoPrefixCaching(argparse.Action):
    """`--no-prefix-caching`: the old name of `--no-enable-prefix-caching`."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest="enable_prefix_caching", nargs=0,
                         default=argparse.SUPPRESS, **kwargs)  # fmt: skip

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            "warning: --no-prefix-caching is deprecated: use --no-enable-prefix-caching",
            file=sys.stderr,
        )
        namespace.enable_prefix_caching = False


def _engine_fields(args) -> dict:
    """The `EngineConfig` fields among the parsed flags (None: the config's default)."""
    return {k: v for k, v in settings_from_args(args, EngineConfig).items() if v is not None}


def cmd_export(args) -> int:
    from jaxmamba.export.artifact import runtime_platform
    from jaxmamba.export.compile_cache import setup_compilation_cache
    from jaxmamba.export.writer import export_artifact

    setup_compilation_cache(enabled=False)  # export lowers only
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: artifacts hold one-device "
            "steps; serve the model itself to run it sharded (docs/tensor_parallel.md)"
        )
    platforms = [p.strip() for p in (args.platforms or runtime_platform()).split(",") if p.strip()]
    start = time.perf_counter()
    out = export_artifact(
        args.model,
        args.out,
        platforms=platforms,
        dtype=args.dtype,
        seed=args.seed,
        engine=_engine_fields(args),
        quantization=args.quantization,
        weights=args.weights,
        overwrite=args.overwrite,
        executables=args.executables,
        workers=args.workers,
        sampler_variants=args.sampler_variants,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(f"wrote {out} ({', '.join(platforms)}) in {time.perf_counter() - start:.1f} s")
    return 0


def add_parsers(sub) -> None:
    exp = sub.add_parser(
        "export",
        help="write a serving artifact: every bucket's jax.export step, Orbax weights, manifest",
    )
    add_model_arg(exp)
    add_setting_args(exp, RunConfig, ("dtype", "seed", "quantization"))
    add_engine_args(exp)
    exp.add_argument("--no-prefix-caching", action=_NoPrefixCaching,
                     help="deprecated: --no-enable-prefix-caching")  # fmt: skip
    exp.add_argument("--out", required=True, help="the artifact directory to create")
    exp.add_argument(
        "--platforms",
        help="comma-separated jax.export platforms among cpu, cuda, tpu (default: this "
        "machine's, as jax.default_backend() names it)",
    )
    exp.add_argument(
        "--no-weights",
        dest="weights",
        action="store_false",
        help="leave the weights out (serve with LLM(DIR, params=...))",
    )
    exp.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    exp.add_argument(
        "--executables",
        action="store_true",
        help="also store every step compiled for this machine (its platform must be in "
        "--platforms): the same device kind and jaxlib then start without compiling",
    )
    exp.add_argument(
        "--workers",
        type=int,
        default=1,
        help="trace and lower the steps in this many processes (tracing holds the GIL)",
    )
    exp.add_argument(
        "--no-sampler-variants",
        dest="sampler_variants",
        action="store_const",
        const=False,
        help="export one program a bucket: without the sort-free and argmax-only sampler "
        "programs of each decode bucket (greedy and plain-temperature decode steps then pay "
        "the full sampler)",
    )
    exp.set_defaults(func=cmd_export)
    add_more_parsers(sub)


def _bucket(text: str) -> tuple[int, int, int]:
    try:
        t, b, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a bucket is TxBxD (e.g. 512x9x1), got {text!r}"
        ) from None
    return t, b, d


def cmd_aot(args) -> int:
    from jaxmamba.export.aot import aot_compile

    if args.platform != "tpu":
        raise ValueError(f"--platform {args.platform}: only tpu compiles deviceless here")
    reports = aot_compile(
        args.model,
        topology=args.topology,
        dtype=args.dtype if args.dtype != "auto" else "bfloat16",
        engine=_engine_fields(args),
        quantization=args.quantization,
        buckets=args.buckets,
        serialize=args.serialize,
        say=lambda line: print(line, flush=True),
    )
    return 0 if reports else 1


def cmd_convert(args) -> int:
    from jaxmamba.model.weights import convert_checkpoint

    start = time.perf_counter()
    out = convert_checkpoint(args.src, args.dst, dtype=args.dtype, quantization=args.quantization)
    print(f"wrote the Orbax checkpoint {out} in {time.perf_counter() - start:.1f} s")
    return 0


def add_more_parsers(sub) -> None:
    aot = sub.add_parser(
        "aot",
        help="compile every bucket's step for a TPU topology without a TPU (libtpu) and "
        "report memory against HBM, FLOPs and estimated step times",
    )
    add_model_arg(aot)
    add_setting_args(aot, RunConfig, ("dtype", "seed", "quantization"))
    add_engine_args(aot)
    aot.add_argument("--platform", default="tpu", choices=["tpu"], help="(default: tpu)")
    aot.add_argument("--topology", default="v6e:2x2", help="v5e:2x2, v6e:2x2, v5p:2x2x1, ...")
    aot.add_argument("--buckets", type=_bucket, nargs="+", help="only these TxBxD buckets")
    aot.add_argument("--serialize", help="a folder for the compiled executables")
    aot.set_defaults(func=cmd_aot)
    conv = sub.add_parser("convert", help="an HF checkpoint -> an Orbax checkpoint directory")
    conv.add_argument("--from", dest="src", required=True, help="HF checkpoint directory")
    conv.add_argument("--to", dest="dst", required=True, help="the directory to create")
    conv.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the stored weights' dtype; auto: the checkpoint's (default: auto)",
    )
    add_setting_args(conv, RunConfig, ("quantization",))
    conv.set_defaults(func=cmd_convert)
