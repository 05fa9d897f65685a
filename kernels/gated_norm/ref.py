"""The gated group RMSNorm's reference in plain jnp: float32 math, the output in the given dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def gated_group_rmsnorm_ref(
    y: jax.Array,  # [T, W]
    z_source: jax.Array,  # [T, Wz] z is columns [z_offset, z_offset + W)
    scale: jax.Array,  # [W]
    *,
    num_groups: int,
    eps: float,
    z_offset: int = 0,
    out_dtype=None,
) -> jax.Array:
    width = y.shape[-1]
    z = lax.slice_in_dim(z_source, z_offset, z_offset + width, axis=-1)
    gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    grouped = gated.reshape(*gated.shape[:-1], num_groups, width // num_groups)
    grouped = grouped * lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    out = scale.astype(jnp.float32) * grouped.reshape(gated.shape)
    return out.astype(out_dtype or y.dtype)
