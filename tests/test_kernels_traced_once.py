"""Equal kernel calls share one traced kernel. `kernels.common.pallas_call` hands every call
of a kernel with equal options the callable made for the first, so a step's jaxpr holds one
kernel jaxpr per distinct kernel, not one per layer (JAX's lowering cache then lowers each
once: the 9B decode step traced and lowered 58 kernels, now 3, docs/benchmarks.md), while a
kernel whose options differ in anything that changes its trace gets its own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.runner import ModelRunner, jitted_step
from jaxmamba.kernels.common import pallas_call
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import MAX_PAGES, PAGE_SIZE, builder, row

IMPLS = {"cuda": "auto_gpu", "tpu": "auto_tpu"}


def _pallas_calls(jaxpr) -> list:
    """Every pallas_call equation of a jaxpr and of the jaxprs inside its equations."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    found += _pallas_calls(inner)
    return found


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_every_layer_calls_one_traced_kernel(platform):
    cfg = config_from_preset("nemotron-h-tiny")
    spec = CacheSpec(num_slots=8, num_pages=8 * MAX_PAGES, page_size=PAGE_SIZE)
    runner = ModelRunner(cfg, init_params(cfg, seed=0), spec, impl=IMPLS[platform])
    rng = np.random.default_rng(0)
    rows = [row([3], 5, slot=0), row([4], 9, slot=1),
            row(rng.integers(0, 256, 21).tolist(), 0, slot=2)]  # fmt: skip
    bucket = Bucket(32, 3, 2)  # decode rows and a prefill: every kind of kernel
    args, kwargs = runner.step_args(jax.device_put(builder(runner).build(rows, bucket)), 2)
    eqns = _pallas_calls(jitted_step.trace(*args, **kwargs).jaxpr.jaxpr)
    by_name: dict[str, list] = {}
    for eqn in eqns:
        by_name.setdefault(_kernel_name(eqn), []).append(eqn)
    assert len(cfg.mamba_layers) >= 2 and len(cfg.attention_layers) >= 2
    assert len(by_name) >= 3, sorted(by_name)  # conv, scan or state, attention at least
    for name, calls in by_name.items():
        # Every kernel is a layer's: called in each of at least two layers, traced once per
        # operand shapes (the small-M matmul has one kernel per projection shape).
        by_shapes: dict[tuple, set] = {}
        for e in calls:
            shapes = tuple(str(v.aval) for v in e.invars)
            by_shapes.setdefault(shapes, set()).add(id(e.params["jaxpr"]))
        assert len(calls) >= 2, (name, len(calls))
        assert all(len(k) == 1 for k in by_shapes.values()), (name, len(calls), by_shapes)


def _kernel_name(eqn) -> str:
    if "name" in eqn.params:  # jax 0.10
        return eqn.params["name"]
    return eqn.params["name_and_src_info"].name


def _add(scale):
    def kernel(x_ref, o_ref):
        o_ref[...] = (x_ref[...] * scale).astype(o_ref.dtype)

    return kernel


def _call(kernel, block=(8, 128)):
    spec = pl.BlockSpec(block, lambda i: (i, 0))  # a fresh lambda each call
    return pallas_call(kernel, grid=(2,), in_specs=[spec], out_specs=spec,
                       out_shape=jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
                       interpret=True)  # fmt: skip


def test_equal_options_share_a_callable_and_others_do_not():
    assert _call(_add(3)) is _call(_add(3))  # same code, equal closure, fresh lambda maps
    assert _call(_add(3)) is not _call(_add(2))
    assert _call(_add(3)) is not _call(_add(3), block=(16, 128))
    # Equal values that trace differently: a Python int, a bool, a strongly typed float32.
    calls = {id(_call(_add(s))) for s in (1, True, 1.0, np.float32(1), -0.0, 0.0)}
    assert len(calls) == 6
    # A kernel closing over an array cannot be keyed: a fresh pallas_call each time.
    weights = jnp.ones((8, 128), jnp.bfloat16)
    assert _call(_add(weights)) is not _call(_add(weights))

    x = jax.random.normal(jax.random.key(0), (16, 128), jnp.bfloat16)
    for scale in (3, np.float32(0.5)):
        got = jax.jit(lambda v, s=scale: _call(_add(s))(v))(x)
        want = (x * scale).astype(x.dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
