"""Plant known bugs one at a time and check that the tests meant to catch each one fail.

Each mutation is a textual replacement in one source file of a copy of the repository (a temp
directory; the working tree is never touched). The named tests run in that copy, its
`jaxmamba` first on PYTHONPATH (an editable install's finder comes after the path's own
packages); a mutation is caught when they fail. The tests first run unmutated (`--no-baseline`
skips that), since a failure there would make every mutation look caught.

    python scripts/dev/mutations.py            # every mutation; exit 1 if one is not caught
    python scripts/dev/mutations.py --list
    python scripts/dev/mutations.py min_tokens_device_mask prefix_lookup_whole_prompt
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPY_IGNORE = (".git", ".venv", "build", "out", "*.egg-info", "__pycache__", ".pytest_cache",
               "x.partial")  # fmt: skip

MIN_TOKENS = "tests/test_min_tokens_hf.py"
SIZING = "tests/test_memory_sizing.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, or a file then "-k" and an expression
    count: int = 1  # how many times `old` occurs (every one is replaced)


MUTATIONS = [
    Mutation(
        "min_tokens_device_mask",
        "jaxmamba/model/sampling.py",
        "masking = (counters < min_tokens)[:, None]",
        "masking = (counters < 0)[:, None]",
        (f"{MIN_TOKENS}::test_stop_ids_are_held_back_until_min_tokens_as_in_hf",),
    ),
    Mutation(
        "min_tokens_host_stop_check",
        "jaxmamba/engine/engine.py",
        "if n >= p.min_tokens:",
        "if n >= 0:",
        (f"{MIN_TOKENS}::test_the_host_never_stops_before_min_tokens_whatever_the_device_samples",),
    ),
    Mutation(
        "min_tokens_detokenizer_gate",
        "jaxmamba/engine/detokenizer.py",
        "if self.stop and self.num_output_tokens > self.min_tokens:",
        "if self.stop:",
        (f"{MIN_TOKENS}::test_stop_strings_are_looked_for_only_after_min_tokens",),
    ),
    Mutation(
        "step_temporaries_undercounted_100x",
        "jaxmamba/engine/runner.py",
        "return int(analysis.temp_size_in_bytes + max(unaliased, 0))",
        "return int(analysis.temp_size_in_bytes // 100 + max(unaliased, 0))",
        (SIZING, "-k", "budget_leaves or sized_from_device"),
        count=2,
    ),
    Mutation(
        "step_unaliased_outputs_dropped",
        "jaxmamba/engine/runner.py",
        "return int(analysis.temp_size_in_bytes + max(unaliased, 0))",
        "return int(analysis.temp_size_in_bytes)",
        (SIZING, "-k", "budget_leaves or sized_from_device"),
        count=2,
    ),
    Mutation(
        "prefix_lookup_whole_prompt",
        "jaxmamba/engine/scheduler.py",
        "match = cache.match(req.prompt_token_ids, req.prompt_len - 1)",
        "match = cache.match(req.prompt_token_ids, req.prompt_len)",
        ("tests/test_engine.py::test_a_fully_cached_prompt_still_computes_its_last_token",),
    ),
]


def copy_repo(dst: Path) -> None:
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(*COPY_IGNORE), symlinks=True)
    # `jaxmamba.kernels` is the top-level kernels/ (pyproject's package-dir): make the copy's
    # package hold it, so that nothing is imported from the working tree.
    (dst / "jaxmamba" / "kernels").symlink_to("../kernels", target_is_directory=True)


def run_tests(tree: Path, tests: tuple[str, ...], timeout: int) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    check = "import jaxmamba, jaxmamba.kernels as k; print(jaxmamba.__file__, k.__file__)"
    where = subprocess.run([sys.executable, "-c", check], cwd=tree, env=env, text=True,
                           capture_output=True, check=True).stdout  # fmt: skip
    if not all(Path(p).resolve().is_relative_to(tree.resolve()) for p in where.split()):
        raise RuntimeError(f"the copy imports jaxmamba from outside {tree}: {where}")
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", "-x",
           *tests]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, text=True, capture_output=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.perf_counter() - start
    out = proc.stdout.splitlines()
    failed = [ln for ln in out if ln.startswith(("FAILED", "ERROR"))]
    why = [ln[1:].strip() for ln in out if ln.startswith("E ")]
    summary = " / ".join([*failed[:1], *why[:1]]) or (out[-1] if out else proc.stderr[-160:])
    return proc.returncode, summary[:240], time.perf_counter() - start


def apply(tree: Path, m: Mutation) -> None:
    f = tree / m.path
    text = f.read_text()
    found = text.count(m.old)
    if found != m.count:
        raise RuntimeError(f"{m.name}: {m.old!r} occurs {found} times in {m.path}, "
                           f"expected {m.count}: update the mutation")  # fmt: skip
    f.write_text(text.replace(m.old, m.new))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per pytest run")
    args = ap.parse_args()
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.path}: {m.old!r} -> {m.new!r}\n    tests: {' '.join(m.tests)}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        ap.error(f"unknown mutations {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[n] for n in args.names] if args.names else MUTATIONS
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="jaxmamba-mutations-") as tmp:
        pristine = Path(tmp) / "pristine"
        copy_repo(pristine)
        if not args.no_baseline:
            for tests in dict.fromkeys(m.tests for m in chosen):
                rc, summary, secs = run_tests(pristine, tests, args.timeout)
                print(f"baseline {' '.join(tests)}: rc {rc} ({secs:.0f} s) {summary}", flush=True)
                if rc != 0:
                    print("the unmutated tests fail: no mutation result would mean anything")
                    return 2
        for i, m in enumerate(chosen):
            tree = Path(tmp) / f"m{i}"
            shutil.copytree(pristine, tree, symlinks=True)
            apply(tree, m)
            rc, summary, secs = run_tests(tree, m.tests, args.timeout)
            caught = rc not in (0, -1)
            ok &= caught
            rows.append((m.name, "caught" if caught else "NOT CAUGHT", f"{secs:.0f} s", summary))
            print(f"{m.name}: {rows[-1][1]} ({secs:.0f} s) {summary}", flush=True)
            shutil.rmtree(tree)
    print("\n| mutation | result | time | first failure |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
