"""The `export`, `aot` and `convert` subcommands, and the compilation-cache flags of every
command that builds an engine (added to the shared model flags by `jaxmamba.cli`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compilation-cache-dir",
        help="JAX's persistent compilation cache (default: $JAXMAMBA_COMPILATION_CACHE_DIR or "
        "~/.cache/jaxmamba/xla): a second start-up loads the compiled steps from it",
    )
    p.add_argument(
        "--no-compilation-cache",
        dest="compilation_cache",
        action="store_false",
        help="compile every step afresh, writing nothing",
    )


def cache_kwargs(args) -> dict:
    """The `LLM` kwargs of `add_cache_args`'s flags (none if the parser lacks them)."""
    if not hasattr(args, "compilation_cache"):
        return {}
    return dict(
        compilation_cache=args.compilation_cache, compilation_cache_dir=args.compilation_cache_dir
    )


def _engine_fields(args) -> dict:
    """The `EngineConfig` fields among the parsed flags (None: the config's default)."""
    from jaxmamba.engine.config import EngineConfig

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    out = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "no_prefix_caching", False):
        out["enable_prefix_caching"] = False
    return out


def _add_if_missing(p: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    if flag not in p._option_string_actions:
        p.add_argument(flag, **kwargs)


def cmd_export(args) -> int:
    from jaxmamba.export.compile_cache import setup_compilation_cache
    from jaxmamba.export.writer import export_artifact

    setup_compilation_cache(enabled=False)  # export lowers only
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: artifacts hold one-device "
            "steps; serve the model itself to run it sharded (docs/tensor_parallel.md)"
        )
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    start = time.perf_counter()
    out = export_artifact(
        args.model,
        args.out,
        platforms=platforms,
        dtype=args.dtype,
        seed=args.seed,
        engine=_engine_fields(args),
        weights=args.weights,
        overwrite=args.overwrite,
        executables=args.executables,
        workers=args.workers,
        sampler_variants=args.sampler_variants,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(f"wrote {out} ({', '.join(platforms)}) in {time.perf_counter() - start:.1f} s")
    return 0


def add_parsers(sub, add_model_args, add_engine_args) -> None:
    exp = sub.add_parser(
        "export",
        help="write a serving artifact: every bucket's jax.export step, Orbax weights, manifest",
    )
    add_model_args(exp)
    add_engine_args(exp)
    _add_if_missing(exp, "--max-prefill-seqs", type=int)
    _add_if_missing(exp, "--page-size", type=int)
    _add_if_missing(exp, "--track-interval", type=int)
    _add_if_missing(exp, "--no-prefix-caching", action="store_true")
    exp.add_argument("--out", required=True, help="the artifact directory to create")
    exp.add_argument(
        "--platforms",
        default="cpu",
        help="comma-separated jax.export platforms among cpu, cuda, tpu (default: cpu)",
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
    add_more_parsers(sub, add_model_args, add_engine_args)


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
        buckets=args.buckets,
        serialize=args.serialize,
        say=lambda line: print(line, flush=True),
    )
    return 0 if reports else 1


def cmd_convert(args) -> int:
    from jaxmamba.model.orbax_io import convert_checkpoint

    start = time.perf_counter()
    out = convert_checkpoint(args.src, args.dst, dtype=args.dtype)
    print(f"wrote the Orbax checkpoint {out} in {time.perf_counter() - start:.1f} s")
    return 0


def add_more_parsers(sub, add_model_args, add_engine_args) -> None:
    aot = sub.add_parser(
        "aot",
        help="compile every bucket's step for a TPU topology without a TPU (libtpu) and "
        "report memory against HBM, FLOPs and estimated step times",
    )
    add_model_args(aot)
    add_engine_args(aot)
    _add_if_missing(aot, "--max-prefill-seqs", type=int)
    _add_if_missing(aot, "--page-size", type=int)
    aot.add_argument("--platform", default="tpu", choices=["tpu"])
    aot.add_argument("--topology", default="v6e:2x2", help="v5e:2x2, v6e:2x2, v5p:2x2x1, ...")
    aot.add_argument("--buckets", type=_bucket, nargs="+", help="only these TxBxD buckets")
    aot.add_argument("--serialize", help="a folder for the compiled executables")
    aot.set_defaults(func=cmd_aot)
    conv = sub.add_parser("convert", help="an HF checkpoint -> an Orbax checkpoint directory")
    conv.add_argument("--from", dest="src", required=True, help="HF checkpoint directory")
    conv.add_argument("--to", dest="dst", required=True, help="the directory to create")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    conv.set_defaults(func=cmd_convert)
