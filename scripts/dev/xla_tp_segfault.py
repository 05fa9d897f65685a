"""XLA segfaults compiling a `jax.shard_map` that takes a zero-sized operand (JAX 0.11.2).

A zero-sized NumPy constant closed over by a shard_map body becomes an operand of the
`sdy.manual_computation`. `jnp` makes one without being asked: `x.at[:n].set(y)` with `n =
len(x)` is a scatter whose index array is `np.zeros((0,), int32)`. Compiling that program
with Shardy (the default partitioner) ends in SIGSEGV inside `backend_compile_and_load`.
In the spmd-partitioner pipeline, `zero_sized_hlo_elimination` replaces the zero-sized
operand (and its uses in the body) with constants; then the `shardy-xla` pass's MLIR
canonicalizer crashes in `mlir::sdy::ManualComputationUnusedInputsPattern::matchAndRewrite`
(gdb backtrace, jaxlib 0.11.2 CPU), on the now unused input.

    jax/jaxlib 0.11.2 (CPU; Python 3.12)   "scatter" and "const" segfault; with
                                           jax_use_shardy_partitioner=False (GSPMD) both run
    jax/jaxlib 0.10.2 (CPU; Python 3.11)   both run (the same StableHLO)

In the engine, the TP steps where every row decodes met it through `.at[:num_decode].set`
(`model/step.py::_input_ids` uses a `dynamic_update_slice` instead). Each case runs in a
child process, on 2 virtual CPU devices:

    python scripts/dev/xla_tp_segfault.py                # every case, with and without Shardy
    python scripts/dev/xla_tp_segfault.py scatter --hlo  # one case in this process, its StableHLO
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

CASES = ("scatter", "const", "control")


def run_case(case: str, shardy: bool, show_hlo: bool) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    jax.config.update("jax_use_shardy_partitioner", shardy)
    empty = np.zeros((0,), np.int32)
    bodies = {
        "scatter": lambda x: x.at[: x.shape[0]].set(x + 1),  # index: int32[0] constant
        "const": lambda x: jnp.concatenate([x, empty]),  # a closed-over int32[0]
        "control": lambda x: x.at[: x.shape[0] - 1].set(x[:-1] + 1),  # index: int32[1]
    }
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    fn = jax.jit(jax.shard_map(bodies[case], mesh=mesh, in_specs=PartitionSpec(),
                               out_specs=PartitionSpec()))  # fmt: skip
    x = jnp.arange(4, dtype=jnp.int32)
    lowered = fn.lower(x)
    if show_hlo:
        print(lowered.as_text())
    print(lowered.compile()(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", choices=CASES, help="run one case in this process")
    parser.add_argument("--gspmd", action="store_true", help="jax_use_shardy_partitioner=False")
    parser.add_argument("--hlo", action="store_true", help="print the lowered StableHLO")
    args = parser.parse_args()
    if args.case is not None:
        run_case(args.case, shardy=not args.gspmd, show_hlo=args.hlo)
        return
    import jax
    import jaxlib

    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {sys.version.split()[0]}")
    crashed = False
    for case in CASES:
        for gspmd in (False, True):
            cmd = [sys.executable, __file__, case] + ["--gspmd"] * gspmd
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            rc = proc.returncode
            what = "ok" if rc == 0 else f"exit {rc}"
            if rc == -signal.SIGSEGV:
                what, crashed = "SIGSEGV", True
            print(f"{case:8} {'gspmd' if gspmd else 'shardy':7} {what}")
    sys.exit(1 if crashed else 0)


if __name__ == "__main__":
    main()
