"""Benchmark the decode state update (``selective_state_update``) on one GPU: our Pallas
kernel, the XLA reference (``impl="ref"``) and SGLang 0.5.23's Triton kernel, per batch size.

Nemotron-Nano-9B-v2 Mamba shapes (H 128, P 80, G 8, N 128), bf16 activations, fp32 state,
D, dt bias and softplus. A program runs ``steps`` updates, each exactly one kernel launch
(each step's inputs separate arguments, each output a separate result) on other slots of a
pool of at least 256, so the state is not served from L2; SGLang's are ``steps`` launches
captured in one CUDA graph. At the end each batch is also timed inside a busy program
(``bench_common.busy_program``), where the host's launch time is hidden as in the engine's
decode step. Roofline: the state read and written once, plus x, dt, B, C and y.

    python scripts/bench_state_update.py [--ssu-rows 1,8,32,256] [--sweep] [--reps 30]
    python scripts/bench_state_update.py --smoke      # CPU: interpret mode, toy shapes

Setup, SGLang and the timing method: see ``bench_common.py``.
"""

from __future__ import annotations

import argparse
import functools

import bench_common as bc
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels import selective_state_update
from jaxmamba.kernels.state_update.gpu import GpuBlockSizes, selective_state_update_gpu

# Steps a program per batch size: 0.6-5 ms of state traffic.
STEPS = {1: 256, 8: 32, 32: 8, 256: 8}
# Sweep (rows of P a tile, tiles a program, warps): SGLang-sized tiles, fewer or more
# programs, whole heads a program.
SWEEP = [(4, 1, 4), (4, 1, 2), (8, 1, 4), (8, 1, 2), (16, 1, 4), (16, 1, 8), (16, 5, 4)]
SWEEP += [(16, 5, 8), (8, 10, 4), (8, 5, 4)]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ssu-rows", default="1,8,32,256", help="state update batch sizes (comma-separated)"
    )


def variants(interpret: bool) -> dict:
    return {
        f"triton bp{bp} t{t} w{w}": functools.partial(
            selective_state_update_gpu,
            interpret=interpret,
            block_sizes=GpuBlockSizes(head_dim=bp, tiles=t, num_warps=w),
        )
        for bp, t, w in SWEEP
    }


def bench_batch(rows: int, steps: int, args, table: bc.Table, rng) -> None:
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    h, p, g, n = s.heads, s.head_dim, s.groups, s.state
    slots_total = 256 if rows <= 32 else 2 * rows  # real slots; the pool has one more (pad)
    state = rng.standard_normal((slots_total + 1, h, p, n), np.float32) * 0.5
    x = rng.standard_normal((steps, rows, h, p), np.float32)
    dt = rng.standard_normal((steps, rows, h), np.float32) - 2.0
    bmat = rng.standard_normal((steps, rows, g, n), np.float32)
    cmat = rng.standard_normal((steps, rows, g, n), np.float32)
    a = -np.exp(rng.standard_normal(h).astype(np.float32))
    d = rng.standard_normal(h).astype(np.float32)
    dt_bias = rng.standard_normal(h).astype(np.float32) * 0.1
    perm = rng.permutation(slots_total).astype(np.int32)
    slot_sets = np.stack([np.roll(perm, -i * rows)[:rows] for i in range(steps)])

    ja, jd, jbias = (jnp.asarray(v) for v in (a, d, dt_bias))
    # Per step: its own device arrays (x, dt, B, C, slots), as a decode step receives them.
    inputs = [
        (*(jnp.asarray(v[i], bc.ACT) for v in (x, dt, bmat, cmat)), jnp.asarray(slot_sets[i]))
        for i in range(steps)
    ]
    pools = bc.Pools(state, jnp.float32)

    def step_op(impl=None, kernel=None):
        kernel = kernel or functools.partial(selective_state_update, impl=impl)
        return lambda pool, x, dt, b, c, slots: kernel(
            pool, x, dt, ja, b, c, slots, D=jd, dt_bias=jbias
        )

    ref_pool, ref_ys = bc.decode_program(step_op(impl="ref"))(pools.fresh(), inputs)
    ref_y = jnp.stack(ref_ys).astype(jnp.float32)

    def checked(name, fn):
        pool, ys = fn(pools.fresh(), inputs)
        bc.check(f"ssu bs{rows} {name} y", jnp.stack(ys).astype(jnp.float32), ref_y, 1e-2)
        bc.check(f"ssu bs{rows} {name} state", pool, ref_pool, 1e-4)

    nbytes = 2 * rows * h * p * n * 4 + rows * (2 * h * p + h + 2 * g * n) * 2
    row, busy = bc.time_decode(
        f"state update bs {rows}", step_op, checked, pools, inputs, args=args, max_calls=16,
        roof=bc.roofline(nbytes), variants=variants(args.smoke) if args.sweep else {},
    )  # fmt: skip
    row.peer = sglang_time(rows, steps, args.reps, (state, x, dt, bmat, cmat, a, d, dt_bias),
                             slot_sets, ref_y)  # fmt: skip
    table.add(row, busy)


def sglang_time(rows, steps, reps, arrays, slot_sets, ref_y) -> float | None:
    """SGLang's seconds a step, or None without it."""
    ssu = bc.sglang_kernel("triton_ops.mamba_ssm", "selective_state_update")
    if ssu is None:
        return None
    import torch

    state, x, dt, bmat, cmat, a, d, dt_bias = arrays
    _, h, p, n = state.shape
    tstate = bc.to_torch(state)
    tx, tdt, tb, tc = (bc.to_torch(v, torch.bfloat16) for v in (x, dt, bmat, cmat))
    ta = bc.to_torch(a)[:, None, None].expand(h, p, n)  # SGLang takes A, D, dt per P row
    td = bc.to_torch(d)[:, None].expand(h, p)
    tbias = bc.to_torch(dt_bias)[:, None].expand(h, p)
    tslots = torch.from_numpy(slot_sets).cuda()
    outs = torch.empty((steps, rows, h, p), dtype=torch.bfloat16, device="cuda")

    def step(i):
        ssu(
            tstate, tx[i], tdt[i][:, :, None].expand(rows, h, p), ta, tb[i], tc[i], D=td,
            z=None, dt_bias=tbias, dt_softplus=True, state_batch_indices=tslots[i], out=outs[i],
        )  # fmt: skip
        return outs[i]

    return bc.sglang_steps_time(f"state update bs {rows}", step, steps, reps, ref_y[0])


def run(args, table: bc.Table) -> None:
    rng = np.random.default_rng(0)
    batches = [int(r) for r in args.ssu_rows.split(",")]
    for rows in batches[:1] if args.smoke else batches:
        steps = 2 if args.smoke else STEPS.get(rows, max(1, 2048 // rows))
        bench_batch(rows, steps, args, table, rng)


CASES = {"state_update": run}

if __name__ == "__main__":
    bc.main_for(__doc__, CASES, add_args)
