"""Mosaic GPU state update: lowers for CUDA anywhere; runs against the reference on a GPU.

The Mosaic GPU backend has no CPU or interpret path here, so on CPU the numerical test is
skipped; the lowering test still builds the whole kernel module (Mosaic GPU's Python-side
lowering), which catches API and layout errors without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import selective_state_update_ref
from jaxmamba.kernels import state_update_mosaic_gpu as mgpu

pytestmark = pytest.mark.skipif(mgpu.plgpu is None, reason=str(mgpu.IMPORT_ERROR))

# rows, heads, head_dim, groups, state: (H/G)*P a multiple of 64, tiles straddling heads.
SHAPES = [(3, 8, 80, 2, 128), (2, 4, 32, 1, 16)]


def _inputs(rng, rows, heads, head_dim, groups, state, with_z):
    num_slots = 2 * rows
    slots = rng.permutation(num_slots)[:rows].astype(np.int32)
    pool = rng.standard_normal((num_slots + 1, heads, head_dim, state)).astype(np.float32)
    args = (
        jnp.asarray(pool),
        jnp.asarray(rng.standard_normal((rows, heads, head_dim)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((rows, heads)) - 1.0, jnp.bfloat16),
        -jnp.exp(jnp.asarray(rng.standard_normal(heads), jnp.float32)),
        jnp.asarray(rng.standard_normal((rows, groups, state)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((rows, groups, state)), jnp.bfloat16),
        jnp.asarray(slots),
    )
    kw = dict(
        D=jnp.asarray(rng.standard_normal(heads), jnp.float32),
        dt_bias=jnp.asarray(rng.standard_normal(heads) * 0.1, jnp.float32),
        z=jnp.asarray(rng.standard_normal((rows, heads, head_dim)), jnp.bfloat16)
        if with_z
        else None,
    )
    return args, kw


@pytest.mark.parametrize("with_z", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_mosaic_state_update_lowers_for_cuda(shape, with_z):
    args, kw = _inputs(np.random.default_rng(0), *shape, with_z)
    fn = jax.jit(functools.partial(mgpu.selective_state_update_mosaic_gpu, **kw))
    disabled = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
    exported = jax.export.export(fn, platforms=("cuda",), disabled_checks=disabled)(*args)
    text = exported.mlir_module()
    assert "mosaic_gpu" in text
    assert "output_operand_aliases" in text  # the pool is updated in place


def test_mosaic_state_update_rejects_untileable_shapes():
    args, _ = _inputs(np.random.default_rng(0), 2, 4, 24, 2, 16, False)  # (H/G)*P = 48
    with pytest.raises(ValueError, match="% 64"):
        mgpu.selective_state_update_mosaic_gpu(*args)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels run on a GPU")
@pytest.mark.parametrize("with_z", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_mosaic_state_update_matches_reference_on_gpu(shape, with_z):
    args, kw = _inputs(np.random.default_rng(1), *shape, with_z)
    y_ref, pool_ref = selective_state_update_ref(*args, **kw)
    y, pool = jax.jit(functools.partial(mgpu.selective_state_update_mosaic_gpu, **kw))(*args)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), 2e-2, 2e-2)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), rtol=1e-5, atol=1e-5)
