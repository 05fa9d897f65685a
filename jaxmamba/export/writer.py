"""`jaxmamba export`: write an artifact directory (see `jaxmamba.export.artifact`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxmamba.export.artifact import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PLATFORM_IMPLS,
    UNSTABLE_CUSTOM_CALLS,
    artifact_speculation,
    bucket_name,
    programs,
    runtime_platform,
    sha256,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "config.json")  # fmt: skip


def _flat_step(params, cache, slot_state, inputs, *, trees, model, spec, num_decode,
               sampler: str = "full", speculative=None):  # fmt: skip
    """The engine step on flat lists of leaves: what an artifact stores for one bucket and
    sampler program (`jaxmamba aot` compiles the full one); `speculative` (an `NgramSpec`):
    the step of a runner that speculates."""
    from jaxmamba.model.step import step_fn

    args = [jax.tree.unflatten(t, leaves) for t, leaves in
            zip(trees, (params, cache, slot_state, inputs), strict=True)]  # fmt: skip
    extra = {} if speculative is None else {"speculative": speculative}
    packed, cache, slot_state = step_fn(*args, model=model, spec=spec, num_decode=num_decode,
                                        sampler=sampler, **extra)  # fmt: skip
    return packed, jax.tree.leaves(cache), jax.tree.leaves(slot_state)


def device_key() -> str:
    """What a serialized executable is bound to: jaxlib and the first device's kind."""
    import jaxlib

    return f"jaxlib {jaxlib.__version__} {jax.devices()[0].device_kind}"


@contextlib.contextmanager
def _without_persistent_cache():
    """Compile afresh inside: an XLA:CPU executable read back from JAX's persistent cache
    serializes without the runtime functions it links at compile time, and fails to run when
    loaded ("Function wrapped_exponential not found"; tests/test_export.py reproduces it).
    JAX decides once per process whether the cache is used; `reset_cache` (public, in
    `jax.experimental.compilation_cache`) makes it decide again on the way in and out."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        reset_cache()


def compile_serialized(exported) -> bytes:
    """`exported`'s step compiled for this machine, as bytes (pickled
    `serialize_executable` payload and pytrees)."""
    import pickle

    from jax.experimental.serialize_executable import serialize

    args, _ = jax.tree.unflatten(
        exported.in_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
    )
    with _without_persistent_cache():
        compiled = jax.jit(exported.call, donate_argnums=(1, 2)).lower(*args).compile()
    return pickle.dumps(serialize(compiled))


def add_executables(src: str | os.PathLike, out: str | os.PathLike, runner) -> Path:
    """A copy of the artifact `src` at `out` that also holds, for every program (bucket and
    sampler) `runner` (an `ArtifactRunner` of `src`) has compiled, that step serialized for
    this machine, as `export --executables` stores it. A step the runner read back from the
    persistent cache, or one XLA cannot serialize as it is, is compiled afresh
    (`compile_serialized`): on XLA:CPU the former does not load, and an executable whose sort
    got XLA:CPU's built-in comparator may refuse to serialize where the same step compiled
    afresh does not."""
    import pickle

    from jax.experimental.serialize_executable import serialize

    src, out = Path(src), Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: pick a new directory")
    shutil.copytree(src, out)
    manifest = json.loads((out / MANIFEST).read_text())
    platform = runtime_platform()
    for entry in manifest["buckets"]:
        key = (entry["num_tokens"], entry["num_rows"], entry["num_decode"])
        for sampler, node in programs(entry):
            if (key, sampler) not in runner.compiled or platform not in node["files"]:
                continue
            compiled, fresh = runner.compiled[key, sampler]
            rel = node["files"][platform]["path"].replace(".jaxexport", ".executable")
            blob = None
            if fresh:
                try:
                    blob = pickle.dumps(serialize(compiled))
                except jax.errors.JaxRuntimeError:  # XLA:CPU: "`LessThan` is not serializable"
                    blob = None
            if blob is None:
                exported = jax.export.deserialize(
                    bytearray((out / node["files"][platform]["path"]).read_bytes()))  # fmt: skip
                blob = compile_serialized(exported)
            (out / rel).write_bytes(blob)
            node.setdefault("executables", {})[platform] = {
                "path": rel, "sha256": sha256(out / rel), "device": device_key()
            }  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def _aval(x) -> dict:
    return {"shape": [int(d) for d in x.shape], "dtype": np.dtype(x.dtype).name}


def program_padding(builder, bucket, sampler: str, vocab_size: int, structured: bool):
    """Padding inputs of the step program `(bucket, sampler)` as the live runner warms it up
    (`StepRunner.program_inputs`): the builder's padding, with the all-allowing token bitmask
    where the program takes one (`takes_bitmask`; `structured`: the programs serve structured
    outputs)."""
    from jaxmamba.engine.runner import all_allowed_bitmask, takes_bitmask

    inputs = builder.padding(bucket)
    if structured and takes_bitmask(dataclasses.astuple(bucket), sampler):
        inputs = all_allowed_bitmask(inputs, vocab_size)
    return inputs


def step_specs(cfg, spec, dtype, params_tree, builder, bucket, sampler: str = "full",
               structured: bool = False, speculative=None):  # fmt: skip
    """The abstract `(params, cache, slot_state, inputs)` of one bucket's step program
    (`sampler`; `structured`: with the token bitmask where it takes one, `program_padding`;
    `speculative`: the slot state of a runner that speculates so), and their treedefs; the
    inputs packed into one buffer, as the runners pass them."""
    from jaxmamba.model.cache import cache_shapes
    from jaxmamba.model.metadata import PackedStepInputs
    from jaxmamba.model.step import init_slot_state

    slot_state = jax.eval_shape(lambda: init_slot_state(cfg, spec, dtype, speculative))
    padding = program_padding(builder, bucket, sampler, cfg.vocab_size, structured)
    inputs = PackedStepInputs.pack(padding)
    args = (params_tree, cache_shapes(cfg, spec, dtype), slot_state, inputs)
    trees = tuple(jax.tree.structure(a) for a in args)
    flat = tuple(
        [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype")
                              else x.dtype) for x in jax.tree.leaves(a)]
        for a in args
    )  # fmt: skip
    return flat, trees


def export_step(cfg, spec, dtype, params_tree, builder, bucket, platform: str, impl=None,
                sampler: str = "full", structured: bool = False,
                speculative=None):  # fmt: skip
    """`jax.export` of one bucket's step for `platform` (flat leaves in and out), with the
    `sampler` program (`jaxmamba.engine.runner.FULL`, `PLAIN` or `GREEDY`); `structured`: it
    takes the token bitmask where `takes_bitmask` says; `speculative` (an `NgramSpec`): the
    step of a runner that speculates (a verify bucket's is the verify step)."""
    from jaxmamba.model.model import Mamba2HybridLM

    model = Mamba2HybridLM(cfg, dtype, impl or PLATFORM_IMPLS[platform])
    flat, trees = step_specs(cfg, spec, dtype, params_tree, builder, bucket, sampler, structured,
                             speculative)  # fmt: skip
    fn = jax.jit(
        functools.partial(_flat_step, trees=trees, model=model, spec=spec,
                          num_decode=bucket.num_decode, sampler=sampler,
                          speculative=speculative),
        donate_argnums=(1, 2),
    )  # fmt: skip
    disabled = [jax.export.DisabledSafetyCheck.custom_call(c) for c in UNSTABLE_CUSTOM_CALLS]
    return jax.export.export(fn, platforms=(platform,), disabled_checks=disabled)(*flat)


def export_score(cfg, spec, dtype, params_tree, platform: str, impl=None):
    """`jax.export` of the prompt_logprobs program (`runner.score_fn`) for `platform`: flat
    params leaves, the slot state's `prompt_hidden` and the targets in, packed rows out."""
    from jaxmamba.model.model import Mamba2HybridLM
    from jaxmamba.model.step import init_slot_state, score_fn
    from jaxmamba.step_contract import MAX_PROMPT_LOGPROB_TOKENS

    model = Mamba2HybridLM(cfg, dtype, impl or PLATFORM_IMPLS[platform])
    tree = jax.tree.structure(params_tree)
    fn = jax.jit(lambda params, hidden, targets: score_fn(
        jax.tree.unflatten(tree, params), hidden, targets, model=model, spec=spec))  # fmt: skip
    hidden = jax.eval_shape(lambda: init_slot_state(cfg, spec, dtype)).prompt_hidden
    targets = jax.ShapeDtypeStruct((MAX_PROMPT_LOGPROB_TOKENS,), np.int32)
    params = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(params_tree)]
    return jax.export.export(fn, platforms=(platform,))(params, hidden, targets)


def _setup(model: str, engine: dict | None, dtype: str):
    """What exporting `model` with these engine settings needs, host side: the dtype's name,
    the model and engine configs, the cache spec, the step builder, the tokenizer."""
    from jaxmamba.engine.batch import StepBuilder
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.model.dtypes import resolve_dtype
    from jaxmamba.model.families import load_config
    from jaxmamba.step_contract import CacheSpec
    from jaxmamba.tokenizer import load_tokenizer, with_tokenizer_eos

    dtype_name = {"bf16": "bfloat16", "fp32": "float32"}.get(d := resolve_dtype(dtype, model), d)
    cfg = load_config(model)
    tokenizer = load_tokenizer(model, cfg)
    cfg = with_tokenizer_eos(cfg, tokenizer)
    engine_cfg = EngineConfig(**(engine or {})).for_chunk_size(cfg.chunk_size)
    spec = CacheSpec(
        num_slots=engine_cfg.state_slots, num_pages=engine_cfg.pages,
        page_size=engine_cfg.page_size, ssm_dtype=engine_cfg.ssm_dtype,
        kv_dtype=engine_cfg.kv_cache_dtype,
    )  # fmt: skip
    builder = StepBuilder(spec, engine_cfg.max_pages_per_seq, cfg.vocab_size, cfg.chunk_size,
                          speculative=engine_cfg.speculative_config is not None)  # fmt: skip
    return dtype_name, cfg, engine_cfg, spec, builder, tokenizer


_WORKER_SETUP: dict = {}  # in an export worker process: (model, engine, dtype) -> _setup(...)


def param_tree(model: str, cfg, dtype, quantization: str | None = None, params=None):
    """The step's parameters as `ShapeDtypeStruct`s: `params`' when given, else the model's
    (`param_shapes`) quantized as `quantization` (or `jaxmamba convert --quantization`) says —
    or, for a quantized checkpoint, as it loads (read here)."""
    from jaxmamba.model.params import quantized_param_shapes
    from jaxmamba.model.weights import checkpoint_quantization, converted_quantization, load_params

    if params is None and checkpoint_quantization(model) is not None:
        params = load_params(model, cfg, dtype, 0, quantization)
    if params is not None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return quantized_param_shapes(cfg, dtype, quantization or converted_quantization(model))


def _worker_init() -> None:
    # JAX 0.11's Pallas GPU lowering asks for a GPU device: a worker on a GPU machine opens
    # one, without taking the memory pool JAX allocates by default.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def _export_job(job) -> tuple[bytes, float]:
    """In an export worker: one bucket's serialized step for one platform and sampler
    program, and the seconds its tracing and lowering took."""
    from jaxmamba.engine.batch import Bucket
    from jaxmamba.model.dtypes import DTYPES

    model, engine, dtype, quantization, bucket, platform, sampler, structured = job
    key = (model, json.dumps(engine, sort_keys=True, default=repr), dtype, quantization)
    if key not in _WORKER_SETUP:
        dtype_name, cfg, *rest = _setup(model, engine, dtype)
        tree = param_tree(model, cfg, DTYPES[dtype_name], quantization)
        _WORKER_SETUP[key] = (dtype_name, cfg, *rest, tree)
    dtype_name, cfg, engine_cfg, spec, builder, _, tree = _WORKER_SETUP[key]
    jdtype = DTYPES[dtype_name]
    start = time.perf_counter()
    exp = export_step(cfg, spec, jdtype, tree, builder, Bucket(*bucket), platform,
                      sampler=sampler, structured=structured,
                      speculative=artifact_speculation(engine_cfg.speculative_config))  # fmt: skip
    return exp.serialize(), time.perf_counter() - start


def _export_in_workers(jobs: list, workers: int, say) -> list[tuple[bytes, float]]:
    """`_export_job` of every job, in `workers` processes (tracing and lowering are Python
    under the GIL: threads would not overlap them, processes do)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    results = []
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
        for i, result in enumerate(pool.map(_export_job, jobs)):
            results.append(result)
            say(f"traced and lowered {i + 1}/{len(jobs)} in a worker ({result[1]:.1f} s)")
    return results


def export_artifact(
    model: str,
    out: str | os.PathLike,
    *,
    platforms: Sequence[str] | None = None,
    dtype: str = "auto",
    seed: int = 0,
    engine: dict | None = None,
    quantization: str | None = None,
    weights: bool = True,
    buckets: Sequence | None = None,
    params=None,
    overwrite: bool = False,
    executables: bool = False,
    workers: int = 1,
    sampler_variants: bool | None = None,
    structured_outputs: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Export `model` (a preset, YAML or HF checkpoint) served with the `engine` settings
    (`EngineConfig` fields) into the directory `out`; returns it.

    `platforms`: the `jax.export` platforms to export for (cpu, cuda, tpu); default this
    process's own, so the artifact serves on the machine that exported it.
    `quantization` ("fp8", "int8"; `RunConfig.quantization`): the weights quantized at load
    (a quantized checkpoint's are exported as it holds them); the FP8 KV cache is the
    `engine`'s `kv_cache_dtype`. `params` given: those, as they are.
    `buckets`: the `Bucket`s to export (default: every bucket the scheduler can use, what
    `precompile` compiles); an artifact serves only steps of the buckets it holds.
    `weights=False` (`--no-weights`) leaves the weights out: `LLM(out, params=...)` or
    `weights=` a checkpoint then brings them. `executables=True` (`--executables`) also
    stores each step compiled for this machine's platform and device (when it is among
    `platforms`): a process on the same device kind and jaxlib loads it without compiling.
    `workers > 1` traces and lowers the steps in that many processes. `sampler_variants`
    (default: unless `JAXMAMBA_SAMPLER_VARIANTS=0`) also exports each pure decode bucket's
    sort-free PLAIN and argmax-only GREEDY sampler programs, which serving runs when no row of
    a decode step needs what they leave out (`jaxmamba.engine.runner.choose_sampler`); False
    (`--no-sampler-variants`) exports one program a bucket. `structured_outputs` (default:
    unless `JAXMAMBA_STRUCTURED_OUTPUTS=0`): every FULL program takes the token bitmask where
    `jaxmamba.engine.runner.takes_bitmask` says, as the live runner's do, so the artifact
    serves constrained requests (the manifest's `structured_outputs` records it).
    `engine["speculative_config"]` (method "ngram"; "draft_model" and "mtp" are refused by
    name): the steps are those of a live engine that speculates so, its verify buckets
    included, and `LLM(out)` speculates with them (the manifest's `engine` records it)."""
    from jaxmamba.config import checkpoint_dir
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.engine.runner import (
        FULL,
        bucket_samplers,
        structured_outputs_enabled,
        variants_enabled,
    )
    from jaxmamba.engine.scheduler import Scheduler
    from jaxmamba.model.cache import cache_shapes
    from jaxmamba.model.dtypes import DTYPES
    from jaxmamba.model.orbax_io import flat_specs, save_params
    from jaxmamba.model.weights import load_params
    from jaxmamba.step_contract import StepInputs

    say = progress or (lambda _msg: None)
    speculative = artifact_speculation(EngineConfig(**(engine or {})).speculative_config)
    if platforms is None:
        platforms = (runtime_platform(),)
    unknown = sorted(set(platforms) - set(PLATFORM_IMPLS))
    if unknown or not platforms:
        raise ValueError(f"platforms must be among {sorted(PLATFORM_IMPLS)}, got {platforms}")
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise ValueError(f"{out} exists: pick a new directory (or overwrite=True)")
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    dtype_name, cfg, engine_cfg, spec, builder, tokenizer = _setup(model, engine, dtype)
    jdtype = DTYPES[dtype_name]
    all_buckets = Scheduler(cfg, engine_cfg).all_buckets()
    buckets = list(all_buckets if buckets is None else buckets)
    if params is None and weights:
        start = time.perf_counter()
        params = load_params(model, cfg, jdtype, seed, quantization)
        say(f"weights: loaded in {time.perf_counter() - start:.1f} s")
    params_tree = param_tree(model, cfg, jdtype, quantization, params)
    if sampler_variants is None:
        sampler_variants = variants_enabled()
    if structured_outputs is None:
        structured_outputs = structured_outputs_enabled()

    def samplers(bucket) -> tuple[str, ...]:
        return bucket_samplers(bucket.num_rows, bucket.num_decode) if sampler_variants else (FULL,)

    exported = {}  # (bucket, platform, sampler) -> serialized step, from the workers
    if workers > 1:
        jobs = [(str(model), engine, dtype, quantization, dataclasses.astuple(b), p, s,
                 structured_outputs)
                for b in buckets for p in platforms for s in samplers(b)]  # fmt: skip
        for job, (blob, _) in zip(jobs, _export_in_workers(jobs, workers, say), strict=True):
            exported[job[4:7]] = blob

    weights_entry = None
    if weights:
        start = time.perf_counter()
        save_params(tmp / "weights", params)
        tensors = {k: {"shape": list(s), "dtype": d} for k, (s, d) in flat_specs(params).items()}
        weights_entry = {"path": "weights", "format": "orbax", "tensors": tensors}
        say(f"weights: Orbax checkpoint in {time.perf_counter() - start:.1f} s")
    ckpt = checkpoint_dir(model)
    tokenizer_dir = None
    if ckpt is not None and (ckpt / "tokenizer.json").is_file():
        (tmp / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (ckpt / name).is_file():
                shutil.copy2(ckpt / name, tmp / "tokenizer" / name)
        tokenizer_dir = "tokenizer"
    elif tokenizer is not None and type(tokenizer).__name__ == "ByteTokenizer":
        tokenizer_dir = "byte"  # the byte-level presets' tokenizer: no files

    entries = []
    for bucket in buckets:
        entry = {"num_tokens": bucket.num_tokens, "num_rows": bucket.num_rows,
                 "num_decode": bucket.num_decode, "files": {}}  # fmt: skip
        name = bucket_name(*dataclasses.astuple(bucket))
        for platform, sampler in itertools.product(platforms, samplers(bucket)):
            start = time.perf_counter()
            blob = exported.get((dataclasses.astuple(bucket), platform, sampler))
            if blob is None:
                exp = export_step(cfg, spec, jdtype, params_tree, builder, bucket, platform,
                                  sampler=sampler, structured=structured_outputs,
                                  speculative=speculative)  # fmt: skip
                blob = exp.serialize()
            else:
                exp = jax.export.deserialize(bytearray(blob))
            # The full program's files sit in the bucket's entry, a variant's in
            # entry["variants"][sampler] (`artifact.programs`).
            node = entry if sampler == FULL else entry.setdefault("variants", {}).setdefault(
                sampler, {"files": {}})  # fmt: skip
            stem = name if sampler == FULL else f"{name}.{sampler}"
            rel = f"steps/{platform}/{stem}.jaxexport"
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(blob)
            node["files"][platform] = {"path": rel, "sha256": sha256(tmp / rel)}
            if executables and platform == runtime_platform():
                rel_x = rel.replace(".jaxexport", ".executable")
                (tmp / rel_x).write_bytes(compile_serialized(exp))
                node.setdefault("executables", {})[platform] = {
                    "path": rel_x,
                    "sha256": sha256(tmp / rel_x),
                    "device": device_key(),
                }
            avals = {"inputs": [_aval(a) for a in exp.in_avals],
                     "outputs": [_aval(a) for a in exp.out_avals]}  # fmt: skip
            if "inputs" not in entry:  # the FULL program, exported first
                entry.update(avals)
                entry["in_shardings"] = [str(s) for s in exp.in_shardings_hlo]
                entry["out_shardings"] = [str(s) for s in exp.out_shardings_hlo]
                entry["num_devices"] = exp.nr_devices
            elif avals["outputs"] != entry["outputs"]:
                raise RuntimeError(f"bucket {name}: the {sampler} program's outputs differ")
            elif avals["inputs"] != entry["inputs"]:  # its buffer holds no token bitmask
                if node.get("inputs", avals["inputs"]) != avals["inputs"]:
                    raise RuntimeError(f"bucket {name}: the {sampler} program's inputs differ "
                                       f"between platforms")  # fmt: skip
                node["inputs"] = avals["inputs"]
            say(f"exported {platform} step T={bucket.num_tokens} B={bucket.num_rows} "
                f"decode={bucket.num_decode} ({sampler} sampler) in "
                f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        entries.append(entry)

    score = {"files": {}}
    for platform in platforms:
        start = time.perf_counter()
        rel = f"steps/{platform}/score.jaxexport"
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(export_score(cfg, spec, jdtype, params_tree, platform).serialize())
        score["files"][platform] = {"path": rel, "sha256": sha256(tmp / rel)}
        say(f"exported {platform} prompt_logprobs program in {time.perf_counter() - start:.1f} s")

    slot_avals, _ = step_specs(cfg, spec, jdtype, params_tree, builder, buckets[0],
                               speculative=speculative)  # fmt: skip
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jax_version": jax.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "source": str(model),
        "platforms": list(platforms),
        "impls": {p: PLATFORM_IMPLS[p] for p in platforms},
        "model": cfg.to_dict(),
        "dtype": dtype_name,
        "quantization": quantization,
        "engine": dataclasses.asdict(engine_cfg),
        "cache": spec._asdict(),
        "input_fields": list(StepInputs._fields),
        "structured_outputs": structured_outputs,
        "state": {
            "params": len(slot_avals[0]),
            "cache": [_aval(a) for a in jax.tree.leaves(cache_shapes(cfg, spec, jdtype))],
            "slot_state": [_aval(a) for a in slot_avals[2]],
        },
        "all_buckets": len(all_buckets),
        "buckets": entries,
        "score": score,
        "weights": weights_entry,
        "tokenizer": tokenizer_dir,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.rename(out)
    return out
