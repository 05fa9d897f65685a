"""Pallas causal conv1d kernels (TPU and GPU, interpret mode on CPU) against the references
and a float64 numpy direct convolution."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import (
    ColumnView,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
)
from jaxmamba.kernels.conv1d.gpu import (
    VarlenGpuBlockSizes,
    causal_conv1d_update_gpu,
    causal_conv1d_varlen_gpu,
    silu,
)
from jaxmamba.kernels.conv1d.tpu import VarlenTpuBlockSizes, causal_conv1d_varlen_tpu

# float32 runs the exact SiLU; bf16 the tanh form (interpret mode: its emulation, see gpu.py).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Small tiles, so the sweep crosses tile boundaries (sequence starts in the middle of a tile,
# K-1 halo rows from the previous tile) without many interpret-mode grid steps.
SMALL_TPU = VarlenTpuBlockSizes(tokens=16, channels=128)
SMALL_GPU = VarlenGpuBlockSizes(tokens=8, channels=64)
# The GPU kernel's interior path is taken by the spans inside a long sequence (e.g. tokens
# 32..39 of the first case), the general path by the others; tokens past T (5 padding + a
# ragged last tile) in every case.
GPU_VARIANTS = {
    "gpu": SMALL_GPU,  # the defaults: 4 tiles a program
    "gpu_tile_one": dataclasses.replace(SMALL_GPU, tiles=1),
    # 2-token tiles, 4 a program: programs on either path (tokens 32..39 of the first case on
    # the interior one); the last program's last tile lies past T.
    "gpu_tile_loop": dataclasses.replace(SMALL_GPU, tokens=2, tiles=4),
}
VARLEN = {
    "tpu": functools.partial(causal_conv1d_varlen_tpu, interpret=True, block_sizes=SMALL_TPU),
    **{
        name: functools.partial(causal_conv1d_varlen_gpu, interpret=True, block_sizes=sizes)
        for name, sizes in GPU_VARIANTS.items()
    },
}
UPDATE = {
    "tpu": functools.partial(causal_conv1d_update, impl="interpret"),
    "gpu": functools.partial(causal_conv1d_update_gpu, interpret=True),
}


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _numpy_varlen(x, weight, bias, cu, init, track_ends):
    x, weight, bias = (np.asarray(a, np.float64) for a in (x, weight, bias))
    width = weight.shape[0]
    y = np.full(x.shape, np.nan)
    finals, tracked = [], []
    for s in range(len(cu) - 1):
        start, end = cu[s], cu[s + 1]
        prev = np.zeros((width - 1, x.shape[1])) if init is None else np.asarray(init[s], float)
        inp = np.concatenate([prev, x[start:end]])
        for r in range(end - start):
            y[start + r] = _silu((inp[r : r + width] * weight).sum(0) + bias)
        finals.append(inp[end - start : end - start + width - 1])
        tracked.append(inp[track_ends[s] : track_ends[s] + width - 1])
    return y, np.stack(finals), np.stack(tracked)


@pytest.mark.parametrize("kernel", sorted(VARLEN))
@pytest.mark.parametrize(
    "lengths,dim,width,dtype,with_init",
    [
        ([1, 7, 0, 8, 9, 21, 3], 128, 4, jnp.float32, True),
        ([5, 0, 18, 2], 192, 4, jnp.bfloat16, False),
        ([11, 1, 6], 64, 3, jnp.bfloat16, True),
    ],
)
def test_conv_varlen_kernel_matches_reference_and_numpy(
    kernel, lengths, dim, width, dtype, with_init
):
    rng = np.random.default_rng(sum(lengths) + dim)
    real = sum(lengths)
    num_tokens = real + 5  # padding tokens, poisoned: they must never reach a real output
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    x[real:] = np.nan
    x = jnp.asarray(x, dtype)
    weight = jnp.asarray(rng.standard_normal((width, dim)) / np.sqrt(width), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(dim), jnp.float32)
    init = rng.standard_normal((len(lengths), width - 1, dim)).astype(np.float32)
    init = jnp.asarray(init, dtype) if with_init else None
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    track_ends = np.array([rng.integers(0, n + 1) for n in lengths], np.int32)

    args = (x, weight, bias, jnp.asarray(cu))
    kw = dict(initial_states=init, track_ends=jnp.asarray(track_ends))
    y, final, tracked = VARLEN[kernel](*args, **kw)
    y_ref, final_ref, tracked_ref = causal_conv1d_varlen_ref(*args, **kw)
    y_np, final_np, tracked_np = _numpy_varlen(x, weight, bias, cu, init, track_ends)

    tol = TOL[dtype]
    y = np.asarray(y, np.float32)[:real]
    np.testing.assert_allclose(y, np.asarray(y_ref, np.float32)[:real], rtol=tol, atol=tol)
    np.testing.assert_allclose(y, y_np[:real], rtol=tol, atol=tol)
    for ours, ref, ref_np in ((final, final_ref, final_np), (tracked, tracked_ref, tracked_np)):
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
        np.testing.assert_allclose(np.asarray(ours, np.float32), ref_np, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "kernel, start",
    # 40: a multiple of 8 (as the in_proj output's xBC is: 16-byte rows on the GPU); 5: not.
    [("ref", 40), ("tpu", 40), ("gpu", 40), ("gpu", 5), ("gpu_tile_loop", 5)],
)
def test_conv_varlen_reads_a_column_view_in_place(kernel, start):
    """x as D columns of a wider array whose other columns are NaN (a read of a wrong column
    is NaN): the same outputs, bit for bit, as from x alone. Tokens 32..63 are an interior
    span for the GPU kernels' default tiles, and two channel blocks cover D."""
    rng = np.random.default_rng(start)
    lengths, dim, width = [3, 0, 70, 6, 1], 128, 4
    real = sum(lengths)
    x = rng.standard_normal((real + 3, dim)).astype(np.float32)
    x[real:] = np.nan
    wide = np.full((x.shape[0], start + dim + 24), np.nan, np.float32)
    wide[:, start : start + dim] = x
    x, wide = jnp.asarray(x, jnp.bfloat16), jnp.asarray(wide, jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((width, dim)) / np.sqrt(width), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(dim), jnp.float32)
    init = jnp.asarray(rng.standard_normal((len(lengths), width - 1, dim)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    track_ends = jnp.asarray([rng.integers(0, n + 1) for n in lengths], jnp.int32)
    fn = causal_conv1d_varlen_ref if kernel == "ref" else VARLEN[kernel]
    kw = dict(initial_states=init, track_ends=track_ends)
    viewed = fn(ColumnView.of(wide, start, (dim,)), weight, bias, cu, **kw)
    plain = fn(x, weight, bias, cu, **kw)
    np.testing.assert_array_equal(np.asarray(viewed[0][:real]), np.asarray(plain[0][:real]))
    for ours, theirs in zip(viewed[1:], plain[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_conv_varlen_dispatch_runs_tpu_kernel_in_interpret_mode():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((12, 128)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    cu = jnp.asarray([0, 5, 12], jnp.int32)
    ours = causal_conv1d_varlen(x, weight, None, cu, impl="interpret")
    ref = causal_conv1d_varlen_ref(x, weight, None, cu)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ours[1], ref[1])


@pytest.mark.parametrize("kernel", sorted(UPDATE))
@pytest.mark.parametrize(
    "rows,dim,width,dtype,state_dtype",
    [(5, 256, 4, jnp.bfloat16, jnp.bfloat16), (3, 96, 4, jnp.float32, jnp.float32)],
)
def test_conv_update_kernel_matches_reference_and_numpy(
    kernel, rows, dim, width, dtype, state_dtype
):
    rng = np.random.default_rng(rows + dim)
    num_slots = 2 * rows
    slots = rng.permutation(num_slots)[:rows].astype(np.int32)
    slots[-2:] = num_slots  # two pad rows share the pad slot
    real = slots != num_slots
    pool = rng.standard_normal((num_slots + 1, width - 1, dim)).astype(np.float32)
    pool[-1] = np.nan
    pool = jnp.asarray(pool, state_dtype)
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    x[~real] = np.nan
    x = jnp.asarray(x, dtype)
    weight = jnp.asarray(rng.standard_normal((width, dim)) / np.sqrt(width), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(dim), jnp.float32)

    args = (pool, x, weight, bias, jnp.asarray(slots))
    y, new_pool = UPDATE[kernel](*args)
    y_ref, pool_ref = causal_conv1d_update_ref(*args)

    window = np.concatenate(
        [np.asarray(pool, np.float64)[slots[real]], np.asarray(x, np.float64)[real][:, None]], 1
    )
    y_np = _silu((window * np.asarray(weight, np.float64)).sum(1) + np.asarray(bias, np.float64))
    tol = TOL[dtype]
    y = np.asarray(y, np.float32)
    np.testing.assert_allclose(y[real], np.asarray(y_ref, np.float32)[real], rtol=tol, atol=tol)
    np.testing.assert_allclose(y[real], y_np, rtol=tol, atol=tol)
    new_pool, pool_ref = np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32)
    np.testing.assert_array_equal(new_pool[:-1], pool_ref[:-1])
    np.testing.assert_array_equal(new_pool[slots[real]], window[:, 1:].astype(np.float32))


def test_conv_varlen_gpu_rejects_non_pow2_tile():
    x = jnp.ones((16, 64), jnp.float32)
    with pytest.raises(ValueError, match="power-of-two"):
        causal_conv1d_varlen_gpu(
            x, x[:4], None, jnp.asarray([0, 16], jnp.int32), interpret=True,
            block_sizes=VarlenGpuBlockSizes(tokens=12),
        )  # fmt: skip


def test_gpu_conv_float32_default_is_the_exact_silu():
    """float32 inputs take the exact SiLU on the GPU by default: in interpret mode the kernels
    match the reference to float32 rounding, far below the tanh form's error."""
    rng = np.random.default_rng(7)
    dim, width = 64, 4
    x = jnp.asarray(3 * rng.standard_normal((40, dim)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((width, dim)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(dim), jnp.float32)
    cu = jnp.asarray([0, 3, 29, 40], jnp.int32)
    init = jnp.asarray(rng.standard_normal((3, width - 1, dim)), jnp.float32)
    args, kw = (x, weight, bias, cu), dict(initial_states=init)
    y = causal_conv1d_varlen_gpu(*args, **kw, interpret=True, block_sizes=SMALL_GPU)[0]
    y_ref = causal_conv1d_varlen_ref(*args, **kw)[0]
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)

    pool = jnp.asarray(rng.standard_normal((5, width - 1, dim)), jnp.float32)
    slots = jnp.asarray([3, 0, 4], jnp.int32)
    update_args = (pool, x[:3], weight, bias, slots)
    y = causal_conv1d_update_gpu(*update_args, interpret=True)[0]
    np.testing.assert_allclose(y, causal_conv1d_update_ref(*update_args)[0], rtol=1e-6, atol=1e-6)


def test_silu_tanh_form_runs_its_approximation_in_interpret_mode():
    """The bf16 kernels' tanh form is an approximation in interpret mode too (tanh rounded to
    16 significant bits), within that rounding of the exact SiLU; the exact form is exact."""
    y = jnp.linspace(-30.0, 30.0, 20001, dtype=jnp.float32)
    exact = np.asarray(y, np.float64) / (1.0 + np.exp(-np.asarray(y, np.float64)))
    np.testing.assert_allclose(silu(y, approx=False, interpret=True), exact, rtol=1e-6, atol=1e-7)
    err = np.abs(np.asarray(silu(y, approx=True, interpret=True), np.float64) - exact)
    assert err.max() > 1e-7  # not the exact function
    assert np.all(err <= 2.0**-16 * np.abs(np.asarray(y)) / 2 + 1e-6)
