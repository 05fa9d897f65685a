"""Benchmark the Mamba kernels on one GPU: decode state update, causal conv (prefill and
decode update) and the SSD prefill scan (the cases of ``scripts/bench_ssd.py``), in one run.

Nemotron-Nano-9B-v2 Mamba shapes (H 128, P 80, G 8, N 128, conv_dim 12288, K 4), bf16
activations, fp32 SSM state, bf16 conv state. Per case: our Pallas kernel, the XLA reference
(``impl="ref"``), SGLang 0.5.23's Triton kernel (if importable), their ratio, and our fraction
of the roofline (bytes / 4.3 TB/s, each input read once and each output written once).

Outputs are checked against the reference on the device before timing (every variant too).
Decode cases run ``steps`` updates as one jitted program in which each step is exactly one
kernel launch: each step's inputs are separate arguments and each output a separate result.
SGLang's are ``steps`` launches captured in one CUDA graph, replayed from a cold L2 (the
warm figure is printed too: at batch 1 a conv-update replay fits in L2). (The earlier
``lax.scan`` over stacked inputs added a slice of every input and an update of the stacked
output around each kernel: up to three launches a step and, for the conv update at batch
256, 25 MB of copies against the kernel's 50 MB; ``--scan`` still times ours that way.)
Each step touches other slots, so the state is not served from L2. Our programs are timed
as several calls dispatched back to back and one sync (host dispatch overlaps the device,
as graph replay does); each case prints whether XLA put the program into a CUDA graph
(command buffer). Prefill cases rotate two input sets (2 x 400 MB). Median of ``--reps``.

XLA does not put these programs into CUDA graphs, so at small batch that wall time is the
host's launch time, not the kernel's. The engine's decode step is one XLA program whose GPU
is busy 95 % of the time at batch 1: the host runs ahead and a kernel costs its device
time. So, at the end of the run (after every SGLang graph: once the profiler has run,
torch's graph capture fails), each decode case is also timed "in a busy program": the steps
behind a ~5 ms matmul they wait on, their span read from a ``jax.profiler`` trace. That
span is what the issue's "time small batches the way each engine runs them" compares with
SGLang's graph replay.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD/.sgl_ssd:$PWD \
        python3 scripts/bench_kernels.py --reps 10 [--sweep] [--scan]

``--sweep`` adds the block-size variants of the Triton kernels and the Mosaic GPU state
update (``kernels/state_update_mosaic_gpu.py``); a variant that fails to compile or
mismatches the reference is reported and skipped.

SGLang's files are not part of this repo: unpack ``sglang/kernels/ops/mamba/triton_ops/``
(``mamba_ssm.py`` and the ``ssd_*.py`` chunked-scan chain) and
``sglang/kernels/ops/mamba/causal_conv1d_triton.py`` from the ``sglang==0.5.23`` wheel into an
ignored folder (with package ``__init__``s that import only those, and a shim for
``sglang.kernels.jit.utils.is_arch_support_pdl``) and put it on ``PYTHONPATH``. Without the
SSD chain the SSD cases time ours and XLA only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:
    from jaxmamba.kernels import (  # noqa: E402
        causal_conv1d_update,
        causal_conv1d_varlen,
        conv1d_pallas,
        selective_state_update,
        state_update_mosaic_gpu,
        state_update_pallas,
    )
except ImportError:  # not installed (the GPU machine): the repo root is on sys.path
    from kernels import (  # noqa: E402
        causal_conv1d_update,
        causal_conv1d_varlen,
        conv1d_pallas,
        selective_state_update,
        state_update_mosaic_gpu,
        state_update_pallas,
    )

H, P, G, N, DIM, K = 128, 80, 8, 128, 12288, 4
HBM = 4.3e12  # bytes/s, measured D2D copy on this H200 (DESIGN §8)
ACT = jnp.bfloat16
IMPL = "pallas"  # --smoke: "interpret" at toy shapes, to check this script on CPU
SMOKE = False

try:
    import torch
    from sglang.kernels.ops.mamba.causal_conv1d_triton import (
        causal_conv1d_fn as sgl_conv_fn,
    )
    from sglang.kernels.ops.mamba.causal_conv1d_triton import (
        causal_conv1d_update as sgl_conv_update,
    )
    from sglang.kernels.ops.mamba.triton_ops.mamba_ssm import (
        selective_state_update as sgl_ssu,
    )

    HAVE_SGL = torch.cuda.is_available()
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"SGLang kernels not importable ({e}); timing ours and XLA only")
    HAVE_SGL = False


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(name, ours, ref, tol):
    err = rel_err(ours, ref)
    status = "ok" if err < tol and np.isfinite(err) else "FAIL"
    print(f"  check {name}: rel err {err:.2e} ({status}, tol {tol:.0e})")
    if status == "FAIL":
        raise SystemExit(f"{name}: output mismatch")


def median_time(fn, reps: int, calls: int = 1) -> float:
    """Median wall time of ``calls`` back-to-back calls of ``fn`` (which must not block);
    one sync per repetition, so host dispatch overlaps the device work, as graph replay
    does for SGLang."""
    jax.block_until_ready(fn())  # warm-up (compile, autotune)
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = [fn() for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def uses_command_buffer(jitted, *args) -> bool:
    """Whether XLA put the program's kernels into a CUDA graph (a command-buffer thunk)."""
    return "command_buffer" in jitted.lower(*args).compile().as_text()


def decode_program(op, steps: int):
    """``steps`` calls of ``op(pool, *inputs_i) -> (y_i, pool)`` in one jitted program.

    Each step's inputs are separate arguments and each ``y_i`` a separate output, so the
    program is exactly ``steps`` kernel launches, like SGLang's captured graph: no slice of
    stacked inputs or update of a stacked output per step (a ``lax.scan`` adds both).
    """

    step = jax.jit(op)  # one lowering of the kernel, called ``steps`` times

    def run(pool, inputs):
        ys = []
        for step_inputs in inputs:
            y, pool = step(pool, *step_inputs)
            ys.append(y)
        return pool, ys

    return jax.jit(run, donate_argnums=0)


def busy_program(op):
    """``decode_program`` behind a lead-in on which step 0 depends: one bf16 matmul (one
    kernel, ~5 ms on the H200). While the GPU runs it the host enqueues every step, as in the
    engine's decode step, where the GPU is busy for 95 % of a batch-1 step; the steps' span on
    the device is then what they cost inside a whole decode program, without the host's
    per-launch time (``in_program_time``)."""
    step = jax.jit(op)

    def run(pool, inputs, lead_a, lead_b):
        lead = lead_a @ lead_b
        gate = (lead[0, 0] > jnp.inf).astype(jnp.int32)  # always 0, not foldable
        ys = []
        for i, step_inputs in enumerate(inputs):
            if i == 0:  # every op's step takes the slots last
                step_inputs = (*step_inputs[:-1], step_inputs[-1] + gate)
            y, pool = step(pool, *step_inputs)
            ys.append(y)
        return pool, ys, lead[0, 0]

    return jax.jit(run, donate_argnums=0)


def in_program_time(op, pools, inputs, steps: int) -> tuple[float, float, float]:
    """Our steps' device span, kernel time (seconds per step) and kernels per step inside a
    busy program, from a ``jax.profiler`` trace of one call after a warm-up."""
    import tempfile

    from jaxmamba.bench import device_kernel_events, load_trace_events, steps_after_lead_in

    fn = busy_program(op)
    lead_a = jax.random.normal(jax.random.key(1), (8192, 8192), ACT)
    lead_b = jax.random.normal(jax.random.key(2), (8192, 32768), ACT)  # 4.4 TFLOP
    pool = pools.fresh()
    pool, ys, _ = fn(pool, inputs, lead_a, lead_b)
    jax.block_until_ready(ys)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            pool, ys, _ = fn(pool, inputs, lead_a, lead_b)
            jax.block_until_ready(ys)
        events = device_kernel_events(load_trace_events(trace_dir))
    span, busy, kernels = steps_after_lead_in(events, steps)
    return span * 1e-6, busy * 1e-6, kernels


def scan_program(op):
    """The earlier timing: ``lax.scan`` over stacked inputs (a slice and a stacked-output
    update per step around the kernel), kept to show what that costs."""

    def run(pool, stacked):
        def body(pool, inp):
            y, pool = op(pool, *inp)
            return pool, y

        return jax.lax.scan(body, pool, stacked, unroll=True)

    return jax.jit(run, donate_argnums=0)


class Pools:
    """Donated pools, one per timed program, threaded through its calls."""

    def __init__(self, host_pool, dtype):
        self.host, self.dtype, self.live = host_pool, dtype, {}

    def fresh(self):
        return jnp.asarray(self.host, self.dtype)

    def caller(self, key, fn, inputs):
        self.live[key] = self.fresh()

        def call():
            self.live[key], ys = fn(self.live[key], inputs)
            return ys

        return call


def torch_time(fn, reps: int, cold: bool = False) -> float:
    """Median device time of ``fn`` between two CUDA events. ``cold``: a 512 MB read before
    each repetition (outside the events) leaves L2 without the data of the last one, as our
    busy programs start after a lead-in matmul that streams ~640 MB through it."""
    flush = torch.empty(256 << 20, dtype=torch.bfloat16, device="cuda") if cold else None
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def sglang_graph_time(case: str, replay, reps: int, steps: int) -> float:
    """SGLang's time a step: its graph replayed from a cold L2 (``torch_time``), as ours runs
    after the lead-in. A replay whose data fits in L2 (the conv update at batch 1 touches
    ~32 MB) would otherwise be served from the last replay's lines; the warm figure is
    printed beside it."""
    cold, warm = torch_time(replay, reps, cold=True) / steps, torch_time(replay, reps) / steps
    print(f"  sglang {case}: {cold * 1e6:.2f} us a step from a cold L2, {warm * 1e6:.2f} warm")
    return cold


def graph_of(calls):
    """Capture ``calls()`` in a CUDA graph; returns a replay function."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # warm-up outside capture (Triton compiles here)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph.replay


def to_torch(a, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32))).cuda()
    return t if dtype is None else t.to(dtype)


ROWS = []


def report(case, ours, xla, sgl, nbytes, in_program=None, roof=None):
    """``in_program``: {label: op} of steps (decode, conv prefill) to time inside a busy
    program at the end of the run (``measure_in_program``), "ours" first. ``roof``: the
    roofline time where it is not ``nbytes`` over HBM (FLOP-bound cases)."""
    roof = nbytes / HBM if roof is None else roof
    ROWS.append(dict(case=case, ours=ours, xla=xla, sgl=sgl, roof=roof, in_program=in_program))
    sgl_s = f"{sgl * 1e6:9.1f}" if sgl else "      n/a"
    ratio = f"{sgl / ours:5.2f}x" if sgl else "  n/a"
    print(
        f"  {case:28s} ours {ours * 1e6:9.1f} us | xla {xla * 1e6:9.1f} | sglang {sgl_s} | "
        f"sglang/ours {ratio} | roofline {roof * 1e6:7.1f} us = {roof / ours:6.1%} of ours"
    )


def measure_in_program(row):
    """Time a case's steps (decode steps, conv prefill calls) inside a busy program
    (``in_program_time``), ours and each variant; sets ``row["in_program"]`` to ours (seconds
    a step). Runs after every SGLang timing: once the profiler has run, torch's CUDA-graph
    capture fails in this process."""
    ops, pools, inputs, steps = row["in_program"]
    row["in_program"] = None
    roof, sgl = row["roof"], row["sgl"]
    for label, op in ops.items():
        try:
            span, kernel, per_step = in_program_time(op, pools, inputs, steps)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"  {row['case']} {label} in a busy program: FAILED {type(e).__name__}: {e}")
            continue
        ratio = f"sglang/ours {sgl / span:5.2f}x | " if sgl else ""
        print(
            f"  {row['case']:20s} {label:32s} in a busy program: span {span * 1e6:8.1f} us a "
            f"step, kernels {kernel * 1e6:8.1f} us ({per_step:.2f} a step) | {ratio}"
            f"{roof / span:6.1%} of roofline"
        )
        if label == "ours":
            row["in_program"] = span


# --------------------------------------------------------------------------- state update


def time_decode_kernels(
    checked, ours_fn, ref_fn, step_op, pools, inputs, variants, steps, reps, max_calls, nbytes, scan
):
    """Check and time our decode program and the reference (``steps`` launches a program,
    several programs back to back up to ``max_calls`` steps), then the sweep's variants, each
    checked before it is timed; returns (ours, ref) seconds per step and what
    ``measure_in_program`` needs."""
    checked("ours", ours_fn)
    graphed = uses_command_buffer(ours_fn, pools.fresh(), inputs) if not SMOKE else False
    calls = max(1, max_calls // steps)

    def timed(key, fn):
        return median_time(pools.caller(key, fn, inputs), reps, calls) / steps

    ours, xla = timed("ours", ours_fn), timed("ref", ref_fn)
    print(f"    ours: XLA command buffer (CUDA graph) = {graphed}")
    in_program_ops = {"ours": step_op(IMPL)}
    if scan:
        stacked = tuple(jnp.stack(v) for v in zip(*inputs, strict=True))
        t = median_time(pools.caller("scan", scan_program(step_op(IMPL)), stacked), reps) / steps
        print(
            f"    ours timed the earlier way (lax.scan, stacked inputs/outputs): {t * 1e6:.1f} us"
        )
    for name, kernel in variants.items():
        try:
            fn = decode_program(step_op(kernel=kernel), steps)
            checked(name, fn)
            t = timed(name, fn)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"    variant {name}: FAILED {type(e).__name__}: {str(e)[:600]}")
            continue
        print(f"    variant {name}: {t * 1e6:.1f} us = {nbytes / HBM / t:.1%} of roofline")
        in_program_ops[f"variant {name}"] = step_op(kernel=kernel)
    pools.live.clear()
    # The profiler sees no device kernels on CPU.
    in_program = None if SMOKE else (in_program_ops, pools, inputs, steps)
    return ours, xla, in_program


def bench_state_update(rows: int, steps: int, reps: int, rng, variants=None, scan=False):
    variants = variants or {}
    slots_total = 256 if rows <= 32 else 2 * rows  # real slots; the pool has one more (pad)
    state = rng.standard_normal((slots_total + 1, H, P, N), np.float32) * 0.5
    x = rng.standard_normal((steps, rows, H, P), np.float32)
    dt = rng.standard_normal((steps, rows, H), np.float32) - 2.0
    bmat = rng.standard_normal((steps, rows, G, N), np.float32)
    cmat = rng.standard_normal((steps, rows, G, N), np.float32)
    a = -np.exp(rng.standard_normal(H).astype(np.float32))
    d = rng.standard_normal(H).astype(np.float32)
    dt_bias = rng.standard_normal(H).astype(np.float32) * 0.1
    perm = rng.permutation(slots_total).astype(np.int32)
    slot_sets = np.stack([np.roll(perm, -i * rows)[:rows] for i in range(steps)])

    ja, jd, jbias = (jnp.asarray(v) for v in (a, d, dt_bias))
    # Per step: its own device arrays (x, dt, B, C, slots), as a decode step receives them.
    inputs = [
        (*(jnp.asarray(v[i], ACT) for v in (x, dt, bmat, cmat)), jnp.asarray(slot_sets[i]))
        for i in range(steps)
    ]
    pools = Pools(state, jnp.float32)

    def step_op(impl=None, kernel=None):
        kernel = kernel or functools.partial(selective_state_update, impl=impl)
        return lambda pool, x, dt, b, c, slots: kernel(
            pool, x, dt, ja, b, c, slots, D=jd, dt_bias=jbias
        )

    ours_fn, ref_fn = decode_program(step_op(IMPL), steps), decode_program(step_op("ref"), steps)
    ref_pool, ref_ys = ref_fn(pools.fresh(), inputs)
    ref_y = jnp.stack(ref_ys).astype(jnp.float32)

    def checked(name, fn):
        pool, ys = fn(pools.fresh(), inputs)
        check(f"ssu bs{rows} {name} y", jnp.stack(ys).astype(jnp.float32), ref_y, 1e-2)
        check(f"ssu bs{rows} {name} state", pool, ref_pool, 1e-4)

    nbytes = 2 * rows * H * P * N * 4 + rows * (2 * H * P + H + 2 * G * N) * 2
    ours, xla, in_program = time_decode_kernels(
        checked, ours_fn, ref_fn, step_op, pools, inputs, variants, steps, reps, 16, nbytes, scan
    )

    sgl = None
    if HAVE_SGL:
        tstate = to_torch(state)
        tx = [to_torch(v, torch.bfloat16) for v in (x, dt, bmat, cmat)]
        ta = to_torch(a)[:, None, None].expand(H, P, N)
        td = to_torch(d)[:, None].expand(H, P)
        tbias = to_torch(dt_bias)[:, None].expand(H, P)
        tslots = torch.from_numpy(slot_sets).cuda()
        outs = torch.empty((steps, rows, H, P), dtype=torch.bfloat16, device="cuda")

        def sgl_step(i):
            sgl_ssu(
                tstate, tx[0][i], tx[1][i][:, :, None].expand(rows, H, P), ta, tx[2][i],
                tx[3][i], D=td, z=None, dt_bias=tbias, dt_softplus=True,
                state_batch_indices=tslots[i], out=outs[i],
            )  # fmt: skip

        sgl_step(0)
        torch.cuda.synchronize()
        check(f"sglang ssu bs{rows} y (step 0)", outs[0].float().cpu().numpy(), ref_y[0], 1e-2)
        replay = graph_of(lambda: [sgl_step(i) for i in range(steps)])
        sgl = sglang_graph_time(f"state update bs {rows}", replay, reps, steps)
        del tstate

    report(f"state update bs {rows}", ours, xla, sgl, nbytes, in_program)


# --------------------------------------------------------------------------- conv


def bench_conv_prefill(num_seqs: int, seqlen: int, reps: int, rng, variants=None):
    variants = variants or {}
    tokens = num_seqs * seqlen
    xs = [rng.standard_normal((tokens, DIM), np.float32) for _ in range(2)]
    w = rng.standard_normal((K, DIM), np.float32) * 0.5
    bias = rng.standard_normal(DIM).astype(np.float32) * 0.1
    init = rng.standard_normal((num_seqs, K - 1, DIM), np.float32)
    has_init = np.arange(num_seqs) % 2 == 0
    init[~has_init] = 0.0
    cu = (np.arange(num_seqs + 1) * seqlen).astype(np.int32)
    jxs = [jnp.asarray(v, ACT) for v in xs]
    jw, jb, jinit = jnp.asarray(w, ACT), jnp.asarray(bias, ACT), jnp.asarray(init, ACT)
    jcu = jnp.asarray(cu)

    def fn(impl, op=None):
        op = op or functools.partial(causal_conv1d_varlen, impl=impl)
        return jax.jit(lambda x: op(x, jw, jb, jcu, initial_states=jinit)[:2])

    ours_fn, ref_fn = fn(IMPL), fn("ref")
    out, ref = ours_fn(jxs[0]), ref_fn(jxs[0])
    check("conv prefill y", out[0].astype(jnp.float32), ref[0].astype(jnp.float32), 1e-2)
    check("conv prefill final", out[1].astype(jnp.float32), ref[1].astype(jnp.float32), 1e-2)

    def timed(f):
        turn = iter(range(1 << 30))
        return median_time(lambda: f(jxs[next(turn) % 2]), reps, calls=10)

    ours, xla = timed(ours_fn), timed(ref_fn)
    nbytes = 2 * tokens * DIM * 2 + num_seqs * 2 * (K - 1) * DIM * 2 + (K + 1) * DIM * 2
    for name, op in variants.items():
        try:
            f = fn(None, op)
            out = f(jxs[0])
            check(
                f"conv prefill {name} y",
                out[0].astype(jnp.float32),
                ref[0].astype(jnp.float32),
                1e-2,
            )
            t = timed(f)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"    variant {name}: FAILED {type(e).__name__}: {str(e)[:600]}")
            continue
        print(f"    variant {name}: {t * 1e6:.1f} us = {nbytes / HBM / t:.1%} of roofline")

    sgl = None
    if HAVE_SGL:
        txs = [to_torch(v, torch.bfloat16) for v in xs]  # [T, D]: channel-last views below
        tw = to_torch(w.T, torch.bfloat16).contiguous()  # [D, K]
        tb = to_torch(bias, torch.bfloat16)
        pool = torch.zeros((num_seqs + 1, K - 1, DIM), dtype=torch.bfloat16, device="cuda")
        pool[:num_seqs] = to_torch(init, torch.bfloat16)
        tcu = torch.from_numpy(cu).cuda()
        idx = torch.arange(num_seqs, dtype=torch.int32, device="cuda")
        thas = torch.from_numpy(has_init).cuda()
        lens = [seqlen] * num_seqs

        def call_sgl(x):
            return sgl_conv_fn(
                x.t(), tw, tb, pool.transpose(1, 2), tcu, lens, cache_indices=idx,
                has_initial_state=thas, activation="silu",
            )  # fmt: skip

        y = call_sgl(txs[0]).t().float().cpu().numpy()
        check("sglang conv prefill y", y, np.asarray(ref[0].astype(jnp.float32)), 1e-2)
        pool[:num_seqs] = to_torch(init, torch.bfloat16)

        def run(n=10):
            for i in range(n):
                call_sgl(txs[i % 2])

        sgl = torch_time(run, reps) / 10

    # Inside a busy program, as the model's prefill program runs it: the initial states ride
    # as the "pool", the sequence bounds last (``busy_program`` gates them). Each call's final
    # states are the next call's initial states, so no two calls are alike (XLA would merge
    # identical ones into one).
    def prefill_op(op):
        def step(init, x, cu):
            y, final = op(x, jw, jb, cu, initial_states=init)[:2]
            return y, final.astype(init.dtype)

        return step

    ops = {"ours": prefill_op(functools.partial(causal_conv1d_varlen, impl=IMPL))}
    ops.update({f"variant {name}": prefill_op(op) for name, op in variants.items()})
    steps = 8
    in_program = None
    if not SMOKE:  # the profiler sees no device kernels on CPU
        in_program = (ops, Pools(init, ACT), [(jxs[i % 2], jcu) for i in range(steps)], steps)
    report(f"conv prefill {num_seqs}x{seqlen}", ours, xla, sgl, nbytes, in_program)


def bench_conv_update(rows: int, steps: int, reps: int, rng, variants=None, scan=False):
    variants = variants or {}
    slots_total = max(1024, 2 * rows)
    pool = rng.standard_normal((slots_total + 1, K - 1, DIM), np.float32)
    x = rng.standard_normal((steps, rows, DIM), np.float32)
    w = rng.standard_normal((K, DIM), np.float32) * 0.5
    bias = rng.standard_normal(DIM).astype(np.float32) * 0.1
    perm = rng.permutation(slots_total).astype(np.int32)
    slot_sets = np.stack([np.roll(perm, -i * rows)[:rows] for i in range(steps)])
    jw, jb = jnp.asarray(w, ACT), jnp.asarray(bias, ACT)
    inputs = [(jnp.asarray(x[i], ACT), jnp.asarray(slot_sets[i])) for i in range(steps)]
    pools = Pools(pool, ACT)

    def step_op(impl=None, kernel=None):
        kernel = kernel or functools.partial(causal_conv1d_update, impl=impl)
        return lambda pool, x, slots: kernel(pool, x, jw, jb, slots)

    ours_fn, ref_fn = decode_program(step_op(IMPL), steps), decode_program(step_op("ref"), steps)
    ref_pool, ref_ys = ref_fn(pools.fresh(), inputs)
    ref_y = jnp.stack(ref_ys).astype(jnp.float32)

    def checked(name, fn):
        out_pool, ys = fn(pools.fresh(), inputs)
        check(f"conv update bs{rows} {name} y", jnp.stack(ys).astype(jnp.float32), ref_y, 1e-2)
        out_pool, want = out_pool.astype(jnp.float32), ref_pool.astype(jnp.float32)
        check(f"conv update bs{rows} {name} state", out_pool, want, 1e-6)

    nbytes = rows * (2 * (K - 1) * DIM * 2 + 2 * DIM * 2) + (K + 1) * DIM * 2
    ours, xla, in_program = time_decode_kernels(
        checked, ours_fn, ref_fn, step_op, pools, inputs, variants, steps, reps, 64, nbytes, scan
    )

    sgl = None
    if HAVE_SGL:
        tpool = to_torch(pool, torch.bfloat16)
        tx = to_torch(x, torch.bfloat16)
        tw = to_torch(w.T, torch.bfloat16).contiguous()
        tb = to_torch(bias, torch.bfloat16)
        tslots = torch.from_numpy(slot_sets).cuda()
        ys = [None] * steps

        def sgl_step(i):
            ys[i] = sgl_conv_update(
                tx[i], tpool.transpose(1, 2), tw, tb, activation="silu",
                conv_state_indices=tslots[i],
            )  # fmt: skip

        sgl_step(0)
        torch.cuda.synchronize()
        check(f"sglang conv update bs{rows} y", ys[0].float().cpu().numpy(), ref_y[0], 1e-2)
        replay = graph_of(lambda: [sgl_step(i) for i in range(steps)])
        sgl = sglang_graph_time(f"conv update bs {rows}", replay, reps, steps)

    report(f"conv update bs {rows}", ours, xla, sgl, nbytes, in_program)


def ssu_variants(smoke: bool):
    # (rows of P a tile, tiles a program, warps): SGLang-sized tiles, the old default,
    # fewer/more programs, whole heads a program.
    sizes = [(4, 1, 4), (4, 1, 2), (8, 1, 4), (8, 1, 2), (16, 1, 4), (16, 1, 8), (16, 5, 4)]
    sizes += [(16, 5, 8), (8, 10, 4), (8, 5, 4)]
    variants = {
        f"triton bp{bp} t{t} w{w}": functools.partial(
            state_update_pallas.selective_state_update_gpu,
            interpret=smoke,
            block_sizes=state_update_pallas.GpuBlockSizes(head_dim=bp, tiles=t, num_warps=w),
        )
        for bp, t, w in sizes
    }
    for bp, t, w in ((16, 1, 4), (8, 1, 4)):  # the state streamed past L2
        variants[f"triton bp{bp} t{t} w{w} evict-first"] = functools.partial(
            state_update_pallas.selective_state_update_gpu,
            interpret=smoke,
            block_sizes=state_update_pallas.GpuBlockSizes(
                head_dim=bp, tiles=t, num_warps=w, state_eviction="evict_first"
            ),
        )
    if not smoke:  # Mosaic GPU has no CPU path
        mosaic = state_update_mosaic_gpu.selective_state_update_mosaic_gpu
        variants["mosaic"] = mosaic
        variants["mosaic auto-barriers"] = functools.partial(mosaic, auto_barriers=True)
    return variants


def conv_prefill_variants(smoke: bool):
    """Changes to the default ``ConvVarlenBlockSizes`` (4 tokens x 1024 channels, 4 warps,
    4 tiles a program, the window carried in registers, tanh SiLU), compared inside
    a busy program as well, where a call's launch overhead does not blur them: the shifted
    2-D tiles and the accurate SiLU form (the fifth session's kernel is both), tile shapes.
    The earlier sweeps (the "rows" kernels, tile shapes, loads a tile ahead, the grid's
    channel axis first, streaming stores, which all lost) are in docs/benchmarks.md."""
    variants = [
        dict(),
        dict(gpu_carry_window=False),
        dict(gpu_silu="exp2_rcp"),
        dict(gpu_carry_window=False, gpu_silu="exp2_rcp"),
        dict(gpu_tiles=8),
        dict(gpu_channels=512, gpu_num_warps=2),
        dict(gpu_num_stages=2),
    ]
    default = conv1d_pallas.ConvVarlenBlockSizes()
    return {
        (", ".join(f"{k[4:]}={v}" for k, v in changes.items()) or "default"): functools.partial(
            conv1d_pallas.causal_conv1d_varlen_gpu,
            interpret=smoke,
            block_sizes=dataclasses.replace(default, **changes),
        )
        for changes in variants
    }


def conv_update_variants(smoke: bool):
    sizes = [(64, 1), (128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (1024, 4), (2048, 8)]
    variants = {
        f"bd{bd} w{w}": conv1d_pallas.ConvUpdateBlockSizes(gpu_channels=bd, gpu_num_warps=w)
        for bd, w in sizes
    }
    variants["sigmoid SiLU"] = conv1d_pallas.ConvUpdateBlockSizes(gpu_silu="sigmoid")
    return {
        name: functools.partial(
            conv1d_pallas.causal_conv1d_update_gpu, interpret=smoke, block_sizes=sizes
        )
        for name, sizes in variants.items()
    }


def bench_ssd(names: list[str] | None):
    """SSD prefill cases of ``scripts/bench_ssd.py`` (which see; None: all of them), timed in
    this run: ours checked against the reference first, SGLang's chunked-scan chain with
    ``triton.testing.do_bench``."""
    import bench_ssd as ssd  # scripts/ is this script's folder, first on sys.path

    sgl = None
    if HAVE_SGL:
        try:
            import triton.testing
            from sglang.kernels.ops.mamba.triton_ops import mamba_chunk_scan_combined  # noqa: F401

            sgl = triton.testing
        except ImportError as e:
            print(f"SGLang's SSD chain not importable ({e}); timing ours and XLA only")
    for name in names or ssd.CASES:
        r = ssd.measure_case(name, sgl)
        print(f"  ssd {name}: state pass alone {r['states']:.3f} ms")
        report(
            f"ssd {name}{'' if r['ok'] else ' (MISMATCH)'}",
            r["ours"] / 1e3,
            r["xla"] / 1e3,
            r["sgl"] / 1e3 if np.isfinite(r["sgl"]) else None,
            None,
            roof=r["roof"] / 1e3,  # bytes or FLOPs, whichever binds (bench_ssd.roofline)
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--cases", default="ssu,conv_prefill,conv_update,ssd", help="comma-separated subset"
    )
    parser.add_argument(
        "--ssd-cases",
        default=None,
        help="SSD prefill cases (scripts/bench_ssd.py's names, comma-separated; default all)",
    )
    parser.add_argument("--smoke", action="store_true", help="toy shapes, interpret mode")
    parser.add_argument(
        "--ssu-rows", default="1,8,32,256", help="state update batch sizes (comma-separated)"
    )
    parser.add_argument("--sweep", action="store_true", help="also time GPU block-size variants")
    parser.add_argument(
        "--scan", action="store_true", help="also time ours the earlier way (lax.scan)"
    )
    args = parser.parse_args()
    if args.smoke:
        global H, P, G, N, DIM, IMPL, SMOKE
        H, P, G, N, DIM, IMPL, SMOKE = 4, 16, 2, 16, 256, "interpret", True
        args.reps = 2
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    cases = args.cases.split(",")
    if "ssu" in cases:
        steps_for = {1: 256, 8: 32, 32: 8, 256: 8}  # 0.6-5 ms of state traffic a program
        ssu_rows = [int(r) for r in args.ssu_rows.split(",")]
        for rows in ssu_rows[:1] if args.smoke else ssu_rows:
            steps = steps_for.get(rows, max(1, 2048 // rows))
            variants = ssu_variants(args.smoke) if args.sweep else None
            steps = 2 if args.smoke else steps
            bench_state_update(rows, steps, args.reps, rng, variants, args.scan)
    if "conv_prefill" in cases:
        variants = conv_prefill_variants(args.smoke) if args.sweep else None
        if args.smoke:
            bench_conv_prefill(2, 64, args.reps, rng, variants)
        else:
            bench_conv_prefill(8, 2048, args.reps, rng, variants)
    if "conv_update" in cases:
        for rows, steps in ((1, 256), (256, 16))[: 1 if args.smoke else 2]:
            variants = conv_update_variants(args.smoke) if args.sweep else None
            steps = 2 if args.smoke else steps
            bench_conv_update(rows, steps, args.reps, rng, variants, args.scan)
    if "ssd" in cases and not args.smoke:  # full shapes only
        bench_ssd(args.ssd_cases.split(",") if args.ssd_cases else None)
    pending = [row for row in ROWS if row["in_program"]]
    if pending:
        print("\nSteps inside a busy program (as the engine's decode and prefill programs run):")
    for row in pending:
        measure_in_program(row)
    print(
        "\n| case | ours (us) | ours in a busy program (us) | XLA ref (us) | SGLang (us) | "
        "SGLang/ours | SGLang/ours in program | roofline (us) | % (best of ours) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in ROWS:
        ours, sgl, in_program = row["ours"], row["sgl"], row["in_program"]
        best = min(ours, in_program or ours)
        cells = [
            row["case"],
            f"{ours * 1e6:.1f}",
            f"{in_program * 1e6:.1f}" if in_program else "-",
            f"{row['xla'] * 1e6:.1f}",
            f"{sgl * 1e6:.1f}" if sgl else "n/a",
            f"{sgl / ours:.2f}" if sgl else "n/a",
            f"{sgl / in_program:.2f}" if sgl and in_program else "-",
            f"{row['roof'] * 1e6:.1f}",
            f"{row['roof'] / best:.0%}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
