"""`jaxmamba aot`: compile the engine's real steps for a TPU topology on a machine without
one (libtpu's compiler runs deviceless), and report per bucket what XLA says it needs.

Every bucket's step (the FULL sampler program `LLM` runs: forward with the platform's Pallas
kernels, the SSD scan among them, then sampling; it takes the token bitmask where
`runner.takes_bitmask` says, unless `JAXMAMBA_STRUCTURED_OUTPUTS=0`) is lowered with
`impl="auto_tpu"` from shapes only (no weights are read or made) for one chip of the topology,
and compiled. Per program it prints the weights, the cache, XLA's temporaries and the total
against the chip's HBM, and XLA's FLOP and byte estimates with the step time they imply at the
chip's peak (a lower bound: max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)).

With `--tensor-parallel-size N` the step is the sharded one (jaxmamba.parallel), compiled
as one SPMD program over N chips of the topology; every figure is then one chip's.

Needs libtpu: `pip install ".[tpu]"`, or the venv `scripts/setup_tpu_venv.sh` prints.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

# Per chip: HBM bytes, peak dense bf16 FLOP/s, HBM bytes/s (Google Cloud's published specs).
CHIPS = {
    "v4": (32 * 2**30, 275e12, 1228e9),
    "v5e": (16 * 2**30, 197e12, 819e9),
    "v5p": (95 * 2**30, 459e12, 2765e9),
    "v6e": (32 * 2**30, 918e12, 1640e9),
}


@dataclasses.dataclass
class ProgramReport:
    bucket: tuple[int, int, int]
    weights: int
    cache: int
    temp: int
    total: int  # arguments + temporaries + outputs not aliased to a donated argument
    hbm: int
    flops: float
    bytes_accessed: float
    est_step_s: float
    compile_s: float
    kernels: tuple[str, ...] = ()  # the Mosaic (Pallas TPU) kernels the program calls
    error: str = ""  # XLA's refusal (out of HBM): the sizes are then unknown

    @property
    def fits(self) -> bool:
        return not self.error and self.total <= self.hbm

    def line(self) -> str:
        t, b, d = self.bucket
        kind = "decode" if d == b else ("mixed" if d else "prefill")
        if self.error:
            return (
                f"T={t:<5} B={b:<3} decode={d:<3} {kind:<7} weights {_size(self.weights)}  "
                f"cache {_size(self.cache)}  OOM: {self.error}"
            )
        return (
            f"T={t:<5} B={b:<3} decode={d:<3} {kind:<7} weights {_size(self.weights)}  "
            f"cache {_size(self.cache)}  temp {_size(self.temp)}  total "
            f"{_size(self.total)} / {self.hbm / 2**30:.2f} GiB {'fits' if self.fits else 'OOM '}  "
            f"{self.flops / 1e9:10.2f} GFLOP {_size(self.bytes_accessed)} moved  "
            f"≥ {self.est_step_s * 1e3:8.3f} ms/step  kernels {','.join(self.kernels) or '-'}  "
            f"(compiled in {self.compile_s:.1f} s)"
        )


def _size(n: float) -> str:
    return f"{n / 2**30:7.2f} GiB" if n >= 2**30 else f"{n / 2**20:7.1f} MiB"


def chip_of(device_kind: str, topology: str) -> str:
    """'v5e' etc. from the topology name (v5e:2x2) or libtpu's device kind."""
    name = topology.split(":")[0].lower()
    if name in CHIPS:
        return name
    kind = device_kind.lower().replace(" ", "")
    for chip, words in (("v5e", ("v5lite", "v5e")), ("v6e", ("v6", "trillium")),
                        ("v5p", ("v5p", "v5")), ("v4", ("v4",))):  # fmt: skip
        if any(w in kind for w in words):
            return chip
    raise ValueError(f"unknown TPU {device_kind!r} (topology {topology!r}): known {list(CHIPS)}")


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def aot_compile(
    model: str,
    *,
    topology: str = "v6e:2x2",
    dtype: str = "bfloat16",
    engine: dict | None = None,
    quantization: str | None = None,
    buckets: Sequence[tuple[int, int, int]] | None = None,
    serialize: str | None = None,
    impl: str = "auto_tpu",
    say: Callable[[str], None] = print,
) -> list[ProgramReport]:
    """Compile every bucket's step (or `buckets`, as (num_tokens, num_rows, num_decode)) for
    one chip of `topology`; returns the reports (and prints them through `say`).
    `serialize`: a folder for the compiled executables (`jax.experimental.serialize_executable`
    payloads, pickled with their pytrees, one file a bucket). `quantization` ("fp8", "int8"):
    the weights as `quantization=` loads them (shapes and dtypes only; a quantized checkpoint's
    are read to learn them); the KV pages' dtype is the `engine`'s `kv_cache_dtype`."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxmamba.engine.batch import Bucket, StepBuilder
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.engine.runner import FULL, structured_outputs_enabled
    from jaxmamba.engine.scheduler import Scheduler
    from jaxmamba.export.writer import _flat_step, param_tree, program_padding, step_specs
    from jaxmamba.model.cache import CacheSpec, cache_shapes
    from jaxmamba.model.dtypes import DTYPES
    from jaxmamba.model.families import load_config
    from jaxmamba.model.model import Mamba2HybridLM

    if (engine or {}).get("speculative_config") is not None:
        raise ValueError(
            "speculative_config: jaxmamba aot compiles the plain steps only, not a speculating "
            "engine's verify steps; export an artifact with it instead (jaxmamba export "
            "--speculative-config)"
        )
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # no libtpu, or an unknown topology
        raise ValueError(
            f"cannot make the TPU topology {topology!r} ({type(e).__name__}: {e}); deviceless "
            "TPU compiles need libtpu: pip install '.[tpu]' or use the python that "
            "scripts/setup_tpu_venv.sh prints"
        ) from e
    device = topo.devices[0]
    tp = int((engine or {}).get("tensor_parallel_size", 1))
    if tp > len(topo.devices):
        raise ValueError(f"tensor_parallel_size={tp}: {topology} has {len(topo.devices)} chips")
    chip = chip_of(device.device_kind, topology)
    hbm, peak_flops, peak_bw = CHIPS[chip]
    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    jdtype = DTYPES[dtype]
    cfg = load_config(model)
    engine_cfg = EngineConfig(**(engine or {})).for_chunk_size(cfg.chunk_size)
    spec = CacheSpec(
        num_slots=engine_cfg.state_slots,
        num_pages=engine_cfg.pages,
        page_size=engine_cfg.page_size,
        ssm_dtype=engine_cfg.ssm_dtype,
        kv_dtype=engine_cfg.kv_cache_dtype,
    )
    all_buckets = Scheduler(cfg, engine_cfg).all_buckets()
    if buckets is not None:
        wanted = {tuple(b) for b in buckets}
        all_buckets = [b for b in all_buckets if dataclasses.astuple(b) in wanted]
        missing = wanted - {dataclasses.astuple(b) for b in all_buckets}
        if missing:
            raise ValueError(f"buckets {sorted(missing)} are not among the scheduler's")
    builder = StepBuilder(spec, engine_cfg.max_pages_per_seq, cfg.vocab_size, cfg.chunk_size)
    params_tree = param_tree(model, cfg, jdtype, quantization)
    weights, cache = _nbytes(params_tree), _nbytes(cache_shapes(cfg, spec, jdtype))
    net = Mamba2HybridLM(cfg, jdtype, impl)
    structured = structured_outputs_enabled()  # the FULL programs take the token bitmask
    lower_sharded = None
    if tp > 1:  # one program for the tp chips; every figure below is one chip's
        from jaxmamba.parallel import sharding as tp_sharding
        from jaxmamba.parallel import step as tp_step

        mesh_plan = tp_step.mesh_plan(cfg, tp, Mesh(np.array(topo.devices[:tp]), ("tp",)))
        per_chip = lambda tree: sum(  # noqa: E731
            int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )
        mesh = mesh_plan.mesh
        weights = per_chip(tp_sharding.sharded_param_shapes(mesh_plan.plan, params_tree, mesh))
        cache = per_chip(tp_sharding.sharded_cache_shapes(mesh_plan.plan, spec, jdtype, mesh))
        lower_sharded = functools.partial(tp_step.lower_step, mesh_plan, params_tree, spec,
                                          dtype=jdtype, impl=impl)  # fmt: skip
        say(mesh_plan.plan.describe())
    where = f"one {device.device_kind}" if tp == 1 else f"{tp} x {device.device_kind} (TP {tp})"
    weights_kind = jnp_name(jdtype) + (f", {quantization} weights" if quantization else "")
    if engine_cfg.kv_cache_dtype != "auto":
        weights_kind += f", {engine_cfg.kv_cache_dtype} KV cache"
    say(
        f"{cfg.name or model} ({weights_kind}) on {where} of {topology} "
        f"({chip}: {hbm / 2**30:.2f} GiB HBM, {peak_flops / 1e12:.0f} TFLOP/s, "
        f"{peak_bw / 1e9:.0f} GB/s); {len(all_buckets)} buckets; cache {spec}"
    )
    out_dir = Path(serialize) if serialize else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    for bucket in all_buckets:
        bucket = Bucket(*dataclasses.astuple(bucket))
        start = time.perf_counter()
        if lower_sharded is not None:
            inputs = program_padding(builder, bucket, FULL, cfg.vocab_size, structured)
            lowered = lower_sharded(inputs, bucket.num_decode)
        else:
            flat, trees = step_specs(cfg, spec, jdtype, params_tree, builder, bucket, FULL,
                                     structured)  # fmt: skip
            flat = [[jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in group]
                    for group in flat]  # fmt: skip
            fn = jax.jit(
                functools.partial(_flat_step, trees=trees, model=net, spec=spec,
                                  num_decode=bucket.num_decode),
                donate_argnums=(1, 2),
            )  # fmt: skip
            lowered = fn.lower(*flat)
        kernels = tuple(sorted(set(re.findall(r'kernel_name = "([^"]+)"', lowered.as_text()))))
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # XLA refuses a program that cannot fit: report it and go on to the next bucket.
            report = ProgramReport(
                dataclasses.astuple(bucket), weights, cache, -1, -1, hbm, 0.0, 0.0, 0.0,
                time.perf_counter() - start, kernels, str(e).splitlines()[0],
            )  # fmt: skip
            reports.append(report)
            say(report.line())
            continue
        elapsed = time.perf_counter() - start
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else (cost or {})
        temp = int(mem.temp_size_in_bytes) if mem is not None else 0
        args = int(mem.argument_size_in_bytes) if mem is not None else weights + cache
        unaliased = 0
        if mem is not None:
            unaliased = max(int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes), 0)
        flops = float(cost.get("flops", 0.0))
        moved = float(cost.get("bytes accessed", 0.0))
        report = ProgramReport(
            dataclasses.astuple(bucket), weights, cache, temp, args + temp + unaliased, hbm,
            flops, moved, max(flops / peak_flops, moved / peak_bw), elapsed, kernels,
        )  # fmt: skip
        reports.append(report)
        say(report.line())
        if out_dir is not None:
            from jax.experimental.serialize_executable import serialize as ser

            payload, in_tree, out_tree = ser(compiled)
            name = "x".join(map(str, report.bucket)) + ".tpu-executable"
            (out_dir / name).write_bytes(pickle.dumps((payload, in_tree, out_tree)))
    fit = sum(r.fits for r in reports)
    say(f"{fit}/{len(reports)} programs fit {'one' if tp == 1 else 'each'} {chip} chip's HBM")
    return reports


def jnp_name(dtype) -> str:
    return np.dtype(dtype).name
