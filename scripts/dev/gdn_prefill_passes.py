"""Where the GDN prefill's time goes on the GPU, at Qwen3-Next's per-layer shapes: each of our
three Pallas passes timed alone over a few block sizes (every variant's whole-kernel output
checked against the XLA reference first), the whole kernel with the best of each, and fla's
``chunk_gated_delta_rule`` kernel by kernel (torch profiler). Prints one table per case.

    PYTHONPATH=.fla python3 scripts/dev/gdn_prefill_passes.py [--cases 1x8192 8x4096] [--reps 20]

A pass timed alone is its own jitted program: the state pass then copies U first (it updates
U in place, and the jit does not donate it), ~64 MB at 1x8192, about 30 µs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_common as bc  # noqa: E402
import bench_gdn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmamba.kernels.common import MIN_DOT_DIM, pow2_at_least  # noqa: E402
from jaxmamba.kernels.gdn import gdn_prefill, gpu  # noqa: E402
from jaxmamba.kernels.ssd.layout import build_chunk_layout, tracked_requests  # noqa: E402

Blocks = gpu.PrefillGpuBlockSizes
WY = [
    dict(wy_sub_block=64),  # one block: the whole chunk by substitution
    dict(wy_sub_block=16, wy_warps=4),
    dict(wy_sub_block=16, wy_warps=2),
    dict(wy_sub_block=32),
]
STATE = [
    dict(state_block_v=32, state_stages=2),
    dict(state_block_v=64, state_stages=2),
    dict(state_block_v=32, state_stages=3),
    dict(state_block_v=32, state_warps=2),
]
OUT = [
    dict(out_block_v=128),
    dict(out_block_v=64),
    dict(out_block_v=128, out_warps=8),
    dict(out_block_v=64, out_stages=3),
]


def make_inputs(seqs: int, length: int, s: bench_gdn.GdnShapes):
    rng = np.random.default_rng(0)
    tokens = seqs * length
    q = rng.standard_normal((tokens, s.key_heads, s.key_dim)).astype(np.float32)
    k = rng.standard_normal((tokens, s.key_heads, s.key_dim)).astype(np.float32)
    v = rng.standard_normal((tokens, s.value_heads, s.value_dim)).astype(np.float32)
    a = rng.standard_normal((tokens, s.value_heads)).astype(np.float32)
    b = rng.standard_normal((tokens, s.value_heads)).astype(np.float32)
    a_log, dt_bias = bench_gdn.gate_params(s, rng)
    g, beta = (np.asarray(x) for x in bench_gdn.gdn_gating(a, b, a_log, dt_bias))
    beta = np.asarray(jnp.asarray(beta, bc.ACT).astype(jnp.float32))
    init = 0.1 * rng.standard_normal((seqs, s.value_heads, s.key_dim, s.value_dim))
    init[::2] = 0.0
    cu = np.arange(seqs + 1, dtype=np.int32) * length
    host = (q, k, v, g, beta, cu, init.astype(np.float32))
    dev = (*(jnp.asarray(x, bc.ACT) for x in (q, k, v)), *(jnp.asarray(x) for x in host[3:]))
    return host, dev


INTERPRET = [False]  # --smoke: CPU, interpret mode, toy shapes


@functools.cache
def whole(s, bs):
    def run(q, k, v, g, beta, cu, init):
        scale = s.key_dim**-0.5
        return gpu.gdn_prefill_gpu(
            q, k, v, g, beta, cu, chunk_size=s.chunk, scale=scale, initial_states=init,
            block_sizes=bs, interpret=INTERPRET[0],
        )  # fmt: skip

    return jax.jit(run)


def pass_calls(dev, s, bs):
    """The three passes as separate jitted programs over the previous passes' outputs, each
    as a no-argument call."""
    q, k, v, g, beta, cu, init = dev
    layout = build_chunk_layout(cu, q.shape[0], s.chunk, None)
    nc = layout.chunk_token_lo.shape[0]
    dims = gpu._Dims(
        chunk_size=s.chunk,
        dk=s.key_dim,
        dv=s.value_dim,
        bk=max(pow2_at_least(s.key_dim), MIN_DOT_DIM),
        heads_per_key=s.value_heads // s.key_heads,
        scale=s.key_dim**-0.5,
        use_qk_l2norm=True,
    )
    lo, count = layout.chunk_token_lo, layout.chunk_token_count
    requests = tracked_requests(nc, None, False)
    opts = dict(dims=dims, bs=bs, interpret=INTERPRET[0])
    wy = jax.jit(functools.partial(gpu._wy_pass, **opts))
    w, u, gamma, kn = wy(lo, count, k, v, g, beta)
    state = jax.jit(
        functools.partial(gpu._state_pass, num_tracked=0, state_dtype=jnp.float32, **opts)
    )
    vnew, entering, _, _ = state(layout, requests, kn, w, gamma, u, init)
    out = jax.jit(functools.partial(gpu._output_pass, **opts))
    return {
        "wy": lambda: wy(lo, count, k, v, g, beta),
        "state": lambda: state(layout, requests, kn, w, gamma, u, init),
        "out": lambda: out(lo, count, q, kn, gamma, vnew, entering),
    }


def fla_breakdown(host, s, reps: int) -> dict[str, float]:
    """fla's kernels' mean device µs over ``reps`` calls, by kernel name (torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ops = bench_gdn.fla_ops()
    if ops is None:
        return {}
    q, k, v, g, beta, cu, init = host
    t = lambda x, dt=None: bc.to_torch(x, dt)  # noqa: E731
    args = (
        t(q, torch.bfloat16)[None],
        t(k, torch.bfloat16)[None],
        t(v, torch.bfloat16)[None],
        t(g)[None],
        t(beta, torch.bfloat16)[None],
    )
    kw = dict(
        scale=s.key_dim**-0.5,
        initial_state=t(init),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.from_numpy(cu).long().cuda(),
    )
    for _ in range(3):
        ops[0](*args, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            ops[0](*args, **kw)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            total = getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
            if total:
                out[e.key[:60]] = total / reps
    return out


def run_case(seqs: int, length: int, reps: int) -> list[str]:
    s = bench_gdn.SMOKE if INTERPRET[0] else bench_gdn.QWEN3_NEXT
    name = f"{seqs}x{length}"
    host, dev = make_inputs(seqs, length, s)
    ref = jax.jit(functools.partial(gdn_prefill, chunk_size=s.chunk, impl="ref"))
    want_o, want_final = ref(*dev[:6], initial_states=dev[6])
    default = Blocks.get_default(seqs, s.value_heads)
    lines = [
        f"\n## prefill {name}  (default blocks: {default})",
        "| pass | variant | µs |",
        "|---|---|---|",
    ]
    best = {}
    for pass_name, variants in (("wy", WY), ("state", STATE), ("out", OUT)):
        for variant in variants:
            bs = dataclasses.replace(default, **variant)
            try:
                o, final = whole(s, bs)(*dev)
                ok = bc.close(f"{name} {variant} o", o, want_o, 2e-2) and bc.close(
                    f"{name} {variant} final", final, want_final, 1e-2
                )
                if not ok:
                    lines.append(f"| {pass_name} | {variant} | WRONG |")
                    continue
                secs = bc.median_time(pass_calls(dev, s, bs)[pass_name], reps)
            except Exception as e:  # a variant that does not compile: say so, go on
                lines.append(f"| {pass_name} | {variant} | {type(e).__name__}: {str(e)[:80]} |")
                continue
            lines.append(f"| {pass_name} | {variant} | {secs * 1e6:.1f} |")
            if secs < best.get(pass_name, (None, 1e9))[1]:
                best[pass_name] = (variant, secs)
    tuned = dataclasses.replace(default, **{k: v for p in best.values() for k, v in p[0].items()})
    for label, bs in (("default", default), ("best of each", tuned)):
        o, final = whole(s, bs)(*dev)
        bc.check(f"{name} {label} o", o, want_o, 2e-2)
        secs = bc.median_time(lambda bs=bs: whole(s, bs)(*dev), reps)
        lines.append(f"| whole | {label}: {bs} | {secs * 1e6:.1f} |")
    fla = {} if INTERPRET[0] else fla_breakdown(host, s, reps)
    for kernel, us in sorted(fla.items(), key=lambda x: -x[1]):
        lines.append(f"| fla | {kernel} | {us:.1f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["1x8192", "8x4096"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU: interpret mode, toy shapes")
    args = p.parse_args()
    INTERPRET[0] = args.smoke
    lines = []
    for case in args.cases:
        seqs, length = (int(x) for x in case.split("x"))
        lines += run_case(seqs, length, args.reps)
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
