"""Time the on-device sampler at Nemotron-H's vocabulary (131072) for decode batch sizes.

`sample` runs with every feature of a step: logit_bias, min_tokens, the penalties (their
per-row `[B, V]` state), top-k/top-p/min-p. Beside it, the two pieces it spends separately: a
full-vocabulary `jnp.sort` per row (the cut-off), and `lax.top_k` of the 20 raw top logprobs.

    python scripts/bench_sampling.py [--vocab 131072] [--batch 1 32 128 256]
"""

from __future__ import annotations

import argparse

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.model.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, Penalties, sample


def median_us(fn, *args, reps: int = 30) -> float:
    return bc.median_time(lambda: fn(*args), reps) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128, 256])
    args = p.parse_args()
    sample_jit = jax.jit(sample)
    sort_jit = jax.jit(lambda x: jnp.sort(x, axis=-1))
    top_k_jit = jax.jit(lambda x: jax.lax.top_k(x, MAX_LOGPROBS))
    rows = []
    for b in args.batch:
        rng = np.random.default_rng(b)
        logits = jnp.asarray(rng.standard_normal((b, args.vocab), np.float32) * 4)
        # A mixed batch: greedy, temperature only, top-k 50, top-p 0.9.
        kind = np.arange(b) % 4
        temperature = jnp.asarray(np.where(kind == 0, 0.0, 0.8), jnp.float32)
        top_k = jnp.asarray(np.where(kind == 2, 50, 0), jnp.int32)
        top_p = jnp.asarray(np.where(kind == 3, 0.9, 1.0), jnp.float32)
        seeds = jnp.arange(b, dtype=jnp.uint32)
        counters = jnp.zeros(b, jnp.int32)
        min_p = jnp.full(b, 0.05, jnp.float32)
        min_tokens = jnp.full(b, 4, jnp.int32)
        stop_ids = jnp.asarray(rng.integers(0, args.vocab, (b, MAX_STOP_IDS)), jnp.int32)
        bias_ids = jnp.asarray(rng.integers(0, args.vocab, (b, MAX_LOGIT_BIAS)), jnp.int32)
        bias_values = jnp.asarray(rng.uniform(-5, 5, (b, MAX_LOGIT_BIAS)), jnp.float32)
        penalties = Penalties(
            jnp.asarray(rng.random((b, args.vocab)) < 0.01),
            jnp.asarray(rng.poisson(0.01, (b, args.vocab)), jnp.int32),
            jnp.full(b, 0.5, jnp.float32),
            jnp.full(b, 0.5, jnp.float32),
            jnp.full(b, 1.2, jnp.float32),
        )
        t_sample = median_us(
            sample_jit, logits, temperature, top_p, top_k, seeds, counters, min_p, min_tokens,
            stop_ids, bias_ids, bias_values, penalties,
        )  # fmt: skip
        rows.append((b, t_sample, median_us(sort_jit, logits), median_us(top_k_jit, logits)))
    print(f"{jax.devices()[0].device_kind}, vocab {args.vocab}, jax {jax.__version__}")
    print("| batch | sample µs | full sort µs | top-20 µs |")
    print("|---|---|---|---|")
    for b, t_sample, t_sort, t_top in rows:
        print(f"| {b} | {t_sample:.0f} | {t_sort:.0f} | {t_top:.0f} |")


if __name__ == "__main__":
    main()
