"""Pallas kernels for the decode selective state update (Mosaic TPU and Triton-lowered GPU).

Both read each row's state ``[H, P, N]`` from the slot pool once and write it back once, in
place: the pool is aliased input→output (``input_output_aliases``), and a jitted caller that
donates it lets XLA skip the copy. Pad rows point at the pad slot; several of them may race
on it, which is harmless because nothing reads it.

* TPU: grid ``(B, H / hb)``; the slot ids are scalar-prefetched into SMEM and pick the state
  block ``[hb, P, N]`` in the index map, so Mosaic's pipeline DMAs row ``b+1``'s state while
  row ``b`` computes. ``hb`` heads share one B/C group. Per-head scalars (dt, A, D) and the
  head vectors (x, z, y) carry trailing unit dims so every in-kernel op is a broadcast.
* GPU: grid ``(B, H, P / bp)``, one ``[bp, N]`` state tile a program; Triton needs
  power-of-two tiles, so ``bp`` is the largest power of two dividing P (16 for P = 80) and N
  is walked in power-of-two tiles when it is not one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return min(n & -n, cap)


def tpu_interpret_params(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def softplus(x: jax.Array) -> jax.Array:
    # Same as jax.nn.softplus in float32 (exp(20) already swamps the 1), lowers everywhere.
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _process_dt(dt, dt_bias, dt_softplus, dt_limit):
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = softplus(dt)
    lo, hi = dt_limit
    if lo > -math.inf:
        dt = jnp.maximum(dt, lo)
    if hi < math.inf:
        dt = jnp.minimum(dt, hi)
    return dt


@dataclasses.dataclass(frozen=True)
class _Options:
    has_d: bool
    has_z: bool
    has_bias: bool
    dt_softplus: bool
    dt_limit: tuple[float, float]


def _optional(opts: _Options, refs):
    """Split the optional refs (D, z, dt_bias) off the front of ``refs``."""
    refs = list(refs)
    d = refs.pop(0) if opts.has_d else None
    z = refs.pop(0) if opts.has_z else None
    bias = refs.pop(0) if opts.has_bias else None
    return d, z, bias, refs


# --------------------------------------------------------------------------- TPU (Mosaic)


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    max_block_bytes: int = 1 << 19  # state bytes per grid step (x4 in VMEM: in/out, 2 buffers)

    def heads(self, heads_per_group: int, head_dim: int, state_size: int) -> int:
        """The most heads of one group whose state block fits ``max_block_bytes``."""
        per_head = head_dim * state_size * 4
        fits = [
            hb
            for hb in range(1, heads_per_group + 1)
            if heads_per_group % hb == 0 and hb * per_head <= self.max_block_bytes
        ]
        return max(fits, default=1)


def _tpu_kernel(opts: _Options, slots_ref, state_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, *rest):
    del slots_ref  # used by the index maps only
    d_ref, z_ref, bias_ref, (y_ref, state_out_ref) = _optional(opts, rest)
    dt = dt_ref[...].astype(_F32)  # [hb, 1, 1]
    dt = _process_dt(
        dt, None if bias_ref is None else bias_ref[...], opts.dt_softplus, opts.dt_limit
    )
    decay = jnp.exp(dt * a_ref[...])  # [hb, 1, 1]
    x = x_ref[...].astype(_F32)  # [hb, P, 1]
    h = state_ref[...].astype(_F32)  # [hb, P, N]
    h = decay * h + (dt * x) * b_ref[...].astype(_F32)  # B: [1, N]
    state_out_ref[...] = h.astype(state_out_ref.dtype)
    y = jnp.sum(h * c_ref[...].astype(_F32), axis=-1, keepdims=True)  # [hb, P, 1]
    if d_ref is not None:
        y = y + d_ref[...] * x
    if z_ref is not None:
        z = z_ref[...].astype(_F32)
        y = y * (z * jax.nn.sigmoid(z))
    y_ref[...] = y.astype(y_ref.dtype)


def selective_state_update_tpu(
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
    block_sizes: TpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    rows, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    r = num_heads // num_groups
    hb = (block_sizes or TpuBlockSizes()).heads(r, head_dim, state_size)
    opts = _Options(D is not None, z is not None, dt_bias is not None, dt_softplus, dt_limit)

    def head_scalar(a):  # [H] -> [H, 1, 1] f32
        return a.astype(_F32).reshape(num_heads, 1, 1)

    row_scalar = pl.BlockSpec((None, hb, 1, 1), lambda b, j, s: (b, j, 0, 0))
    head_spec = pl.BlockSpec((hb, 1, 1), lambda b, j, s: (j, 0, 0))
    vec_spec = pl.BlockSpec((None, hb, head_dim, 1), lambda b, j, s: (b, j, 0, 0))
    group_spec = pl.BlockSpec(
        (None, None, 1, state_size), lambda b, j, s: (b, jax.lax.div(j, r // hb), 0, 0)
    )
    state_spec = pl.BlockSpec((None, hb, head_dim, state_size), lambda b, j, s: (s[b], j, 0, 0))
    args = [
        state,
        x.reshape(rows, num_heads, head_dim, 1),
        dt.reshape(rows, num_heads, 1, 1),
        head_scalar(A),
        B.reshape(rows, num_groups, 1, state_size),
        C.reshape(rows, num_groups, 1, state_size),
    ]
    specs = [state_spec, vec_spec, row_scalar, head_spec, group_spec, group_spec]
    if D is not None:
        args.append(head_scalar(D))
        specs.append(head_spec)
    if z is not None:
        args.append(z.reshape(rows, num_heads, head_dim, 1))
        specs.append(vec_spec)
    if dt_bias is not None:
        args.append(head_scalar(dt_bias))
        specs.append(head_spec)

    y, new_state = pl.pallas_call(
        functools.partial(_tpu_kernel, opts),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(rows, num_heads // hb),
            in_specs=specs,
            out_specs=[vec_spec, state_spec],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((rows, num_heads, head_dim, 1), x.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={1: 1},  # operand 0 is the prefetched slots
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_params(interpret),
        name="selective_state_update",
    )(slots.astype(jnp.int32), *args)
    return y.reshape(rows, num_heads, head_dim), new_state


# --------------------------------------------------------------------------- GPU (Triton)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    head_dim: int = 16  # rows of P a program (capped by the largest power of two dividing P)
    state: int = 128  # columns of N a tile
    num_warps: int = 4
    num_stages: int = 1


def _gpu_kernel(
    opts: _Options,
    bp: int,
    bn: int,
    heads_per_group: int,
    slots_ref,
    state_ref,
    x_ref,
    dt_ref,
    a_ref,
    b_ref,
    c_ref,
    *rest,
):
    d_ref, z_ref, bias_ref, (y_ref, state_out_ref) = _optional(opts, rest)
    row, head, pblk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[row]
    group = jax.lax.div(head, heads_per_group)
    p = pl.ds(pl.multiple_of(pblk * bp, bp), bp)
    dt = dt_ref[row, head].astype(_F32)
    dt = _process_dt(
        dt, None if bias_ref is None else bias_ref[head].astype(_F32), opts.dt_softplus,
        opts.dt_limit,
    )  # fmt: skip
    decay = jnp.exp(dt * a_ref[head].astype(_F32))
    x = x_ref[row, head, p].astype(_F32)  # [bp]
    dtx = (dt * x)[:, None]  # [bp, 1]
    y = jnp.zeros((bp,), _F32)
    for n0 in range(0, state_ref.shape[-1], bn):
        n = pl.ds(n0, bn)
        h = state_ref[slot, head, p, n].astype(_F32)  # [bp, bn]
        h = decay * h + dtx * b_ref[row, group, n].astype(_F32)[None, :]
        state_out_ref[slot, head, p, n] = h.astype(state_out_ref.dtype)
        y = y + jnp.sum(h * c_ref[row, group, n].astype(_F32)[None, :], axis=1)
    if d_ref is not None:
        y = y + d_ref[head].astype(_F32) * x
    if z_ref is not None:
        zv = z_ref[row, head, p].astype(_F32)
        y = y * (zv * jax.nn.sigmoid(zv))
    y_ref[row, head, p] = y.astype(y_ref.dtype)


def selective_state_update_gpu(
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
    block_sizes: GpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    bs = block_sizes or GpuBlockSizes()
    rows, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    bp = pow2_divisor(head_dim, bs.head_dim)
    bn = pow2_divisor(state_size, bs.state)
    opts = _Options(D is not None, z is not None, dt_bias is not None, dt_softplus, dt_limit)
    optional = [a for a in (D, z, dt_bias) if a is not None]
    kernel = functools.partial(_gpu_kernel, opts, bp, bn, num_heads // num_groups)
    y, new_state = pl.pallas_call(
        kernel,
        grid=(rows, num_heads, head_dim // bp),
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="selective_state_update",
    )(slots.astype(jnp.int32), state, x, dt, A, B, C, *optional)
    return y, new_state
