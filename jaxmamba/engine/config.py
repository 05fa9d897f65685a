"""The settings `LLM(...)` and every command take: `EngineConfig` (batch limits, pool sizes,
prefix caching, checkpoint spacing, the recurrent state's and the KV pages' dtypes, speculative
decoding) and `RunConfig` (dtype, weight quantization, seed, kernels, compilation). Each field
holds its default and help text once; the CLI's flags are generated from them
(`jaxmamba.cli_args`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from jaxmamba.engine.memory import default_sizes

# `mamba_ssm_cache_dtype` -> the dtype the recurrent states are stored in (the field's help
# says why auto is float32).
MAMBA_SSM_CACHE_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16"}


# `kv_cache_dtype` -> the attention pages' dtype (None: the model's), vLLM's names.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
# `quantization` -> how a float checkpoint's weights are quantized at load time (vLLM's names).
QUANTIZATION_METHODS = ("fp8", "int8")


def kv_cache_dtype(setting: str, model_dtype):
    """The attention pages' dtype for a `kv_cache_dtype` setting: `model_dtype` for auto."""
    if not isinstance(setting, str) or setting not in KV_CACHE_DTYPES:
        raise ValueError(
            f"EngineConfig.kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {setting!r}"
        )
    return KV_CACHE_DTYPES[setting] or model_dtype


def ssm_cache_dtype(setting: str) -> str:
    """The recurrent states' dtype name for a `mamba_ssm_cache_dtype` setting."""
    if not isinstance(setting, str) or setting not in MAMBA_SSM_CACHE_DTYPES:
        raise ValueError(
            f"EngineConfig.mamba_ssm_cache_dtype must be one of {sorted(MAMBA_SSM_CACHE_DTYPES)}, "
            f"got {setting!r}"
        )
    return MAMBA_SSM_CACHE_DTYPES[setting]


def setting(default, help: str, *, choices: Sequence[str] | None = None, positive=False,
            parse=None):  # fmt: skip
    """A settings field: its default, its flag's help text, the values the flag offers,
    whether it must be a positive int (None allowed where that is the default), and the
    function that reads its flag's text (`parse`; default: the field's type)."""
    metadata = {"help": help, "positive": positive}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if parse is not None:
        metadata["parse"] = parse
    return field(default=default, metadata=metadata)


# The most draft tokens a verify step scores per row (a verify bucket holds 1 + k tokens a row).
MAX_SPECULATIVE_TOKENS = 16
# `SpeculativeConfig.method` values: what each needs, and whether this engine runs it yet.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys): each decode step of a row
    verifies `num_speculative_tokens` draft tokens in one step of the target model and keeps
    the accepted prefix, on the device (docs/speculative.md).

    `method` "ngram" (prompt lookup): the draft is what followed the latest earlier occurrence
    of the row's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    "draft_model" (`model`: a smaller checkpoint or preset sharing the target's tokenizer and
    vocabulary): the draft model's greedy continuation, run inside the verify step with its own
    per-slot state. "mtp": the target checkpoint's multi-token-prediction layer, run inside the
    verify step with its own KV pages (Qwen3-Next, Qwen3.5; a model without one is refused by name).
    `disable_by_batch_size`: a step with more decode rows than this does not speculate."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        where = "speculative_config"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"{where}.method must be one of {list(SPECULATIVE_METHODS)}, got "
                             f"{self.method!r}")  # fmt: skip
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}.{name} must be an int >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{where}.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got "
                f"{self.num_speculative_tokens}"
            )
        if self.method == "ngram":
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"{where}.prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                    f"prompt_lookup_max ({self.prompt_lookup_max})"
                )
            if self.model is not None:
                raise ValueError(f"{where}.model is for method 'draft_model'; method 'ngram' "
                                 f"drafts from the prompt (got model={self.model!r})")  # fmt: skip
        if self.method == "draft_model" and not self.model:
            raise ValueError(f"{where}.model is required for method 'draft_model' (a smaller "
                             "checkpoint sharing the target's tokenizer)")  # fmt: skip
        if self.method == "mtp" and self.model is not None:
            raise ValueError(
                f"{where}.model is for method 'draft_model'; method 'mtp' drafts with the "
                f"target's own MTP layers (got model={self.model!r})"
            )

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A `speculative_config` setting: None, a SpeculativeConfig, a dict of its keys, or
        that dict as JSON text (the CLI flag). Unknown keys are a ValueError naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got "
                             f"{type(value).__name__}")  # fmt: skip
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {names}")
        if "method" not in value:
            raise ValueError("speculative_config.method is required: 'ngram', 'draft_model' or "
                             "'mtp'")  # fmt: skip
        return cls(**value)


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
    kv_cache_dtype: str = setting(
        "auto",
        "dtype of the attention layers' KV pages: auto, the model dtype; fp8 (fp8_e4m3), "
        "float8_e4m3fn pages with the checkpoint's per-tensor k/v scales, else 1.0 (as vLLM), "
        "half the bytes of bf16 pages (docs/quantization.md)",
        choices=KV_CACHE_DTYPES,
    )
    speculative_config: SpeculativeConfig | dict | str | None = setting(
        None,
        'speculative decoding, vLLM\'s keys as JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4, '
        '"disable_by_batch_size": 32}; draft tokens are verified in one step and accepted on '
        "the device, greedy output unchanged (docs/speculative.md)",
        parse=SpeculativeConfig.parse,
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
        kv_cache_dtype(self.kv_cache_dtype, None)
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )

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

    def kv_itemsize(self, model_itemsize: int) -> int:
        """Bytes of one value in the KV pages, the model dtype's being `model_itemsize`."""
        name = KV_CACHE_DTYPES[self.kv_cache_dtype]
        return model_itemsize if name is None else np.dtype(getattr(ml_dtypes, name)).itemsize

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
    quantization: str | None = setting(
        None,
        "quantize a float checkpoint's projection and expert weights at load time: fp8, "
        "float8_e4m3fn weights with a scale per output channel (FP8 GEMMs); int8, weight-only "
        "int8 (for TPUs). Default: as the checkpoint is (FP8 checkpoints load as published; "
        "docs/quantization.md)",
        choices=QUANTIZATION_METHODS,
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
