"""The Mosaic TPU kernels compile with the real TPU compiler (libtpu), without a TPU.

``scripts/setup_tpu_venv.sh`` makes (once, in a cache folder CI can keep) a venv with
``jax[tpu]`` at this project's jax version; ``scripts/tpu_compile_kernels.py`` then lowers and
compiles every TPU kernel for a deviceless ``v6e:2x2`` topology in that venv. If libtpu cannot
be installed (no network and no cached venv) the tests fail: CI can always install it, so a
missing libtpu there is a broken setup, not a reason to skip. A developer without network skips
them explicitly with ``JAXMAMBA_ALLOW_NO_TPU=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = (
    "selective_state_update",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "paged_attention_prefill",
    "paged_attention_decode",
    "gdn_prefill",
    "gdn_decode",
)


@pytest.fixture(scope="module")
def tpu_python() -> str:
    setup = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_tpu_venv.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if setup.returncode != 0:
        reason = f"libtpu (jax[tpu]) could not be installed: {setup.stderr[-2000:]}"
        if os.environ.get("JAXMAMBA_ALLOW_NO_TPU") == "1":
            pytest.skip(reason)
        pytest.fail(f"{reason}\n(without network, set JAXMAMBA_ALLOW_NO_TPU=1 to skip these tests)")
    return setup.stdout.strip().splitlines()[-1]


def test_tpu_kernels_compile_with_libtpu(tpu_python):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="")
    run = subprocess.run(
        [tpu_python, str(ROOT / "scripts" / "tpu_compile_kernels.py"), "--topology", "v6e:2x2"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    output = run.stdout + run.stderr[-4000:]
    assert run.returncode == 0, output
    for name in EXPECTED:
        assert f"OK {name}" in run.stdout, output


SSD_SCRIPT = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxmamba.kernels import ssd_varlen
topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2")
sh = NamedSharding(Mesh([topo.devices[0]], ("x",)), PartitionSpec())
T, H, P, G, N, S = 512, 8, 64, 1, 128, 2
spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
fn = jax.jit(lambda x, dt, a, b, c, cu: ssd_varlen(x, dt, a, b, c, cu, chunk_size=128,
                                                   impl="pallas_tpu"))
lowered = fn.lower(spec((T, H, P)), spec((T, H)), spec((H,), jnp.float32), spec((T, G, N)),
                   spec((T, G, N)), spec((S + 1,), jnp.int32))
assert "tpu_custom_call" in lowered.as_text()
lowered.compile()
print("OK ssd_varlen")
"""


def _tpu_env():
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="")


def test_ssd_scan_kernel_compiles_with_libtpu(tpu_python):
    run = subprocess.run([tpu_python, "-c", SSD_SCRIPT], capture_output=True, text=True,
                         timeout=600, env=_tpu_env(), cwd=ROOT)  # fmt: skip
    assert run.returncode == 0 and "OK ssd_varlen" in run.stdout, run.stderr[-4000:]


def test_whole_model_steps_compile_deviceless_with_libtpu(tpu_python):
    """`jaxmamba aot`: the tiny model's decode and prefill steps (Pallas kernels included)
    compiled for one v6e chip, with memory and cost reported."""
    cmd = [tpu_python, "-m", "jaxmamba.cli", "aot", "--model", "nemotron-h-tiny",
           "--topology", "v6e:2x2", "--max-num-seqs", "1", "--max-model-len", "32",
           "--max-num-batched-tokens", "16", "--buckets", "1x1x1", "16x1x0"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_tpu_env(),
                         cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = {line.split()[0]: line for line in run.stdout.splitlines() if line.startswith("T=")}
    assert set(lines) == {"T=1", "T=16"}, run.stdout
    assert "2/2 programs fit one v6e chip's HBM" in run.stdout
    kernels = {k: v.split(" kernels ")[1].split()[0].split(",") for k, v in lines.items()}
    # Decode: the conv and state updates of the Mamba layers, paged attention; prefill: the
    # varlen conv and the SSD scan, paged attention.
    assert {"causal_conv1d_update", "selective_state_update", "paged_attention_tpu"} <= set(
        kernels["T=1"]
    ), lines
    assert {"causal_conv1d_varlen", "ssd_varlen_tpu", "paged_attention_tpu"} <= set(
        kernels["T=16"]
    ), lines
    for line in lines.values():
        assert "GFLOP" in line and "ms/step" in line and "fits" in line


def test_gdn_model_steps_compile_deviceless_with_libtpu(tpu_python):
    """`jaxmamba aot` on a Gated DeltaNet hybrid: the tiny Qwen3-Next's decode and prefill
    steps with the GDN kernels compiled for one v6e chip."""
    cmd = [tpu_python, "-m", "jaxmamba.cli", "aot", "--model", "qwen3-next-tiny",
           "--topology", "v6e:2x2", "--max-num-seqs", "1", "--max-model-len", "128",
           "--max-num-batched-tokens", "64", "--buckets", "1x1x1", "64x1x0"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_tpu_env(),
                         cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = {line.split()[0]: line for line in run.stdout.splitlines() if line.startswith("T=")}
    assert set(lines) == {"T=1", "T=64"}, run.stdout
    assert "2/2 programs fit one v6e chip's HBM" in run.stdout
    kernels = {k: set(v.split(" kernels ")[1].split()[0].split(",")) for k, v in lines.items()}
    assert {"causal_conv1d_update", "gdn_decode_tpu"} <= kernels["T=1"], lines
    assert {"causal_conv1d_varlen", "gdn_prefill_tpu"} <= kernels["T=64"], lines


def test_int8_model_with_fp8_pages_compiles_deviceless_with_libtpu(tpu_python):
    """`jaxmamba aot --quantization int8 --kv-cache-dtype fp8`: the tiny model's decode and
    prefill steps with int8 weights (weight-only: converted in the step, the TPU's MXU has no
    FP8) and FP8 KV pages (upcast tile by tile in the Mosaic attention kernel) compile for one
    v6e chip."""
    cmd = [tpu_python, "-m", "jaxmamba.cli", "aot", "--model", "nemotron-h-tiny",
           "--topology", "v6e:2x2", "--max-num-seqs", "1", "--max-model-len", "32",
           "--max-num-batched-tokens", "16", "--buckets", "1x1x1", "16x1x0",
           "--quantization", "int8", "--kv-cache-dtype", "fp8"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_tpu_env(),
                         cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "int8 weights, fp8 KV cache" in run.stdout, run.stdout
    assert "kv_dtype='fp8'" in run.stdout, run.stdout
    assert "2/2 programs fit one v6e chip's HBM" in run.stdout, run.stdout
    lines = [line for line in run.stdout.splitlines() if line.startswith("T=")]
    assert len(lines) == 2 and all("paged_attention_tpu" in line for line in lines), lines
