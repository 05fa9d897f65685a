"""JAX's persistent compilation cache, on by default for the engine.

`LLM(compilation_cache_dir=...)`, `jaxmamba generate --compilation-cache-dir DIR`, or
`$JAXMAMBA_COMPILATION_CACHE_DIR` pick the folder (default `~/.cache/jaxmamba/xla`, under
`$XDG_CACHE_HOME` if set); `compilation_cache=False` / `--no-compilation-cache` turns it off.

What it saves: XLA's compile of a step (keyed by the lowered module, the compile options and
the backend), and on GPU XLA's per-fusion autotuning results. What it does not save: tracing
the model and lowering it to StableHLO, which run in Python at every start-up (an exported
artifact skips the tracing; see docs/export.md). Every compile is written, however fast
(`jax_persistent_cache_min_compile_time_secs=0`): JAX's default of 1 s skips the small
buckets, which then compile again in every process.

JAX decides at the first compile of a process whether it uses the cache, and keeps to that;
a later call here that turns the cache off or moves it makes JAX decide again at its next
compile (`reset_cache`), so `LLM(compilation_cache=False)` after an `LLM` with the cache on
compiles afresh.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_ACTIVE: list[str | None] = []  # the folder this process set up (or None: turned off)


def default_cache_dir() -> Path:
    env = os.environ.get("JAXMAMBA_COMPILATION_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxmamba" / "xla"


def setup_compilation_cache(
    cache_dir: str | os.PathLike | None = None, *, enabled: bool = True, quiet: bool = False
) -> str | None:
    """Point JAX's persistent compilation cache at `cache_dir` (default `default_cache_dir()`),
    or turn it off; returns the folder in use (None when off). Says where on stderr the first
    time a process sets it up, unless `quiet`. A folder set by the user through
    `jax.config.update("jax_compilation_cache_dir", ...)` before is kept when `cache_dir` is
    None."""
    import jax

    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        _decide_again_if_changed(None)
        return None
    current = jax.config.jax_compilation_cache_dir
    path = str(Path(cache_dir).expanduser()) if cache_dir is not None else None
    if path is None:
        path = current or str(default_cache_dir())
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if _ACTIVE != [path] and not quiet:
        sys.stderr.write(f"jaxmamba: XLA compilation cache at {path}\n")
    _decide_again_if_changed(path)
    return path


def _decide_again_if_changed(path: str | None) -> None:
    """Record `path` (None: off) as this process's cache; when it differs from the one set up
    before, reset JAX's once-per-process decision (`reset_cache`, public in
    `jax.experimental.compilation_cache`) so the next compile follows the new settings."""
    if _ACTIVE and _ACTIVE != [path]:
        from jax.experimental.compilation_cache.compilation_cache import reset_cache

        reset_cache()
    _ACTIVE[:] = [path]


def active_cache_dir() -> str | None:
    """The folder `setup_compilation_cache` last set up in this process (None: off or never)."""
    return _ACTIVE[0] if _ACTIVE else None
