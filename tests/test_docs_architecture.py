"""docs/architecture.md says where things live; these tests keep it true.

The doc's layout is a set of markdown tables with the columns `path | what it holds`. A row's
path is a file or, ending in `/`, a folder (from the repository root). In its second column,
a backticked name (`Name` or `Class.member`) must be defined at the top level of the row's
file, or for a folder bound in its `__init__.py`; a backticked file (`x.py`, `x/`, `*.yaml`)
must exist in the row's folder (or from the root). Every module and folder under jaxmamba/,
every kernel op and each of its files, and every top-level folder must have its row.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

_BACKTICKED = re.compile(r"`([^`]+)`")
_SYMBOL = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")
_FILE = re.compile(r"[\w.*-]+(/[\w.*-]+)*(/|\.(py|md|yaml|json|sh))")
_SKIP = {"__pycache__"}


@cache
def layout_rows() -> tuple[tuple[str, str], ...]:
    """`(path, what it holds)` of every row of the doc's `path | what it holds` tables."""
    rows, in_table = [], False
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if cells[:2] == ["path", "what it holds"]:
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not set(line) <= set("|-: "):
            path = _BACKTICKED.fullmatch(cells[0])
            assert path, f"docs/architecture.md: a layout row's path is not backticked: {line!r}"
            rows.append((path.group(1), "|".join(cells[1:])))
    return tuple(rows)


def named_paths() -> set[str]:
    """Every path the layout names: row paths, and the files named inside a folder's row."""
    out = set()
    for path, text in layout_rows():
        out.add(path.rstrip("/"))
        if path.endswith("/"):
            out.update(
                f"{path}{n}".rstrip("/") for n in _BACKTICKED.findall(text) if _FILE.fullmatch(n)
            )
    return out


def _defined(tree: ast.Module, *, imports: bool) -> dict[str, set[str]]:
    """Top-level names of a module -> the names bound in their class body (empty otherwise)."""
    out: dict[str, set[str]] = {}

    def targets(node) -> list[str]:
        if isinstance(node, ast.Assign):  # `x = ...`, `x, y = ...`; not `x.attr = ...`
            names = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            return [n.id for n in names if isinstance(n, ast.Name)]
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            return [node.target.id]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            return [(a.asname or a.name).split(".")[0] for a in node.names]
        return []

    for node in tree.body:
        for name in targets(node):
            out.setdefault(name, set())
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n for item in node.body for n in targets(item)}
    return out


def _path_exists(base: Path, name: str) -> bool:
    if "*" in name:
        return any(base.glob(name)) or any(ROOT.glob(name))
    return (base / name).exists() or (ROOT / name).exists()


def test_layout_paths_exist():
    missing = [path for path, _ in layout_rows() if not (ROOT / path).exists()]
    assert layout_rows(), "docs/architecture.md has no `path | what it holds` table"
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_layout_files_named_in_rows_exist():
    missing = []
    for path, text in layout_rows():
        base = ROOT / path if path.endswith("/") else (ROOT / path).parent
        for name in _BACKTICKED.findall(text):
            if _FILE.fullmatch(name) and not _path_exists(base, name):
                missing.append(f"{path}: {name}")
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_layout_symbols_live_where_the_doc_says():
    wrong = []
    for path, text in layout_rows():
        source = ROOT / path / "__init__.py" if path.endswith("/") else ROOT / path
        symbols = [
            n for n in _BACKTICKED.findall(text)
            if _SYMBOL.fullmatch(n) and not _FILE.fullmatch(n) and not n.startswith("jaxmamba.")
        ]  # fmt: skip
        if not symbols:
            continue
        if source.suffix != ".py" or not source.is_file():
            wrong.append(f"{path}: names {symbols} but has no Python module to define them")
            continue
        # A package's names are what it offers (its imports too); a module's, what it defines.
        defined = _defined(ast.parse(source.read_text()), imports=path.endswith("/"))
        for name in symbols:
            owner, _, member = name.partition(".")
            if owner not in defined or (member and member not in defined[owner]):
                wrong.append(f"`{name}` is not defined in {source.relative_to(ROOT)}")
    assert not wrong, "docs/architecture.md misplaces names:\n" + "\n".join(wrong)


def test_every_jaxmamba_module_and_folder_is_named():
    existing = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "jaxmamba").rglob("*")
        if not _SKIP & set(p.parts)
        and (p.is_dir() or (p.suffix == ".py" and p.name != "__init__.py"))
    }
    unnamed = sorted(existing - named_paths())
    assert not unnamed, f"docs/architecture.md's layout does not name: {unnamed}"


def kernel_ops() -> list[Path]:
    """Every op folder of kernels/: a dispatcher `__init__.py`, `ref.py` and a kernel."""
    return sorted(
        d for d in (ROOT / "kernels").iterdir()
        if (d / "__init__.py").is_file() and (d / "ref.py").is_file()
        and ((d / "gpu.py").is_file() or (d / "tpu.py").is_file())
    )  # fmt: skip


def test_every_kernel_op_and_its_files_are_named():
    ops = kernel_ops()
    assert len(ops) >= 9, f"expected the kernel ops under kernels/, found {ops}"
    rows = dict(layout_rows())
    unnamed = [f"kernels/{d.name}/" for d in ops if f"kernels/{d.name}/" not in rows]
    assert not unnamed, f"docs/architecture.md has no row for the kernel ops {unnamed}"
    for d in ops:
        files = {p.name for p in d.glob("*.py") if p.name != "__init__.py"}
        named = set(_BACKTICKED.findall(rows[f"kernels/{d.name}/"]))
        assert files <= named, f"kernels/{d.name}/'s row does not name {sorted(files - named)}"
    modules = {f"kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    modules.discard("kernels/__init__.py")
    assert modules <= named_paths(), f"unnamed: {sorted(modules - named_paths())}"


def test_every_top_level_folder_is_named():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout to tell source folders from build outputs")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    folders = {f.split("/")[0] for f in tracked if "/" in f and not f.startswith(".")}
    unnamed = sorted(folders - named_paths())
    assert not unnamed, f"docs/architecture.md has no row for the top-level folders {unnamed}"
    assert {"configs", "kernels", "tests", "scripts", "docs", "jaxmamba"} <= named_paths()
