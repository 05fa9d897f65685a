"""Which kernels one call of an op launches, and how long each runs: a driver for Nsight
Compute. Each case is warmed up (compiled, run twice), then called once between
``cuProfilerStart`` and ``cuProfilerStop``, so with ``--profile-from-start off`` the listing
holds exactly that call's kernels (XLA's fusions around ours included):

    ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size \\
        python3 scripts/kernel_listing.py conv_prefill,conv_update,ssd_64x256,ssd_1x8192

Nemotron-Nano-9B-v2 Mamba shapes, as in ``bench_kernels.py`` and ``bench_ssd.py``. Nsight
Compute runs the kernels one at a time, so the durations are each kernel alone, without the
gaps between launches.
"""

from __future__ import annotations

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench_ssd  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmamba.kernels import causal_conv1d_update, causal_conv1d_varlen  # noqa: E402

DIM, K = 12288, 4


def profiled(name: str, call):
    """Warm ``call`` up (compile, run twice), then run it once inside the profiled range."""
    cuda = ctypes.CDLL("libcuda.so.1")
    for _ in range(2):
        jax.block_until_ready(call())
    print(f"=== {name}", flush=True)
    cuda.cuProfilerStart()
    jax.block_until_ready(call())
    cuda.cuProfilerStop()


def conv_prefill(rng):
    tokens, seqs = 16384, 8
    x = jnp.asarray(rng.standard_normal((tokens, DIM)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, DIM)) * 0.5, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(DIM) * 0.1, jnp.bfloat16)
    init = jnp.asarray(rng.standard_normal((seqs, K - 1, DIM)), jnp.bfloat16)
    cu = jnp.asarray(np.arange(seqs + 1) * (tokens // seqs), jnp.int32)
    fn = jax.jit(
        lambda x: causal_conv1d_varlen(x, w, b, cu, initial_states=init, impl="pallas")[:2]
    )
    profiled("conv prefill 8x2048", lambda: fn(x))


def conv_update(rng):
    pool = jnp.asarray(rng.standard_normal((1025, K - 1, DIM)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, DIM)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, DIM)) * 0.5, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(DIM) * 0.1, jnp.bfloat16)
    slots = jnp.asarray([7], jnp.int32)

    def step(pool, x):
        y, pool = causal_conv1d_update(pool, x, w, b, slots, impl="pallas")
        return pool, y

    fn = jax.jit(step, donate_argnums=0)
    state = {"pool": pool}

    def call():  # the pool is donated: each call threads the last call's pool through
        state["pool"], y = fn(state["pool"], x)
        return y

    profiled("conv update bs 1", call)


def ssd(case: str):
    inp = bench_ssd.make_inputs(bench_ssd.CASES[case], "init" in case)
    fn, args = bench_ssd.ours(inp, "pallas")
    profiled(f"ssd {case}", lambda: fn(*args))


CASES = {
    "conv_prefill": conv_prefill,
    "conv_update": conv_update,
    "ssd_1x8192": lambda rng: ssd("1x8192"),
    "ssd_64x256": lambda rng: ssd("64x256 init"),
}


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    rng = np.random.default_rng(0)
    for name in names:
        CASES[name](rng)


if __name__ == "__main__":
    main()
