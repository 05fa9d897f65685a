"""Which kernels one call of an op launches, and how long each runs: a driver for Nsight
Compute. Each case is warmed up (compiled, run twice), then called once between
``cuProfilerStart`` and ``cuProfilerStop``, so with ``--profile-from-start off`` the listing
holds exactly that call's kernels (XLA's fusions around ours included):

    ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size \\
        python3 scripts/dev/kernel_listing.py conv_prefill,conv_update,ssd_64x256,ssd_1x8192

Nemotron-Nano-9B-v2 Mamba shapes, as in ``scripts/bench_conv.py`` and ``scripts/bench_ssd.py``.
Nsight Compute runs the kernels one at a time, so the durations are each kernel alone,
without the gaps between launches. Needs
``python3 -m pip install --no-deps --no-build-isolation -e .`` in the repo root (the kernels
come from the installed ``jaxmamba.kernels``).
"""

from __future__ import annotations

import argparse
import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels import (
    build_chunk_layout,
    causal_conv1d_update,
    causal_conv1d_varlen,
    ssd_varlen,
)

H, P, G, N, CHUNK = 128, 80, 8, 128, 128
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


def ssd(rng, lengths: list[int], with_init: bool):
    """The SSD scan over sequences of ``lengths`` tokens, one tracked state a sequence (its
    last chunk), with initial states if ``with_init``."""
    tokens, seqs = sum(lengths), len(lengths)

    def normal(*shape, dtype=jnp.bfloat16, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    x, dt = normal(tokens, H, P), normal(tokens, H)
    b, c = normal(tokens, G, N, scale=0.5), normal(tokens, G, N, scale=0.5)
    a = -jnp.exp(normal(H, dtype=jnp.float32))
    d, bias = normal(H, dtype=jnp.float32), normal(H, dtype=jnp.float32) - 1.0
    init = normal(seqs, H, P, N, dtype=jnp.float32, scale=0.1) if with_init else None
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    layout = build_chunk_layout(cu, tokens, CHUNK)
    fn = jax.jit(
        lambda x, dt, b, c: ssd_varlen(
            x, dt, a, b, c, cu, chunk_size=CHUNK, D=d, dt_bias=bias, initial_states=init,
            layout=layout, state_chunks=layout.seq_last_chunk.astype(jnp.int32), impl="pallas",
        )
    )  # fmt: skip
    name = f"ssd {seqs}x{lengths[0]}{' init' if with_init else ''}"
    profiled(name, lambda: fn(x, dt, b, c))


CASES = {
    "conv_prefill": conv_prefill,
    "conv_update": conv_update,
    "ssd_1x8192": lambda rng: ssd(rng, [8192], with_init=False),
    "ssd_64x256": lambda rng: ssd(rng, [256] * 64, with_init=True),
}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cases", nargs="?", default=",".join(CASES), help="comma-separated")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for name in args.cases.split(","):
        CASES[name](rng)


if __name__ == "__main__":
    main()
