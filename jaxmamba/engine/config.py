"""The engine's settings: batch limits, pool sizes, prefix caching, checkpoint spacing, the
recurrent state's dtype."""

from __future__ import annotations

import dataclasses
import math
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


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_prefill_seqs: int = 8  # prefill rows per step
    page_size: int = 16
    enable_prefix_caching: bool = True
    # Decode checkpoints every this many tokens, a multiple of lcm(chunk_size, page_size);
    # default (None): the first such multiple >= 256, see `for_chunk_size`.
    track_interval: int | None = None
    # Explicit pool sizes; by default sized from device memory (jaxmamba/engine/memory.py), or
    # on CPU max_num_seqs slots and every row at max_model_len, twice both with caching.
    # Slots beyond max_num_seqs are the prefix cache's checkpoint slots.
    num_state_slots: int | None = None
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9  # of the device's memory for weights, steps and cache
    kv_cache_memory_bytes: int | None = None  # the cache's size in bytes, instead of the above
    # Devices the model is split over (jaxmamba.parallel, docs/tensor_parallel.md); the cache
    # sizes above are then per shard's share of every slot and page.
    tensor_parallel_size: int = 1
    mamba_ssm_cache_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of every recurrent layer's state (Mamba2 SSM and Gated DeltaNet "
            "states; conv windows keep the model dtype): bfloat16 halves the state's bytes, so "
            "more state slots fit; auto is float32 here (vLLM's auto follows the model dtype), "
            "since the state accumulates over the whole sequence"
        },
    )

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens",
                     "max_prefill_seqs", "page_size", "track_interval",
                     "num_state_slots", "num_pages", "kv_cache_memory_bytes",
                     "tensor_parallel_size"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("track_interval", "num_state_slots", "num_pages",
                                          "kv_cache_memory_bytes"):  # fmt: skip
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
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
