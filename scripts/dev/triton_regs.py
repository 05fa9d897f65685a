"""Registers, spills, memory instructions and loop loads of the Triton-lowered GPU kernels, on
a machine without a GPU: each Pallas kernel is lowered for CUDA (``jax.export``), its Triton
IR compiled by a standalone Triton for sm_90a and assembled by Triton's ``ptxas``.

The project's environment has no Triton; give a Python that has one (any 3.x; the device
runs XLA's own Triton, so the counts are a close proxy, not the device's exact numbers):

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.6.0
    python scripts/dev/triton_regs.py --triton-python /tmp/tv/bin/python --kernel conv \\
        "tokens=4, channels=1024, num_warps=4" "tiles=8"
    python scripts/dev/triton_regs.py --triton-python /tmp/tv/bin/python --kernel ssd \\
        "" "out_heads=8"

Each argument is the kernel's block-size fields (the ``VarlenGpuBlockSizes`` of
``jaxmamba.kernels.conv1d.gpu``, the ``GpuBlockSizes`` of ``ssd.gpu`` and
``state_update.gpu``); an empty one is the default. Shapes are Nemotron-H 9B's, as in the
benchmarks. Per Pallas call it prints registers, spilled bytes, shared memory, SASS
load/store/barrier counts, its MMA instructions (``HGMMA``: warpgroup MMA, wgmma; ``HMMA``:
mma.sync) and, for a kernel with a loop, the loads in the loop body after Triton's
pipeliner: ``async`` copies are prefetched for a later iteration, ``sync`` loads are waited
on in the iteration that issues them (tensor loads the pipeliner moved a step ahead show up
as ``sync`` too, see the TTGIR).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxmamba.kernels.conv1d import gpu as conv_gpu
from jaxmamba.kernels.ssd import gpu as ssd_gpu
from jaxmamba.kernels.state_update import gpu as state_update_gpu

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
H, P, G, N, DIM, K = 128, 80, 8, 128, 12288, 4


def shapes(*specs):
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]


def conv_case(fields):
    sizes = conv_gpu.VarlenGpuBlockSizes(**fields)
    tokens, seqs = 16384, 8

    def step(x, w, b, cu, init):
        return conv_gpu.causal_conv1d_varlen_gpu(
            x, w, b, cu, initial_states=init, block_sizes=sizes
        )[:2]

    avals = shapes(
        ((tokens, DIM), BF16), ((K, DIM), BF16), ((DIM,), BF16), ((seqs + 1,), I32),
        ((seqs, K - 1, DIM), BF16),
    )  # fmt: skip
    return conv_gpu, step, avals


def ssd_case(fields):
    sizes = ssd_gpu.GpuBlockSizes(**fields)
    tokens = 8192

    def step(x, dt, a, b, c, cu):
        return ssd_gpu.ssd_varlen_gpu(x, dt, a, b, c, cu, chunk_size=128, block_sizes=sizes)[:2]

    avals = shapes(
        ((tokens, H, P), BF16), ((tokens, H), BF16), ((H,), F32), ((tokens, G, N), BF16),
        ((tokens, G, N), BF16), ((2,), I32),
    )  # fmt: skip
    return ssd_gpu, step, avals


def ssu_case(fields):
    sizes = state_update_gpu.GpuBlockSizes(**fields)
    rows, slots = 32, 513

    def step(state, x, dt, a, b, c, slot_ids, d, bias):
        return state_update_gpu.selective_state_update_gpu(
            state, x, dt, a, b, c, slot_ids, D=d, dt_bias=bias, block_sizes=sizes
        )

    avals = shapes(
        ((slots, H, P, N), F32), ((rows, H, P), BF16), ((rows, H), BF16), ((H,), F32),
        ((rows, G, N), BF16), ((rows, G, N), BF16), ((rows,), I32), ((H,), F32), ((H,), F32),
    )  # fmt: skip
    return state_update_gpu, step, avals


CASES = {"conv": conv_case, "ssd": ssd_case, "ssu": ssu_case}

COMPILE = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
open(path + ".ptx", "w").write(kernel.asm["ptx"])
open(path + ".ttgir", "w").write(kernel.asm["ttgir"])
print(kernel.metadata.shared)
print(triton.__file__)
"""


def triton_modules(kind: str, spec: str) -> list[tuple[str, str, int, int]]:
    """(name, Triton IR without locations, warps, stages) of every Pallas call of the kernel
    at these block sizes, in call order."""
    fields = dict(eval(f"dict({spec})"))  # noqa: S307 - the user's own command line
    module, step, avals = CASES[kind](fields)
    real_pallas_call = pl.pallas_call
    params = {}

    def printing_pallas_call(*args, **kwargs):
        compiler = kwargs.get("compiler_params")
        params[kwargs.get("name")] = (compiler.num_warps, compiler.num_stages)
        return real_pallas_call(*args, **{**kwargs, "debug": True})

    printed = io.StringIO()
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(module.pl, "pallas_call", printing_pallas_call):
        with contextlib.redirect_stdout(printed):
            jax.export.export(jax.jit(step), platforms=("cuda",), disabled_checks=disabled)(*avals)
    text = printed.getvalue()
    for pattern in (r" \[unknown\]", r' "[^"\n]*"\(#loc\d*\)', r" \(#loc\d*\)", r"^#loc.*$"):
        text = re.sub(pattern, "", text, flags=re.M)
    found = []
    for start in [m.start() for m in re.finditer(r"^module @", text, flags=re.M)]:
        lines = [line.rstrip() for line in text[start:].split("\n")]
        ir = "\n".join(lines[: lines.index("}") + 1])  # the module ends at a bare brace
        name = re.search(r"tt.func public @(\w+)", ir).group(1)
        warps, stages = params.get(name, (4, 1))
        found.append((name, ir, warps, stages))
    return found


def loop_loads(ttgir: str) -> str:
    """Loads inside the first ``scf.for`` of the compiled TTGIR: async copies and the rest."""
    body = ttgir[ttgir.index("scf.for") :] if "scf.for" in ttgir else ""
    body = body[: body.index("scf.yield")] if "scf.yield" in body else ""
    copies = len(re.findall(r"async_copy_global_to_local", body))
    loads = len(re.findall(r"= tt\.load ", body))
    return f"; loop body: {copies} async, {loads} sync loads" if body else ""


def report(name: str, ir: str, warps: int, stages: int, triton_python: str, workdir: str) -> str:
    path = os.path.join(workdir, f"{name}_{abs(hash(ir))}.ttir")
    with open(path, "w") as f:
        f.write(ir)
    out = subprocess.run(
        [triton_python, "-c", COMPILE, path, str(warps), str(stages)],
        capture_output=True,
        text=True,
        check=True,
    )
    shared, triton_file = out.stdout.split()[-2:]
    bin_dir = os.path.join(os.path.dirname(triton_file), "backends", "nvidia", "bin")
    cubin = path + ".cubin"
    ptxas = subprocess.run(
        [os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", path + ".ptx", "-o", cubin],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    sass = subprocess.run(
        [os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True
    ).stdout
    regs = re.search(r"Used (\d+) registers", ptxas).group(1)
    spills = re.search(r"(\d+) bytes spill stores", ptxas).group(1)
    ops = ("LDG", r"LDG\.E\.128", "STG", "BAR", "LDL", "HGMMA", "HMMA")
    counts = {op: len(re.findall(op, sass)) for op in ops}
    counts = " ".join(f"{op.replace(chr(92), '')} {n}" for op, n in counts.items())
    with open(path + ".ttgir") as f:
        loops = loop_loads(f.read())
    return (
        f"  {name} ({warps} warps, {stages} stages): {regs} registers, {spills} B spilled, "
        f"{int(shared) // 1024} KiB shared; "
        f"SASS {counts}{loops}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("specs", nargs="*", default=[""])
    parser.add_argument("--kernel", choices=sorted(CASES), default="conv")
    parser.add_argument("--triton-python", default=sys.executable)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for spec in args.specs:
            print(f"{args.kernel} {spec or 'default'}:", flush=True)
            for name, ir, warps, stages in triton_modules(args.kernel, spec):
                print(report(name, ir, warps, stages, args.triton_python, workdir), flush=True)


if __name__ == "__main__":
    main()
