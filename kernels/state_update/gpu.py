"""Pallas GPU kernel (Triton lowering) for the decode selective state update.

Grid ``(P / (bp * tiles), H, B)``: a program updates ``tiles`` state tiles ``[bp, N]`` of one
(slot, head). Triton needs power-of-two tiles, so ``bp`` is the largest power of two dividing
P (16 for P = 80) and N is walked in power-of-two tiles when it is not one. Every load (state
first, then x, B, C and the per-head scalars) is issued right after the slot id arrives and
before any arithmetic, so the slot is the only memory latency in front of the state. The
state is read once and written once, in place: the pool is aliased input→output, so a jitted
caller that donates it lets XLA skip the copy. Pad rows point at the pad slot; several of
them may race on it, which is harmless because nothing reads it.

Why the Triton lowering: the op is a gather by slot with no matrix work, a scalar load and
then plain pointer loads and stores of any tile shape, which the Triton lowering expresses
directly; Mosaic GPU's register layout holds it to 64-row tiles, which straddle heads at
P = 80 (a Mosaic GPU version measured slower: docs/history.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import largest_divisor, pallas_call, pow2_divisor, process_dt, silu

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tiles of the Triton kernel: a program updates ``tiles`` tiles of ``[head_dim, state]``.

    ``head_dim`` is capped by the largest power of two dividing P (Triton tiles are powers of
    two); ``tiles`` by the number of such tiles in P (the largest divisor of it not above).
    """

    head_dim: int = 16  # rows of P a tile
    tiles: int = 1  # tiles of P a program (all loads issued together)
    state: int = 128  # columns of N a tile
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def get_default(cls, rows: int) -> GpuBlockSizes:
        """The tiles for a batch of ``rows``. Up to 32 rows: whole heads a program (5 tiles of
        16 P rows for P = 80), 8 warps, a fifth of the programs; more rows: 16-row tiles
        (``python3 scripts/bench_state_update.py --sweep`` in a busy program on the H200,
        docs/benchmarks.md)."""
        return cls(tiles=5, num_warps=8) if rows <= 32 else cls()


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


def _kernel(
    opts: _Options,
    bp: int,
    tiles: int,
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
    pblk, head, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[row]
    group = jax.lax.div(head, heads_per_group)
    ps = [pl.ds(pl.multiple_of((pblk * tiles + i) * bp, bp), bp) for i in range(tiles)]
    ns = [pl.ds(n0, bn) for n0 in range(0, state_ref.shape[-1], bn)]
    # Every load is issued before anything waits on one, the state first: the slot is then
    # the only latency in front of the state (processing dt first would add a second).
    h = [[state_ref[slot, head, p, n] for n in ns] for p in ps]
    xs = [x_ref[row, head, p] for p in ps]
    zs = [None if z_ref is None else z_ref[row, head, p] for p in ps]
    bs = [b_ref[row, group, n] for n in ns]
    cs = [c_ref[row, group, n] for n in ns]
    dt = dt_ref[row, head]
    bias = None if bias_ref is None else bias_ref[head]
    skip = None if d_ref is None else d_ref[head].astype(_F32)
    a = a_ref[head].astype(_F32)
    dt = process_dt(dt, bias, opts.dt_softplus, opts.dt_limit)
    decay = jnp.exp(dt * a)
    for i, p in enumerate(ps):
        x = xs[i].astype(_F32)  # [bp]
        dtx = (dt * x)[:, None]  # [bp, 1]
        y = jnp.zeros((bp,), _F32)
        for j, n in enumerate(ns):
            hij = decay * h[i][j].astype(_F32) + dtx * bs[j].astype(_F32)[None, :]
            state_out_ref[slot, head, p, n] = hij.astype(state_out_ref.dtype)
            y = y + jnp.sum(hij * cs[j].astype(_F32)[None, :], axis=1)
        if skip is not None:
            y = y + skip * x
        if zs[i] is not None:
            zv = zs[i].astype(_F32)
            y = y * silu(zv)
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
    rows, num_heads, head_dim = x.shape
    bs = block_sizes or GpuBlockSizes.get_default(rows)
    num_groups, state_size = B.shape[1:]
    bp = pow2_divisor(head_dim, bs.head_dim)
    tiles = largest_divisor(head_dim // bp, bs.tiles)
    bn = pow2_divisor(state_size, bs.state)
    opts = _Options(D is not None, z is not None, dt_bias is not None, dt_softplus, dt_limit)
    optional = [a for a in (D, z, dt_bias) if a is not None]
    kernel = functools.partial(_kernel, opts, bp, tiles, bn, num_heads // num_groups)
    y, new_state = pallas_call(
        kernel,
        # P blocks vary fastest: neighbouring programs stream one slot's contiguous state.
        grid=(head_dim // (bp * tiles), num_heads, rows),
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
