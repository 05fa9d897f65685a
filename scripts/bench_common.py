"""What the kernel benchmarks share: the model's shapes, timing, the checks against the
reference, the roofline, SGLang's kernels for comparison, and the result table.

``bench_kernels.py`` runs every op's cases in one run; ``bench_<op>.py`` runs one op's. They
import this file as a sibling module, so run them as files from anywhere
(``python scripts/bench_ssd.py``): Python puts a script's own folder first on ``sys.path``.
They import the kernels from the installed package (``jaxmamba.kernels``); on the GPU
machine run ``python3 -m pip install --no-deps --no-build-isolation -e .`` in the repo root first.

SGLang's Triton kernels are not part of this repo. To compare with them, unpack
``sglang/kernels/ops/mamba/triton_ops/`` (``mamba_ssm.py`` and the ``ssd_*.py`` chunked-scan
chain) and ``sglang/kernels/ops/mamba/causal_conv1d_triton.py`` from the ``sglang==0.5.23``
wheel into an ignored folder, with package ``__init__``s that import only those and a shim
for ``sglang.kernels.jit.utils.is_arch_support_pdl``, and put that folder on ``PYTHONPATH``.
Without them (or without torch and a CUDA device) the benchmarks time ours and XLA's only.

Timing: a case's program is called back to back and synced once per repetition, so the
host's dispatch overlaps the device, as a CUDA-graph replay does; the median of
``--reps`` repetitions. Roofline: each input read once and each output written once at
``HBM_BYTES_PER_S``, or the FLOPs at ``PEAK_FLOPS`` where those take longer.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (DESIGN §8)
PEAK_FLOPS = 800e12  # measured bf16 matmul on the H200
ACT = jnp.bfloat16  # activations, weights and the conv state; the SSM state is float32
SGLANG_MAMBA = "sglang.kernels.ops.mamba"


@dataclasses.dataclass(frozen=True)
class MambaShapes:
    """One Mamba2 layer's dimensions (the notation of the kernels' docstrings)."""

    heads: int  # H
    head_dim: int  # P
    groups: int  # G
    state: int  # N
    conv_dim: int  # channels of the causal conv (x, B and C of every head)
    conv_width: int = 4  # K
    chunk: int = 128  # C: the SSD scan's chunk


MAMBA_9B = MambaShapes(heads=128, head_dim=80, groups=8, state=128, conv_dim=12288)
MAMBA_SMOKE = MambaShapes(heads=4, head_dim=16, groups=2, state=16, conv_dim=256, chunk=16)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions (median)")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU: the kernels in interpret mode at toy shapes"
    )
    parser.add_argument("--sweep", action="store_true", help="also time block-size variants")
    parser.add_argument("--json", help="write every row (variants included) to this file")


def start(args: argparse.Namespace) -> None:
    """Refuse to time on a CPU unless ``--smoke``; print what runs where."""
    if args.smoke:
        args.reps = min(args.reps, 2)
    elif jax.default_backend() != "gpu":
        raise SystemExit("needs a GPU (or --smoke: the interpret-mode check on CPU)")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)


def kernel_impl(args: argparse.Namespace) -> str:
    """The dispatcher's ``impl`` for our kernel: compiled for the GPU, or interpreted."""
    return "interpret" if args.smoke else "pallas"


def roofline(nbytes: float, flops: float = 0.0) -> float:
    """Seconds at the roofline: the bytes at HBM bandwidth or the FLOPs at peak, the longer."""
    return max(nbytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS)


# --------------------------------------------------------------------------- checks


class Mismatch(AssertionError):
    """An output differs from the reference's by more than the tolerance."""


def rel_err(a, b) -> float:
    """Relative L2 error of ``a`` against ``b``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def close(name: str, got, want, tol: float) -> bool:
    """Print ``got``'s relative error against ``want`` and whether it is within ``tol``."""
    err = rel_err(got, want)
    ok = bool(err < tol and np.isfinite(err))
    print(f"  check {name}: rel err {err:.2e} ({'ok' if ok else 'FAIL'}, tol {tol:.0e})")
    return ok


def check(name: str, got, want, tol: float) -> None:
    """``close`` or raise ``Mismatch``: nothing is timed that is not right."""
    if not close(name, got, want, tol):
        raise Mismatch(f"{name}: output differs from the reference")


# --------------------------------------------------------------------------- timing


def median_time(fn: Callable[[], Any], reps: int, calls: int = 1) -> float:
    """Seconds a call: the median over ``reps`` of ``calls`` back-to-back calls of ``fn``
    (which must not block) and one sync, after two warm-up calls (compile, autotune)."""
    jax.block_until_ready(fn())
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


def time_variants(row: Row, measures: dict[str, Callable[[], float]]) -> None:
    """Run each variant's ``measure()`` (check it, then time it: seconds) and record it on
    ``row``; a variant that fails to compile or mismatches is reported and skipped."""
    for name, measure in measures.items():
        try:
            seconds = measure()
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"    {row.case} variant {name}: FAILED {type(e).__name__}: {str(e)[:600]}")
            continue
        row.variants[name] = seconds
        print(
            f"    {row.case} variant {name}: {seconds * 1e6:.1f} us = "
            f"{row.roof / seconds:.1%} of roofline",
            flush=True,
        )


# --------------------------------------------------------------------------- decode steps


class Pools:
    """Donated pools (the state a decode step updates), one per timed program, threaded
    through that program's calls."""

    def __init__(self, host_pool: np.ndarray, dtype):
        self.host, self.dtype, self.live = host_pool, dtype, {}

    def fresh(self) -> jax.Array:
        return jnp.asarray(self.host, self.dtype)

    def caller(self, key: str, fn, inputs) -> Callable[[], Any]:
        """A call of ``fn(pool, inputs) -> (pool, ys)`` on pool ``key``, returning ``ys``."""
        self.live[key] = self.fresh()

        def call():
            self.live[key], ys = fn(self.live[key], inputs)
            return ys

        return call


def decode_program(op):
    """``steps`` calls of ``op(pool, *inputs_i) -> (y_i, pool)`` in one jitted program.

    Each step's inputs are separate arguments and each ``y_i`` a separate output, so the
    program is exactly ``steps`` kernel launches, like SGLang's captured graph: no slice of
    stacked inputs or update of a stacked output per step (a ``lax.scan`` adds both).
    """
    step = jax.jit(op)  # one lowering of the kernel, called once a step

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
    engine's decode step, whose GPU is busy 95 % of a batch-1 step; the steps' span on the
    device is then what they cost inside a whole program, without the host's per-launch
    time. Every op's step takes the slots (or sequence bounds) last: step 0's are gated."""
    step = jax.jit(op)

    def run(pool, inputs, lead_a, lead_b):
        lead = lead_a @ lead_b
        gate = (lead[0, 0] > jnp.inf).astype(jnp.int32)  # always 0, not foldable
        ys = []
        for i, step_inputs in enumerate(inputs):
            if i == 0:
                step_inputs = (*step_inputs[:-1], step_inputs[-1] + gate)
            y, pool = step(pool, *step_inputs)
            ys.append(y)
        return pool, ys, lead[0, 0]

    return jax.jit(run, donate_argnums=0)


class BusySteps(NamedTuple):
    """What ``Table.time_busy`` needs to time a case's steps inside a busy program."""

    ops: dict[str, Callable]  # label -> op(pool, *inputs_i) -> (y_i, pool); "ours" first
    pools: Pools
    inputs: list[tuple]
    steps: int


def busy_time(op, pools: Pools, inputs, steps: int) -> tuple[float, float, float]:
    """The steps' device span and kernel time (seconds a step) and kernels a step inside a
    busy program, from a ``jax.profiler`` trace of one call after a warm-up."""
    from trace_summary import device_kernel_events, load_trace_events, steps_after_lead_in

    fn = busy_program(op)
    lead_a = jax.random.normal(jax.random.key(1), (8192, 8192), ACT)
    lead_b = jax.random.normal(jax.random.key(2), (8192, 32768), ACT)  # 4.4 TFLOP
    pool, ys, _ = fn(pools.fresh(), inputs, lead_a, lead_b)
    jax.block_until_ready(ys)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            pool, ys, _ = fn(pool, inputs, lead_a, lead_b)
            jax.block_until_ready(ys)
        events = device_kernel_events(load_trace_events(trace_dir))
    span, busy, kernels = steps_after_lead_in(events, steps)
    return span * 1e-6, busy * 1e-6, kernels


def time_decode(
    case: str,
    step_op: Callable[..., Callable],
    checked: Callable[[str, Callable], None],
    pools: Pools,
    inputs: list[tuple],
    *,
    args: argparse.Namespace,
    max_calls: int,
    roof: float,
    variants: dict[str, Callable],
) -> tuple[Row, BusySteps | None]:
    """Check and time our decode program and the reference's (``len(inputs)`` steps a
    program, programs back to back up to ``max_calls`` steps), then each variant kernel,
    checked before it is timed. ``step_op(impl=..., kernel=...)`` makes one step;
    ``checked(name, program)`` checks a program's outputs. Returns the row (seconds a step)
    and what ``Table.time_busy`` needs."""
    steps = len(inputs)
    ours_fn = decode_program(step_op(impl=kernel_impl(args)))
    ref_fn = decode_program(step_op(impl="ref"))
    checked("ours", ours_fn)
    if not args.smoke:
        graphed = uses_command_buffer(ours_fn, pools.fresh(), inputs)
        print(f"    ours: XLA command buffer (CUDA graph) = {graphed}")
    calls = max(1, max_calls // steps)

    def timed(key, fn):
        return median_time(pools.caller(key, fn, inputs), args.reps, calls) / steps

    row = Row(case, ours=timed("ours", ours_fn), xla=timed("ref", ref_fn), roof=roof)

    def measure(name, kernel):
        fn = decode_program(step_op(kernel=kernel))
        checked(name, fn)
        return timed(name, fn)

    time_variants(row, {name: functools.partial(measure, name, k) for name, k in variants.items()})
    pools.live.clear()
    if args.smoke:  # the profiler sees no device kernels on CPU
        return row, None
    ops = {"ours": step_op(impl=kernel_impl(args))}
    ops.update({f"variant {name}": step_op(kernel=variants[name]) for name in row.variants})
    return row, BusySteps(ops, pools, inputs, steps)


# --------------------------------------------------------------------------- SGLang (torch)


@functools.cache
def sglang_kernel(module: str, name: str) -> Callable | None:
    """``sglang.kernels.ops.mamba.<module>.<name>``, or None (saying why, once) where SGLang's
    files are not on ``PYTHONPATH`` or torch has no CUDA device."""
    try:
        import importlib

        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
        return getattr(importlib.import_module(f"{SGLANG_MAMBA}.{module}"), name)
    except (ImportError, AttributeError) as e:
        print(f"SGLang's {module}.{name} not importable ({e}); timing ours and XLA's only")
        return None


def to_torch(a, dtype=None):
    """A host or device array as a CUDA tensor (through float32), cast to ``dtype``."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32))).cuda()
    return t if dtype is None else t.to(dtype)


def torch_time(fn: Callable[[], Any], reps: int, cold: bool = False) -> float:
    """Median device seconds of ``fn()`` between two CUDA events. ``cold``: a 512 MB read
    before each repetition (outside the events) leaves L2 without the last one's data, as our
    busy programs start after a lead-in matmul that streams ~640 MB through it."""
    import torch

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


def cuda_graph(calls: Callable[[], Any]) -> Callable[[], None]:
    """Capture ``calls()`` in a CUDA graph (after a warm-up outside it); returns its replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # Triton compiles here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph.replay


def sglang_steps_time(
    case: str, step: Callable[[int], Any], steps: int, reps: int, want_y0, peer: str = "sglang"
):
    """SGLang's (or another ``peer``'s torch kernels') seconds a decode step. ``step(i)``
    runs step ``i`` and returns its output; step 0's is checked against ``want_y0`` first.
    Then ``step(0..steps-1)`` are captured in one CUDA graph, replayed from a cold L2
    (``torch_time``), as ours runs after the lead-in: a replay whose data fits in L2 (the conv
    update at batch 1 touches ~32 MB) would otherwise be served from the last replay's lines.
    The warm figure is printed beside it."""
    import torch

    y0 = step(0)
    torch.cuda.synchronize()
    check(f"{peer} {case} y (step 0)", y0.float().cpu().numpy(), want_y0, 1e-2)
    replay = cuda_graph(lambda: [step(i) for i in range(steps)])
    cold = torch_time(replay, reps, cold=True) / steps
    warm = torch_time(replay, reps) / steps
    print(f"  {peer} {case}: {cold * 1e6:.2f} us a step from a cold L2, {warm * 1e6:.2f} warm")
    return cold


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class Row:
    """One case's result, in seconds a call (a step, for decode cases)."""

    case: str
    ours: float
    xla: float
    roof: float
    peer: float | None = None  # the peer's kernel (the Table's `peer`: SGLang's, fla's)
    in_program: float | None = None  # ours inside a busy program (``Table.time_busy``)
    variants: dict[str, float] = dataclasses.field(default_factory=dict)


class Table:
    """The rows of one run: printed as they come, timed inside busy programs at the end
    (``time_busy``), then printed as one markdown table."""

    def __init__(self, peer: str = "SGLang"):
        self.peer = peer  # whose kernels the rows' `peer` times are
        self.rows: list[Row] = []
        self.busy: list[tuple[Row, BusySteps]] = []

    def add(self, row: Row, busy: BusySteps | None = None) -> None:
        """Record and print ``row``; ``busy``: its steps, to time in a busy program later."""
        self.rows.append(row)
        if busy is not None:
            self.busy.append((row, busy))
        peer = self.peer.lower()
        sgl = f"{row.peer * 1e6:9.1f}" if row.peer else "      n/a"
        ratio = f"{row.peer / row.ours:5.2f}x" if row.peer else "  n/a"
        print(
            f"  {row.case:28s} ours {row.ours * 1e6:9.1f} us | xla {row.xla * 1e6:9.1f} | "
            f"{peer} {sgl} | {peer}/ours {ratio} | roofline {row.roof * 1e6:7.1f} us = "
            f"{row.roof / row.ours:6.1%} of ours",
            flush=True,
        )

    def time_busy(self) -> None:
        """Time each recorded case's steps inside a busy program (``busy_time``), ours and
        each variant; ours goes into ``Row.in_program``. Runs after every SGLang timing: once
        the profiler has run, torch's CUDA-graph capture fails in this process."""
        if self.busy:
            print("\nSteps inside a busy program (as the engine's programs run them):")
        for row, busy in self.busy:
            for label, op in busy.ops.items():
                try:
                    span, kernels, per_step = busy_time(op, busy.pools, busy.inputs, busy.steps)
                except Exception as e:  # noqa: BLE001 - report and go on with the others
                    print(f"  {row.case} {label} in a busy program: FAILED {type(e).__name__}: {e}")
                    continue
                ratio = f"{self.peer}/ours {row.peer / span:5.2f}x | " if row.peer else ""
                print(
                    f"  {row.case:20s} {label:32s} in a busy program: span {span * 1e6:8.1f} us "
                    f"a step, kernels {kernels * 1e6:8.1f} us ({per_step:.2f} a step) | {ratio}"
                    f"{row.roof / span:6.1%} of roofline",
                    flush=True,
                )
                if label == "ours":
                    row.in_program = span
        self.busy.clear()

    def print_markdown(self) -> None:
        """The rows as a markdown table (times in µs); columns no row fills are left out."""
        columns = {
            "case": lambda r: r.case,
            "ours (us)": lambda r: f"{r.ours * 1e6:.1f}",
            "ours in a busy program (us)": lambda r: _us(r.in_program),
            "XLA ref (us)": lambda r: f"{r.xla * 1e6:.1f}",
            "XLA/ours": lambda r: f"{r.xla / r.ours:.2f}",
            f"{self.peer} (us)": lambda r: _us(r.peer),
            f"{self.peer}/ours": lambda r: f"{r.peer / r.ours:.2f}" if r.peer else "-",
            f"{self.peer}/ours in program": lambda r: (
                f"{r.peer / r.in_program:.2f}" if r.peer and r.in_program else "-"
            ),
            "roofline (us)": lambda r: f"{r.roof * 1e6:.1f}",
            "% of roofline (best of ours)": lambda r: (
                f"{r.roof / min(r.ours, r.in_program or r.ours):.0%}"
            ),
        }
        cells = {name: [cell(r) for r in self.rows] for name, cell in columns.items()}
        shown = [name for name, col in cells.items() if any(c != "-" for c in col)]
        print("\n| " + " | ".join(shown) + " |")
        print("|" + "---|" * len(shown))
        for i in range(len(self.rows)):
            print("| " + " | ".join(cells[name][i] for name in shown) + " |")

    def finish(self, args: argparse.Namespace) -> None:
        """Time the busy programs, print the table and write ``--json``."""
        self.time_busy()
        self.print_markdown()
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(r) for r in self.rows], f, indent=1)


def _us(seconds: float | None) -> str:
    return f"{seconds * 1e6:.1f}" if seconds else "-"


def main_for(
    description: str,
    cases: dict[str, Callable],
    add_args: Callable | None = None,
    peer: str = "SGLang",
) -> None:
    """The ``main`` of a benchmark script: the common options, ``add_args``' own and
    ``--cases`` (a subset of ``cases``: name -> ``run(args, table)``), then the chosen cases'
    rows into one table (``peer``: whose kernels the rows compare with)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--cases", default=",".join(cases), help="comma-separated subset")
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(cases)
    if unknown:
        parser.error(f"unknown --cases {sorted(unknown)}; choose from {list(cases)}")
    start(args)
    table = Table(peer)
    for name in args.cases.split(","):
        cases[name](args, table)
    table.finish(args)
