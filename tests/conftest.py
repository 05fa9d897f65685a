"""Set-up shared by every test module."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Free a module's compiled programs when the module ends.

    The suite runs in one process, and XLA:CPU keeps memory mappings for every executable it
    holds. Kept for the whole suite, they passed Linux's limit (``vm.max_map_count``, 65,530)
    at ~85 % of the suite, and the next compile crashed the process (a segfault in
    ``backend_compile_and_load``; seen with 65,123 mappings before it)."""
    yield
    jax.clear_caches()
    gc.collect()
