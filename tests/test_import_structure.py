"""The import structure: the host side imports neither jax nor the model, and no module of
jaxmamba/ or kernels/ imports itself through others (function-level imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"jaxmamba": ROOT / "jaxmamba", "jaxmamba.kernels": ROOT / "kernels"}

# Host modules: scheduling, pools, the prefix cache, tokens and text, the server (its CLI
# builds an `LLM`, so it is not one).
HOST_MODULES = [
    "jaxmamba.step_contract",
    "jaxmamba.sampling_params",
    "jaxmamba.inputs",
    "jaxmamba.tokenizer",
    "jaxmamba.chat",
    "jaxmamba.structured",
    "jaxmamba.structured.grammar",
    "jaxmamba.structured.matcher",
    "jaxmamba.engine.allocator",
    "jaxmamba.engine.batch",
    "jaxmamba.engine.config",
    "jaxmamba.engine.detokenizer",
    "jaxmamba.engine.memory",
    "jaxmamba.engine.outputs",
    "jaxmamba.engine.prefix_cache",
    "jaxmamba.engine.request",
    "jaxmamba.engine.scheduler",
    "jaxmamba.serve.api_server",
    "jaxmamba.serve.engine_loop",
    "jaxmamba.serve.metrics",
    "jaxmamba.serve.protocol",
]

_BLOCKED = ("jax", "jaxlib", "flax", "jaxmamba.model", "jaxmamba.kernels")

_IMPORT_HOST_SIDE = f"""
import importlib, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {_BLOCKED!r}):
            raise ImportError(f"the host side imported {{name}}")

sys.meta_path.insert(0, Blocked())
for module in {HOST_MODULES!r}:
    importlib.import_module(module)
"""


def test_host_modules_import_neither_jax_nor_the_model():
    result = subprocess.run([sys.executable, "-c", _IMPORT_HOST_SIDE], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of this tree `module` imports anywhere in its body (not under
    `if TYPE_CHECKING:`, which never runs)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return {name for name in found if name in modules and name != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, path, modules) for m, path in modules.items()}
    cycles = _cycles(graph)
    described = [
        " / ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles
    ]  # fmt: skip
    assert not cycles, "import cycles:\n" + "\n".join(described)
