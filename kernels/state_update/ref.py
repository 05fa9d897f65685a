"""The decode selective state update in plain jnp (float32 arithmetic): the kernels' reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import process_dt


def selective_state_update_ref(
    state: jax.Array,  # [S', H, P, N]
    x: jax.Array,  # [B, H, P]
    dt: jax.Array,  # [B, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [B, G, N]
    C: jax.Array,  # [B, G, N]
    slots: jax.Array,  # i32[B]
    *,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | None = None,  # [B, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[jax.Array, jax.Array]:
    rows, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    r = num_heads // num_groups
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, H]
    decay = jnp.exp(dt * A.astype(jnp.float32))  # [B, H]
    xf = x.astype(jnp.float32)
    bh = jnp.repeat(B.astype(jnp.float32), r, axis=1)  # [B, H, N]
    ch = jnp.repeat(C.astype(jnp.float32), r, axis=1)  # [B, H, N]
    h = state[slots].astype(jnp.float32)  # [B, H, P, N]
    h = decay[..., None, None] * h + (dt[..., None] * xf)[..., None] * bh[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", h, ch)
    if D is not None:
        y = y + D.astype(jnp.float32)[:, None] * xf
    if z is not None:
        y = y * jax.nn.silu(z.astype(jnp.float32))
    new_state = state.at[slots].set(h.astype(state.dtype))
    return y.astype(x.dtype), new_state
