"""The fused decode step as the chain it replaces: the conv update and the selective state
update (the references of ``conv1d`` and ``state_update``, or any implementation of them),
then the checkpoint copies. The kernels' reference, and the path on TPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from ..conv1d.ref import causal_conv1d_update_ref
from ..state_update.ref import selective_state_update_ref


class DecodeLayout(NamedTuple):
    """Sizes and column offsets of Mamba2's in_proj output ``[z | x B C | dt]`` (``W`` wide):
    z is ``H·P`` columns, the conv input xBC ``D = H·P + 2·G·N``, dt ``H``."""

    num_heads: int  # H
    head_dim: int  # P
    num_groups: int  # G
    state_size: int  # N
    conv_dim: int  # D

    @classmethod
    def of(cls, ssm_state: jax.Array, conv_weight: jax.Array, A: jax.Array) -> DecodeLayout:
        _, num_heads, head_dim, state_size = ssm_state.shape
        conv_dim = conv_weight.shape[1]
        bc = conv_dim - num_heads * head_dim
        if A.shape != (num_heads,) or bc <= 0 or bc % (2 * state_size):
            raise ValueError(
                f"expected A [H={num_heads}] and conv_dim = H·P + 2·G·N for ssm_state "
                f"{ssm_state.shape}; got A {A.shape}, conv_weight {conv_weight.shape}"
            )
        num_groups = bc // (2 * state_size)
        if num_heads % num_groups:
            raise ValueError(f"H={num_heads} is not a multiple of G={num_groups}")
        return cls(num_heads, head_dim, num_groups, state_size, conv_dim)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def xbc_col(self) -> int:  # first xBC column of the in_proj output
        return self.d_inner

    @property
    def b_col(self) -> int:  # first B column inside xBC
        return self.d_inner

    @property
    def c_col(self) -> int:  # first C column inside xBC
        return self.d_inner + self.num_groups * self.state_size

    @property
    def dt_col(self) -> int:  # first dt column of the in_proj output
        return self.d_inner + self.conv_dim

    @property
    def width(self) -> int:  # W
        return self.dt_col + self.num_heads


def decode_chain(
    conv_update: Callable,
    state_update: Callable,
    conv_state: jax.Array,  # [S', K-1, D]
    ssm_state: jax.Array,  # [S', H, P, N]
    zxbcdt: jax.Array,  # [T, W]
    conv_weight: jax.Array,  # [K, D]
    conv_bias: jax.Array | None,  # [D]
    A: jax.Array,  # [H]
    slots: jax.Array,  # i32[B]
    *,
    D: jax.Array | None = None,  # [H]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    track_src: jax.Array | None = None,  # i32[KT]
    track_dst: jax.Array | None = None,  # i32[KT]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode step through ``conv_update`` and ``state_update`` (the signatures of
    ``causal_conv1d_update`` and ``selective_state_update``), with the slices between them
    and the checkpoint copies after."""
    lay = DecodeLayout.of(ssm_state, conv_weight, A)
    rows = slots.shape[0]
    h, p, g, n = lay.num_heads, lay.head_dim, lay.num_groups, lay.state_size
    xbc = zxbcdt[:rows, lay.xbc_col : lay.dt_col]
    dt = zxbcdt[:rows, lay.dt_col : lay.width]
    xbc, conv_state = conv_update(conv_state, xbc, conv_weight, conv_bias, slots)
    x = xbc[:, : lay.b_col].reshape(rows, h, p)
    b = xbc[:, lay.b_col : lay.c_col].reshape(rows, g, n)
    c = xbc[:, lay.c_col :].reshape(rows, g, n)
    y, ssm_state = state_update(
        ssm_state, x, dt, A, b, c, slots,
        D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
    )  # fmt: skip
    if track_src is not None:  # the checkpoint copies (unused entries: pad → pad)
        conv_state = conv_state.at[track_dst].set(conv_state[track_src])
        ssm_state = ssm_state.at[track_dst].set(ssm_state[track_src])
    return y.reshape(rows, h * p), conv_state, ssm_state


def mamba2_decode_ref(*args, **kwargs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``decode_chain`` through the plain-jnp references."""
    return decode_chain(causal_conv1d_update_ref, selective_state_update_ref, *args, **kwargs)
