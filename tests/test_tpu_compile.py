"""The Mosaic TPU kernels compile with the real TPU compiler (libtpu), without a TPU.

``scripts/setup_tpu_venv.sh`` makes (once, in a cache folder CI can keep) a venv with
``jax[tpu]`` at this project's jax version; ``scripts/tpu_compile_kernels.py`` then lowers and
compiles every TPU kernel for a deviceless ``v6e:2x2`` topology in that venv. Skipped only if
libtpu cannot be installed (no network and no cached venv).
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
        pytest.skip(f"libtpu (jax[tpu]) could not be installed: {setup.stderr[-2000:]}")
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
