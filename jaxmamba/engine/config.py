"""The settings `LLM(...)` and every command take: `EngineConfig` (batch limits, pool sizes,
prefix caching, checkpoint spacing, the recurrent state's dtype) and `RunConfig` (dtype, seed,
kernels, compilation). Each field holds its default and help text once; the CLI's flags are
generated from them (`jaxmamba.cli_args`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxmamba.engine.memory import default_sizes

# `mamba_ssm_cache_dtype` -> the dtype the recurrent states are stored in (the field's help
# says why auto is float32).
MAMBA_SSM_CACHE_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16"}


def ssm_cache_dtype(setting: str) -> str:
    """The recurrent states' dtype name for a `mamba_ssm_cache_dtype` setting."""
    if not isinstance(setting, str) or setting not in MAMBA_SSM_CACHE_DTYPES:
        raise ValueError(
            f"EngineConfig.mamba_ssm_cache_dtype must be one of {sorted(MAMBA_SSM_CACHE_DTYPES)}, "
            f"got {setting!r}"
        )
    return MAMBA_SSM_CACHE_DTYPES[setting]


def setting(default, help: str, *, choices: Sequence[str] | None = None, positive=False):
    """A settings field: its default, its flag's help text, the values the flag offers, and
    whether it must be a positive int (None allowed where that is the default)."""
    metadata = {"help": help, "positive": positive}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings: batch limits, the cache's pools, prefix caching, the state's
    dtype; an exported artifact fixes all but the memory ones and tensor_parallel_size."""

    max_num_seqs: int = setting(8, "sequences running at once (decode rows)", positive=True)
    max_model_len: int = setting(
        2048, "the most tokens of one sequence, prompt and output", positive=True
    )
    max_num_batched_tokens: int = setting(
        512, "the most tokens of one step (prefill chunk + decode rows)", positive=True
    )
    max_prefill_seqs: int = setting(8, "prefill rows per step", positive=True)
    page_size: int = setting(16, "tokens per KV page of the attention layers", positive=True)
    enable_prefix_caching: bool = setting(
        True,
        "reuse the states and KV pages of prompt prefixes seen before (docs/prefix_cache.md)",
    )
    track_interval: int | None = setting(
        None,
        "store a decode checkpoint every this many tokens, a multiple of lcm(chunk_size, "
        "page_size) (default: the first such multiple >= 256)",
        positive=True,
    )
    num_state_slots: int | None = setting(
        None,
        "state slots: max_num_seqs running rows, the rest the prefix cache's checkpoints "
        "(default: sized from device memory, jaxmamba/engine/memory.py; on CPU max_num_seqs, "
        "twice that with prefix caching)",
        positive=True,
    )
    num_pages: int | None = setting(
        None,
        "KV pages (default: sized from device memory; on CPU every row at max_model_len, "
        "twice that with prefix caching)",
        positive=True,
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "fraction of the device's memory for weights, step temporaries and the cache, which "
        "gets the rest (GPU/TPU; on CPU the cache's sizes are checked against it x the host's "
        "available memory)",
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "the cache's size in bytes (state slots and KV pages), instead of sizing it from "
        "gpu_memory_utilization",
        positive=True,
    )
    tensor_parallel_size: int = setting(
        1,
        "split the model over this many devices (docs/tensor_parallel.md); the cache sizes "
        "are then per shard's share of every slot and page",
        positive=True,
    )
    mamba_ssm_cache_dtype: str = setting(
        "float32",
        "dtype of every recurrent layer's state (Mamba2 SSM and Gated DeltaNet states; conv "
        "windows keep the model dtype): bfloat16 halves the state's bytes, so more state slots "
        "fit; auto is float32 here (vLLM's auto follows the model dtype), since the state "
        "accumulates over the whole sequence",
        choices=MAMBA_SSM_CACHE_DTYPES,
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.metadata["positive"] or (value is None and f.default is None):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{f.name} must be a positive int, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        ssm_cache_dtype(self.mamba_ssm_cache_dtype)

    def for_chunk_size(self, chunk_size: int) -> EngineConfig:
        """This config with `track_interval` resolved for a model of `chunk_size`: a user's
        value must be a multiple of lcm(chunk_size, page_size); the default is the first
        multiple >= 256 (chunk sizes need not be powers of two)."""
        block = math.lcm(chunk_size, self.page_size)
        if self.track_interval is None:
            return dataclasses.replace(self, track_interval=block * -(-256 // block))
        if self.track_interval % block:
            raise ValueError(
                f"track_interval={self.track_interval} must be a multiple of "
                f"lcm(chunk_size={chunk_size}, page_size={self.page_size}) = {block}"
            )
        return self

    @property
    def ssm_dtype(self) -> str:
        """The recurrent states' dtype (`CacheSpec.ssm_dtype`)."""
        return ssm_cache_dtype(self.mamba_ssm_cache_dtype)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def state_slots(self) -> int:
        """All state slots: max_num_seqs running rows, the rest checkpoint slots."""
        if self.num_state_slots is not None:
            return self.num_state_slots
        return default_sizes(self.max_num_seqs, self.max_pages_per_seq, self.enable_prefix_caching)[
            0
        ]

    @property
    def pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return default_sizes(self.max_num_seqs, self.max_pages_per_seq, self.enable_prefix_caching)[
            1
        ]


@dataclass(frozen=True)
class RunConfig:
    """How `LLM` loads and runs the model; checked where it is used (`resolve_dtype`, the
    kernel dispatcher)."""

    dtype: str = setting(
        "auto",
        "compute dtype; auto: the checkpoint's torch_dtype (float16 runs in bfloat16), "
        "float32 for random-weight presets",
        choices=("auto", "float32", "bfloat16"),
    )
    seed: int = setting(
        0, "seed of a preset's random weights and of requests that bring no seed of their own"
    )
    impl: str = setting(
        "auto",
        "kernels: auto, the platform's Pallas kernels where it has them; ref, the pure-JAX "
        "references; pallas, the kernels",
        choices=("auto", "ref", "pallas"),
    )
    precompile: bool = setting(
        False, "compile every step bucket at start-up, so nothing compiles under load"
    )
    compilation_cache: bool = setting(
        True,
        "JAX's persistent compilation cache: a second start-up loads the compiled steps from "
        "it; off: compile every step afresh, writing nothing",
    )
    compilation_cache_dir: str | None = setting(
        None,
        "the compilation cache's folder (default: $JAXMAMBA_COMPILATION_CACHE_DIR or "
        "~/.cache/jaxmamba/xla)",
    )
