"""Helpers the ops share: dt processing and SiLU, matmul precision, tile arithmetic, the
Mosaic TPU lane/sublane moves, shape checks, interpret mode, column views of packed arrays,
and `pallas_call`, which hands equal kernel calls one traced and lowered kernel.

Plain jnp/lax, so the device-side helpers (``softplus``, ``silu``, ``process_dt``, ``dot``)
lower through XLA, Mosaic TPU and Triton alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MIN_DOT_DIM = 16  # Triton's smallest matmul block edge


def _name_the_triton_dialect_module() -> None:
    """MLIR's Python bindings look for a dialect's Python module under
    `jaxlib.mlir.dialects.<namespace>` (and two more prefixes) when they build its ops, and
    do not remember a miss; jaxlib's Triton dialect lives at `jaxlib.triton.dialect`, so
    every op of the Triton lowering searched the import path six times (jaxlib 0.10.2: 27,766
    failed imports of each name lowering one 9B decode step for CUDA, ~30 % of its
    lowering time). Naming the real module where they look ends the search; the lowered
    modules are byte-identical."""
    name = "jaxlib.mlir.dialects.tt"
    if name in sys.modules:
        return
    try:
        from jaxlib.triton import dialect
    except ImportError:  # a jaxlib without the Triton dialect: nothing searches for it
        return
    sys.modules[name] = dialect


_name_the_triton_dialect_module()


def softplus(x: jax.Array) -> jax.Array:
    """``log(1 + exp(x))`` without overflow, in a form every backend lowers."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)``, exact, inside a kernel (the references use ``jax.nn.silu``)."""
    return x * jax.nn.sigmoid(x)


def process_dt(
    dt: jax.Array,  # [..., H] (a scalar inside a kernel)
    dt_bias: jax.Array | None,  # [H]
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> jax.Array:
    """float32 ``clip(softplus(dt + dt_bias), *dt_limit)`` (softplus only if requested)."""
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = softplus(dt)
    return jnp.clip(dt, dt_limit[0], dt_limit[1])


def matmul_precision(dtype) -> lax.Precision:
    """float32 operands are the parity reference: keep the MXU / tensor cores from dropping
    to bf16 / tf32 passes. Other dtypes take the default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """2-D matmul contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``,
    accumulated in float32 (exact passes for float32 operands)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(
        a, b, dims, precision=matmul_precision(a.dtype), preferred_element_type=jnp.float32
    )


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return min(n & -n, cap)


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (at least 1)."""
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def to_column(row: jax.Array) -> jax.Array:
    """[1, n] -> [n, 1] without a transpose (an identity mask and a lane sum; exact), for
    Mosaic TPU kernels that move vectors between the lane and sublane axes on the VPU."""
    return jnp.sum(jnp.where(_identity(row.shape[1]), row, 0.0), axis=1, keepdims=True)


def to_row(col: jax.Array) -> jax.Array:
    """[n, 1] -> [1, n], as :func:`to_column`."""
    return jnp.sum(jnp.where(_identity(col.shape[0]), col, 0.0), axis=0, keepdims=True)


def _identity(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)


def check_optional_shapes(**arrays: tuple[jax.Array | None, tuple[int, ...]]) -> None:
    """Raise if an optional argument that was given (``name=(array, expected_shape)``) does
    not have its expected shape."""
    for name, (arr, shape) in arrays.items():
        if arr is not None and arr.shape != shape:
            raise ValueError(f"expected {name} {shape}, got {arr.shape}")


def aligned(start, *parts: int):
    """``start`` (a sum of multiples of ``parts``) with the alignment Triton can rely on: the
    hint that lets it vectorise a load at a column offset it cannot see through."""
    return pl.multiple_of(start, functools.reduce(math.gcd, parts))


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["array"], meta_fields=["start", "inner"]
)
@dataclasses.dataclass(frozen=True)
class ColumnView:
    """A ``[T, *inner]`` operand held as columns ``[start, start + prod(inner))`` of a wider
    ``[T, W]`` array: the xBC and dt columns of Mamba2's in_proj output, the x, B and C
    columns of the conv output.

    A kernel's custom call takes whole arrays, so a slice in front of one is a copy. The GPU
    kernels read a view's columns in place (``start`` is static); the references and the TPU
    kernels (whose BlockSpecs tile whole arrays) take ``materialize``'s slice. Build one with
    ``ColumnView.of``, which checks it."""

    array: jax.Array  # [T, W]
    start: int
    inner: tuple[int, ...]

    @classmethod
    def of(cls, array: jax.Array, start: int, inner: tuple[int, ...]) -> ColumnView:
        inner = tuple(int(n) for n in inner)
        if array.ndim != 2 or not 0 <= start <= array.shape[1] - math.prod(inner):
            raise ValueError(
                f"a column view of {inner} (= {math.prod(inner)} columns) at column {start} "
                f"needs a [T, W] array with W >= {start + math.prod(inner)}; got {array.shape}"
            )
        return cls(array, int(start), inner)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.array.shape[0], *self.inner)

    @property
    def ndim(self) -> int:
        return 1 + len(self.inner)

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def width(self) -> int:
        return math.prod(self.inner)

    def materialize(self) -> jax.Array:  # [T, *inner]
        cols = lax.slice_in_dim(self.array, self.start, self.start + self.width, axis=1)
        return cols.reshape(self.shape)

    def take_rows(self, rows: jax.Array) -> jax.Array:  # [*rows.shape, *inner]
        """Rows ``rows`` of the operand: a gather of whole rows of the wide array, then their
        columns, so no copy of the wide array is made whether or not XLA fuses a slice into a
        gather (for the few rows of the conv windows)."""
        picked = self.array[rows][..., self.start : self.start + self.width]
        return picked.reshape(*rows.shape, *self.inner)


def as_view(a: jax.Array | ColumnView) -> ColumnView:
    """``a`` as a column view: a plain ``[T, ...]`` array is all the columns of itself
    flattened to ``[T, prod(...)]`` (a bitcast, no copy)."""
    if isinstance(a, ColumnView):
        return a
    return ColumnView(a.reshape(a.shape[0], -1), 0, tuple(a.shape[1:]))


def as_array(a: jax.Array | ColumnView) -> jax.Array:
    """``a`` as a plain ``[T, ...]`` array (a view's slice)."""
    return a.materialize() if isinstance(a, ColumnView) else a


def tpu_interpret_params(interpret):
    """``pallas_call``'s ``interpret`` for a Mosaic TPU kernel: ``True`` runs it under
    ``pltpu.InterpretParams()`` (on any backend); ``False`` or explicit params pass through."""
    return pltpu.InterpretParams() if interpret is True else interpret


_CALLS: dict = {}  # static key of a pallas_call -> the callable pl.pallas_call made for it
_CALLS_LOCK = threading.Lock()


def _static_key(obj):
    """A hashable value-key of a kernel and its pallas_call options, equal for calls that
    trace to the same kernel: a `functools.partial` by its function and arguments, a
    function by its code and the values it closes over (a lambda index map made afresh each
    call is the same map; a wrapper of one by it), a dataclass (a BlockSpec, a grid spec,
    compiler params) by its type and fields, dicts and sequences by their items; anything
    else by its type and value (a TypeError at hashing when it is not hashable: an array, a
    tracer)."""
    if isinstance(obj, functools.partial):
        return ("partial", _static_key(obj.func), _static_key(obj.args),
                _static_key(obj.keywords))  # fmt: skip
    if isinstance(obj, types.FunctionType):
        cells = tuple(_static_key(c.cell_contents) for c in obj.__closure__ or ())
        return ("function", obj.__code__, _static_key(obj.__defaults__),
                _static_key(obj.__kwdefaults__), cells)  # fmt: skip
    if hasattr(obj, "__wrapped__") and not isinstance(obj, type):
        # e.g. the wrapper BlockSpec puts around its index map (functools.update_wrapper)
        return ("wrapper", type(obj), _static_key(obj.__wrapped__))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = tuple((f.name, _static_key(getattr(obj, f.name)))
                       for f in dataclasses.fields(obj))  # fmt: skip
        return ("dataclass", type(obj), fields)
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, _static_key(v)) for k, v in obj.items())))
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, tuple(_static_key(v) for v in obj))
    # With its type: 1, True and np.float32(1) are equal but trace differently (weak types);
    # a float by its repr, which tells 0.0 from -0.0.
    return (type(obj), repr(obj) if isinstance(obj, float) else obj)


def pallas_call(kernel: Callable, **options) -> Callable:
    """`pl.pallas_call(kernel, **options)`, the same callable for equal kernels and options.

    Each `pl.pallas_call` is a new function whose every call traces the kernel again, and
    each traced kernel is lowered (Triton or Mosaic) again: a model calls the same kernel in
    every layer, so a step traced and lowered it once per layer (27 times for the 9B's
    Mamba layers, most of a decode bucket's tracing and lowering). The callable made once for
    a kernel and its options traces once per input shape, and JAX's lowering cache then
    emits its lowering once per module. Kernels or options that do not hash (arrays, closures
    over them) get a fresh `pl.pallas_call`."""
    try:
        key = _static_key((kernel, options))
        hash(key)
    except TypeError:
        return pl.pallas_call(kernel, **options)
    call = _CALLS.get(key)
    if call is None:
        with _CALLS_LOCK:
            call = _CALLS.setdefault(key, pl.pallas_call(kernel, **options))
    return call
