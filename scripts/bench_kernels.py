"""Benchmark every kernel on one GPU in one run: the decode state update, the causal conv
(prefill and decode update), the SSD prefill scan, paged attention, the small-M matmul and
the gated norm, each against the XLA reference and, where SGLang's Triton kernels are on
``PYTHONPATH``, against SGLang 0.5.23's; one table at the end.

The cases are the per-op scripts' (``bench_state_update.py``, ``bench_conv.py``,
``bench_ssd.py``, ``bench_attention.py``, ``bench_matmul.py``, ``bench_gated_norm.py``: their
docstrings say what each measures); this script takes all their options. The decode and
conv-prefill cases are also timed inside a busy program at the end of the run, after every
SGLang timing (once the profiler has run, torch's CUDA-graph capture fails): XLA does not put
these programs into CUDA graphs, so at small batch a program's wall time is the host's launch
time, while in the engine's decode step the host runs ahead and a kernel costs its device
time. That span is what compares with SGLang's graph replay.

    PYTHONPATH=$PWD/.sgl python scripts/bench_kernels.py --reps 10 [--sweep] \\
        [--cases state_update,conv_prefill,conv_update,ssd,column_views,attention,matmul,gated_norm]
    python scripts/bench_kernels.py --smoke      # CPU: interpret mode, toy shapes

Setup, SGLang's files and the timing method: see ``bench_common.py``.
"""

from __future__ import annotations

import bench_attention
import bench_common as bc
import bench_conv
import bench_gated_norm
import bench_matmul
import bench_ssd
import bench_state_update

MODULES = (
    bench_state_update,
    bench_conv,
    bench_ssd,
    bench_attention,
    bench_matmul,
    bench_gated_norm,
)


def add_args(parser) -> None:
    for module in MODULES:
        if hasattr(module, "add_args"):
            module.add_args(parser)


if __name__ == "__main__":
    bc.main_for(__doc__, {k: v for m in MODULES for k, v in m.CASES.items()}, add_args)
