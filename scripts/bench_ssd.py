"""SSD prefill on one GPU: our Pallas kernel vs the XLA reference vs SGLang 0.5.23's Triton chain.

Nemotron-Nano-9B-v2 Mamba shapes (H 128, P 80, G 8, N 128, chunk 128), bf16 activations, fp32
states. Per case the kernel's output is checked against the reference on the device first,
then each implementation is timed (after warm-up, median; see Timing below).

    python3 scripts/bench_ssd.py [--sglang .sgl_ssd] [--sweep]

Roofline = max(bytes / 4.3 TB/s, FLOPs / 800 TFLOP/s), each input read once and each output
written once (x, dt, B, C, initial states in; y, final states out).

Why the Triton lowering for the GPU kernel (and not Mosaic GPU): the kernel reads each chunk
as a window of C rows at an arbitrary token offset (absolute chunk alignment, varlen) and P is
80; masked pointer loads express that directly, while Mosaic GPU's TMA/wgmma path wants
tile-aligned, 128-byte-swizzled windows, which would need a regrouping copy of x (the traffic
the design removes) or hand-written unaligned TMA descriptors. Triton's mma.sync path already
reaches 712 TFLOP/s in a Pallas matmul here (DESIGN §8). Mosaic GPU was not measured.

Timing: ours and the XLA reference as the median over samples of 10 back-to-back jitted calls
(one wait per sample, so host dispatch overlaps device work); SGLang with
`triton.testing.do_bench` (median). "state pass" is the same call returning only the final
states, so XLA drops the output pass.

Results, with the exact commands, are in docs/benchmarks.md; the kernel's versions and why
each replaced the last are in docs/ssd_gpu_notes.md. Latest (fifth session, 2026-11-29,
H200, jax 0.11.2; kernel v3.1, the defaults, through ``bench_kernels.py``): 1x8192 0.456 ms
against SGLang's 0.934 ms, 1x16384 0.847 / 1.847, 8x2048 init 0.961 / 2.183, 64x256 init
1.239 / 2.524, ragged init 0.545 / 1.172; y within 2.8e-3 and states within 1.7e-3 relative
of the reference. ``--sweep`` times the block-size variants listed in ``sweep()`` on one
case (``--sweep-case``) first and runs the cases with the best of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernels.ssd import build_chunk_layout, ssd_varlen  # noqa: E402
from kernels.ssd_pallas_gpu import BlockSizes, ssd_varlen_gpu  # noqa: E402

H, P, G, N, CHUNK = 128, 80, 8, 128, 128
HBM, MMA = 4.3e12, 800e12

CASES = {
    "1x8192": [8192],
    "1x16384": [16384],
    "8x2048 init": [2048] * 8,
    "64x256 init": [256] * 64,
    "ragged init": [1000, 3, 4097, 129, 0, 2000, 777, 127],
}


def roofline(lengths, with_init):
    t, s = sum(lengths), len(lengths)
    state = s * H * P * N * 4
    nbytes = t * H * P * 2 * 2 + t * H * 2 + 2 * t * G * N * 2 + state * (2 if with_init else 1)
    flops = t * H * (2 * CHUNK * (N * G / H + P) + 4 * P * N)
    return max(nbytes / HBM, flops / MMA)


def make_inputs(lengths, with_init, seed=0):
    rng = np.random.default_rng(seed)
    t, s = sum(lengths), len(lengths)
    f = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    inp = dict(
        x=jnp.asarray(f(t, H, P), jnp.bfloat16),
        dt=jnp.asarray(f(t, H), jnp.bfloat16),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, H)), jnp.float32),
        B=jnp.asarray(f(t, G, N, scale=0.5), jnp.bfloat16),
        C=jnp.asarray(f(t, G, N, scale=0.5), jnp.bfloat16),
        D=jnp.asarray(f(H), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-2.0, 0.0, H), jnp.float32),
        cu=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
        init=None,
    )
    if with_init:
        init = f(s, H, P, N, scale=0.1)
        init[: s // 2] = 0.0  # half of the sequences start from zero
        inp["init"] = jnp.asarray(init)
    return inp


def time_jax(fn, *args, iters=20, back_to_back=10):
    """Median device time per call: each sample dispatches ``back_to_back`` calls and waits once,
    so host dispatch overlaps the device work (as CUDA events around one launch would see)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(back_to_back):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / back_to_back)
    return statistics.median(times)


def ours(inp, impl, block_sizes=None, states_only=False):
    """Jitted call of our kernel (or the reference) and its arguments; ``states_only`` keeps
    just the final states, so XLA drops the output pass and the state pass is timed alone."""
    layout = build_chunk_layout(inp["cu"], inp["x"].shape[0], CHUNK)
    # One tracked state per row, as the engine asks for them (each row's checkpoint chunk,
    # here its last; until the fifth session every row asked for chunk 0).
    wanted = layout.seq_last_chunk.astype(jnp.int32)

    def run(x, dt, A, B, C, cu, D, bias, init):
        kw = dict(
            chunk_size=CHUNK, D=D, dt_bias=bias, dt_softplus=True, initial_states=init,
            layout=layout, state_chunks=wanted,
        )  # fmt: skip
        if block_sizes is not None:
            out = ssd_varlen_gpu(x, dt, A, B, C, cu, block_sizes=block_sizes, **kw)
        else:
            out = ssd_varlen(x, dt, A, B, C, cu, impl=impl, **kw)
        return out[1] if states_only else out

    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "cu", "D", "dt_bias", "init")]
    return jax.jit(run), args


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sglang_fn(inp, lengths):
    import torch
    from sglang.kernels.ops.mamba.triton_ops import mamba_chunk_scan_combined

    tt = lambda a: torch.from_dlpack(a).cuda()  # noqa: E731
    x, dt, B, C = (tt(inp[k])[None] for k in ("x", "dt", "B", "C"))
    A, D, bias = tt(inp["A"]), tt(inp["D"]), tt(inp["dt_bias"])
    init = None if inp["init"] is None else tt(inp["init"])
    cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cu = torch.tensor(cu_np, dtype=torch.int32, device="cuda")
    seq_idx = torch.tensor(
        np.repeat(np.arange(len(lengths)), lengths), dtype=torch.int32, device="cuda"
    )[None]
    # vLLM/SGLang's chunk_indices/offsets: chunks restart at every sequence start.
    total = int(cu_np[-1])
    extra = int(np.sum(cu_np[1:-1] % CHUNK > 0))
    n = -(-total // CHUNK) + extra
    idx, off, p = np.arange(n), np.zeros(n, np.int64), 0
    for s, e in zip(cu_np[:-1], cu_np[1:], strict=True):
        p += s % CHUNK > 0
        lo, hi = s // CHUNK + p, e // CHUNK + p + (e % CHUNK > 0)
        idx[lo:hi] -= p
        off[lo] = s % CHUNK
    chunk_indices = torch.tensor(idx, dtype=torch.int32, device="cuda")
    chunk_offsets = torch.tensor(off, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)

    def run():
        return mamba_chunk_scan_combined(
            x, dt, A, B, C, CHUNK, D=D, z=None, dt_bias=bias, initial_states=init,
            seq_idx=seq_idx, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
            cu_seqlens=cu, dt_softplus=True, return_varlen_states=True, out=out,
            state_dtype=torch.float32,
        )  # fmt: skip

    return run, out


def sweep(case: str = "1x8192"):
    """Time block-size variants on one case: state-pass variants alone (states only, final
    states checked), output-pass variants in the full call (y checked); returns the best of
    each combined. A variant whose output misses the reference counts as infinitely slow."""
    inp = make_inputs(CASES[case], "init" in case)
    ref_fn, args = ours(inp, "ref")
    y_ref, final_ref = ref_fn(*args)[:2]
    base = BlockSizes.get_default()  # the variants' base, whatever the case (as timed)
    # The designs that lost in earlier sweeps (P-major states, heads sharing a state-pass
    # program, output programs without the head loop) are gone from the kernel; see
    # docs/ssd_gpu_notes.md.
    state_variants = [
        dict(),  # N-major, whole head dim, N block 64, factors a step ahead
        dict(state_block_n=128, state_warps=8),
        dict(state_block_n=128, state_warps=8, state_stages=3),
    ]
    out_variants = [
        dict(),  # 16 heads of a group a program, block_m 64, 4 warps, D on the diagonal
        dict(out_x_i="load"),  # D·x_i from a second load of x
        dict(out_heads=8),
        dict(out_block_m=128, out_warps=8),
    ]

    def measure(changes, states_only):
        bs = dataclasses.replace(base, **changes)
        try:
            t0 = time.perf_counter()
            fn, fargs = ours(inp, "pallas", bs, states_only=states_only)
            out = fn(*fargs)
            err = rel_err(out, final_ref) if states_only else rel_err(out[0], y_ref)
            ms = time_jax(fn, *fargs, iters=10) * 1e3
            if not err < 2e-2:
                ms = float("inf")
            what = "states only (err: final states)" if states_only else "full (err: y)"
            print(
                f"sweep {what} {changes}: {ms:.3f} ms err={err:.1e} "
                f"(incl. compile {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            return ms
        except Exception as e:  # noqa: BLE001
            print(f"sweep {changes}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
            return float("inf")

    state_ms = [measure(v, True) for v in state_variants]
    best_state = state_variants[state_ms.index(min(state_ms))]
    base = dataclasses.replace(base, **best_state)  # output variants on the best state pass
    out_ms = [measure(v, False) for v in out_variants]
    best_out = out_variants[out_ms.index(min(out_ms))]
    best = dataclasses.replace(base, **best_out)
    print(f"sweep best: {best}", flush=True)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sglang", default=None, help="folder holding the sglang stub package")
    parser.add_argument("--sweep", action="store_true", help="sweep GPU block sizes first")
    parser.add_argument("--sweep-case", default="1x8192", help="the case the sweep times")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(jax.__version__, jax.devices(), flush=True)
    # The kernel's blocks depend on the shape (BlockSizes.for_shape): one sequence of H heads
    # gets the few-sequence blocks, the other cases the defaults.
    print(f"defaults {BlockSizes.get_default()}\none sequence {BlockSizes.for_shape(1, H)}")

    best = None  # block sizes of the sweep's winners; None: the kernel's defaults
    if args.sweep:
        best = sweep(args.sweep_case)
    sgl = None
    if args.sglang:
        sys.path.insert(0, args.sglang)
        try:
            import triton.testing

            sgl = triton.testing
        except Exception as e:  # noqa: BLE001
            print("no triton/torch:", e)

    rows = [measure_case(name, sgl, best) for name in args.cases.split(",")]
    print(
        "\n| case | ours ms | state pass ms | XLA ref ms | SGLang ms | ours/SGLang | roofline ms "
        "| ours % roof |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        flag = "" if r["ok"] else " (MISMATCH)"
        print(
            f"| {r['name']}{flag} | {r['ours']:.3f} | {r['states']:.3f} | {r['xla']:.3f} | "
            f"{r['sgl']:.3f} | {r['ours'] / r['sgl']:.2f} | {r['roof']:.3f} | "
            f"{100 * r['roof'] / r['ours']:.0f} % |"
        )


def measure_case(name, sgl, best=None):
    """One case: ours checked against the reference, then ours, our state pass alone, the
    reference and SGLang (``sgl``: ``triton.testing`` or None) timed; times in ms."""
    lengths = CASES[name]
    with_init = "init" in name
    inp = make_inputs(lengths, with_init)
    real = sum(lengths)
    fn, fargs = ours(inp, "pallas", best)
    ref_fn, _ = ours(inp, "ref")
    y_ref, final_ref, tracked_ref = ref_fn(*fargs)
    t_ref = time_jax(ref_fn, *fargs, iters=10) * 1e3
    try:
        y, final, tracked = fn(*fargs)
        err_y = rel_err(y[:real], y_ref[:real])
        err_s = max(rel_err(final, final_ref), rel_err(tracked, tracked_ref))
        ok = err_y < 2e-2 and err_s < 2e-2 and bool(jnp.all(jnp.isfinite(y[:real])))
        t_ours = time_jax(fn, *fargs) * 1e3
        states_fn, _ = ours(inp, "pallas", best, states_only=True)
        t_states = time_jax(states_fn, *fargs) * 1e3
    except Exception as e:  # noqa: BLE001
        print(f"{name}: ours FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
        ok, err_y, err_s = False, float("nan"), float("nan")
        t_ours = t_states = float("nan")
    t_sgl = float("nan")
    if sgl is not None:
        try:
            run, _ = sglang_fn(inp, lengths)
            t_sgl = sgl.do_bench(run, warmup=25, rep=100, return_mode="median")
        except Exception as e:  # noqa: BLE001
            print(f"{name}: sglang FAILED {type(e).__name__}: {str(e)[:300]}")
    roof = roofline(lengths, with_init) * 1e3
    print(
        f"{name:12s} ok={ok} err_y={err_y:.1e} err_state={err_s:.1e} ours={t_ours:.3f} ms "
        f"(state pass {t_states:.3f} ms) "
        f"xla_ref={t_ref:.3f} ms sglang={t_sgl:.3f} ms roofline={roof:.3f} ms",
        flush=True,
    )
    return dict(name=name, ok=ok, ours=t_ours, states=t_states, xla=t_ref, sgl=t_sgl, roof=roof)


if __name__ == "__main__":
    main()
