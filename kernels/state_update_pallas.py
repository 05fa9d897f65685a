"""Pallas kernels for the decode selective state update (Mosaic TPU and Triton-lowered GPU).

Both read each row's state ``[H, P, N]`` from the slot pool once and write it back once, in
place: the pool is aliased input→output (``input_output_aliases``), and a jitted caller that
donates it lets XLA skip the copy. Pad rows point at the pad slot; several of them may race
on it, which is harmless because nothing reads it.

* TPU: grid ``(B, H / hb)``; the slot ids are scalar-prefetched into SMEM and pick the state
  block ``[hb, P, N]`` in the index map, so Mosaic's pipeline DMAs the next block's state
  while this one computes. ``hb`` heads share one B/C group. x, z, y, B, C move as whole
  rows (``[H, P]``, ``[G, N]``: no padding of small dims in HBM); the per-head scalars
  (processed dt, exp(dt A), D) are read from SMEM.
* GPU: grid ``(P / (bp * tiles), H, B)``: a program updates ``tiles`` state tiles
  ``[bp, N]`` of one (slot, head). Triton needs power-of-two tiles, so ``bp`` is the largest
  power of two dividing P (16 for P = 80) and N is walked in power-of-two tiles when it is
  not one. Every load (state first, then x, B, C and the per-head scalars) is issued right
  after the slot id arrives and before any arithmetic: processing dt before loading the
  state put a second dependent memory latency in front of the state in every program.

GPU lowering, per op (issue 4: Mosaic GPU or the Triton lowering). The Triton lowering is
the default for this op and the conv kernels: they are gathers by slot with no matrix work,
a program needs a scalar load (its slot) and then plain pointer loads and stores with any
tile shape, which the Triton lowering expresses directly (on Ampere and Hopper alike). The
Mosaic GPU version of this op (``state_update_mosaic_gpu.py``) is held to the WGMMA
register layout, 64-row tiles, so P = 80 forces per-row factors precomputed in XLA (~2 % more
traffic and one more launch a step). Measured on the H200 (2026-11-29,
``scripts/bench_kernels.py --sweep``, one program of back-to-back steps, µs a step): batch 1
21.8 vs 18.6 (Triton, same timing), batch 8 56.9 vs 52.9, batch 32 147.4 vs 115.2: Mosaic
GPU is 28 % slower at batch 32, no faster at 1 and 8 (there the wall time is mostly
launches) and 1.3x slower at batch 256 (963 µs against 740-771 µs for the Triton tiles, a
later sweep), so dispatch keeps the Triton kernel. Inside a busy program (the way the
engine's decode step runs it) the Triton kernel takes 5.0 / 23.7 / 88.3 / 687.5 µs at batch
1 / 8 / 32 / 256, SGLang's in its CUDA graph 5.3 / 23.9 / 88.2 / 690.4 µs; 687.5 µs is
91 % of the 4.3 TB/s roofline (docs/benchmarks.md, fifth session).
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


def _column(row: jax.Array) -> jax.Array:
    """[1, P] -> [P, 1] on the VPU (an identity mask and a lane sum; exact)."""
    n = row.shape[1]
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (n, n), 1
    )
    return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def _row(col: jax.Array) -> jax.Array:
    """[P, 1] -> [1, P], as :func:`_column`."""
    n = col.shape[0]
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (n, n), 1
    )
    return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def _pick_row(a: jax.Array, i) -> jax.Array:
    """``a[i:i+1]`` for a dynamic ``i``, as a masked sublane sum."""
    rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    return jnp.sum(jnp.where(rows == i, a, 0.0), axis=0, keepdims=True)


def _tpu_kernel(
    opts: _Options,
    hb: int,
    heads_per_group: int,
    slots_ref,
    state_ref,  # [hb, P, N] this row's slot, heads [j*hb, (j+1)*hb)
    x_ref,  # [H, P] the whole row (fetched once per row)
    dt_ref,  # SMEM [1, H] processed dt
    decay_ref,  # SMEM [1, H] exp(dt A)
    b_ref,  # [G, N]
    c_ref,  # [G, N]
    *rest,
):
    del slots_ref  # used by the index maps only
    rest = list(rest)
    d_ref = rest.pop(0) if opts.has_d else None  # SMEM [H]
    z_ref = rest.pop(0) if opts.has_z else None  # [H, P]
    y_ref, state_out_ref, y_acc = rest
    blk = pl.program_id(1)
    group = jax.lax.div(blk * hb, heads_per_group)
    bv = _pick_row(b_ref[...].astype(_F32), group)  # [1, N]
    cv = _pick_row(c_ref[...].astype(_F32), group)
    xs = x_ref[...].astype(_F32)  # [H, P]
    zs = None if z_ref is None else z_ref[...].astype(_F32)
    y_all = y_acc[...]
    row_ids = jax.lax.broadcasted_iota(jnp.int32, y_all.shape, 0)
    # x varies along P, which is the state's sublane axis but the lane axis of x: each head
    # works on 2-D [P, N] tiles and moves P-vectors between the two axes on the VPU. Rows
    # are picked with masks, not dynamic sublane slices (Mosaic cannot slice packed bf16).
    for j in range(hb):
        head = blk * hb + j
        x = _pick_row(xs, head)  # [1, P]
        dt = dt_ref[0, head]
        h = decay_ref[0, head] * state_ref[j].astype(_F32) + (dt * _column(x)) * bv  # [P, N]
        state_out_ref[j] = h.astype(state_out_ref.dtype)
        y = _row(jnp.sum(h * cv, axis=1, keepdims=True))  # [1, P]
        if d_ref is not None:
            y = y + d_ref[head] * x
        if zs is not None:
            z = _pick_row(zs, head)
            y = y * (z * jax.nn.sigmoid(z))
        y_all = jnp.where(row_ids == head, y, y_all)
    y_acc[...] = y_all

    @pl.when(blk == pl.num_programs(1) - 1)
    def _():
        y_ref[...] = y_acc[...].astype(y_ref.dtype)


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
    opts = _Options(D is not None, z is not None, False, dt_softplus, dt_limit)
    # Per-(row, head) scalars are a [B, H] elementwise op: XLA fuses it; the kernel reads
    # them from SMEM.
    dt = _process_dt(
        dt.astype(_F32), None if dt_bias is None else dt_bias.astype(_F32), dt_softplus, dt_limit
    )
    decay = jnp.exp(dt * A.astype(_F32))

    smem_row = pl.BlockSpec(
        (None, 1, num_heads), lambda b, j, s: (b, 0, 0), memory_space=pltpu.SMEM
    )
    row_spec = pl.BlockSpec((None, num_heads, head_dim), lambda b, j, s: (b, 0, 0))
    group_spec = pl.BlockSpec((None, num_groups, state_size), lambda b, j, s: (b, 0, 0))
    state_spec = pl.BlockSpec((None, hb, head_dim, state_size), lambda b, j, s: (s[b], j, 0, 0))
    args = [state, x, dt.reshape(rows, 1, num_heads), decay.reshape(rows, 1, num_heads), B, C]
    specs = [state_spec, row_spec, smem_row, smem_row, group_spec, group_spec]
    if D is not None:
        args.append(D.astype(_F32))
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    if z is not None:
        args.append(z)
        specs.append(row_spec)

    y, new_state = pl.pallas_call(
        functools.partial(_tpu_kernel, opts, hb, r),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(rows, num_heads // hb),
            in_specs=specs,
            out_specs=[row_spec, state_spec],
            scratch_shapes=[pltpu.VMEM((num_heads, head_dim), _F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={1: 1},  # operand 0 is the prefetched slots
        # y's block is the whole row, revisited along the head axis: that axis is sequential.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret_params(interpret),
        name="selective_state_update",
    )(slots.astype(jnp.int32), *args)
    return y, new_state


# --------------------------------------------------------------------------- GPU (Triton)


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
    # Cache eviction hint for the state's load and store ("evict_first": the state streams
    # through once, so L2 keeps x, B, C and the scalars instead); None: the default policy.
    state_eviction: str | None = None

    @classmethod
    def for_rows(cls, rows: int) -> GpuBlockSizes:
        """The default for a batch of ``rows``. Up to 32 rows: whole heads a program (5 tiles
        of 16 P rows for P = 80), 8 warps, a fifth of the programs. Inside a busy program on
        the H200 (fifth session): 4.7 / 23.8 / 88.1 µs at batch 1 / 8 / 32 against 4.9 /
        24.6 / 88.4 µs for the 16-row tiles, which stay the default at larger batches
        (91 % of the roofline at batch 256)."""
        return cls(tiles=5, num_warps=8) if rows <= 32 else cls()


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (at least 1)."""
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def _gpu_kernel(
    opts: _Options,
    bp: int,
    tiles: int,
    bn: int,
    heads_per_group: int,
    eviction: str | None,
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
    h = [
        [pltriton.load(state_ref.at[slot, head, p, n], eviction_policy=eviction) for n in ns]
        for p in ps
    ]
    xs = [x_ref[row, head, p] for p in ps]
    zs = [None if z_ref is None else z_ref[row, head, p] for p in ps]
    bs = [b_ref[row, group, n] for n in ns]
    cs = [c_ref[row, group, n] for n in ns]
    dt = dt_ref[row, head].astype(_F32)
    bias = None if bias_ref is None else bias_ref[head].astype(_F32)
    skip = None if d_ref is None else d_ref[head].astype(_F32)
    a = a_ref[head].astype(_F32)
    dt = _process_dt(dt, bias, opts.dt_softplus, opts.dt_limit)
    decay = jnp.exp(dt * a)
    for i, p in enumerate(ps):
        x = xs[i].astype(_F32)  # [bp]
        dtx = (dt * x)[:, None]  # [bp, 1]
        y = jnp.zeros((bp,), _F32)
        for j, n in enumerate(ns):
            hij = decay * h[i][j].astype(_F32) + dtx * bs[j].astype(_F32)[None, :]
            pltriton.store(
                state_out_ref.at[slot, head, p, n],
                hij.astype(state_out_ref.dtype),
                eviction_policy=eviction,
            )
            y = y + jnp.sum(hij * cs[j].astype(_F32)[None, :], axis=1)
        if skip is not None:
            y = y + skip * x
        if zs[i] is not None:
            zv = zs[i].astype(_F32)
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
    rows, num_heads, head_dim = x.shape
    bs = block_sizes or GpuBlockSizes.for_rows(rows)
    num_groups, state_size = B.shape[1:]
    bp = pow2_divisor(head_dim, bs.head_dim)
    tiles = largest_divisor(head_dim // bp, bs.tiles)
    bn = pow2_divisor(state_size, bs.state)
    opts = _Options(D is not None, z is not None, dt_bias is not None, dt_softplus, dt_limit)
    optional = [a for a in (D, z, dt_bias) if a is not None]
    kernel = functools.partial(
        _gpu_kernel, opts, bp, tiles, bn, num_heads // num_groups, bs.state_eviction
    )
    y, new_state = pl.pallas_call(
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
