"""The benchmarks' profiler-trace readers (``scripts/trace_summary.py``) on synthetic traces:
only the kernels on the device's stream threads count, and busy/span per step follow from
their times."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from trace_summary import (  # noqa: E402
    device_kernel_events,
    load_trace_events,
    steps_after_lead_in,
    summarize_trace,
)


def write_trace(folder, events):
    run = folder / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def meta(kind, pid, name, tid=None):
    event = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    return event if tid is None else {**event, "tid": tid}


def test_device_kernels_and_summary(tmp_path):
    events = [
        meta("process_name", 1, "/host:CPU"),
        meta("thread_name", 1, "Stream #9", tid=1),  # a host thread with a stream-like name
        meta("process_name", 2, "/device:GPU:0"),
        meta("thread_name", 2, "Stream #13(Compute)", tid=7),
        meta("thread_name", 2, "XLA Ops", tid=8),  # mirrors of the kernels, not kernels
        {"ph": "X", "pid": 1, "tid": 1, "name": "dispatch", "ts": 0, "dur": 50},
        {"ph": "X", "pid": 2, "tid": 8, "name": "fusion", "ts": 10, "dur": 3},
        {"ph": "X", "pid": 2, "tid": 7, "name": "gemm", "ts": 10, "dur": 3},
        {"ph": "X", "pid": 2, "tid": 7, "name": "ssu", "ts": 20, "dur": 4.5},
        {"ph": "X", "pid": 2, "tid": 7, "name": "ssu", "ts": 30, "dur": 4.5},
        {"ph": "i", "pid": 2, "tid": 7, "name": "marker", "ts": 40},
    ]
    write_trace(tmp_path, events)

    kernels = device_kernel_events(load_trace_events(str(tmp_path)))
    assert [(k["name"], k["ts"], k["dur"]) for k in kernels] == [
        ("gemm", 10.0, 3.0),
        ("ssu", 20.0, 4.5),
        ("ssu", 30.0, 4.5),
    ]
    summary = summarize_trace(str(tmp_path), steps=2)
    assert summary["kernels_per_step"] == 1.5
    assert summary["busy_us_per_step"] == 6.0  # (3 + 4.5 + 4.5) / 2
    assert summary["span_us_per_step"] == 12.25  # (34.5 - 10) / 2
    assert summary["top"][0]["name"] == "ssu" and summary["top"][0]["calls_per_step"] == 1.0


def test_steps_after_lead_in():
    lead = {"ts": 0.0, "dur": 5000.0}
    during = {"ts": 10.0, "dur": 3.0}  # enqueued beside the lead-in: not a step
    steps = [{"ts": 5000.0, "dur": 4.0}, {"ts": 5005.0, "dur": 4.0}]
    assert steps_after_lead_in([lead, during, *steps], steps=2) == (4.5, 4.0, 1.0)
    # A second lead-in kernel after the longest one would sit inside the steps' span.
    with pytest.raises(ValueError, match="several kernels"):
        steps_after_lead_in([lead, *steps, {"ts": 6000.0, "dur": 4000.0}], steps=2)
    with pytest.raises(ValueError, match="no kernels after"):
        steps_after_lead_in([during, lead], steps=2)
