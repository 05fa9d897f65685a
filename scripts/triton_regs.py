"""Registers, spills and memory instructions of the GPU varlen conv kernel's variants, on a
machine without a GPU: the Pallas kernel is lowered for CUDA (``jax.export``), its Triton IR
compiled by a standalone Triton for sm_90a and assembled by Triton's ``ptxas``.

The project's environment has no Triton; give a Python that has one (any 3.x; the device
runs XLA's own Triton, so the counts are a close proxy, not the device's exact numbers):

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.6.0
    python scripts/triton_regs.py --triton-python /tmp/tv/bin/python \\
        "variant='tile', tokens=4, channels=1024, warps=4" "variant='rows'"

Each argument is ``ConvVarlenBlockSizes`` fields without the ``gpu_`` prefix (the default
kernel when empty). Shapes: Nemotron-H 9B's conv (T 16384, D 12288, K 4, bf16, 8 sequences
with initial states), as in ``bench_kernels.py``.
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

from jaxmamba.kernels import conv1d_pallas

T, D, K, S = 16384, 12288, 4, 8

COMPILE = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
open(path + ".ptx", "w").write(kernel.asm["ptx"])
print(triton.__file__)
"""


def triton_ir(sizes: conv1d_pallas.ConvVarlenBlockSizes) -> str:
    """The Triton IR (text, locations stripped) of the kernel at these block sizes."""
    real_pallas_call = pl.pallas_call

    def printing_pallas_call(*args, **kwargs):
        return real_pallas_call(*args, **{**kwargs, "debug": True})

    def step(x, w, b, cu, init):
        return conv1d_pallas.causal_conv1d_varlen_gpu(
            x, w, b, cu, initial_states=init, block_sizes=sizes
        )[:2]

    avals = [
        jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((K, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((D,), jnp.bfloat16),
        jax.ShapeDtypeStruct((S + 1,), jnp.int32),
        jax.ShapeDtypeStruct((S, K - 1, D), jnp.bfloat16),
    ]
    printed = io.StringIO()
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(conv1d_pallas.pl, "pallas_call", printing_pallas_call):
        with contextlib.redirect_stdout(printed):
            jax.export.export(jax.jit(step), platforms=("cuda",), disabled_checks=disabled)(*avals)
    text = printed.getvalue()
    text = text[text.index("module @") :]
    text = text[: text.rindex("}") + 1]
    for pattern in (r" \[unknown\]", r' "[^"\n]*"\(#loc\d*\)', r" \(#loc\d*\)", r"^#loc.*$"):
        text = re.sub(pattern, "", text, flags=re.M)
    return text


def report(spec: str, triton_python: str, workdir: str) -> str:
    fields = dict(eval(f"dict({spec})"))  # noqa: S307 - the user's own command line
    sizes = conv1d_pallas.ConvVarlenBlockSizes(**{f"gpu_{k}": v for k, v in fields.items()})
    path = os.path.join(workdir, f"kernel_{abs(hash(spec))}.ttir")
    with open(path, "w") as f:
        f.write(triton_ir(sizes))
    args = [str(sizes.gpu_num_warps), str(sizes.gpu_num_stages)]
    out = subprocess.run(
        [triton_python, "-c", COMPILE, path, *args], capture_output=True, text=True, check=True
    )
    bin_dir = os.path.join(os.path.dirname(out.stdout.strip()), "backends", "nvidia", "bin")
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
    counts = {op: len(re.findall(op, sass)) for op in ("LDG", r"LDG\.E\.128", "STG", "BAR", "LDL")}
    counts = " ".join(f"{op.replace(chr(92), '')} {n}" for op, n in counts.items())
    return f"{spec or 'default'}: {regs} registers, {spills} B spilled; SASS {counts}"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("specs", nargs="*", default=[""])
    parser.add_argument("--triton-python", default=sys.executable)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for spec in args.specs:
            print(report(spec, args.triton_python, workdir), flush=True)


if __name__ == "__main__":
    main()
