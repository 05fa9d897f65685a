"""Decode selective state update as a Mosaic GPU kernel (Pallas ``mosaic_gpu`` backend, Hopper+).

Written beside the Triton-lowered kernel in ``state_update_pallas.py`` to measure the two
Pallas GPU lowerings on the same bandwidth-bound op (issue 4); ``dispatch`` picks per op.

Layout. Mosaic GPU programs are warpgroups (128 threads) holding register arrays in fixed
layouts; the one with row and column broadcasts and row reductions is the WGMMA layout, whose
rows come in multiples of 64. P = 80 is not one, so the kernel sees the state as
``[S', H*P, N]`` (a free reshape) and a program updates 64 consecutive rows of one slot: a
tile may straddle two heads. The per-row factors ``exp(dt A)``, ``dt x`` and ``D x`` are
therefore computed by XLA beforehand as ``[B, H*P]`` rows (one fused elementwise op, ~2 % of
the state traffic) and loaded in the row layout; B and C rows load in the column layout.
Every tile lies in one B/C group when ``(H/G)*P`` is a multiple of 64 (1280 for Nemotron).
The state is read from and written to global memory directly (no shared memory, no TMA: a
gather by slot with nothing to reuse), updated in place through ``input_output_aliases``.

Measured on the H200 with jax 0.11.2 (2026-11-29, ``scripts/bench_kernels.py --sweep``): it
runs and matches the reference (y within 3e-5, state within 5e-8 relative), and is 28 %
slower than the Triton kernel at batch 32 and no faster at batch 1 and 8 (21.8/56.9/147.4 µs a
step against 18.6/52.9/115.2); at batch 256, 963 µs against 740-771 µs for the Triton tiles
(65 % of the HBM roofline). Dispatch does not use it.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .state_update_pallas import _process_dt

try:  # the backend's Python module imports on any jaxlib; the kernel only runs on Hopper+
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as err:  # pragma: no cover - depends on the jax build
    plgpu = None
    IMPORT_ERROR: str | None = f"jax.experimental.pallas.mosaic_gpu is unavailable: {err}"
else:
    IMPORT_ERROR = None

# jax 0.11 lowers Mosaic GPU kernels only through ``mpmd_map`` (``plgpu.kernel``), whose
# public entry takes no ``input_output_aliases``; its private ``_mpmd_map`` does, and in-place
# update of the pool is the point. jax 0.10 lowers ``mpmd_map`` on CUDA as a plain loop, and
# Mosaic GPU through ``pallas_call`` (deprecated there, removed in 0.11).
try:
    from jax._src.pallas import mpmd as _mpmd
    from jax._src.pallas.mosaic_gpu import pallas_call_registration as _mgpu_registration

    _USE_MPMD = hasattr(_mgpu_registration, "mpmd_map_mgpu_lowering_rule")
except ImportError:  # pragma: no cover - depends on the jax build
    _USE_MPMD = False

_F32 = jnp.float32
TILE_ROWS = 64  # rows of the WGMMA register layout a warpgroup holds


def supports(head_dim: int, heads_per_group: int, state_size: int) -> bool:
    """Whether the shapes fit the kernel's tiling (see the module docstring)."""
    return (heads_per_group * head_dim) % TILE_ROWS == 0 and state_size % 8 == 0


_GRID_NAMES = ("tile", "row")


def _load(ref, layout):
    """``ref`` (indexed with ``.at``) into registers in ``layout``; jax 0.10 requires a
    separate index argument, jax 0.11 deprecates it."""
    index = inspect.signature(plgpu.load).parameters["idx"].default
    extra = ((),) if index is inspect.Parameter.empty else ()
    return plgpu.load(ref, *extra, layout=layout, optimized=False)


def _program_ids():
    if _USE_MPMD:
        return tuple(jax.lax.axis_index(name) for name in _GRID_NAMES)
    return tuple(pl.program_id(axis) for axis in range(len(_GRID_NAMES)))


def _kernel(has_d, has_z, rows_per_group, slots_ref, state_ref, decay_ref, dtx_ref, b_ref,
            c_ref, *rest):  # fmt: skip
    rest = list(rest)
    dx_ref = rest.pop(0) if has_d else None
    z_ref = rest.pop(0) if has_z else None
    y_ref, state_out_ref = rest
    blk, row = _program_ids()
    slot = slots_ref[row]
    group = jax.lax.div(blk * TILE_ROWS, rows_per_group)
    r = pl.ds(blk * TILE_ROWS, TILE_ROWS)
    full = plgpu.Layout.WGMMA
    by_row, by_col = full.reduce(1), full.reduce(0)
    h = _load(state_ref.at[slot, r], full)
    decay = _load(decay_ref.at[row, r], by_row)
    dtx = _load(dtx_ref.at[row, r], by_row)
    b = _load(b_ref.at[row, group], by_col)
    c = _load(c_ref.at[row, group], by_col)
    shape = h.shape
    # Broadcast straight to [64, N]: the layouts have no [64, 1] / [1, N] intermediate.
    along_rows = lambda v: jax.lax.broadcast_in_dim(v, shape, (0,))  # noqa: E731
    along_cols = lambda v: jax.lax.broadcast_in_dim(v.astype(_F32), shape, (1,))  # noqa: E731
    h = along_rows(decay) * h.astype(_F32) + along_rows(dtx) * along_cols(b)
    state_out_ref[slot, r, :] = h.astype(state_out_ref.dtype)
    y = jnp.sum(h * along_cols(c), axis=1)
    if dx_ref is not None:
        y = y + _load(dx_ref.at[row, r], by_row)
    if z_ref is not None:
        zv = _load(z_ref.at[row, r], by_row).astype(_F32)
        y = y * (zv * jax.nn.sigmoid(zv))
    y_ref[row, r] = y.astype(y_ref.dtype)


def selective_state_update_mosaic_gpu(
    state: jax.Array,  # [S', H, P, N]
    x: jax.Array,  # [B, H, P]
    dt: jax.Array,  # [B, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [B, G, N]
    C: jax.Array,  # [B, G, N]
    slots: jax.Array,  # i32[B]
    *,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | None = None,  # [B, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    interpret: bool = False,
    auto_barriers: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``auto_barriers``: let Pallas put a warpgroup barrier around each store. Nothing here
    goes through shared memory and each thread writes only its own registers' elements, so
    the kernel needs none; the switch exists to measure that they cost nothing either."""
    if plgpu is None:
        raise NotImplementedError(IMPORT_ERROR)
    if interpret:
        raise NotImplementedError("the Mosaic GPU state update has no interpret mode here")
    rows, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    heads_per_group = num_heads // num_groups
    if not supports(head_dim, heads_per_group, state_size):
        raise ValueError(
            f"Mosaic GPU state update needs (H/G)*P % {TILE_ROWS} == 0 and N % 8 == 0; got "
            f"H/G={heads_per_group}, P={head_dim}, N={state_size}"
        )
    flat = num_heads * head_dim
    dt = _process_dt(
        dt.astype(_F32), None if dt_bias is None else dt_bias.astype(_F32), dt_softplus, dt_limit
    )  # [B, H]
    xf = x.astype(_F32)
    per_row = lambda v: jnp.broadcast_to(v, xf.shape).reshape(rows, flat)  # noqa: E731
    args = [
        state.reshape(state.shape[0], flat, state_size),
        per_row(jnp.exp(dt * A.astype(_F32))[..., None]),
        per_row(dt[..., None] * xf),
        B,
        C,
    ]
    if D is not None:
        args.append(per_row(D.astype(_F32)[:, None] * xf))
    if z is not None:
        args.append(z.reshape(rows, flat))
    kernel = functools.partial(_kernel, D is not None, z is not None, heads_per_group * head_dim)
    grid = (flat // TILE_ROWS, rows)
    out_shape = [
        jax.ShapeDtypeStruct((rows, flat), x.dtype),
        jax.ShapeDtypeStruct(args[0].shape, state.dtype),
    ]
    params = plgpu.CompilerParams(unsafe_no_auto_barriers=not auto_barriers)
    aliases = {1: 1}  # operand 0 is the slots
    if _USE_MPMD:
        mesh = plgpu.Mesh(grid=grid, grid_names=_GRID_NAMES)
        call = _mpmd._mpmd_map(
            [(mesh, kernel)],
            out_shape,
            input_output_aliases=aliases,
            compiler_params=params,
            name="selective_state_update_mgpu",
        )
    else:
        gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
        call = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[gmem] * (len(args) + 1),
            out_specs=[gmem, gmem],
            out_shape=out_shape,
            input_output_aliases=aliases,
            compiler_params=params,
            name="selective_state_update_mgpu",
        )
    y, new_state = call(slots.astype(jnp.int32), *args)
    return y.reshape(x.shape), new_state.reshape(state.shape)
