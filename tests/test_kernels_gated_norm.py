"""gated_group_rmsnorm: the Pallas GPU kernel in interpret mode vs the reference and float64
numpy (z read in place from a wider array whose other columns are NaN), its Triton lowering at
9B shapes, the dispatcher, and the model's norm on the kernel vs on the reference."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.kernels.gated_norm import (
    GpuBlockSizes,
    gated_group_rmsnorm,
    gated_group_rmsnorm_ref,
    group_pieces,
)
from jaxmamba.kernels.gated_norm.gpu import gated_group_rmsnorm_gpu
from jaxmamba.model import layers
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.layers import GatedGroupRMSNorm
from jaxmamba.model.params import param_shapes

from model_helpers import builder, make_runner, row

EPS = 1e-5
# Relative to max |out|: bf16 output rounding (2^-8) dominates; float32 differs in sum order.
RTOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}
SMALL_GRID = dict(min_programs=1)  # the tests' shapes are tiny: keep the configured rows


def _inputs(num_rows, num_groups, group_width, z_offset, dtype, seed=0):
    """y [T, W], z_source [T, z_offset + W + 24] (NaN outside z's columns), scale f32[W]."""
    rng = np.random.default_rng(seed)
    width = num_groups * group_width
    y = rng.standard_normal((num_rows, width))
    z_source = np.full((num_rows, z_offset + width + 24), np.nan)
    z_source[:, z_offset : z_offset + width] = 2 * rng.standard_normal((num_rows, width))
    scale = 1 + 0.5 * rng.standard_normal(width)
    return jnp.asarray(y, dtype), jnp.asarray(z_source, dtype), jnp.asarray(scale, jnp.float32)


def _numpy(y, z_source, scale, num_groups, z_offset):
    y, z_source, scale = (np.asarray(a, np.float64) for a in (y, z_source, scale))
    width = y.shape[1]
    z = z_source[:, z_offset : z_offset + width]
    gated = (y * z / (1 + np.exp(-z))).reshape(y.shape[0], num_groups, -1)
    normed = gated / np.sqrt(np.mean(gated**2, axis=-1, keepdims=True) + EPS)
    return scale * normed.reshape(y.shape)


def _assert_close(got, want, dtype):
    want = np.asarray(want, np.float64)
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err <= RTOL[dtype], f"max relative error {err:.2e} > {RTOL[dtype]:.0e}"


BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(
    "num_rows, num_groups, group_width, z_offset, block_sizes, dtype",
    [
        (1, 4, 80, 0, GpuBlockSizes(), BF16),  # a decode row; 80 = 64 + 16
        (3, 2, 80, 40, GpuBlockSizes(elements=320, **SMALL_GRID), F32),  # 3 rows of a 4-row block
        (37, 3, 80, 13, GpuBlockSizes(elements=320, **SMALL_GRID), BF16),  # 10 blocks, ragged end
        (37, 1, 320, 0, GpuBlockSizes(elements=640, **SMALL_GRID), F32),  # one group: 256 + 64
        # 1280 / 8, in 64-column pieces (64 + 64 + 32), at z_offset 0 of a wider array
        (9, 8, 160, 0, GpuBlockSizes(piece=64, elements=640, **SMALL_GRID), BF16),
        (5, 2, 100, 7, GpuBlockSizes(piece=16, **SMALL_GRID), F32),  # 6 x 16 + 4, unaligned z
    ],
)
def test_kernel_matches_reference_and_float64(
    num_rows, num_groups, group_width, z_offset, block_sizes, dtype
):
    y, z_source, scale = _inputs(num_rows, num_groups, group_width, z_offset, dtype, num_rows)
    kw = dict(num_groups=num_groups, eps=EPS, z_offset=z_offset)
    got = gated_group_rmsnorm_gpu(y, z_source, scale, interpret=True, block_sizes=block_sizes, **kw)
    assert got.shape == y.shape and got.dtype == y.dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()  # no NaN column of z_source read
    _assert_close(got, _numpy(y, z_source, scale, num_groups, z_offset), dtype)
    _assert_close(got, gated_group_rmsnorm_ref(y, z_source, scale, **kw), dtype)


def test_kernel_writes_out_dtype():
    y, z_source, scale = _inputs(6, 2, 48, 5, jnp.bfloat16, seed=3)
    kw = dict(num_groups=2, eps=EPS, z_offset=5, out_dtype=jnp.float32)
    got = gated_group_rmsnorm(y, z_source, scale, impl="interpret", **kw)
    assert got.dtype == jnp.float32
    want = gated_group_rmsnorm_ref(y, z_source, scale, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_pieces_rows_and_warps():
    assert group_pieces(1280, 1024) == ((0, 1024), (1024, 256))
    assert group_pieces(1280, 256) == tuple((i * 256, 256) for i in range(5))
    assert group_pieces(100, 1024) == ((0, 64), (64, 32), (96, 4))
    bs = GpuBlockSizes()
    # 9B: 4 rows x 1280 columns on 4 warps, down to 1 row where the grid would be small.
    assert bs.block_rows(2048, 8, 1280) == 4 and bs.warps(4, 1280) == 4
    assert bs.block_rows(256, 8, 1280) == 4
    assert bs.block_rows(32, 8, 1280) == 1
    # One group over a wide row: one row a program, more warps for the registers.
    assert bs.block_rows(2048, 1, 10240) == 1 and bs.warps(1, 10240) == 8
    assert bs.block_rows(2048, 64, 64) == 128  # narrow groups: more rows a program


def test_kernel_lowers_for_cuda_reading_z_in_place():
    """The Triton lowering (not run: no GPU here) at 9B prefill and decode shapes: one kernel,
    its grid, and z_source passed whole (no slice of it before the call)."""
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    fn = functools.partial(gated_group_rmsnorm, num_groups=8, eps=EPS, impl="pallas_gpu")
    for num_rows, row_blocks in ((2048, 512), (1, 1)):
        args = (jax.ShapeDtypeStruct((num_rows, 10240), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_rows, 22656), jnp.bfloat16),
                jax.ShapeDtypeStruct((10240,), jnp.float32))  # fmt: skip
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[check])
        text = exported(*args).mlir_module()
        assert text.count("xla.gpu.triton") == 1
        assert re.search(rf"grid_x = {row_blocks} : i32,\s*grid_y = 8 : i32", text), text[-2000:]
        assert "stablehlo.slice" not in text


@pytest.mark.cpu_only
def test_dispatch_and_errors():
    y, z_source, scale = _inputs(4, 2, 40, 8, jnp.float32, seed=5)
    kw = dict(num_groups=2, eps=EPS, z_offset=8)
    want = gated_group_rmsnorm_ref(y, z_source, scale, **kw)

    def kernels(impl):
        jaxpr = jax.make_jaxpr(functools.partial(gated_group_rmsnorm, impl=impl, **kw))
        return str(jaxpr(y, z_source, scale)).count("pallas_call")

    assert [kernels(impl) for impl in ("auto", "ref", "auto_tpu", "pallas_tpu")] == [0] * 4
    assert kernels("interpret") == kernels("pallas_gpu") == 1
    got = gated_group_rmsnorm(y, z_source, scale, impl="auto", **kw)  # CPU: the reference
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="CPU"):
        gated_group_rmsnorm(y, z_source, scale, impl="pallas", **kw)
    with pytest.raises(ValueError, match="must lie in z_source"):
        gated_group_rmsnorm(y, z_source, scale, num_groups=2, eps=EPS, z_offset=40)
    with pytest.raises(ValueError, match="must divide"):
        gated_group_rmsnorm(y, z_source, scale, num_groups=3, eps=EPS)
    with pytest.raises(ValueError, match="scale"):
        gated_group_rmsnorm(y, z_source, scale[:-1], **kw)
    with pytest.raises(ValueError, match=r"\[T, W\]"):
        gated_group_rmsnorm(y[None], z_source, scale, **kw)


def test_layer_keeps_its_parameter_and_matches_on_the_kernel():
    """The module's parameters are `{"scale": [W]}` whatever the impl, and its kernel path
    (interpret) gives the reference path's output for z at an offset of a wider array."""
    y, z_source, _ = _inputs(7, 2, 48, 16, jnp.float32, seed=6)
    norm = {
        impl: GatedGroupRMSNorm(2, EPS, jnp.bfloat16, impl=impl) for impl in ("ref", "interpret")
    }
    params = norm["ref"].init(jax.random.key(0), y, z_source, 16)
    assert jax.tree.map(jnp.shape, nn.unbox(params)) == {"params": {"scale": (96,)}}
    params = {"params": {"scale": jnp.linspace(0.5, 1.5, 96)}}
    out = {impl: m.apply(params, y, z_source, 16) for impl, m in norm.items()}
    assert out["interpret"].dtype == jnp.bfloat16
    _assert_close(out["interpret"], out["ref"].astype(jnp.float32), jnp.bfloat16)


def _random_like(tree, rng, scale):
    return jax.tree.map(lambda a: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype), tree)


def test_model_step_with_norm_kernel_matches_reference(monkeypatch):
    """The tiny model's mixed step (decode rows and a prefill) with the norm's kernel
    interpreted, every other op the reference, gives the logits of the reference norm; every
    Mamba layer calls the kernel once. Random parameters and states (no init trace)."""
    cfg = config_from_preset("nemotron-h-tiny")
    rng = np.random.default_rng(0)
    params = _random_like(param_shapes(cfg), rng, 0.1)
    runners = [make_runner(cfg, params) for _ in range(2)]
    cache = _random_like(runners[0].cache, rng, 0.5)
    rows = [row([3], 5, slot=0), row([4], 9, slot=1),
            row(rng.integers(0, 256, 21).tolist(), 0, slot=2)]  # fmt: skip
    inputs = builder(runners[0]).build(rows, Bucket(32, 3, 2))

    traced = []

    def interpreted(*args, **kwargs):
        traced.append(kwargs["impl"])
        return gated_group_rmsnorm(*args, **{**kwargs, "impl": "interpret"})

    logits = []
    for i, runner in enumerate(runners):
        if i == 1:
            monkeypatch.setattr(layers, "gated_group_rmsnorm", interpreted)
            jax.clear_caches()  # the step's jit is module-level: trace it again
        runner.cache = jax.tree.map(jnp.copy, cache)
        logits.append(np.asarray(runner.forward_logits(inputs, 2))[:23])
    jax.clear_caches()
    assert traced == ["auto"] * cfg.num_mamba_layers  # the mixer's impl, one call a layer
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-5, rtol=1e-4)
