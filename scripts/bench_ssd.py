"""Benchmark the SSD prefill scan (``ssd_varlen``) on one GPU: our Pallas kernel, the XLA
reference (``impl="ref"``) and SGLang 0.5.23's Triton chain (``mamba_chunk_scan_combined``).

Nemotron-Nano-9B-v2 Mamba shapes (H 128, P 80, G 8, N 128, chunk 128), bf16 activations,
fp32 states, D, dt bias and softplus; one tracked state a sequence (its last chunk, as the
engine asks for them). Cases: one sequence of 8192 and of 16384 tokens, 8 x 2048 and
64 x 256 with initial states (half of them zero), and a ragged batch. Each case's output
and states are checked against the reference first; a case that misses it is marked
"(MISMATCH)" and the run goes on. "State pass alone" is the call returning only the final
states, so XLA drops the output pass. Roofline: the longer of the bytes (x, dt, B, C and
initial states read once, y and final states written once) and the FLOPs.

    python scripts/bench_ssd.py [--ssd-cases "1x8192,8x2048 init"] [--sweep] [--reps 30]
    python scripts/bench_ssd.py --smoke      # CPU: interpret mode, toy shapes

Case ``column_views``: one Mamba layer's prefill kernels (the conv, then the scan) from its
in_proj output ``[T, H·P + conv_dim + H]`` at 1x2048 and 8x2048, as the mixer calls them (x,
B, C, dt as column views of the in_proj and conv outputs, read in place: "ours") against the
same ops on separate arrays sliced out first (variant "separate arrays": the slices are
copies in front of the kernels); ``--views-profile`` also lists each form's kernels from a
profiler trace (run it last: torch cannot capture CUDA graphs after the profiler).

    python scripts/bench_ssd.py --cases column_views [--views-profile] [--reps 30]

``--sweep`` first times the block-size variants of ``STATE_SWEEP`` (the state pass alone)
and then ``OUT_SWEEP`` (the full call, on the best state pass) on ``--sweep-case``, and runs
the cases with the best of each. Setup, SGLang and the timing method: ``bench_common.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels import ColumnView, build_chunk_layout, causal_conv1d_varlen, ssd_varlen
from jaxmamba.kernels.ssd.gpu import GpuBlockSizes, ssd_varlen_gpu

LENGTHS = {
    "1x8192": [8192],
    "1x16384": [16384],
    "8x2048 init": [2048] * 8,
    "64x256 init": [256] * 64,
    "ragged init": [1000, 3, 4097, 129, 0, 2000, 777, 127],
}
SMOKE_LENGTHS = {"1x64": [64], "ragged init": [40, 3, 0, 21]}
# Sweep: changes to ``GpuBlockSizes()`` (the many-sequence default).
STATE_SWEEP = [dict(), dict(state_block_n=128, state_warps=8)]
STATE_SWEEP += [dict(state_block_n=128, state_warps=8, state_stages=3)]
OUT_SWEEP = [dict(), dict(out_heads=8), dict(out_block_m=128, out_warps=8)]
TOL = 2e-2  # relative; y in bf16


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ssd-cases", default=None, help="SSD cases (LENGTHS' names, comma-separated; all)"
    )
    parser.add_argument("--sweep-case", default=None, help="the case --sweep times (the first)")
    parser.add_argument(
        "--views-profile",
        action="store_true",
        help="column_views: also list each form's kernels from a profiler trace",
    )


def lengths_of(args) -> dict[str, list[int]]:
    return SMOKE_LENGTHS if args.smoke else LENGTHS


def roofline(s: bc.MambaShapes, lengths: list[int], with_init: bool) -> float:
    t, seqs = sum(lengths), len(lengths)
    h, p, g, n = s.heads, s.head_dim, s.groups, s.state
    state = seqs * h * p * n * 4
    nbytes = t * h * p * 2 * 2 + t * h * 2 + 2 * t * g * n * 2 + state * (2 if with_init else 1)
    flops = t * h * (2 * s.chunk * (n * g / h + p) + 4 * p * n)
    return bc.roofline(nbytes, flops)


def make_inputs(s: bc.MambaShapes, lengths: list[int], with_init: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t, seqs = sum(lengths), len(lengths)
    h, p, g, n = s.heads, s.head_dim, s.groups, s.state

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    inp = dict(
        x=jnp.asarray(normal(t, h, p), bc.ACT),
        dt=jnp.asarray(normal(t, h), bc.ACT),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, h)), jnp.float32),
        B=jnp.asarray(normal(t, g, n, scale=0.5), bc.ACT),
        C=jnp.asarray(normal(t, g, n, scale=0.5), bc.ACT),
        D=jnp.asarray(normal(h), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-2.0, 0.0, h), jnp.float32),
        cu=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
        init=None,
    )
    if with_init:
        init = normal(seqs, h, p, n, scale=0.1)
        init[: seqs // 2] = 0.0  # half of the sequences start from zero
        inp["init"] = jnp.asarray(init)
    return inp


def program(inp: dict, chunk: int, impl: str, block_sizes=None, states_only: bool = False):
    """A jitted call of ``ssd_varlen`` (or, with ``block_sizes``, the GPU kernel at those
    blocks; ``impl="interpret"`` interprets it) and its arguments. ``states_only`` keeps just
    the final states, so XLA drops the output pass and the state pass is timed alone."""
    layout = build_chunk_layout(inp["cu"], inp["x"].shape[0], chunk)
    wanted = layout.seq_last_chunk.astype(jnp.int32)  # one tracked state a sequence

    def run(x, dt, A, B, C, cu, D, bias, init):
        kw = dict(
            chunk_size=chunk, D=D, dt_bias=bias, dt_softplus=True, initial_states=init,
            layout=layout, state_chunks=wanted,
        )  # fmt: skip
        if block_sizes is not None:
            interpret = impl == "interpret"
            out = ssd_varlen_gpu(
                x, dt, A, B, C, cu, block_sizes=block_sizes, interpret=interpret, **kw
            )
        else:
            out = ssd_varlen(x, dt, A, B, C, cu, impl=impl, **kw)
        return out[1] if states_only else out

    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "cu", "D", "dt_bias", "init")]
    return jax.jit(run), args


def sglang_program(inp: dict, lengths: list[int], chunk: int):
    """SGLang's chunked scan on the same inputs, as a call with no arguments; None without
    it. Its chunk indices and offsets restart the chunks at every sequence start."""
    scan = bc.sglang_kernel("triton_ops", "mamba_chunk_scan_combined")
    if scan is None:
        return None
    import torch

    def tt(a):
        return torch.from_dlpack(a).cuda()

    x, dt, B, C = (tt(inp[k])[None] for k in ("x", "dt", "B", "C"))
    A, D, bias = tt(inp["A"]), tt(inp["D"]), tt(inp["dt_bias"])
    init = None if inp["init"] is None else tt(inp["init"])
    cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cu = torch.tensor(cu_np, dtype=torch.int32, device="cuda")
    seq_idx = torch.tensor(
        np.repeat(np.arange(len(lengths)), lengths), dtype=torch.int32, device="cuda"
    )[None]
    total = int(cu_np[-1])
    extra = int(np.sum(cu_np[1:-1] % chunk > 0))
    n = -(-total // chunk) + extra
    idx, off, p = np.arange(n), np.zeros(n, np.int64), 0
    for s, e in zip(cu_np[:-1], cu_np[1:], strict=True):
        p += s % chunk > 0
        lo, hi = s // chunk + p, e // chunk + p + (e % chunk > 0)
        idx[lo:hi] -= p
        off[lo] = s % chunk
    chunk_indices = torch.tensor(idx, dtype=torch.int32, device="cuda")
    chunk_offsets = torch.tensor(off, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)

    def call():
        return scan(
            x, dt, A, B, C, chunk, D=D, z=None, dt_bias=bias, initial_states=init,
            seq_idx=seq_idx, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
            cu_seqlens=cu, dt_softplus=True, return_varlen_states=True, out=out,
            state_dtype=torch.float32,
        )  # fmt: skip

    return call


def sweep(args, s: bc.MambaShapes):
    """Time the sweep's variants on ``--sweep-case``: state-pass variants alone (final states
    checked), output-pass variants in the full call on the best state pass (y checked);
    returns the best of each combined. A variant that misses the reference or fails counts
    as infinitely slow."""
    name = args.sweep_case or next(iter(lengths_of(args)))
    inp = make_inputs(s, lengths_of(args)[name], "init" in name)
    ref_fn, fargs = program(inp, s.chunk, "ref")
    y_ref, final_ref = ref_fn(*fargs)[:2]
    impl = bc.kernel_impl(args)

    def measure(base, changes, states_only):
        sizes = dataclasses.replace(base, **changes)
        what = "states only (err: final states)" if states_only else "full (err: y)"
        try:
            t0 = time.perf_counter()
            fn, _ = program(inp, s.chunk, impl, sizes, states_only=states_only)
            out = fn(*fargs)
            err = bc.rel_err(out, final_ref) if states_only else bc.rel_err(out[0], y_ref)
            seconds = bc.median_time(lambda: fn(*fargs), args.reps, calls=10)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"sweep {what} {changes}: FAILED {type(e).__name__}: {str(e)[:1500]}")
            return float("inf")
        print(
            f"sweep {what} {changes}: {seconds * 1e3:.3f} ms err={err:.1e} "
            f"(incl. compile {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        return seconds if err < TOL else float("inf")

    base = GpuBlockSizes()
    state_s = [measure(base, v, True) for v in STATE_SWEEP]
    base = dataclasses.replace(base, **STATE_SWEEP[state_s.index(min(state_s))])
    out_s = [measure(base, v, False) for v in OUT_SWEEP]
    best = dataclasses.replace(base, **OUT_SWEEP[out_s.index(min(out_s))])
    print(f"sweep best: {best}", flush=True)
    return best


def bench_case(name: str, args, table: bc.Table, block_sizes=None) -> None:
    """One case: ours checked against the reference, then ours, our state pass alone, the
    reference and SGLang timed."""
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    lengths = lengths_of(args)[name]
    with_init = "init" in name
    inp = make_inputs(s, lengths, with_init)
    real = sum(lengths)
    impl = bc.kernel_impl(args)
    fn, fargs = program(inp, s.chunk, impl, block_sizes)
    ref_fn, _ = program(inp, s.chunk, "ref")
    y_ref, final_ref, tracked_ref = ref_fn(*fargs)

    def timed(f):
        return bc.median_time(lambda: f(*fargs), args.reps, calls=10)

    t_ref = timed(ref_fn)
    try:
        y, final, tracked = fn(*fargs)
        ok = bc.close(f"ssd {name} y", y[:real], y_ref[:real], TOL)
        ok &= bc.close(f"ssd {name} final states", final, final_ref, TOL)
        ok &= bc.close(f"ssd {name} tracked states", tracked, tracked_ref, TOL)
        t_ours = timed(fn)
        t_states = timed(program(inp, s.chunk, impl, block_sizes, states_only=True)[0])
    except Exception as e:  # noqa: BLE001 - report and go on with the other cases
        print(f"ssd {name}: ours FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
        ok, t_ours, t_states = False, float("nan"), float("nan")
    print(f"  ssd {name}: state pass alone {t_states * 1e3:.3f} ms")
    t_sgl = None
    sgl_call = None if args.smoke else sglang_program(inp, lengths, s.chunk)
    if sgl_call is not None:
        try:
            t_sgl = bc.torch_time(sgl_call, args.reps, cold=True)
        except Exception as e:  # noqa: BLE001 - report and time ours only
            print(f"ssd {name}: sglang FAILED {type(e).__name__}: {str(e)[:300]}")
    name = f"ssd {name}{'' if ok else ' (MISMATCH)'}"
    table.add(
        bc.Row(name, ours=t_ours, xla=t_ref, roof=roofline(s, lengths, with_init), peer=t_sgl)
    )


def run(args, table: bc.Table) -> None:
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    print(f"SSD GPU block sizes: {GpuBlockSizes()} (few sequences: {s.heads} heads each, "
          f"{GpuBlockSizes.get_default(1, s.heads)})")  # fmt: skip
    best = sweep(args, s) if args.sweep else None  # None: the kernel's per-shape defaults
    names = args.ssd_cases.split(",") if args.ssd_cases else list(lengths_of(args))
    for name in names:
        bench_case(name, args, table, best)


# --------------------------------------------------------------------------- column views

VIEW_LENGTHS = {"1x2048": [2048], "8x2048 init": [2048] * 8}
SMOKE_VIEW_LENGTHS = {"1x64": [64], "ragged init": [40, 3, 0, 21]}


def layer_prefill_program(s: bc.MambaShapes, lengths: list[int], impl: str, views: bool):
    """One Mamba layer's conv and scan from its in_proj output ``[T, z | xBC | dt]``, as the
    mixer's prefill runs them (initial states, one tracked state a sequence). ``views``: xBC
    and dt are column views of the in_proj output, x, B and C of the conv output; otherwise
    they are sliced out first (copies in front of the kernels)."""
    h, p, g, n = s.heads, s.head_dim, s.groups, s.state
    d_inner, conv_dim = h * p, h * p + 2 * g * n
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    layout = build_chunk_layout(cu, sum(lengths), s.chunk)
    wanted = layout.seq_last_chunk.astype(jnp.int32)

    def run(zxbcdt, weight, bias, init_conv, A, D, dt_bias, init_ssm):
        if views:
            xbc = ColumnView.of(zxbcdt, d_inner, (conv_dim,))
            dt = ColumnView.of(zxbcdt, d_inner + conv_dim, (h,))
        else:
            _, xbc, dt = jnp.split(zxbcdt, [d_inner, d_inner + conv_dim], axis=1)
        out, conv_final, _ = causal_conv1d_varlen(
            xbc, weight, bias, cu, initial_states=init_conv, impl=impl
        )
        if views:
            x = ColumnView.of(out, 0, (h, p))
            B, C = (ColumnView.of(out, d_inner + i * g * n, (g, n)) for i in range(2))
        else:
            x, B, C = jnp.split(out, [d_inner, d_inner + g * n], axis=1)
            x, B, C = x.reshape(-1, h, p), B.reshape(-1, g, n), C.reshape(-1, g, n)
        y, final, tracked = ssd_varlen(
            x, dt, A, B, C, cu, chunk_size=s.chunk, D=D, dt_bias=dt_bias, dt_softplus=True,
            initial_states=init_ssm, layout=layout, state_chunks=wanted, impl=impl,
        )  # fmt: skip
        return y, conv_final, final, tracked

    return jax.jit(run)


def layer_prefill_inputs(s: bc.MambaShapes, lengths: list[int], rng) -> tuple[list, list]:
    """Two in_proj outputs (rotated: more than the L2 cache between calls of one) and the
    other arguments: conv weights, initial conv and SSM states (half of them zero), A, D, dt
    bias."""
    t, seqs = sum(lengths), len(lengths)
    h, p, g, n, k = s.heads, s.head_dim, s.groups, s.state, s.conv_width
    conv_dim = h * p + 2 * g * n
    width = h * p + conv_dim + h

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    zxbcdts = [jnp.asarray(normal(t, width), bc.ACT) for _ in range(2)]
    half = (np.arange(seqs) < seqs // 2)[:, None, None]
    init_conv, init_ssm = normal(seqs, k - 1, conv_dim), normal(seqs, h, p, n, scale=0.1)
    init_conv, init_ssm = np.where(half, 0.0, init_conv), np.where(half[..., None], 0.0, init_ssm)
    rest = [
        jnp.asarray(normal(k, conv_dim, scale=0.5), bc.ACT),
        jnp.asarray(normal(conv_dim, scale=0.1), bc.ACT),
        jnp.asarray(init_conv, bc.ACT),
        jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, h)), jnp.float32),
        jnp.asarray(normal(h), jnp.float32),
        jnp.asarray(rng.uniform(-2.0, 0.0, h), jnp.float32),
        jnp.asarray(init_ssm, jnp.float32),
    ]
    return zxbcdts, rest


def kernels_of(fn, args) -> str:
    """The kernels of one call of ``fn``, from a profiler trace."""
    import tempfile

    from trace_summary import format_trace_summary, summarize_trace

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
        return format_trace_summary("one call", summarize_trace(trace_dir, 1, top=None))


def bench_column_views(name: str, lengths: list[int], args, table: bc.Table, rng) -> None:
    """One case: both forms checked against the reference, then the views (ours), the
    separate arrays (a variant) and the reference timed."""
    s = bc.MAMBA_SMOKE if args.smoke else bc.MAMBA_9B
    impl = bc.kernel_impl(args)
    zxbcdts, rest = layer_prefill_inputs(s, lengths, rng)
    real = sum(lengths)
    views = layer_prefill_program(s, lengths, impl, views=True)
    separate = layer_prefill_program(s, lengths, impl, views=False)
    ref = layer_prefill_program(s, lengths, "ref", views=False)
    want = ref(zxbcdts[0], *rest)

    def checked(label, fn):
        got = fn(zxbcdts[0], *rest)
        for what, ours, theirs in zip(("y", "conv final", "final", "tracked"), got, want,
                                      strict=True):  # fmt: skip
            if what == "y":
                ours, theirs = ours[:real], theirs[:real]
            bc.check(f"layer prefill {name} {label} {what}", ours, theirs, TOL)

    def timed(fn):
        turn = iter(range(1 << 30))
        return bc.median_time(lambda: fn(zxbcdts[next(turn) % 2], *rest), args.reps, calls=10)

    checked("views", views)
    checked("separate arrays", separate)
    conv_bytes = 2 * real * (s.heads * s.head_dim + 2 * s.groups * s.state) * 2
    row = bc.Row(
        f"layer prefill {name} (views)",
        ours=timed(views),
        xla=timed(ref),
        roof=bc.roofline(conv_bytes) + roofline(s, lengths, with_init=True),
    )
    bc.time_variants(row, {"separate arrays": lambda: timed(separate)})
    if "separate arrays" in row.variants:
        sep = row.variants["separate arrays"]
        print(f"    views save {(sep - row.ours) * 1e6:.1f} us a layer (separate / views = "
              f"{sep / row.ours:.3f})")  # fmt: skip
    table.add(row)
    if args.views_profile and not args.smoke:  # the profiler sees no device kernels on CPU
        for label, fn in (("views", views), ("separate arrays", separate)):
            print(f"\n{name}, {label}: {kernels_of(fn, [zxbcdts[0], *rest])}", flush=True)


def run_column_views(args, table: bc.Table) -> None:
    rng = np.random.default_rng(3)
    for name, lengths in (SMOKE_VIEW_LENGTHS if args.smoke else VIEW_LENGTHS).items():
        bench_column_views(name, lengths, args, table, rng)


CASES = {"ssd": run, "column_views": run_column_views}

if __name__ == "__main__":
    bc.main_for(__doc__, CASES, add_args)
