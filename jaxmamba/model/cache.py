"""The device-side state cache: slot pools for recurrent states (Mamba2 and Gated DeltaNet
layers) and paged KV for attention.

Every pool has one extra entry at the end — the **pad sink**. Padding rows, rows that track
nothing this step and padding tokens write there, so no write ever branches on device data.
Pools are kept per layer (tuples) so a kernel can update one layer's pool in place through
buffer donation without slicing a stacked array.

The pages have the model dtype, or float8_e4m3fn for `kv_cache_dtype="fp8"` (the spec's
`kv_dtype`; `attention.py` says how the scales apply).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmamba.config import ModelConfig
from jaxmamba.engine.config import kv_cache_dtype
from jaxmamba.step_contract import CacheSpec


class StateCache(NamedTuple):
    # Per recurrent layer (`ModelConfig.recurrent_layers`): a Mamba2 layer's conv window
    # [S+1, K-1, conv_dim] and SSM state [S+1, H, P, N]; a Gated DeltaNet layer's conv window
    # [S+1, K-1, gdn_conv_dim] and delta-rule state [S+1, HV, Dk, Dv]. Conv windows have the
    # activation dtype, states f32 (or bf16 by spec).
    conv: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]
    k_pages: tuple[jax.Array, ...]  # per attention layer: [NP+1, page_size, Hkv, Dh]
    v_pages: tuple[jax.Array, ...]  # per attention layer: [NP+1, page_size, Hkv, Dh]


def kv_dtype(spec: CacheSpec, dtype) -> jnp.dtype:
    """The pages' dtype: `dtype` (the model's), or the spec's `kv_dtype` setting's
    (`EngineConfig.kv_cache_dtype`)."""
    return jnp.dtype(kv_cache_dtype(spec.kv_dtype, dtype))


# Logical axis names of each cache array, for sharding (heads split across devices). A Gated
# DeltaNet layer's pools split the same dims (conv channels, value heads): the names pick the
# mesh axis, and each shard's pools are the shard model's (`sharding.sharded_cache_shapes`).
CACHE_LOGICAL_AXES = {
    "conv": ("slots", None, "mamba_conv"),
    "ssm": ("slots", "mamba_heads", None, None),
    "k_pages": ("pages", None, "kv_heads", None),
    "v_pages": ("pages", None, "kv_heads", None),
}


def cache_shapes(cfg: ModelConfig, spec: CacheSpec, dtype) -> StateCache:
    """Shapes and dtypes of every cache array, as `jax.ShapeDtypeStruct`s."""
    slots = spec.num_slots + 1
    shapes = [cfg.recurrent_state_shapes(layer) for layer in cfg.recurrent_layers]
    kv = jax.ShapeDtypeStruct(
        (spec.num_pages + 1, spec.page_size, cfg.num_key_value_heads, cfg.head_dim),
        kv_dtype(spec, dtype),
    )
    return StateCache(
        conv=tuple(jax.ShapeDtypeStruct((slots, *conv), dtype) for conv, _ in shapes),
        ssm=tuple(
            jax.ShapeDtypeStruct((slots, *state), jnp.dtype(spec.ssm_dtype)) for _, state in shapes
        ),
        k_pages=(kv,) * cfg.num_attention_layers,
        v_pages=(kv,) * cfg.num_attention_layers,
    )


def init_cache(cfg: ModelConfig, spec: CacheSpec, dtype) -> StateCache:
    """A zeroed cache. States are always written before they are read as initial states."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, spec, dtype))


def cache_bytes(cfg: ModelConfig, spec: CacheSpec, dtype) -> int:
    leaves = jax.tree.leaves(cache_shapes(cfg, spec, dtype))
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in leaves)


def copy_entries(cache: StateCache, src_slots: jax.Array, dst_slots: jax.Array,
                 src_pages: jax.Array, dst_pages: jax.Array) -> StateCache:  # fmt: skip
    """`cache` with each source slot's states copied to its destination slot and each source
    KV page to its destination page (n > 1 forks; unused entries: pad onto pad)."""
    copy = lambda pool, src, dst: pool.at[dst].set(pool[src])  # noqa: E731
    return StateCache(
        tuple(copy(c, src_slots, dst_slots) for c in cache.conv),
        tuple(copy(c, src_slots, dst_slots) for c in cache.ssm),
        tuple(copy(k, src_pages, dst_pages) for k in cache.k_pages),
        tuple(copy(v, src_pages, dst_pages) for v in cache.v_pages),
    )


def slots_after(x: jax.Array, slots: jax.Array) -> jax.Array:
    """`slots`, unchanged, made to depend on `x` (a layer's input): XLA then gathers a pool's
    rows by them inside that layer. A gather that reads only the step's inputs may otherwise
    be scheduled at the step's start, and a prefill step holds every layer's gathered row
    states at once (9B, 512 tokens x 64 prefill rows, XLA:CPU float32: 56 GiB of
    temporaries, 39 GiB with this; `scripts/dev/cache_copies.py`). `x * 0` is 0, or NaN for
    a non-finite `x`, and XLA converts NaN to the integer 0."""
    return slots + (x.reshape(-1)[0] * 0).astype(slots.dtype)
