"""How a model splits over `n` tensor-parallel shards: the shard's sizes, and what cannot split.

Each shard holds `1/n` of the Mamba heads (with their conv channels, dt, A, D and gated-norm
columns), of the Gated DeltaNet value heads (with their conv channels, z, a, b, dt_bias and
A_log), of the attention query heads, of the MLP and expert hidden units, and of the
vocabulary. What does not divide:

* Mamba heads, GDN value heads or query heads not a multiple of `n`: refused (a head cannot
  be split).
* `n_groups` (B/C groups), GDN key heads or KV heads fewer than, or not a multiple of, `n`:
  each is
  repeated `lcm(count, n) / count` times, so every shard holds whole copies of the groups
  (KV heads) its heads read — `lcm(count, n)` always divides the head count, since both
  `count` and `n` do. The same rule vLLM applies to KV heads, applied to groups too.
* MLP / expert hidden units and the vocabulary not a multiple of `n`: zero-padded (a zero
  hidden unit adds nothing; padded vocabulary columns are cut off after the logits gather).

A gated-norm group wider than a shard's columns (n_groups not a multiple of `n`) is reduced
across shards (`collectives.group_mean_square`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxmamba.config import ModelConfig
from jaxmamba.parallel.collectives import ShardLayout

AXIS = "tp"  # the mesh axis name


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class TensorParallelPlan:
    cfg: ModelConfig  # the whole model's
    size: int
    axis: str = AXIS

    def __post_init__(self):
        cfg, n = self.cfg, self.size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {n!r}")
        if cfg.mamba_layers and cfg.mamba_num_heads % n:
            raise ValueError(
                f"tensor_parallel_size={n} must divide the Mamba heads "
                f"(mamba_num_heads={cfg.mamba_num_heads}): each shard holds whole heads"
            )
        if cfg.gdn_layers and cfg.gdn_num_value_heads % n:
            raise ValueError(
                f"tensor_parallel_size={n} must divide the Gated DeltaNet value heads "
                f"(gdn_num_value_heads={cfg.gdn_num_value_heads}): each shard holds whole heads"
            )
        if cfg.attention_layers and cfg.num_attention_heads % n:
            raise ValueError(
                f"tensor_parallel_size={n} must divide the attention query heads "
                f"(num_attention_heads={cfg.num_attention_heads}): each shard holds whole heads"
            )

    @property
    def groups(self) -> int:
        """B/C groups after repetition: lcm(n_groups, n), `groups / n` per shard."""
        return math.lcm(self.cfg.n_groups, self.size)

    @property
    def gdn_key_heads(self) -> int:
        """GDN key heads after repetition: lcm(gdn_num_key_heads, n), `/ n` per shard (value
        head h reads key head h // (HV / Hk), so a shard's value heads read whole copies)."""
        if not self.cfg.gdn_layers:
            return self.cfg.gdn_num_key_heads
        return math.lcm(self.cfg.gdn_num_key_heads, self.size)

    @property
    def kv_heads(self) -> int:
        """KV heads after repetition: lcm(num_key_value_heads, n), `kv_heads / n` per shard."""
        if not self.cfg.attention_layers:
            return self.cfg.num_key_value_heads
        return math.lcm(self.cfg.num_key_value_heads, self.size)

    @property
    def padded_vocab(self) -> int:
        return _round_up(self.cfg.vocab_size, self.size)

    def padded(self, width: int) -> int:
        """A hidden width (MLP, expert) padded with zero units to a multiple of n."""
        return _round_up(width, self.size)

    def layout(self) -> ShardLayout:
        cfg = self.cfg
        return ShardLayout(
            axis=self.axis,
            size=self.size,
            vocab_size=cfg.vocab_size,
            vocab_rows=self.padded_vocab // self.size,
            norm_group_size=cfg.d_inner // cfg.n_groups if cfg.mamba_layers else 0,
        )

    def shard_config(self) -> ModelConfig:
        """The config one shard's model runs with (the vocabulary size stays the model's:
        the sampler sees gathered logits; the embedding rows come from `layout()`)."""
        cfg, n = self.cfg, self.size
        local = dict(mamba_num_heads=cfg.mamba_num_heads // n, n_groups=self.groups // n)
        if cfg.gdn_layers:
            local.update(gdn_num_key_heads=self.gdn_key_heads // n,
                         gdn_num_value_heads=cfg.gdn_num_value_heads // n)  # fmt: skip
        if cfg.attention_layers:
            local.update(num_attention_heads=cfg.num_attention_heads // n,
                         num_key_value_heads=self.kv_heads // n)  # fmt: skip
        for name in ("intermediate_size", "moe_intermediate_size",
                     "moe_shared_intermediate_size"):  # fmt: skip
            if getattr(cfg, name):
                local[name] = self.padded(getattr(cfg, name)) // n
        return dataclasses.replace(cfg, **local)

    def describe(self) -> str:
        cfg, n = self.cfg, self.size
        parts = []
        if cfg.mamba_layers:
            parts += [f"{cfg.mamba_num_heads // n} of {cfg.mamba_num_heads} Mamba heads",
                      f"{self.groups // n} of {self.groups} B/C groups"]  # fmt: skip
            if self.groups != cfg.n_groups:
                parts[-1] += f" (n_groups={cfg.n_groups} repeated {self.groups // cfg.n_groups}x)"
        if cfg.gdn_layers:
            hv, hk = cfg.gdn_num_value_heads, cfg.gdn_num_key_heads
            parts.append(f"{hv // n} of {hv} GDN value heads")
            parts.append(f"{self.gdn_key_heads // n} of {self.gdn_key_heads} GDN key heads")
            if self.gdn_key_heads != hk:
                parts[-1] += f" (gdn_num_key_heads={hk} repeated {self.gdn_key_heads // hk}x)"
        if cfg.attention_layers:
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            parts.append(f"{hq // n} of {hq} query heads")
            parts.append(f"{self.kv_heads // n} of {self.kv_heads} KV heads")
            if self.kv_heads != hkv:
                parts[-1] += f" (num_key_value_heads={hkv} repeated {self.kv_heads // hkv}x)"
        return f"tensor parallel over {n} shards, each with " + ", ".join(parts)
