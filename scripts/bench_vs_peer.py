"""This engine and the peer path side by side, in one device run: the 9B step's table of
issue 17 (prefill 1x2048 and 8x2048, decode batch 1/32/128/256 at context 512) with ratios,
then (optionally) the offline-throughput benchmark.

The peer is `../shared/anchors/anchor_torch_e2e.py` (PyTorch on SGLang 0.5.23's Triton Mamba
kernels, cuBLAS, SDPA, decode in a CUDA graph), prepared into `.anchors/` by
`bash ../shared/anchors/prepare.sh` and carried to the GPU machine. Each side runs in its own
process, one after the other (the GPU is not shared between them while timing); both print
`jaxmamba.bench.format_results` rows, which are read back and joined here. Each side's output
streams through as it runs (a call cut short keeps what finished), and the joined table is
printed before the throughput benchmark starts. Our extra rows (`decode-full`, `decode-plain`: other
sampler programs; `decode cb=...`: command-buffer settings; `prefill xN`: N prefill steps back
to back) get columns of their own.

    python3 scripts/bench_vs_peer.py --out-dir $OUT [--cases p1x2048 p8x2048 d1 d32 d128 d256]
        [--engine-args "--small-m-impls none auto"] [--throughput-args "--num-prompts 64"]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CASES = ["p1x2048", "p8x2048", "d1", "d32", "d128", "d256"]
ROW = re.compile(
    r"^\| ((?:prefill|decode)[^|]*?) \| (\d+) \| (\d+) \| ([\d.]+) ms \| ([\d,]+) \| "
    r"([\d.]+)% (.*) \|$"
)


def parse_table(text: str) -> dict[tuple[str, int], dict]:
    """The `format_results` rows of a log, by (phase label, batch); the last row of a case
    wins."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            phase, batch, length, ms, tok_s, util, _ = m.groups()
            rows[(phase, int(batch))] = {
                "input_len": int(length),
                "ms": float(ms),
                "tokens_per_s": float(tok_s.replace(",", "")),
                "utilisation": float(util) / 100,
            }
    return rows


def run(cmd: list[str], cwd: Path, log_path: Path, timeout: float, env=None) -> str:
    """Run `cmd`, its output streamed to stdout (indented) and to `log_path`; killed after
    `timeout` seconds. Returns the output."""
    print(f"$ (cd {cwd} && {shlex.join(cmd)})", flush=True)
    start = time.perf_counter()
    lines = []
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)  # fmt: skip
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    with open(log_path, "w") as log:
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()
            print("  " + line, end="", flush=True)
        proc.wait()
        timer.cancel()
        if proc.returncode != 0:
            note = f"[exit {proc.returncode} after {time.perf_counter() - start:.0f} s]\n"
            lines.append(note)
            log.write(note)
            print("  " + note, end="", flush=True)
    print(f"  {time.perf_counter() - start:.0f} s, log {log_path}", flush=True)
    return "".join(lines)


def case_key(case: str) -> tuple[str, int]:
    return ("prefill", int(case[1:].split("x")[0])) if case[0] == "p" else ("decode", int(case[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    p.add_argument("--out-dir", default="bench_vs_peer")
    p.add_argument("--peer-dir", default=str(ROOT / ".anchors"))
    p.add_argument("--peer-timeout", type=float, default=200)
    p.add_argument("--peer-budget", type=float, default=160, help="peer: start no case after")
    p.add_argument("--engine-timeout", type=float, default=300)
    p.add_argument("--engine-budget", type=float, default=240, help="ours: start no case after")
    p.add_argument("--engine-args", default="", help="extra arguments for bench_engine.py")
    p.add_argument("--engine-env", default="", help="e.g. XLA_FLAGS=... for bench_engine.py")
    p.add_argument(
        "--throughput-args", default=None, help="run scripts/bench_throughput.py with these"
    )
    p.add_argument("--throughput-timeout", type=float, default=240)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--peer-log", default=None, help="read the peer's rows from this log instead")
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"cases": args.cases}

    peer = {}
    if args.peer_log:
        peer = parse_table(Path(args.peer_log).read_text())
    elif not args.skip_peer:
        peer_log = run([sys.executable, "anchor_torch_e2e.py", "--cases", *args.cases,
                        "--budget-s", str(args.peer_budget)], Path(args.peer_dir),
                       out / "peer.log", args.peer_timeout)  # fmt: skip
        peer = parse_table(peer_log)
    env = dict(os.environ)
    for assignment in shlex.split(args.engine_env):
        key, _, value = assignment.partition("=")
        env[key] = value
    engine_log = run([sys.executable, "scripts/bench_engine.py", "--cases", *args.cases,
                      "--budget-s", str(args.engine_budget), "--out",
                      str(out / "engine.json"), *shlex.split(args.engine_args)], ROOT,
                     out / "engine.log", args.engine_timeout, env)  # fmt: skip
    ours = parse_table(engine_log)

    extra = sorted({label for label, _ in ours} - {"prefill", "decode"})
    lines = [
        "| case | this engine | peer path | ratio | ours: utilisation | "
        + "".join(f"ours, {label} | " for label in extra),
        "|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for case in args.cases:
        key = case_key(case)
        a, b = ours.get(key), peer.get(key)
        name = f"prefill {case[1:]}" if key[0] == "prefill" else f"decode batch {key[1]}"
        what = "MFU" if key[0] == "prefill" else "of HBM roofline"
        ratio = f"{a['ms'] / b['ms']:.2f}" if a and b else "—"
        mine = "failed" if a is None else f"{a['ms']:.2f} ms"
        theirs = "—" if b is None else f"{b['ms']:.2f} ms"
        util = "—" if a is None else f"{a['utilisation']:.1%} {what}"
        more = [ours.get((label, key[1])) if label.startswith(key[0]) else None
                for label in extra]  # fmt: skip
        cells = "".join("— | " if m is None else f"{m['ms']:.2f} ms | " for m in more)
        lines.append(f"| {name} | {mine} | {theirs} | {ratio} | {util} | {cells}")
        record[case] = {"ours": a, "peer": b, **dict(zip(extra, more, strict=True))}
    table = "\n".join(lines)
    (out / "bench_vs_peer.json").write_text(json.dumps(record, indent=1))
    print(table, flush=True)

    if args.throughput_args is not None:
        tp_log = run([sys.executable, "scripts/bench_throughput.py", "--out",
                      str(out / "throughput.json"), *shlex.split(args.throughput_args)], ROOT,
                     out / "throughput.log", args.throughput_timeout)  # fmt: skip
        record["throughput_tail"] = tp_log.splitlines()[-12:]
        (out / "bench_vs_peer.json").write_text(json.dumps(record, indent=1))
        print(table)


if __name__ == "__main__":
    main()
