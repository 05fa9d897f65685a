"""The engine's settings: batch limits, pool sizes, prefix caching, checkpoint spacing."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


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
    num_state_slots: int | None = None  # default: max_num_seqs, twice that with prefix caching
    num_pages: int | None = None  # default: every row at max_model_len, 2x with caching

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens",
                     "max_prefill_seqs", "page_size", "track_interval",
                     "num_state_slots", "num_pages"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("track_interval", "num_state_slots", "num_pages"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")

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
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def state_slots(self) -> int:
        if self.num_state_slots is not None:
            return self.num_state_slots
        return self.max_num_seqs * (2 if self.enable_prefix_caching else 1)

    @property
    def pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return self.max_num_seqs * self.max_pages_per_seq * (2 if self.enable_prefix_caching else 1)
