"""Time the on-device sampler at Nemotron-H's vocabulary (131072) for decode batch sizes, and
check what a device-side `lax.cond` costs the host on this backend.

`sample` runs as the engine's step runs it (every argument: logit_bias, min_tokens, the
penalties' per-row `[B, V]` state) over batches whose rows all ask for the same thing: greedy,
temperature only (`vllm bench throughput`'s default), top-k 50, top-p 0.9, and the mixed batch
of the older tables (greedy, temperature, top-k 50, top-p 0.9, min-p 0.05): one program, so
the mixes should cost the same. `plain_greedy` and `plain_temperature` time the program the
engine's decode steps run when no row filters or asks for top logprobs (`sample(cutoff=False,
top_logprobs=False)`: no sort, no top-20). Beside it, the top-20 logprobs alone, one
`lax.top_k` against the two-stage `top_k_blocked` for several blocks, and one full sort.

`--many-kernel-probe N`: the same question for a program of N kernels (an engine step has
~800), ten calls queued: the time per call with the `lax.cond` against the `jnp.where`.

`--cond-probe`: a program of ~10 ms of matmuls, then a `lax.cond` on a device value (or the
same choice as a `jnp.where`); how long the call takes
to return (dispatch) against the program's time, and ten calls queued back to back. The
programs have a few kernels each, so a host-side read of the predicate costs them little.

    python scripts/bench_sampling.py [--vocab 131072] [--batch 1 32 128 256] [--cond-probe]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.model.sampling import (
    Penalties,
    sample,
    top_k_blocked,
)
from jaxmamba.step_contract import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS

MIXES = ("greedy", "temperature", "top_k50", "top_p0.9", "mixed")
# (row name, sample switches, with the penalties' state) for all-greedy rows
GREEDY_PARTS = (
    ("greedy_no_penalties", {}, False),
    ("greedy_no_draw", {"draw": False}, True),
    ("greedy_no_draw_no_penalties", {"draw": False}, False),
    ("greedy_argmax_logprob", {"draw": False, "ranks": False}, False),
)


def median_us(fn, *args, reps: int = 30) -> float:
    return bc.median_time(lambda: fn(*args), reps) * 1e6


def sampling_args(mix: str, b: int, vocab: int, rng) -> tuple:
    kind = np.arange(b) % 4 if mix == "mixed" else np.full(b, MIXES.index(mix))
    if mix == "mixed":
        kind = np.array([0, 1, 2, 3])[kind]
    temperature = np.where(kind == 0, 0.0, 0.8).astype(np.float32)
    top_k = np.where(kind == 2, 50, 0).astype(np.int32)
    top_p = np.where(kind == 3, 0.9, 1.0).astype(np.float32)
    min_p = np.full(b, 0.05 if mix == "mixed" else 0.0, np.float32)
    stop_ids = rng.integers(0, vocab, (b, MAX_STOP_IDS))
    bias_ids = np.full((b, MAX_LOGIT_BIAS), -1)
    bias_ids[:, :8] = rng.integers(0, vocab, (b, 8))
    penalties = Penalties(
        jnp.asarray(rng.random((b, vocab)) < 0.01),
        jnp.asarray(rng.poisson(0.01, (b, vocab)), jnp.int32),
        jnp.zeros(b, jnp.float32),
        jnp.zeros(b, jnp.float32),
        jnp.ones(b, jnp.float32),
    )
    return (
        jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k),
        jnp.arange(b, dtype=jnp.uint32), jnp.full(b, 5, jnp.int32), jnp.asarray(min_p),
        jnp.full(b, 0, jnp.int32), jnp.asarray(stop_ids, jnp.int32),
        jnp.asarray(bias_ids, jnp.int32), jnp.zeros((b, MAX_LOGIT_BIAS), jnp.float32), penalties,
    )  # fmt: skip


def bench_sampler(vocab: int, batches: list[int]) -> list[dict]:
    sample_jit = jax.jit(sample)
    plain_jit = jax.jit(functools.partial(sample, cutoff=False, top_logprobs=False))
    rows = []
    for b in batches:
        rng = np.random.default_rng(b)
        logits = jnp.asarray(rng.standard_normal((b, vocab), np.float32) * 4)
        row = {"batch": b}
        for mix in MIXES:
            row[mix] = median_us(sample_jit, logits, *sampling_args(mix, b, vocab, rng))
        for mix in ("greedy", "temperature"):
            args = sampling_args(mix, b, vocab, rng)
            full, plain = sample_jit(logits, *args), plain_jit(logits, *args)
            assert np.array_equal(np.asarray(full.tokens), np.asarray(plain.tokens)), mix
            row[f"plain_{mix}"] = median_us(plain_jit, logits, *args)
        # What each part of the plain greedy program costs: the penalties' [B, V] state, the
        # random draw and the ranks, each left out in turn (the same tokens).
        args = sampling_args("greedy", b, vocab, rng)
        want = np.asarray(plain_jit(logits, *args).tokens)
        for name, kw, penalties in GREEDY_PARTS:
            fn = jax.jit(functools.partial(sample, cutoff=False, top_logprobs=False, **kw))
            part_args = args if penalties else (*args[:-1], None)
            assert np.array_equal(np.asarray(fn(logits, *part_args).tokens), want), name
            row[name] = median_us(fn, logits, *part_args)
        row["top20_lax"] = median_us(jax.jit(lambda x: jax.lax.top_k(x, MAX_LOGPROBS)), logits)
        for block in (1024, 2048, 4096, 8192):
            fn = jax.jit(functools.partial(top_k_blocked, k=MAX_LOGPROBS, block=block))
            assert np.array_equal(
                np.asarray(fn(logits)[1]), np.asarray(jax.lax.top_k(logits, 20)[1])
            )
            row[f"top20_block{block}"] = median_us(fn, logits)
        row["sort"] = median_us(jax.jit(lambda x: jnp.sort(x, axis=-1)), logits)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cond_probe() -> dict:
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (8192, 8192), jnp.bfloat16) * 0.01
    x = jax.random.normal(key, (8192, 8192), jnp.bfloat16)

    def heavy(x):
        for _ in range(6):  # ~1.4 TFLOP: a few ms
            x = jnp.tanh(x @ w)
        return x

    def with_cond(x):
        y = heavy(x)
        return jax.lax.cond(
            jnp.sum(y[0].astype(jnp.float32)) > 0, lambda v: v * 2, lambda v: v * 3, y
        )

    def with_where(x):
        y = heavy(x)
        return jnp.where(jnp.sum(y[0].astype(jnp.float32)) > 0, y * 2, y * 3)

    out = {}
    probes = (
        ("cond", jax.jit(with_cond)),
        ("where", jax.jit(with_where)),
    )
    for name, fn in probes:
        jax.block_until_ready(fn(x))
        dispatch, total = [], []
        for _ in range(15):
            start = time.perf_counter()
            y = fn(x)
            dispatch.append(time.perf_counter() - start)
            jax.block_until_ready(y)
            total.append(time.perf_counter() - start)
        # Ten calls queued back to back: a host-side read stalls the queue between them.
        start = time.perf_counter()
        y = x
        for _ in range(10):
            y = fn(y)
        jax.block_until_ready(y)
        out[name] = {
            "dispatch_ms": float(np.median(dispatch) * 1e3),
            "total_ms": float(np.median(total) * 1e3),
            "ten_queued_ms": (time.perf_counter() - start) * 1e3,
        }
    print(json.dumps(out), flush=True)
    return out


def many_kernel_probe(num_kernels: int = 400) -> dict:
    """A program of `num_kernels` separate elementwise kernels (~10 µs each on the device),
    ending in a `lax.cond` on a device value or the same choice as a `jnp.where`; ten calls
    queued back to back. If the host waits for the predicate, the next call's launches are no
    longer hidden behind the device's work and the cond version takes longer per call."""
    x = jnp.linspace(-1.0, 1.0, 1 << 22, dtype=jnp.float32)

    def body(x):
        for _ in range(num_kernels):
            x = jax.lax.optimization_barrier(x * 1.0001 + 1e-4)  # one kernel each
        return x

    def with_cond(x):
        y = body(x)
        return jax.lax.cond(y[0] > 0, lambda v: v * 0.5, lambda v: v * 0.25, y)

    def with_where(x):
        y = body(x)
        return jnp.where(y[0] > 0, y * 0.5, y * 0.25)

    out = {"num_kernels": num_kernels}
    for name, fn in (("cond", jax.jit(with_cond)), ("where", jax.jit(with_where))):
        jax.block_until_ready(fn(x))
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            y = x
            for _ in range(10):
                y = fn(y)
            jax.block_until_ready(y)
            runs.append((time.perf_counter() - start) * 1e3 / 10)
        out[name + "_ms_per_call"] = float(np.median(runs))
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 32, 128, 256])
    p.add_argument("--cond-probe", action="store_true")
    p.add_argument("--many-kernel-probe", type=int, default=0, help="kernels; 0: skip")
    p.add_argument("--out", default="")
    args = p.parse_args()
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if args.cond_probe:
        record["cond_probe"] = cond_probe()
    if args.many_kernel_probe:
        record["many_kernel_probe"] = many_kernel_probe(args.many_kernel_probe)
        if not args.batch:
            print(json.dumps(record))
            return
    record["sampler"] = rows = bench_sampler(args.vocab, args.batch)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"{record['device']}, vocab {args.vocab}, jax {jax.__version__}; µs, median of 30")
    print(f"| batch | {' | '.join(MIXES)} | top-20 lax / blocked 1024 | full sort |")
    print("|---" * (len(MIXES) + 3) + "|")
    for r in rows:
        cells = " | ".join(f"{r[m]:.0f}" for m in MIXES)
        top = f"{r['top20_lax']:.0f} / {r['top20_block1024']:.0f}"
        print(f"| {r['batch']} | {cells} | {top} | {r['sort']:.0f} |")


if __name__ == "__main__":
    main()
