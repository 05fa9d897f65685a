"""small_m_matmul: the Pallas GPU kernel in interpret mode vs the reference and float64 numpy,
and the model's opt-in switch that routes decode-sized projections through it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.runner import ModelRunner, step_fn
from jaxmamba.kernels.matmul import MAX_ROWS, small_m_matmul, small_m_matmul_ref
from jaxmamba.kernels.matmul.gpu import GpuBlockSizes, small_m_matmul_gpu
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import param_shapes

from model_helpers import builder, make_runner, row

# Relative to max |y|: bf16 output rounding (2^-8) dominates; float32 sums differ in order only.
RTOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}
# Several blocks, and edges, along K=200 and N=333; min_steps=1 lets the automatic split
# count reach 4 (4 splits of 2 steps of 32 rows: the last split is ragged).
SMALL = GpuBlockSizes(block_n=64, block_k=32, min_steps=1)


def _inputs(m, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
    return x, w


def _assert_close(got, want, dtype):
    want = np.asarray(want, np.float64)
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err <= RTOL[dtype], f"max relative error {err:.2e} > {RTOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "m, block_sizes",
    [
        (1, SMALL),
        (1, GpuBlockSizes(block_n=64, block_k=32, single_row_fma=True)),
        (3, GpuBlockSizes(block_n=64, block_k=32, split_k=3)),  # 3 * 3 * 32 > 200: an empty tail
        (16, GpuBlockSizes(block_n=128, block_k=64, split_k=1)),  # direct store, no partials
        (20, SMALL),  # 17..32 rows: a 32-row dot
        (32, GpuBlockSizes(block_n=64, block_k=32, split_k=1)),
    ],
)
def test_kernel_matches_reference_and_float64(m, block_sizes, dtype):
    x, w = _inputs(m, 200, 333, dtype, seed=m)
    got = small_m_matmul_gpu(x, w, interpret=True, block_sizes=block_sizes)
    assert got.shape == (m, 333) and got.dtype == x.dtype
    _assert_close(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64), dtype)
    _assert_close(got, small_m_matmul_ref(x, w), dtype)


def test_nan_row_stays_in_its_row():
    """Rows are independent: a NaN row of x (a pad row) poisons only its own output row."""
    x, w = _inputs(5, 200, 333, jnp.bfloat16, seed=7)
    x = x.at[2].set(jnp.nan)
    got = np.asarray(small_m_matmul_gpu(x, w, interpret=True, block_sizes=SMALL), np.float64)
    assert np.isnan(got[2]).all()
    real = [0, 1, 3, 4]
    want = np.asarray(x, np.float64)[real] @ np.asarray(w, np.float64)
    _assert_close(got[real], want, jnp.bfloat16)


def test_split_count_fills_the_machine_but_keeps_steps():
    assert SMALL.splits(200, 333) == 4
    bs = GpuBlockSizes(block_n=128, block_k=64, min_programs=264, min_steps=4)
    assert bs.splits(4480, 131072) == 1  # 1024 column blocks already
    assert bs.splits(10240, 4480) == 8  # 35 blocks -> 280 programs
    assert bs.splits(200, 4480) == 1  # 4 K tiles: one split of >= 4 steps
    assert GpuBlockSizes(split_k=3).splits(10240, 4480) == 3


def test_kernel_takes_the_tuned_sizes_of_its_shape(monkeypatch):
    """Without explicit block sizes the kernel uses `TUNED`'s entry for (K, N, row class): a
    toy entry changes the launch (an invalid one is refused), others keep the defaults."""
    from jaxmamba.kernels.matmul import gpu

    assert [gpu.row_class(m) for m in (1, 2, 16, 17, 32)] == [1, 16, 16, 32, 32]
    assert GpuBlockSizes.for_shape(4480, 22656, 1) == GpuBlockSizes(block_n=64)
    assert GpuBlockSizes.for_shape(4480, 15680, 24) == GpuBlockSizes(block_n=64, split_k=1)
    assert GpuBlockSizes.for_shape(4480, 22656, 4) == GpuBlockSizes()
    assert GpuBlockSizes.for_shape(200, 333, 1) == GpuBlockSizes()
    x, w = _inputs(1, 200, 333, jnp.bfloat16, seed=3)
    monkeypatch.setitem(gpu.TUNED, (200, 333, 1), dict(block_n=24))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        small_m_matmul_gpu(x, w, interpret=True)
    monkeypatch.setitem(gpu.TUNED, (200, 333, 1), dict(block_n=32, block_k=16, split_k=2))
    got = small_m_matmul_gpu(x, w, interpret=True)
    _assert_close(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64), jnp.bfloat16)


@pytest.mark.cpu_only
def test_model_default_follows_the_ops_impl(monkeypatch):
    """A model's decode projections take the kernel where its ops take the GPU kernels."""
    from jaxmamba.kernels.matmul import SMALL_M_ENV, model_small_m_impl

    assert model_small_m_impl("auto") is None  # CPU: XLA's dot
    assert model_small_m_impl("pallas") is None
    assert model_small_m_impl("auto_gpu") == "auto_gpu"
    assert model_small_m_impl("pallas_gpu") == "pallas_gpu"
    for impl in ("ref", "interpret", "auto_tpu", "pallas_tpu"):
        assert model_small_m_impl(impl) is None
    assert model_small_m_impl("auto_gpu", "xla") is None
    assert model_small_m_impl("ref", "interpret") == "interpret"  # given: used as is
    monkeypatch.setenv(SMALL_M_ENV, "0")
    assert model_small_m_impl("auto_gpu") is None
    assert model_small_m_impl("auto_gpu", "auto_gpu") == "auto_gpu"


@pytest.mark.cpu_only
def test_dispatch_out_dtype_and_errors():
    x, w = _inputs(2, 96, 80, jnp.bfloat16)
    got = small_m_matmul(x, w, out_dtype=jnp.float32, impl="interpret")
    assert got.dtype == jnp.float32
    _assert_close(got, small_m_matmul_ref(x, w, out_dtype=jnp.float32), jnp.float32)
    assert small_m_matmul(x, w, impl="auto").dtype == jnp.bfloat16  # CPU: the reference
    with pytest.raises(ValueError, match="rows"):
        small_m_matmul(jnp.zeros((MAX_ROWS + 1, 96), jnp.bfloat16), w, impl="ref")
    with pytest.raises(ValueError, match="share a dtype"):
        small_m_matmul(x, w.astype(jnp.float32), impl="ref")
    with pytest.raises(ValueError, match="CPU"):
        small_m_matmul(x, w, impl="pallas")


def _random_like(tree, rng, scale):
    return jax.tree.map(lambda a: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype), tree)


def test_decode_with_small_m_kernel_matches_xla_dot():
    """The tiny model's decode step with the switch on (kernel in interpret mode, every
    other op the reference) gives the logits and states of the switch off. Parameters and
    cached states are random (no init trace, no prefill: this test stays fast)."""
    cfg = config_from_preset("nemotron-h-tiny")
    rng = np.random.default_rng(0)
    params = _random_like(param_shapes(cfg), rng, 0.1)
    off = make_runner(cfg, params)
    on = ModelRunner(cfg, params, off.cache_spec, small_m_impl="interpret")
    off.cache = _random_like(off.cache, rng, 0.5)
    on.cache = jax.tree.map(jnp.copy, off.cache)
    decode = [row([5], 6, slot=0), row([9], 11, slot=1)]
    inputs = builder(off).build(decode, Bucket(4, 4, 4))
    # The switch is what routes the projections: one kernel per Linear with it, none without.
    linears = 2 * cfg.num_mamba_layers + 4 * cfg.num_attention_layers
    linears += 2 * cfg.layer_types.count("mlp")
    for runner, expected in ((off, 0), (on, linears)):
        args, kwargs = runner.step_args(inputs, 4)
        jaxpr = jax.make_jaxpr(functools.partial(step_fn, **kwargs))(*args)
        assert str(jaxpr).count("name=small_m_matmul") == expected
    logits = [np.asarray(r.forward_logits(inputs, 4))[:2] for r in (off, on)]
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-5, rtol=1e-4)
    for a, b in zip(off.cache.ssm, on.cache.ssm, strict=True):
        np.testing.assert_allclose(np.asarray(b[:2]), np.asarray(a[:2]), atol=2e-5, rtol=1e-4)
