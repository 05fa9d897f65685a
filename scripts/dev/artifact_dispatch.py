"""The host cost of dispatching an artifact's decode step: the call of the exported step with
the host `StepInputs` arrays as they are, against one `jax.device_put` of the list first.
Exports a small `nemotron-h-tiny` artifact on first use.

    python scripts/dev/artifact_dispatch.py --artifact /tmp/art32 --rows 32
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="an artifact directory (made if missing)")
    ap.add_argument("--rows", type=int, default=32, help="decode rows (max_num_seqs)")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()

    from jaxmamba import LLM
    from jaxmamba.export.writer import export_artifact

    if not Path(args.artifact).exists():
        engine = dict(max_num_seqs=args.rows, max_model_len=64, max_num_batched_tokens=64)
        export_artifact("nemotron-h-tiny", args.artifact, engine=engine)
    llm = LLM(args.artifact, compilation_cache=False)
    runner = llm.runner
    bucket = next(b for b in llm.engine.scheduler.all_buckets()
                  if b.num_decode == b.num_rows == args.rows)  # fmt: skip
    leaves = jax.tree.leaves(llm.engine.builder.padding(bucket))
    step = runner._step((bucket.num_tokens, bucket.num_rows, bucket.num_decode), "plain")

    def call(put: bool):
        inputs = jax.device_put(leaves) if put else leaves
        packed, runner.cache, runner.slot_state = step(runner.params, runner.cache,
                                                       runner.slot_state, inputs)  # fmt: skip
        return packed

    for put in (True, False, True, False):  # alternated: the container's load drifts
        jax.block_until_ready(call(put))
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            out = call(put)
            times.append(time.perf_counter() - start)
            jax.block_until_ready(out)
        name = "device_put of the list" if put else "host arrays as they are"
        print(f"{name:24s} call median {np.median(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
