"""Pallas selective_state_update kernels (TPU and GPU, interpret mode on CPU) against the
reference and a float64 numpy step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import selective_state_update, selective_state_update_ref
from jaxmamba.kernels.state_update.gpu import GpuBlockSizes, selective_state_update_gpu

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

KERNELS = {
    "tpu": functools.partial(selective_state_update, impl="interpret"),
    "gpu": functools.partial(selective_state_update_gpu, interpret=True),
    # Several P tiles a program (5 of 8 rows at P = 80, whole heads at P = 12 and 16).
    "gpu_tiles": functools.partial(
        selective_state_update_gpu, interpret=True, block_sizes=GpuBlockSizes(head_dim=8, tiles=5)
    ),
}


def _softplus(v):
    return np.log1p(np.exp(-np.abs(v))) + np.maximum(v, 0.0)


def _numpy_step(pool, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus):
    """float64 loop over rows and heads; returns (y, new_pool) for the real rows."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    pool, x, dt, A, B, C, D, z, dt_bias = map(f, (pool, x, dt, A, B, C, D, z, dt_bias))
    heads, groups = x.shape[1], B.shape[1]
    y = np.zeros_like(x)
    for row, slot in enumerate(slots):
        for h in range(heads):
            g = h // (heads // groups)
            d = dt[row, h] + (0.0 if dt_bias is None else dt_bias[h])
            d = _softplus(d) if dt_softplus else d
            d = max(d, 0.0)  # dt_limit lower bound 0
            pool[slot, h] = np.exp(d * A[h]) * pool[slot, h] + d * np.outer(x[row, h], B[row, g])
            y[row, h] = pool[slot, h] @ C[row, g]
            if D is not None:
                y[row, h] += D[h] * x[row, h]
            if z is not None:
                y[row, h] *= z[row, h] / (1.0 + np.exp(-z[row, h]))
    return y, pool


CASES = [
    # rows, heads, head_dim, groups, state, dtype, optional inputs
    (5, 4, 80, 2, 12, jnp.bfloat16, True),
    (3, 4, 12, 1, 16, jnp.float32, True),
    (7, 6, 16, 3, 8, jnp.float32, False),
]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rows,heads,head_dim,groups,state,dtype,optional", CASES)
def test_state_update_kernel_matches_reference_and_numpy(
    kernel, rows, heads, head_dim, groups, state, dtype, optional
):
    rng = np.random.default_rng(rows * 100 + head_dim)
    num_slots = 2 * rows
    pad_slot = num_slots
    # Real rows take distinct slots; the last two rows are padding on the pad slot.
    slots = rng.permutation(num_slots)[:rows].astype(np.int32)
    slots[-2:] = pad_slot
    real = slots != pad_slot

    pool = rng.standard_normal((num_slots + 1, heads, head_dim, state)).astype(np.float32)
    pool[pad_slot] = np.nan

    def per_row(*shape, scale=1.0):
        a = (scale * rng.standard_normal((rows, *shape))).astype(np.float32)
        a[~real] = np.nan
        return jnp.asarray(a, dtype)

    x, dt, z = per_row(heads, head_dim), per_row(heads), per_row(heads, head_dim)
    B, C = per_row(groups, state, scale=0.5), per_row(groups, state, scale=0.5)
    A = jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, heads)), jnp.float32)
    D = jnp.asarray(rng.standard_normal(heads), jnp.float32) if optional else None
    dt_bias = jnp.asarray(rng.uniform(-2.0, 0.0, heads), jnp.float32) if optional else None
    z = z if optional else None
    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=optional)

    args = (jnp.asarray(pool), x, dt, A, B, C, jnp.asarray(slots))
    y, new_pool = KERNELS[kernel](*args, **kw)
    y_ref, pool_ref = selective_state_update_ref(*args, **kw)
    y_np, pool_np = _numpy_step(pool, x, dt, A, B, C, slots[real], D, z, dt_bias, optional)

    tol = TOL[dtype]
    y, new_pool = np.asarray(y, np.float32), np.asarray(new_pool)
    np.testing.assert_allclose(y[real], np.asarray(y_ref, np.float32)[real], rtol=tol, atol=tol)
    np.testing.assert_allclose(y[real], y_np[: real.sum()], rtol=tol, atol=tol)
    np.testing.assert_allclose(new_pool[:-1], np.asarray(pool_ref)[:-1], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(new_pool[:-1], pool_np[:-1], rtol=tol, atol=tol)
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_state_update_kernel_jits_with_donated_pool():
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((4, 2, 8, 16)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 2, 8)), jnp.float32)
    dt = jnp.asarray(rng.standard_normal((2, 2)), jnp.float32)
    bc = jnp.asarray(rng.standard_normal((2, 1, 16)), jnp.float32)
    a = -jnp.ones(2)
    slots = jnp.asarray([2, 0], jnp.int32)
    expected = selective_state_update_ref(pool, x, dt, a, bc, bc, slots)
    step = jax.jit(functools.partial(selective_state_update, impl="interpret"), donate_argnums=0)
    y, new_pool = step(pool, x, dt, a, bc, bc, slots)
    np.testing.assert_allclose(y, expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_pool, expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_state_update_dispatch_picks_platform_kernels():
    args = (
        jnp.zeros((3, 2, 8, 16)), jnp.ones((2, 2, 8)), jnp.ones((2, 2)), -jnp.ones(2),
        jnp.ones((2, 1, 16)), jnp.ones((2, 1, 16)), jnp.asarray([0, 2], jnp.int32),
    )  # fmt: skip
    with pytest.raises(ValueError, match="CPU"):
        selective_state_update(*args, impl="pallas")
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for impl, platform, marker in (
        ("pallas_tpu", "tpu", "tpu_custom_call"),
        ("auto_gpu", "cuda", "xla.gpu.triton"),
        ("auto", "tpu", "scatter"),  # traced on CPU: the reference
    ):
        fn = jax.jit(functools.partial(selective_state_update, impl=impl))
        exported = jax.export.export(fn, platforms=(platform,), disabled_checks=[triton])(*args)
        assert marker in exported.mlir_module(), impl
