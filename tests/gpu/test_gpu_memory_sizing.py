"""Memory sizing against the device: the step temporaries the engine plans for its largest
bucket (what ``LLM`` leaves out of the cache budget) against the bytes the device's allocator
actually peaks at when that bucket runs (``memory_stats()["peak_bytes_in_use"]``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_tier import INTERPRET, skip_unless_gpu

skip_unless_gpu()

PROBE = Path(__file__).with_name("memory_probe.py")
MiB = 1 << 20
# Beside XLA's temporary buffer, a step may hold a few small allocations of its own (the
# sampler's outputs, RNG state): a fixed allowance.
SLACK = 8 * MiB


def test_planned_step_temporaries_cover_the_measured_peak_of_the_largest_bucket():
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # No autotuning: its scratch buffers would set the process's peak while compiling, above
    # the step's own; the probe's figure and its step are compiled alike.
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    cmd = [sys.executable, str(PROBE)] + (["--interpret"] if INTERPRET else [])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    planned = probe["planned_temporaries"]
    assert planned > 0, probe
    if probe["peak_after"] is None:
        pytest.skip(f"no memory_stats on {probe['backend']}: the probe ran, nothing to compare")
    before, peak = probe["in_use_before"], probe["peak_after"]
    assert peak > probe["peak_before"], f"the step did not set the process's peak: {probe}"
    measured = peak - before
    assert measured <= planned * 1.05 + SLACK, (
        f"the step peaked {measured / MiB:.1f} MiB above its arguments; the engine planned "
        f"{planned / MiB:.1f} MiB: {probe}"
    )
    assert planned <= 2 * measured + SLACK, (
        f"the engine planned {planned / MiB:.1f} MiB of step temporaries, more than twice the "
        f"{measured / MiB:.1f} MiB measured: {probe}"
    )
