"""Set-up shared by every test module."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Free a module's compiled programs when the module ends.

    The suite runs in one process, and XLA:CPU keeps memory mappings for every executable it
    holds: kept for the whole suite, they pass Linux's limit (``vm.max_map_count``, 65,530)
    and the next compile crashes the process (a segfault in ``backend_compile_and_load``)."""
    yield
    jax.clear_caches()
    gc.collect()
