"""The host cost of the all-allowing token bitmask the runner gives every FULL step without a
constrained row (`StepRunner._with_bitmask`; docs/structured_outputs.md): per decode step of
`--rows` rows and a `--vocab` vocabulary, the step's packing (`PackedStepInputs.pack`, one
int32 buffer) with and without the bitmask, and the bitmask's lookup alone; for comparison, a
fresh all-ones array per step (what the cached one avoids). No model, no device work: the
runner's own method on padding inputs (`step_contract.padding`).

Medians (and minima) in µs over `--repeats` calls; the host-to-device copy of the extra bytes
(B·ceil(V/32)·4) is not timed here.

    PYTHONPATH=. python3 scripts/bench_bitmask_host.py [--rows 128 192] [--vocab 131072]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from jaxmamba.engine.runner import FULL, StepRunner
from jaxmamba.model.metadata import PackedStepInputs
from jaxmamba.step_contract import CacheSpec, padding
from jaxmamba.structured.bitmask import bitmask_words


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median, minimum) µs of `fn()`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6, min(times) * 1e6


def measure(runner: StepRunner, rows: int, pages_per_seq: int, repeats: int) -> str:
    spec = CacheSpec(num_slots=256, num_pages=8192, page_size=16)
    x = padding(rows, rows, pages_per_seq, spec)  # a decode step
    bucket = (rows, rows, rows)
    runner._with_bitmask(x, bucket, FULL)  # the cached mask, made once
    plain = timed(lambda: PackedStepInputs.pack(x), repeats)
    masked = timed(lambda: PackedStepInputs.pack(runner._with_bitmask(x, bucket, FULL)), repeats)
    lookup = timed(lambda: runner._with_bitmask(x, bucket, FULL), repeats)
    words = bitmask_words(runner.cfg.vocab_size)
    fresh = timed(lambda: np.full((rows, words), -1, np.int32), repeats)
    return (f"B={rows}: mask {rows * words * 4 / 2**20:.1f} MiB; pack {plain[0]:.0f} µs (min "
            f"{plain[1]:.0f}) without, {masked[0]:.0f} µs (min {masked[1]:.0f}) with: "
            f"+{masked[0] - plain[0]:.0f} µs; lookup {lookup[0]:.1f} µs; a fresh all-ones "
            f"array {fresh[0]:.0f} µs")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 192])
    ap.add_argument("--vocab", type=int, default=131072)  # nemotron-nano-9b-v2
    ap.add_argument("--pages-per-seq", type=int, default=512)  # 8192 tokens, 16-token pages
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()

    runner = StepRunner()
    runner.cfg = SimpleNamespace(vocab_size=args.vocab)
    print(f"vocab {args.vocab} ({bitmask_words(args.vocab)} words a row), "
          f"{args.pages_per_seq} pages a row")  # fmt: skip
    for rows in args.rows:
        print(measure(runner, rows, args.pages_per_seq, args.repeats))


if __name__ == "__main__":
    main()
