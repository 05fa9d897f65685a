"""Pallas GPU kernels (Triton lowering) for the fused Mamba2 decode step.

Two kernels a layer, both reading the in_proj output ``zxbcdt [T, W]`` in place (rows
``[0, B)``, its xBC and dt columns by static offset: no slice copies):

1. *conv*, grid ``(B, D / bd)``: the K-1 state rows of the slot and the new xBC column block
   are loaded before any store, the shifted window is stored back in place and, for a row
   that checkpoints this step, to its track slot too; ``silu(conv + bias)`` goes to ``xbc``
   ``[B, D]``. The arithmetic (and the SiLU form) is ``conv1d.gpu``'s update kernel's.
2. *state*, grid ``(P / (bp * tiles), H, B)``: dt processing, the selective state update with
   the D skip into ``y [B, H·P]``, the new state stored in place and to the track slot; x, B
   and C are read from ``xbc`` by offset, dt from ``zxbcdt``. The arithmetic is
   ``state_update.gpu``'s kernel's.

Why two kernels and not one: the B and C channels of the conv are shared by the H/G heads
of a group, so a one-kernel grid finer than ``(B, G)`` programs would have one program shift
a slot's B/C conv state in place while another still reads its old window (a read-after-write
race across programs; Pallas has no grid barrier). At ``(B, G)`` programs a batch-1 step has
G = 8 programs for 5 MB of state a layer, a few SMs streaming what the 128-program state
kernel spreads over the GPU. The gate and the grouped RMSNorm stay in XLA for the same
reason: a group's norm spans 16 heads, 16 programs.

The checkpoint copies that the unfused path runs as gathers and scatters of whole states
after the kernels are stores of values already in registers here: each row's checkpoint target
(``track_by_row``, the pad slot for none) is loaded beside its slot, and a program whose target
is not the pad slot stores its tiles there too: one target a row, so no program scans the
step's list of copies.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import aligned, largest_divisor, pallas_call, pow2_divisor, process_dt
from ..conv1d.gpu import UpdateGpuBlockSizes
from ..conv1d.gpu import silu as conv_silu
from ..state_update.gpu import GpuBlockSizes as StateGpuBlockSizes
from .ref import DecodeLayout

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """The two kernels' tiles: the conv update's and the state update's."""

    conv: UpdateGpuBlockSizes = UpdateGpuBlockSizes()
    state: StateGpuBlockSizes = StateGpuBlockSizes()

    @classmethod
    def get_default(cls, rows: int) -> GpuBlockSizes:
        """Up to 32 rows the two ops' defaults; above, 1024-channel conv programs (fewer
        programs load each row's checkpoint target) and half-width state tiles on 2 warps
        (``python3 scripts/bench_mamba_decode.py --rows 256 --sweep``)."""
        if rows <= 32:
            return cls(UpdateGpuBlockSizes.get_default(), StateGpuBlockSizes.get_default(rows))
        return cls(UpdateGpuBlockSizes(channels=1024, num_warps=4),
                   StateGpuBlockSizes(tiles=1, state=64, num_warps=2))  # fmt: skip


def _store_tracked(target, pad_slot: int, store) -> None:
    """``store(target)`` when the row checkpoints this step (its target is not the pad slot);
    ``target`` None: the step has no checkpoints (no code for them)."""
    if target is None:
        return

    @pl.when(target != pad_slot)
    def _():
        store(target)


def track_targets_by_row(
    slots: jax.Array,  # i32[B]
    track_src: jax.Array,  # i32[KT]
    track_dst: jax.Array,  # i32[KT]
    pad_slot: int,
) -> jax.Array:  # i32[B]
    """Each row's checkpoint target from the list of copies (pad slot: none). A working slot is
    the source of at most one copy with a real target, so the largest match is the one."""
    match = (track_src[None, :] == slots[:, None]) & (track_dst[None, :] != pad_slot)
    target = jnp.max(jnp.where(match, track_dst[None, :], -1), axis=1)
    return jnp.where(target < 0, pad_slot, target).astype(jnp.int32)


# --------------------------------------------------------------------------- conv


def _conv_kernel(
    lay: DecodeLayout, k: int, bd: int, act, has_bias: bool, pad_slot: int, tracking: bool,
    slots_ref, track_ref, state_ref, zx_ref, w_ref, *rest,
):  # fmt: skip
    bias_ref, y_ref, state_out_ref = rest if has_bias else (None, *rest)
    row = pl.program_id(0)
    d0 = pl.program_id(1) * bd
    d = pl.ds(pl.multiple_of(d0, bd), bd)
    slot, target = slots_ref[row], track_ref[row] if tracking else None
    x = zx_ref[row, pl.ds(aligned(lay.xbc_col + d0, lay.xbc_col, bd), bd)]
    window = [state_ref[slot, tap, d] for tap in range(k - 1)] + [x.astype(state_ref.dtype)]
    acc = jnp.zeros((bd,), _F32)
    for tap in range(k):
        acc = acc + w_ref[tap, d].astype(_F32) * window[tap].astype(_F32)

    def store(dst):
        for tap in range(k - 1):
            state_out_ref[dst, tap, d] = window[tap + 1]

    store(slot)
    _store_tracked(target, pad_slot, store)
    if bias_ref is not None:
        acc = acc + bias_ref[d].astype(_F32)
    y_ref[row, d] = act(acc).astype(y_ref.dtype)


# --------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class _StateOptions:
    has_d: bool
    has_bias: bool
    dt_softplus: bool
    dt_limit: tuple[float, float]
    pad_slot: int
    tracking: bool


def _state_kernel(
    lay: DecodeLayout, opts: _StateOptions, bp: int, tiles: int, bn: int,
    slots_ref, track_ref, state_ref, xbc_ref, zx_ref, a_ref, *rest,
):  # fmt: skip
    rest = list(rest)
    d_ref = rest.pop(0) if opts.has_d else None
    bias_ref = rest.pop(0) if opts.has_bias else None
    y_ref, state_out_ref = rest
    pblk, head, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    p_dim, n_dim = lay.head_dim, lay.state_size
    slot, target = slots_ref[row], track_ref[row] if opts.tracking else None
    group = jax.lax.div(head, lay.num_heads // lay.num_groups)
    p_starts = [(pblk * tiles + i) * bp for i in range(tiles)]
    ps = [pl.ds(pl.multiple_of(p0, bp), bp) for p0 in p_starts]
    ns = [pl.ds(n0, bn) for n0 in range(0, n_dim, bn)]
    b_col, c_col = lay.b_col + group * n_dim, lay.c_col + group * n_dim
    # Every load is issued before anything waits on one, the state first (as in
    # state_update.gpu): the slot is then the only latency in front of the state.
    h = [[state_ref[slot, head, p, n] for n in ns] for p in ps]
    xs = [xbc_ref[row, pl.ds(aligned(head * p_dim + p0, p_dim, bp), bp)] for p0 in p_starts]
    bs = [xbc_ref[row, pl.ds(aligned(b_col + n.start, lay.b_col, n_dim, bn), bn)] for n in ns]
    cs = [xbc_ref[row, pl.ds(aligned(c_col + n.start, lay.c_col, n_dim, bn), bn)] for n in ns]
    dt = zx_ref[row, lay.dt_col + head]
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
            new = hij.astype(state_out_ref.dtype)

            def store(dst, new=new, p=p, n=n):
                state_out_ref[dst, head, p, n] = new

            store(slot)
            _store_tracked(target, opts.pad_slot, store)
            y = y + jnp.sum(hij * cs[j].astype(_F32)[None, :], axis=1)
        if skip is not None:
            y = y + skip * x
        y_ref[row, pl.ds(aligned(head * p_dim + p_starts[i], p_dim, bp), bp)] = y.astype(
            y_ref.dtype
        )


def mamba2_decode_gpu(
    conv_state: jax.Array,  # [S', K-1, D]
    ssm_state: jax.Array,  # [S', H, P, N]
    zxbcdt: jax.Array,  # [T, W]
    conv_weight: jax.Array,  # [K, D]
    conv_bias: jax.Array | None,  # [D]
    A: jax.Array,  # [H]
    slots: jax.Array,  # i32[B]
    *,
    D: jax.Array | None = None,  # [H]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    track_src: jax.Array | None = None,  # i32[KT]
    track_dst: jax.Array | None = None,  # i32[KT]
    track_by_row: jax.Array | None = None,  # i32[B]
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    rows = slots.shape[0]
    lay = DecodeLayout.of(ssm_state, conv_weight, A)
    bs = block_sizes or GpuBlockSizes.get_default(rows)
    slots = slots.astype(jnp.int32)
    pad_slot = conv_state.shape[0] - 1
    tracking = track_by_row is not None or track_src is not None
    if track_by_row is None:
        track_by_row = (
            track_targets_by_row(slots, track_src, track_dst, pad_slot) if tracking
            else slots  # not read: the kernels are built without the checkpoint stores
        )  # fmt: skip
    tracks = (slots, track_by_row.astype(jnp.int32))

    # conv: [B, D] post-SiLU xBC, the conv state shifted in place.
    k, dim = conv_weight.shape
    bd = pow2_divisor(dim, bs.conv.channels)
    # The conv update kernel's SiLU: the tanh form for bf16 outputs, exact otherwise.
    approx = jnp.dtype(zxbcdt.dtype) == jnp.bfloat16
    act = functools.partial(conv_silu, approx=approx, interpret=interpret)
    xbc, conv_state = pallas_call(
        functools.partial(_conv_kernel, lay, k, bd, act, conv_bias is not None, pad_slot, tracking),
        grid=(rows, dim // bd),
        out_shape=[
            jax.ShapeDtypeStruct((rows, dim), zxbcdt.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={2: 1},
        compiler_params=pltriton.CompilerParams(num_warps=bs.conv.num_warps, num_stages=1),
        interpret=interpret,
        name="mamba2_decode_conv",
    )(*tracks, conv_state, zxbcdt, conv_weight, *([] if conv_bias is None else [conv_bias]))

    # state: y [B, H·P] (heads flat, as the gated norm reads them: a [B, H, P] output made
    # XLA convert it to float32 in a pass of its own before the norm), the state in place.
    sb = bs.state
    bp = pow2_divisor(lay.head_dim, sb.head_dim)
    tiles = largest_divisor(lay.head_dim // bp, sb.tiles)
    bn = pow2_divisor(lay.state_size, sb.state)
    opts = _StateOptions(D is not None, dt_bias is not None, dt_softplus, tuple(dt_limit),
                         pad_slot, tracking)  # fmt: skip
    optional = [v for v in (D, dt_bias) if v is not None]
    y, ssm_state = pallas_call(
        functools.partial(_state_kernel, lay, opts, bp, tiles, bn),
        # P blocks vary fastest: neighbouring programs stream one slot's contiguous state.
        grid=(lay.head_dim // (bp * tiles), lay.num_heads, rows),
        out_shape=[
            jax.ShapeDtypeStruct((rows, lay.d_inner), zxbcdt.dtype),
            jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype),
        ],
        input_output_aliases={2: 1},
        compiler_params=pltriton.CompilerParams(num_warps=sb.num_warps, num_stages=sb.num_stages),
        interpret=interpret,
        name="mamba2_decode_state",
    )(*tracks, ssm_state, xbc, zxbcdt, A, *optional)
    return y, conv_state, ssm_state
