"""Set-up shared by every test module."""

import gc
import importlib.util
import os
import shutil
import sys
import tempfile

# A CUDA plugin is installed and not turned off: the backend will be the GPU (decided before
# jax starts its backend, which the settings below must precede).
_CUDA = os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu") and any(
    importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")
)
# XLA:CPU compiles with LLVM at -O0 in tests: the suite's time is mostly XLA compiling the
# steps of small random models (each bucket a program, seconds apiece), and the backend's
# optimisation level changes how fast the code runs, not what it computes. It roughly halves
# each compile. Set before jax starts its backend; subprocesses the tests start inherit it.
# Not on a GPU, whose kernels are compiled by the same LLVM and should be what a server runs.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if not _CUDA and _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
# The xdist workers share one GPU: each takes memory as it needs it, not 75 % of it up front,
# and at most its share of 60 % of it (the rest is the driver's: the workers' CUDA contexts,
# command buffers, cuBLAS workspaces). The share is also the limit an `LLM` sizes its cache
# within (`memory_stats()["bytes_limit"]`), so one test's engine cannot starve the others.
if _CUDA:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.6 / _workers:.3f}")

# `python -m pytest` from the checkout root puts the root first on sys.path, and with it our
# `kernels/` folder (installed as `jaxmamba.kernels`) as a top-level package `kernels`. That
# name belongs to Hugging Face's `kernels` distribution, which transformers (>= 5.25) imports
# as a dependency: with the root on sys.path it would find our folder instead and fail to
# import. jaxmamba comes from its install (editable or not), so the root is not needed here.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxmamba.export.compile_cache import setup_compilation_cache  # noqa: E402

_CACHE_ENV = "JAXMAMBA_COMPILATION_CACHE_DIR"

# The longest files, longest first (their seconds in `pytest --durations=0`). xdist
# (`--dist loadfile --no-loadscope-reorder`) hands out files in collection order, each to the
# first free worker: the long ones start first and the short ones fill in behind them, so
# neither worker is left with a long file after the other has finished.
LONGEST_FIRST = (
    "test_speculative.py",
    "test_engine.py",
    "test_memory_sizing.py",
    "test_kernels_ssd_pallas.py",
    "test_server.py",
    "test_artifacts_executables.py",
    "test_model_hf_parity.py",
    "test_stopping_hf.py",
    "test_artifacts_compile_cache.py",
    "test_llm_api.py",
    "test_artifacts.py",
    "test_speculative_mtp.py",
    "test_speculative_draft.py",
    "test_family_nemotron_h_moe.py",
    "test_tpu_compile.py",
    "test_sampling_hf.py",
    "test_prefix_branch.py",
    "test_streaming.py",
    "test_demo_model.py",
    "test_tensor_parallel.py",
    "test_speculative_tp.py",
    "test_gdn_engine.py",
    "test_family_qwen3_next.py",
    "test_family_qwen3_5.py",
)


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-full",
        action="store_true",
        help="tests/gpu: every preset, float32 and the other block-size regimes, not only the "
        "default selection (JAXMAMBA_GPU_TIER=full does the same)",
    )


def pytest_configure(config):
    """One persistent compilation cache for the whole run, empty at its start and shared by
    the xdist workers (and the subprocesses tests start), set up before the first compile:
    a step compiled in one test file is then read back, not compiled again, wherever the
    same program recurs. Its being empty keeps local runs as cold as CI's."""
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): asserts what holds on CPU alone (impl='auto' is the reference, "
        "impl='pallas' raises, host memory sizes the cache); skipped on other backends",
    )
    if config.getoption("--gpu-full"):  # read by tests/gpu/gpu_tier.py at collection
        os.environ["JAXMAMBA_GPU_TIER"] = "full"
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config._jaxmamba_cache = tempfile.mkdtemp(prefix="jaxmamba-test-xla-")
        os.environ[_CACHE_ENV] = config._jaxmamba_cache
    _use_run_cache()


def _use_run_cache():
    """Tests turn the cache off (`LLM(compilation_cache=False)`) or move it: it is put back
    after every module."""
    setup_compilation_cache(os.environ[_CACHE_ENV], quiet=True)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside a file and among the rest is kept
    if jax.default_backend() != "cpu":
        for item in items:
            if item.get_closest_marker("cpu_only"):
                why = f"asserts CPU behaviour; the backend is {jax.default_backend()}"
                item.add_marker(pytest.mark.skip(reason=why))


def pytest_unconfigure(config):
    path = getattr(config, "_jaxmamba_cache", None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def full_precision_float32_dots(request):
    """On a GPU, float32 dots default to TF32 (a 10-bit mantissa); the suite's float32
    tolerances assume full float32, as on CPU, where the references and the interpreted kernels
    it compares run. The GPU tier (`tests/gpu/`) runs at the default precision a server runs
    with, its tolerances set for TF32. Global, not a thread-local context: the engine traces
    some programs on its compile threads."""
    if not _CUDA or request.path.parent.name == "gpu":
        yield
        return
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", None)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Free a module's compiled programs when the module ends.

    The suite runs in one process, and XLA:CPU keeps memory mappings for every executable it
    holds: kept for the whole suite, they pass Linux's limit (``vm.max_map_count``, 65,530)
    and the next compile crashes the process (a segfault in ``backend_compile_and_load``)."""
    yield
    jax.clear_caches()
    gc.collect()
    _use_run_cache()
