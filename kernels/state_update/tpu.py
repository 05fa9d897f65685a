"""Pallas Mosaic TPU kernel for the decode selective state update (also run in TPU interpret
mode).

Grid ``(B, H / hb)``; the slot ids are scalar-prefetched into SMEM and pick the state block
``[hb, P, N]`` in the index map, so Mosaic's pipeline DMAs the next block's state while this
one computes. ``hb`` heads share one B/C group. x, z, y, B, C move as whole rows (``[H, P]``,
``[G, N]``: no padding of small dims in HBM); the per-head scalars (processed dt, exp(dt A),
D) are read from SMEM. The state is read once and written once, in place: the pool is
aliased input→output, so a jitted caller that donates it lets XLA skip the copy. Pad rows
point at the pad slot; several of them may race on it, which is harmless because nothing
reads it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import pallas_call, process_dt, silu, to_column, to_row, tpu_interpret_params

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    max_block_bytes: int = 1 << 19  # state bytes per grid step (x4 in VMEM: in/out, 2 buffers)

    @classmethod
    def get_default(cls) -> TpuBlockSizes:
        return cls()

    def heads(self, heads_per_group: int, head_dim: int, state_size: int) -> int:
        """The most heads of one group whose state block fits ``max_block_bytes``."""
        per_head = head_dim * state_size * 4
        fits = [
            hb
            for hb in range(1, heads_per_group + 1)
            if heads_per_group % hb == 0 and hb * per_head <= self.max_block_bytes
        ]
        return max(fits, default=1)


def _pick_row(a: jax.Array, i) -> jax.Array:
    """``a[i:i+1]`` for a dynamic ``i``, as a masked sublane sum."""
    rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    return jnp.sum(jnp.where(rows == i, a, 0.0), axis=0, keepdims=True)


def _kernel(
    has_d: bool,
    has_z: bool,
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
    d_ref = rest.pop(0) if has_d else None  # SMEM [H]
    z_ref = rest.pop(0) if has_z else None  # [H, P]
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
        h = decay_ref[0, head] * state_ref[j].astype(_F32) + (dt * to_column(x)) * bv  # [P, N]
        state_out_ref[j] = h.astype(state_out_ref.dtype)
        y = to_row(jnp.sum(h * cv, axis=1, keepdims=True))  # [1, P]
        if d_ref is not None:
            y = y + d_ref[head] * x
        if zs is not None:
            z = _pick_row(zs, head)
            y = y * silu(z)
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
    hb = (block_sizes or TpuBlockSizes.get_default()).heads(r, head_dim, state_size)
    # Per-(row, head) scalars are a [B, H] elementwise op: XLA fuses it; the kernel reads
    # them from SMEM.
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
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

    y, new_state = pallas_call(
        functools.partial(_kernel, D is not None, z is not None, hb, r),
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
