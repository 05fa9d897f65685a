"""The fused Mamba2 decode kernels (GPU, interpret mode on CPU) against the chain of references
they replace, a float64 numpy loop, and the chain of the two ops' GPU kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import mamba2_decode, mamba2_decode_ref
from jaxmamba.kernels.conv1d.gpu import UpdateGpuBlockSizes, causal_conv1d_update_gpu
from jaxmamba.kernels.mamba_decode import FUSED_ENV, DecodeLayout, decode_chain
from jaxmamba.kernels.mamba_decode.gpu import (
    GpuBlockSizes,
    mamba2_decode_gpu,
    track_targets_by_row,
)
from jaxmamba.kernels.state_update.gpu import GpuBlockSizes as StateBlockSizes
from jaxmamba.kernels.state_update.gpu import selective_state_update_gpu

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
SAME = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3}  # a bf16 ulp: y rounded on either side
# Small tiles: several conv programs a row, one P tile of 8 rows a state program.
SMALL = GpuBlockSizes(UpdateGpuBlockSizes(channels=16), StateBlockSizes(head_dim=8, tiles=1))


def _softplus(v):
    return np.log1p(np.exp(-np.abs(v))) + np.maximum(v, 0.0)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _numpy_step(conv, ssm, zx, w, bias, A, slots, D, dt_bias, softplus, src, dst, lay):
    """float64 loop over rows and heads; returns (y, conv, ssm) for the rows in ``slots``."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    conv, ssm, zx, w, bias, A, D, dt_bias = map(f, (conv, ssm, zx, w, bias, A, D, dt_bias))
    h, p, g, n = lay.num_heads, lay.head_dim, lay.num_groups, lay.state_size
    y = np.zeros((len(slots), h, p))
    for r, slot in enumerate(slots):
        window = np.concatenate([conv[slot], zx[r, lay.xbc_col : lay.dt_col][None]])  # [K, D]
        xbc = (window * w).sum(0) + (0.0 if bias is None else bias)
        xbc = _silu(xbc)
        conv[slot] = window[1:]
        x = xbc[: lay.b_col].reshape(h, p)
        b = xbc[lay.b_col : lay.c_col].reshape(g, n)
        c = xbc[lay.c_col :].reshape(g, n)
        for head in range(h):
            grp = head // (h // g)
            d = zx[r, lay.dt_col + head] + (0.0 if dt_bias is None else dt_bias[head])
            d = max(_softplus(d) if softplus else d, 0.0)
            ssm[slot, head] = np.exp(d * A[head]) * ssm[slot, head] + d * np.outer(x[head], b[grp])
            y[r, head] = ssm[slot, head] @ c[grp] + (0.0 if D is None else D[head] * x[head])
    for s, t in zip(src, dst, strict=True):
        if s in slots:
            conv[t], ssm[t] = conv[s], ssm[s]
    return y, conv, ssm


def _gpu_chain(*args, sizes: GpuBlockSizes, **kwargs):
    """The unfused GPU path: the two ops' kernels in interpret mode, with the XLA glue."""
    return decode_chain(
        functools.partial(causal_conv1d_update_gpu, interpret=True, block_sizes=sizes.conv),
        functools.partial(selective_state_update_gpu, interpret=True, block_sizes=sizes.state),
        *args,
        **kwargs,
    )


def _inputs(rng, rows, heads, head_dim, groups, state, width, dtype, optional, tracks):
    """Random inputs; the pad slot, the rows past B, the z columns and the pad rows are NaN,
    so a read of any of them shows in the outputs."""
    conv_dim = heads * head_dim + 2 * groups * state
    num_slots = 2 * rows + 2
    pad = num_slots
    slots = rng.permutation(num_slots)[:rows].astype(np.int32)
    slots[-2:] = pad  # the last two rows are padding
    free = np.setdiff1d(np.arange(num_slots), slots)
    conv = rng.standard_normal((num_slots + 1, width - 1, conv_dim)).astype(np.float32)
    ssm = rng.standard_normal((num_slots + 1, heads, head_dim, state)).astype(np.float32)
    conv[pad] = ssm[pad] = np.nan
    lay = DecodeLayout(heads, head_dim, groups, state, conv_dim)
    zx = rng.standard_normal((rows + 3, lay.width)).astype(np.float32)
    zx[:, lay.dt_col :] -= 1.0
    zx[rows:] = np.nan
    zx[:rows][slots == pad] = np.nan
    zx[:, : lay.xbc_col] = np.nan  # z: the gate is not this op's
    kw = dict(dt_softplus=optional)
    if optional:
        kw |= dict(
            D=jnp.asarray(rng.standard_normal(heads), jnp.float32),
            dt_bias=jnp.asarray(rng.uniform(-2.0, 0.0, heads), jnp.float32),
        )
    if tracks:  # two real rows checkpoint into free slots; one unused entry
        first, last = np.flatnonzero(slots != pad)[[0, -1]]
        kw["track_src"] = jnp.asarray([slots[first], slots[last], pad], jnp.int32)
        kw["track_dst"] = jnp.asarray([free[0], free[1], pad], jnp.int32)
    weights = (
        jnp.asarray(0.5 * rng.standard_normal((width, conv_dim)), dtype),
        jnp.asarray(rng.standard_normal(conv_dim), dtype) if optional else None,
        jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, heads)), jnp.float32),
    )
    args = (jnp.asarray(conv, dtype), jnp.asarray(ssm), jnp.asarray(zx, dtype), weights[0],
            weights[1], weights[2], jnp.asarray(slots))  # fmt: skip
    return args, kw, lay, slots, pad


CASES = [
    # rows, heads, head_dim, groups, state, conv width, dtype, optional inputs, tracks, tiles
    (5, 4, 80, 2, 16, 4, jnp.bfloat16, True, True, None),  # the defaults: 5 P tiles a program
    (5, 6, 12, 3, 8, 4, jnp.float32, False, True, SMALL),
    (34, 2, 8, 1, 16, 4, jnp.float32, True, True, None),  # > 32 rows: wide conv, N/2 tiles
]


@pytest.mark.parametrize(
    "rows,heads,head_dim,groups,state,width,dtype,optional,tracks,sizes", CASES
)
def test_fused_decode_matches_chain_reference_numpy_and_unfused_kernels(
    rows, heads, head_dim, groups, state, width, dtype, optional, tracks, sizes
):
    rng = np.random.default_rng(rows * 100 + head_dim + width)
    args, kw, lay, slots, pad = _inputs(
        rng, rows, heads, head_dim, groups, state, width, dtype, optional, tracks
    )
    fused = functools.partial(mamba2_decode_gpu, interpret=True, block_sizes=sizes, **kw)
    y, conv, ssm = jax.jit(fused)(*args)
    if tracks:  # the targets by row, as ForwardMetadata passes them: the same step
        pairs = dict(
            zip(
                np.asarray(kw["track_src"]).tolist(),
                np.asarray(kw["track_dst"]).tolist(),
                strict=True,
            )
        )
        by_row = jnp.asarray([pairs.get(s, pad) for s in slots.tolist()], jnp.int32)
        got = jax.jit(functools.partial(fused, track_by_row=by_row))(*args)
        for a, b in zip(got, (y, conv, ssm), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    real = slots != pad
    y, conv, ssm = np.asarray(y, np.float32)[real], np.asarray(conv, np.float32), np.asarray(ssm)

    # The unfused GPU kernels' arithmetic, without the copies between: equal up to the order
    # XLA:CPU gives the interpreted float ops (an ulp or so).
    chain = functools.partial(_gpu_chain, sizes=sizes or GpuBlockSizes.get_default(rows), **kw)
    y_k, conv_k, ssm_k = jax.jit(chain)(*args)
    same = dict(rtol=SAME[dtype], atol=SAME[dtype])
    np.testing.assert_allclose(y, np.asarray(y_k, np.float32)[real], **same)
    np.testing.assert_allclose(conv[:-1], np.asarray(conv_k, np.float32)[:-1], **same)
    np.testing.assert_allclose(ssm[:-1], np.asarray(ssm_k)[:-1], rtol=2e-6, atol=2e-6)

    tol = TOL[dtype]
    y_r, conv_r, ssm_r = jax.jit(functools.partial(mamba2_decode_ref, **kw))(*args)
    np.testing.assert_allclose(y, np.asarray(y_r, np.float32)[real], rtol=tol, atol=tol)
    np.testing.assert_allclose(conv[:-1], np.asarray(conv_r, np.float32)[:-1], rtol=tol, atol=tol)
    np.testing.assert_allclose(ssm[:-1], np.asarray(ssm_r)[:-1], rtol=tol, atol=tol)

    src = [] if "track_src" not in kw else np.asarray(kw["track_src"]).tolist()
    dst = [] if "track_dst" not in kw else np.asarray(kw["track_dst"]).tolist()
    host = [np.asarray(a, np.float32) if a is not None else None for a in args]
    y_np, conv_np, ssm_np = _numpy_step(
        *host[:6], slots[real], kw.get("D"), kw.get("dt_bias"), kw["dt_softplus"], src, dst, lay
    )
    np.testing.assert_allclose(y, y_np.reshape(y.shape), rtol=tol, atol=tol)
    np.testing.assert_allclose(conv[:-1], conv_np[:-1], rtol=tol, atol=tol)
    np.testing.assert_allclose(ssm[:-1], ssm_np[:-1], rtol=tol, atol=tol)

    written = set(slots.tolist()) | set(dst)
    untouched = [s for s in range(pad) if s not in written]
    np.testing.assert_array_equal(ssm[untouched], host[1][untouched])
    np.testing.assert_array_equal(conv[untouched], host[0][untouched])
    if tracks:  # the checkpoint slots hold their rows' new states
        np.testing.assert_array_equal(ssm[dst[0]], ssm[src[0]])
        np.testing.assert_array_equal(conv[dst[1]], conv[src[1]])


def test_fused_decode_jits_with_donated_pools():  # and K = 3, no checkpoints
    rng = np.random.default_rng(1)
    args, kw, *_ = _inputs(rng, 4, 4, 8, 2, 16, 3, jnp.float32, True, False)
    expected = mamba2_decode_ref(*args, **kw)
    step = jax.jit(functools.partial(mamba2_decode, impl="interpret", **kw), donate_argnums=(0, 1))
    for got, want in zip(step(*args), expected, strict=True):
        np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_fused_decode_dispatch_picks_kernels_by_platform(monkeypatch):
    rng = np.random.default_rng(2)
    args, kw, *_ = _inputs(rng, 3, 2, 8, 1, 16, 4, jnp.float32, True, True)
    args = tuple(jnp.nan_to_num(a) if a is not None else None for a in args)
    with pytest.raises(ValueError, match="CPU"):
        mamba2_decode(*args, impl="pallas", **kw)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")

    def lowered(impl, platform):
        fn = jax.jit(functools.partial(mamba2_decode, impl=impl, **kw))
        return jax.export.export(fn, platforms=(platform,), disabled_checks=[triton])(
            *args
        ).mlir_module()

    # The GPU's default: the fused kernels (measured faster than the chain); "0": the chain.
    monkeypatch.delenv(FUSED_ENV, raising=False)
    gpu = lowered("auto_gpu", "cuda")
    assert "mamba2_decode_state" in gpu and "selective_state_update" not in gpu
    monkeypatch.setenv(FUSED_ENV, "0")
    chain = lowered("auto_gpu", "cuda")
    assert "selective_state_update" in chain and "mamba2_decode_state" not in chain
    # No TPU kernel of its own: the two ops' Mosaic TPU kernels.
    assert "tpu_custom_call" in lowered("pallas_tpu", "tpu")
    assert "custom_call" not in lowered("auto", "tpu")  # traced on CPU: the references


def test_track_targets_by_row_reads_each_rows_copy_from_the_list():
    pad = 9
    slots = jnp.asarray([4, 0, 7, pad, pad], jnp.int32)
    src = jnp.asarray([7, pad, 0, 4], jnp.int32)  # slot 4's entry is unused (target pad)
    dst = jnp.asarray([2, pad, 8, pad], jnp.int32)
    got = track_targets_by_row(slots, src, dst, pad)
    np.testing.assert_array_equal(np.asarray(got), [pad, 8, 2, pad, pad])


def test_track_by_row_is_checked_against_the_rows():
    rng = np.random.default_rng(3)
    args, kw, *_ = _inputs(rng, 4, 2, 8, 1, 16, 4, jnp.float32, True, True)
    with pytest.raises(ValueError, match="track_by_row"):
        mamba2_decode(*args, impl="ref", track_by_row=jnp.zeros((3,), jnp.int32), **kw)
    kw.pop("track_src"), kw.pop("track_dst")
    with pytest.raises(ValueError, match="track_by_row"):
        mamba2_decode(*args, impl="ref", track_by_row=jnp.zeros((4,), jnp.int32), **kw)
