"""Benchmark the causal conv on one GPU, prefill (``causal_conv1d_varlen``) and decode update
(``causal_conv1d_update``): our Pallas kernels, the XLA reference (``impl="ref"``) and
SGLang 0.5.23's Triton kernels.

Nemotron-Nano-9B-v2 shapes (conv_dim 12288, K 4), bf16 activations, weights and conv state,
SiLU. Prefill: 8 sequences of 2048 tokens, half with an initial state, two input sets
rotated (2 x 400 MB); also timed inside a busy program at the end, eight calls each
starting from the last one's final states. Update: batch 1 and 256, a program of ``steps``
launches on other slots of the pool, SGLang's captured in one CUDA graph, and each batch
timed inside a busy program at the end (``bench_common.busy_program``). Roofline: x read
and y written once, the initial (or slot) states read and the final ones written once.

    python scripts/bench_conv.py [--cases conv_prefill,conv_update] [--sweep] [--reps 30]
    python scripts/bench_conv.py --smoke      # CPU: interpret mode, toy shapes

Setup, SGLang and the timing method: see ``bench_common.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels import causal_conv1d_update, causal_conv1d_varlen
from jaxmamba.kernels.conv1d.gpu import (
    UpdateGpuBlockSizes,
    VarlenGpuBlockSizes,
    causal_conv1d_update_gpu,
    causal_conv1d_varlen_gpu,
)

# Prefill sweep: changes to the default tiles (``VarlenGpuBlockSizes``).
PREFILL_SWEEP = [dict(), dict(tiles=8), dict(channels=512, num_warps=2), dict(num_stages=2)]
# Update sweep: (channels a program, warps).
UPDATE_SWEEP = [(64, 1), (128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (1024, 4), (2048, 8)]


def weights(rng, dim: int, k: int):
    w = rng.standard_normal((k, dim), np.float32) * 0.5
    return w, rng.standard_normal(dim).astype(np.float32) * 0.1


def prefill_variants(interpret: bool) -> dict:
    default = VarlenGpuBlockSizes()
    return {
        (", ".join(f"{k}={v}" for k, v in changes.items()) or "default"): functools.partial(
            causal_conv1d_varlen_gpu,
            interpret=interpret,
            block_sizes=dataclasses.replace(default, **changes),
        )
        for changes in PREFILL_SWEEP
    }


def update_variants(interpret: bool) -> dict:
    return {
        f"bd{bd} w{w}": functools.partial(
            causal_conv1d_update_gpu,
            interpret=interpret,
            block_sizes=UpdateGpuBlockSizes(channels=bd, num_warps=w),
        )
        for bd, w in UPDATE_SWEEP
    }


def bench_prefill(num_seqs: int, seqlen: int, args, table: bc.Table, rng) -> None:
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    dim, k = s.conv_dim, s.conv_width
    tokens = num_seqs * seqlen
    xs = [rng.standard_normal((tokens, dim), np.float32) for _ in range(2)]
    w, bias = weights(rng, dim, k)
    init = rng.standard_normal((num_seqs, k - 1, dim), np.float32)
    has_init = np.arange(num_seqs) % 2 == 0
    init[~has_init] = 0.0
    cu = (np.arange(num_seqs + 1) * seqlen).astype(np.int32)
    jxs = [jnp.asarray(v, bc.ACT) for v in xs]
    jw, jb, jinit = jnp.asarray(w, bc.ACT), jnp.asarray(bias, bc.ACT), jnp.asarray(init, bc.ACT)
    jcu = jnp.asarray(cu)

    def program(op):
        return jax.jit(lambda x: op(x, jw, jb, jcu, initial_states=jinit)[:2])

    ours_op = functools.partial(causal_conv1d_varlen, impl=bc.kernel_impl(args))
    ours_fn = program(ours_op)
    ref_fn = program(functools.partial(causal_conv1d_varlen, impl="ref"))
    ref = [v.astype(jnp.float32) for v in ref_fn(jxs[0])]

    def checked(name, fn):
        out = fn(jxs[0])
        bc.check(f"conv prefill {name} y", out[0].astype(jnp.float32), ref[0], 1e-2)
        bc.check(f"conv prefill {name} final", out[1].astype(jnp.float32), ref[1], 1e-2)

    def timed(fn):
        turn = iter(range(1 << 30))
        return bc.median_time(lambda: fn(jxs[next(turn) % 2]), args.reps, calls=10)

    checked("ours", ours_fn)
    nbytes = 2 * tokens * dim * 2 + num_seqs * 2 * (k - 1) * dim * 2 + (k + 1) * dim * 2
    row = bc.Row(
        f"conv prefill {num_seqs}x{seqlen}",
        ours=timed(ours_fn),
        xla=timed(ref_fn),
        roof=bc.roofline(nbytes),
    )
    variants = prefill_variants(args.smoke) if args.sweep else {}

    def measure(name, op):
        fn = program(op)
        checked(name, fn)
        return timed(fn)

    bc.time_variants(row, {n: functools.partial(measure, n, op) for n, op in variants.items()})
    row.peer = sglang_prefill_time(xs, w, bias, init, has_init, cu, ref[0], args.reps)

    # Inside a busy program, as the model's prefill program runs it: the initial states ride
    # as the "pool", the sequence bounds last (``busy_program`` gates them). Each call's final
    # states are the next call's initial states, so no two calls are alike (XLA would merge
    # identical ones into one).
    def prefill_step(op):
        def step(init, x, cu):
            y, final = op(x, jw, jb, cu, initial_states=init)[:2]
            return y, final.astype(init.dtype)

        return step

    busy = None
    if not args.smoke:  # the profiler sees no device kernels on CPU
        ops = {"ours": prefill_step(ours_op)}
        ops.update({f"variant {n}": prefill_step(variants[n]) for n in row.variants})
        steps = 8
        inputs = [(jxs[i % 2], jcu) for i in range(steps)]
        busy = bc.BusySteps(ops, bc.Pools(init, bc.ACT), inputs, steps)
    table.add(row, busy)


def sglang_prefill_time(xs, w, bias, init, has_init, cu, ref_y, reps) -> float | None:
    """SGLang's seconds a call (its output checked first), or None without it."""
    conv_fn = bc.sglang_kernel("causal_conv1d_triton", "causal_conv1d_fn")
    if conv_fn is None:
        return None
    import torch

    num_seqs, seqlen = len(cu) - 1, int(cu[1])
    txs = [bc.to_torch(v, torch.bfloat16) for v in xs]  # [T, D]: channel-last views below
    tw = bc.to_torch(w.T, torch.bfloat16).contiguous()  # [D, K]
    tb = bc.to_torch(bias, torch.bfloat16)
    pool = torch.zeros((num_seqs + 1, *init.shape[1:]), dtype=torch.bfloat16, device="cuda")
    pool[:num_seqs] = bc.to_torch(init, torch.bfloat16)
    tcu = torch.from_numpy(cu).cuda()
    idx = torch.arange(num_seqs, dtype=torch.int32, device="cuda")
    thas = torch.from_numpy(has_init).cuda()
    lens = [seqlen] * num_seqs

    def call(x):
        return conv_fn(
            x.t(), tw, tb, pool.transpose(1, 2), tcu, lens, cache_indices=idx,
            has_initial_state=thas, activation="silu",
        )  # fmt: skip

    y = call(txs[0]).t().float().cpu().numpy()
    bc.check("sglang conv prefill y", y, np.asarray(ref_y), 1e-2)
    pool[:num_seqs] = bc.to_torch(init, torch.bfloat16)

    def ten_calls():
        for i in range(10):
            call(txs[i % 2])

    return bc.torch_time(ten_calls, reps) / 10


def bench_update(rows: int, steps: int, args, table: bc.Table, rng) -> None:
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    dim, k = s.conv_dim, s.conv_width
    slots_total = max(1024, 2 * rows)
    pool = rng.standard_normal((slots_total + 1, k - 1, dim), np.float32)
    x = rng.standard_normal((steps, rows, dim), np.float32)
    w, bias = weights(rng, dim, k)
    perm = rng.permutation(slots_total).astype(np.int32)
    slot_sets = np.stack([np.roll(perm, -i * rows)[:rows] for i in range(steps)])
    jw, jb = jnp.asarray(w, bc.ACT), jnp.asarray(bias, bc.ACT)
    inputs = [(jnp.asarray(x[i], bc.ACT), jnp.asarray(slot_sets[i])) for i in range(steps)]
    pools = bc.Pools(pool, bc.ACT)

    def step_op(impl=None, kernel=None):
        kernel = kernel or functools.partial(causal_conv1d_update, impl=impl)
        return lambda pool, x, slots: kernel(pool, x, jw, jb, slots)

    ref_pool, ref_ys = bc.decode_program(step_op(impl="ref"))(pools.fresh(), inputs)
    ref_y = jnp.stack(ref_ys).astype(jnp.float32)
    ref_pool = ref_pool.astype(jnp.float32)

    def checked(name, fn):
        out_pool, ys = fn(pools.fresh(), inputs)
        bc.check(f"conv update bs{rows} {name} y", jnp.stack(ys).astype(jnp.float32), ref_y, 1e-2)
        bc.check(f"conv update bs{rows} {name} state", out_pool.astype(jnp.float32), ref_pool, 1e-6)

    nbytes = rows * (2 * (k - 1) * dim * 2 + 2 * dim * 2) + (k + 1) * dim * 2
    row, busy = bc.time_decode(
        f"conv update bs {rows}", step_op, checked, pools, inputs, args=args, max_calls=64,
        roof=bc.roofline(nbytes), variants=update_variants(args.smoke) if args.sweep else {},
    )  # fmt: skip
    row.peer = sglang_update_time(pool, x, w, bias, slot_sets, ref_y, args.reps)
    table.add(row, busy)


def sglang_update_time(pool, x, w, bias, slot_sets, ref_y, reps) -> float | None:
    """SGLang's seconds a step, or None without it."""
    conv_update = bc.sglang_kernel("causal_conv1d_triton", "causal_conv1d_update")
    if conv_update is None:
        return None
    import torch

    steps, rows = slot_sets.shape
    tpool = bc.to_torch(pool, torch.bfloat16)
    tx = bc.to_torch(x, torch.bfloat16)
    tw = bc.to_torch(w.T, torch.bfloat16).contiguous()
    tb = bc.to_torch(bias, torch.bfloat16)
    tslots = torch.from_numpy(slot_sets).cuda()

    def step(i):
        return conv_update(
            tx[i], tpool.transpose(1, 2), tw, tb, activation="silu", conv_state_indices=tslots[i]
        )

    return bc.sglang_steps_time(f"conv update bs {rows}", step, steps, reps, ref_y[0])


def run_prefill(args, table: bc.Table) -> None:
    rng = np.random.default_rng(1)
    num_seqs, seqlen = (2, 64) if args.smoke else (8, 2048)
    bench_prefill(num_seqs, seqlen, args, table, rng)


def run_update(args, table: bc.Table) -> None:
    rng = np.random.default_rng(2)
    for rows, steps in ((1, 256), (256, 16))[: 1 if args.smoke else 2]:
        bench_update(rows, 2 if args.smoke else steps, args, table, rng)


CASES = {"conv_prefill": run_prefill, "conv_update": run_update}


if __name__ == "__main__":
    bc.main_for(__doc__, CASES)
