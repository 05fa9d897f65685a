"""Readers of `jax.profiler` traces for the benchmarks: the device's kernels, the busy time
and span of each step, and a table of the kernels that took the time. Scripts import it as a
sibling module (scripts/README.md)."""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os


def load_trace_events(trace_dir: str) -> list[dict]:
    """The events of the newest perfetto trace (``*.trace.json.gz``) a ``jax.profiler.trace``
    wrote under ``trace_dir``."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def device_kernel_events(events: list[dict]) -> list[dict]:
    """The complete events on threads named ``Stream ...`` of ``/device:...`` processes of a
    ``jax.profiler`` trace (``load_trace_events``): the kernels and copies as the GPU ran
    them, not the XLA-op rows that mirror them. ``ts`` and ``dur`` are in µs."""
    device_pids = {
        e["pid"] for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
        and "/device:" in str(e.get("args", {}).get("name", ""))
    }  # fmt: skip
    stream_tids = {
        (e["pid"], e["tid"]) for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in device_pids
        and str(e.get("args", {}).get("name", "")).startswith("Stream")
    }  # fmt: skip
    return [
        {**e, "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
        for e in events
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in stream_tids
    ]


def steps_after_lead_in(events, steps: int) -> tuple[float, float, float]:
    """From a trace's device kernel events (``ts``/``dur`` in µs), the events after the
    longest one (the lead-in): (span µs, summed kernel µs, kernels) per step.

    A lead-in split over several kernels (a chain of matmuls, say) would leave some of it
    after the longest one and inflate the steps: an event after it of at least half its
    length is taken for a piece of it, an error."""
    lead = max(events, key=lambda e: e["dur"])
    lead_end = lead["ts"] + lead["dur"]
    after = [e for e in events if e["ts"] >= lead_end]
    if not after:
        raise ValueError("no kernels after the lead-in")
    if any(e["dur"] >= lead["dur"] / 2 for e in after):
        raise ValueError("the lead-in ran as several kernels: the steps' span would hold some")
    span = max(e["ts"] + e["dur"] for e in after) - lead_end
    busy = sum(e["dur"] for e in after)
    return span / steps, busy / steps, len(after) / steps


def summarize_trace(trace_dir: str, steps: int, top: int | None = 15) -> dict:
    """Kernel time on the accelerator's streams of a ``jax.profiler`` trace, per step
    (``device_kernel_events``). ``busy`` is the summed kernel time, ``span`` the first start
    to the last end: a span well above ``busy`` means the device idled between kernels
    (launch or host bound).
    """
    events = load_trace_events(trace_dir)
    names = {
        (e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
        for e in events if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")
    }  # fmt: skip
    return {
        "threads_seen": sorted(set(names.values()))[:40],
        **kernel_table(device_kernel_events(events), steps, top),
    }


def kernel_table(kernels: list[dict], steps: int, top: int | None = None) -> dict:
    """Kernels a step, busy and span (µs a step) and the ``top`` kernels by time (all: None),
    from kernel events with ``name``, ``ts`` and ``dur`` (µs) covering ``steps`` steps."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    busy = sum(sum(v) for v in by_name.values())
    span = (
        max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
        if kernels else 0.0
    )  # fmt: skip
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    # Idle time before each kernel (from the previous kernel's end), by the kernel that ends
    # it: where the device waited, for a launch or the host. The `steps` largest gaps are
    # the waits between steps (the host reading each step's output), listed apart.
    ordered = sorted(kernels, key=lambda e: e["ts"])
    pairs = itertools.pairwise(ordered)
    gaps = sorted(((max(0.0, b["ts"] - a["ts"] - a["dur"]), b["name"]) for a, b in pairs),
                  reverse=True)  # fmt: skip
    between, within = gaps[: steps - 1], gaps[steps - 1 :]
    idle: dict[str, list[float]] = {}
    for gap, name in within:
        idle.setdefault(name, []).append(gap)
    idle_ranked = sorted(idle.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "busy_us_per_step": busy / steps,
        "span_us_per_step": span / steps,
        "idle_between_steps_us": [round(g, 1) for g, _ in between],
        "idle_within_us_per_step": sum(g for g, _ in within) / steps,
        "idle_before": [
            {
                "name": n[:90],
                "gaps_per_step": len(g) / steps,
                "us_per_step": sum(g) / steps,
                "largest_us": max(g),
            }
            for n, g in idle_ranked
        ],  # fmt: skip
        "top": [
            {
                "name": n[:90],
                "calls_per_step": len(d) / steps,
                "us_per_step": sum(d) / steps,
                "share": sum(d) / busy if busy else 0.0,
            }
            for n, d in ranked
        ],  # fmt: skip
    }


def format_trace_summary(title: str, summary: dict) -> str:
    lines = [
        f"{title}: {summary['kernels_per_step']:.0f} kernels/step, busy "
        f"{summary['busy_us_per_step'] / 1e3:.2f} ms, span {summary['span_us_per_step'] / 1e3:.2f}"
        " ms per step",
        "| kernel | calls/step | µs/step | share |",
        "|---|---|---|---|",
    ]
    for k in summary["top"]:
        lines.append(
            f"| `{k['name']}` | {k['calls_per_step']:.1f} | {k['us_per_step']:.0f} | "
            f"{k['share']:.1%} |"
        )
    if "idle_before" in summary:
        lines.append(
            f"idle inside a step: {summary['idle_within_us_per_step'] / 1e3:.2f} ms; between "
            f"steps: {summary['idle_between_steps_us']} µs. Idle before (µs a step, gaps, "
            "largest): " + "; ".join(
                f"`{k['name'][:40]}` {k['us_per_step']:.0f} ({k['gaps_per_step']:.1f}, "
                f"{k['largest_us']:.0f})" for k in summary["idle_before"])
        )  # fmt: skip
    return "\n".join(lines)
