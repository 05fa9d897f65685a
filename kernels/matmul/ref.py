"""The small-M matmul's reference: XLA's ``jnp.dot`` with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import matmul_precision


def small_m_matmul_ref(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    *,
    out_dtype=None,
) -> jax.Array:
    y = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=matmul_precision(x.dtype))
    return y.astype(out_dtype or x.dtype)
