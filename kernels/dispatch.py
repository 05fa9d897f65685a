"""Choose between the plain-jnp reference and a Pallas kernel for one op.

Every public op takes ``impl``:

* ``"auto"``: the current backend's kernel where the op has one (TPU → Mosaic TPU, CUDA →
  Pallas GPU), else the reference; CPU → the reference.
* ``"ref"``: the plain-jnp reference (runs everywhere, float32 accumulation).
* ``"pallas"``: the current backend's kernel; an error on CPU or where the op has none.
* ``"interpret"``: the Pallas kernel in interpret mode on any backend (the TPU kernel under
  ``pltpu.InterpretParams()`` where the op has one, else its GPU kernel).
* ``"pallas_tpu"`` / ``"pallas_gpu"``: that platform's kernel whatever the current backend,
  for ``jax.export(..., platforms=("tpu",))`` and deviceless AOT compiles, where the target is
  not the machine that traces. The choice is made at trace time, so it cannot follow the
  lowering platform (``lax.platform_dependent`` would lower every branch, and a Pallas kernel
  does not lower for the wrong platform).
* ``"auto_tpu"`` / ``"auto_gpu"``: ``"auto"`` for a named target platform — the kernel where
  the op has one for it, else the reference. A whole model mixes ops with and without
  kernels, so this is what exporting a model step for another platform uses.

Every CUDA kernel here is Triton-lowered: they are gathers by slot, sequential scans and page
walks with per-program scalar indexing, masked windows at arbitrary token offsets and
power-of-two tiles of any shape, which the Triton lowering expresses directly (each kernel
module says why for its op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

IMPLS = (
    "auto",
    "ref",
    "pallas",
    "interpret",
    "pallas_tpu",
    "pallas_gpu",
    "auto_tpu",
    "auto_gpu",
)
PLATFORMS = ("tpu", "gpu")


def current_platform() -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: the backend jitted code runs on by default."""
    backend = jax.default_backend()
    return backend if backend in PLATFORMS else "cpu"


def select_impl(
    op: str,
    impl: str,
    *,
    ref: Callable,
    pallas_tpu: Callable | None = None,
    pallas_gpu: Callable | None = None,
    ref_where_no_kernel: bool = False,
) -> Callable:
    """Return the function that implements ``op`` for ``impl``.

    ``pallas_tpu`` / ``pallas_gpu`` are the op's kernels (at least one); each must accept an
    ``interpret: bool`` keyword. ``ref_where_no_kernel``: ``"pallas"`` for a platform without
    a kernel of the op runs ``ref`` instead of raising — for ops whose reference is what that
    platform should run anyway (built from other ops' kernels, or one XLA fusion), so a model
    whose ops all take ``impl="pallas"`` runs there.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    kernels = {"tpu": pallas_tpu, "gpu": pallas_gpu}
    if impl == "ref":
        return ref
    if impl == "interpret":
        return functools.partial(pallas_tpu or pallas_gpu, interpret=True)
    mode, _, target = impl.partition("_")
    platform = target or current_platform()
    if mode == "auto":
        kernel = kernels.get(platform)
        return ref if kernel is None else functools.partial(kernel, interpret=False)
    if platform == "cpu":
        raise ValueError(
            f"{op}: impl='pallas' compiles the kernel for the current backend, which is CPU; "
            "use impl='interpret' to run the kernel on CPU, 'pallas_tpu'/'pallas_gpu' to "
            "lower for another platform, or 'auto'/'ref'"
        )
    if kernels[platform] is None:
        if ref_where_no_kernel:
            return ref
        raise NotImplementedError(f"{op}: no Pallas kernel for {platform} (use impl='ref')")
    return functools.partial(kernels[platform], interpret=False)
