"""Running a test file's own script in a subprocess with forced host (CPU) devices: the way
the tensor-parallel tests get a mesh on a CPU-only machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_with_host_devices(script: str, out: Path, timeout: int, count: int = 4):
    """Run `python script out` with `count` host devices and return the JSON it writes to
    `out`; a non-zero exit fails the test with the subprocess's output."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")  # keeps conftest's
    root = Path(__file__).resolve().parents[1]
    # Not the checkout root: its `kernels/` folder would shadow the `kernels` package
    # transformers imports (tests/conftest.py); jaxmamba comes from its install.
    # (An empty entry would stand for the working directory, the root again.)
    paths = [str(root / "tests"), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run(
        [sys.executable, script, str(out)], env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
