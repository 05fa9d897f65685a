"""Benchmark the fused Mamba2 decode step (``mamba2_decode``'s GPU kernels) against the chain
it replaces (``causal_conv1d_update`` and ``selective_state_update`` kernels, the slices
between them and the checkpoint copies after), per batch size, inside a busy program.

Nemotron-Nano-9B-v2 Mamba shapes (H 128, P 80, G 8, N 128, conv_dim 12288, K 4), bf16
activations and conv state, fp32 SSM state, D, dt bias, softplus, and the engine's decode
checkpoint entries (``min(B, 8)``, all pad → pad, as in most steps). A step's input is the
in_proj output ``[B, W]``. Each batch is checked (fused against chain, one step) before it is
timed; each case prints as it finishes. Roofline: both states read and written once, plus the
in_proj columns read and y written.

    python scripts/bench_mamba_decode.py [--rows 1,32,128,256] [--json out.json]
        [--sweep]     # the fused kernels again with each of CONV_SWEEP's and STATE_SWEEP's
                      # tiles, and built without the checkpoint stores
    python scripts/bench_mamba_decode.py --smoke      # CPU: interpret mode, toy shapes

Setup and the timing method: see ``bench_common.py`` (``busy_program``, ``busy_time``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels.conv1d.gpu import UpdateGpuBlockSizes, causal_conv1d_update_gpu
from jaxmamba.kernels.mamba_decode import DecodeLayout, decode_chain
from jaxmamba.kernels.mamba_decode.gpu import GpuBlockSizes, mamba2_decode_gpu
from jaxmamba.kernels.state_update.gpu import GpuBlockSizes as StateGpuBlockSizes
from jaxmamba.kernels.state_update.gpu import selective_state_update_gpu

STEPS = {1: 64, 8: 16, 32: 8, 128: 4, 256: 4}  # steps a program: 0.3-5 ms of state traffic
MAX_CHECKPOINTS = 8  # jaxmamba.model.metadata.MAX_DECODE_CHECKPOINTS
# --sweep: the fused kernel's state tiles (`state_update.gpu.GpuBlockSizes` fields), each
# in place of the batch's default; the conv tiles keep theirs.
# --sweep: the fused conv kernel's tiles (`conv1d.gpu.UpdateGpuBlockSizes` fields).
CONV_SWEEP = [
    dict(channels=512, num_warps=2),
    dict(channels=1024, num_warps=4),
    dict(channels=2048, num_warps=4),
    dict(channels=2048, num_warps=8),
    dict(channels=4096, num_warps=8),
]
STATE_SWEEP = [
    dict(tiles=1, num_warps=4),
    dict(tiles=5, num_warps=8),
    dict(tiles=1, num_warps=2),
    dict(tiles=1, num_warps=8),
    dict(tiles=1, state=64, num_warps=2),
    dict(tiles=1, state=64, num_warps=4),
    dict(tiles=5, num_warps=4),
    dict(tiles=1, num_warps=4, num_stages=2),
]


class _Pools:
    """The conv and SSM pools a program threads through its steps (``bc.busy_time``)."""

    def __init__(self, conv: np.ndarray, ssm: np.ndarray):
        self.conv, self.ssm = conv, ssm

    def fresh(self):
        return jnp.asarray(self.conv, bc.ACT), jnp.asarray(self.ssm, jnp.float32)


def _op(
    fused: bool,
    interpret: bool,
    block_sizes: GpuBlockSizes | None = None,
    checkpoints: bool = True,
):
    """One step ``op((conv, ssm), *inputs, slots) -> (y, (conv, ssm))``; ``checkpoints=False``
    passes no checkpoint entries, so the kernels are built without the checkpoint stores (what
    they cost)."""
    chain = functools.partial(
        decode_chain,
        functools.partial(causal_conv1d_update_gpu, interpret=interpret),
        functools.partial(selective_state_update_gpu, interpret=interpret),
    )
    fused_fn = functools.partial(mamba2_decode_gpu, interpret=interpret, block_sizes=block_sizes)
    fn = fused_fn if fused else chain

    def op(pools, zx, w, b, a, d, dt_bias, src, dst, slots):
        if not checkpoints:
            src = dst = None
        y, conv, ssm = fn(*pools, zx, w, b, a, slots, D=d, dt_bias=dt_bias,
                          track_src=src, track_dst=dst)  # fmt: skip
        return y, (conv, ssm)

    return op


def bench_batch(rows: int, args, rng, out: list) -> None:
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    h, p, g, n, k = s.heads, s.head_dim, s.groups, s.state, s.conv_width
    lay = DecodeLayout(h, p, g, n, h * p + 2 * g * n)
    steps = 2 if args.smoke else STEPS.get(rows, 4)
    slots_total = 256 if rows <= 32 else 2 * rows  # real slots; the pool has one more (pad)
    pad = slots_total
    conv = rng.standard_normal((slots_total + 1, k - 1, lay.conv_dim), np.float32)
    ssm = rng.standard_normal((slots_total + 1, h, p, n), np.float32) * 0.5
    zx = rng.standard_normal((steps, rows, lay.width), np.float32)
    zx[..., lay.dt_col :] -= 2.0
    perm = rng.permutation(slots_total).astype(np.int32)
    slot_sets = np.stack([np.roll(perm, -i * rows)[:rows] for i in range(steps)])
    shared = (
        jnp.asarray(0.5 * rng.standard_normal((k, lay.conv_dim)), bc.ACT),
        jnp.asarray(0.1 * rng.standard_normal(lay.conv_dim), bc.ACT),
        jnp.asarray(-np.exp(rng.standard_normal(h)), jnp.float32),
        jnp.asarray(rng.standard_normal(h), jnp.float32),
        jnp.asarray(0.1 * rng.standard_normal(h), jnp.float32),
        jnp.full((min(rows, MAX_CHECKPOINTS),), pad, jnp.int32),
        jnp.full((min(rows, MAX_CHECKPOINTS),), pad, jnp.int32),
    )
    inputs = [
        (jnp.asarray(zx[i], bc.ACT), *shared, jnp.asarray(slot_sets[i])) for i in range(steps)
    ]
    pools = _Pools(conv, ssm)
    ops = {"fused": _op(True, args.smoke), "chain": _op(False, args.smoke)}
    default = GpuBlockSizes.get_default(rows)
    variants = {
        ",".join(f"{k}={v}" for k, v in changes.items()): _op(True, args.smoke, dataclasses.replace(
            default, state=dataclasses.replace(StateGpuBlockSizes(), **changes)))
        for changes in (STATE_SWEEP if args.sweep else [])
    }  # fmt: skip
    variants.update({
        "conv " + ",".join(f"{k}={v}" for k, v in changes.items()): _op(True, args.smoke,
            dataclasses.replace(default, conv=UpdateGpuBlockSizes(**changes)))
        for changes in (CONV_SWEEP if args.sweep else [])
    })  # fmt: skip

    # Check: one step of each from the same pools.
    (y_f, (c_f, s_f)), (y_c, (c_c, s_c)) = (
        jax.jit(op)(pools.fresh(), *inputs[0]) for op in ops.values()
    )
    used = slot_sets[0]
    bc.check(f"b{rows} y", y_f, y_c, 1e-3)
    bc.check(f"b{rows} conv state", np.asarray(c_f[used], np.float32),
             np.asarray(c_c[used], np.float32), 1e-6)  # fmt: skip
    bc.check(f"b{rows} ssm state", s_f[used], s_c[used], 1e-6)
    for name, op in list(variants.items()):  # each variant checked before it is timed
        try:
            y_v, (_, s_v) = jax.jit(op)(pools.fresh(), *inputs[0])
            bc.check(f"b{rows} {name} y", y_v, y_c, 1e-3)
            bc.check(f"b{rows} {name} ssm state", s_v[used], s_c[used], 1e-6)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"  b{rows} variant {name}: FAILED {type(e).__name__}: {str(e)[:400]}")
            del variants[name]
    ops.update({f"fused {name}": op for name, op in variants.items()})
    if args.sweep:
        ops["fused, built without checkpoints"] = _op(True, args.smoke, checkpoints=False)

    nbytes = rows * (2 * (h * p * n * 4 + (k - 1) * lay.conv_dim * 2) + (lay.conv_dim + h) * 2
                     + h * p * 2)  # fmt: skip
    roof = bc.roofline(nbytes)
    result = {"rows": rows, "steps": steps, "roofline_us": roof * 1e6}
    for name, op in ops.items():
        if args.smoke:  # the profiler sees no device kernels on CPU: run the program once
            jax.block_until_ready(bc.busy_program(op)(pools.fresh(), inputs, *_lead()))
            print(f"  b{rows} {name}: ran (smoke)", flush=True)
            continue
        span, busy, kernels = bc.busy_time(op, pools, inputs, steps)
        result[name] = {"span_us": span * 1e6, "kernel_us": busy * 1e6, "kernels": kernels}
        print(
            f"  b{rows:<4d} {name}: span {span * 1e6:8.1f} us a step, kernels "
            f"{busy * 1e6:8.1f} us ({kernels:.2f} a step), {roof / span:6.1%} of roofline "
            f"({roof * 1e6:.1f} us)",
            flush=True,
        )
    if not args.smoke:
        ratio = result["fused"]["span_us"] / result["chain"]["span_us"]
        print(f"  b{rows:<4d} fused / chain: {ratio:.3f}", flush=True)
        result["fused_over_chain"] = ratio
    out.append(result)


def _lead():
    return jnp.ones((8, 8), bc.ACT), jnp.ones((8, 8), bc.ACT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    bc.add_common_args(parser)
    parser.add_argument("--rows", default="1,32,128,256", help="batch sizes (comma-separated)")
    args = parser.parse_args()
    bc.start(args)
    rng = np.random.default_rng(0)
    out: list = []
    for rows in (int(r) for r in args.rows.split(",")):
        try:
            bench_batch(rows, args, rng, out)
        except Exception as e:  # noqa: BLE001 - report and go on with the next batch
            print(f"  b{rows}: FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
    if not args.smoke and out:
        print("\n| batch | fused (us) | chain (us) | fused / chain | kernels fused / chain | "
              "roofline (us) | fused % of roofline |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for r in out:
            if "fused" in r and "chain" in r:
                f, c, roof = r["fused"], r["chain"], r["roofline_us"]
                print(f"| {r['rows']} | {f['span_us']:.1f} | {c['span_us']:.1f} | "
                      f"{r['fused_over_chain']:.3f} | {f['kernels']:.2f} / {c['kernels']:.2f} | "
                      f"{roof:.1f} | {roof / f['span_us']:.1%} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
