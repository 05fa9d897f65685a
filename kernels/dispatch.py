"""Choose between the plain-jnp reference and a Pallas kernel for one op.

Every public op takes ``impl``:

* ``"auto"``: the best available implementation for the backend (today: the reference).
* ``"ref"``: the plain-jnp reference (runs everywhere, float32 accumulation).
* ``"pallas"``: the Pallas kernel compiled for the current backend.
* ``"interpret"``: the Pallas kernel in interpret mode (CPU-testable).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

IMPLS = ("auto", "ref", "pallas", "interpret")


def select_impl(
    op: str,
    impl: str,
    *,
    ref: Callable,
    pallas: Callable | None = None,
) -> Callable:
    """Return the function that implements ``op`` for ``impl``.

    ``pallas`` (when a kernel exists) must accept an ``interpret: bool`` keyword.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("auto", "ref"):
        # "auto" will prefer the Pallas kernel on GPU/TPU once kernels exist and are measured.
        return ref
    if pallas is None:
        raise NotImplementedError(
            f"{op}: impl={impl!r} is not available yet; the Pallas kernel lands with the "
            "kernels issue (use impl='ref')"
        )
    return functools.partial(pallas, interpret=impl == "interpret")
