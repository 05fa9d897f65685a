"""Helpers the ops share: dt processing and SiLU, matmul precision, tile arithmetic, the
Mosaic TPU lane/sublane moves, shape checks, interpret mode.

Plain jnp/lax, so the device-side helpers (``softplus``, ``silu``, ``process_dt``, ``dot``)
lower through XLA, Mosaic TPU and Triton alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

MIN_DOT_DIM = 16  # Triton's smallest matmul block edge


def softplus(x: jax.Array) -> jax.Array:
    """``log(1 + exp(x))`` without overflow, in a form every backend lowers."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)``, exact, inside a kernel (the references use ``jax.nn.silu``)."""
    return x * jax.nn.sigmoid(x)


def process_dt(
    dt: jax.Array,  # [..., H] (a scalar inside a kernel)
    dt_bias: jax.Array | None,  # [H]
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> jax.Array:
    """float32 ``clip(softplus(dt + dt_bias), *dt_limit)`` (softplus only if requested)."""
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = softplus(dt)
    return jnp.clip(dt, dt_limit[0], dt_limit[1])


def matmul_precision(dtype) -> lax.Precision:
    """float32 operands are the parity reference: keep the MXU / tensor cores from dropping
    to bf16 / tf32 passes. Other dtypes take the default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """2-D matmul contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``,
    accumulated in float32 (exact passes for float32 operands)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(
        a, b, dims, precision=matmul_precision(a.dtype), preferred_element_type=jnp.float32
    )


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return min(n & -n, cap)


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (at least 1)."""
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def to_column(row: jax.Array) -> jax.Array:
    """[1, n] -> [n, 1] without a transpose (an identity mask and a lane sum; exact), for
    Mosaic TPU kernels that move vectors between the lane and sublane axes on the VPU."""
    return jnp.sum(jnp.where(_identity(row.shape[1]), row, 0.0), axis=1, keepdims=True)


def to_row(col: jax.Array) -> jax.Array:
    """[n, 1] -> [1, n], as :func:`to_column`."""
    return jnp.sum(jnp.where(_identity(col.shape[0]), col, 0.0), axis=0, keepdims=True)


def _identity(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)


def check_optional_shapes(**arrays: tuple[jax.Array | None, tuple[int, ...]]) -> None:
    """Raise if an optional argument that was given (``name=(array, expected_shape)``) does
    not have its expected shape."""
    for name, (arr, shape) in arrays.items():
        if arr is not None and arr.shape != shape:
            raise ValueError(f"expected {name} {shape}, got {arr.shape}")


def tpu_interpret_params(interpret):
    """``pallas_call``'s ``interpret`` for a Mosaic TPU kernel: ``True`` runs it under
    ``pltpu.InterpretParams()`` (on any backend); ``False`` or explicit params pass through."""
    return pltpu.InterpretParams() if interpret is True else interpret
