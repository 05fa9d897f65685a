"""Pallas Mosaic TPU kernels for the causal depthwise conv1d (also run in TPU interpret mode).

Decode update (``[S', K-1, D]`` pool, in place by slot through ``input_output_aliases``):
grid ``(B, D / bd)``, the slot ids scalar-prefetched into SMEM pick the state block in the
index map; the shifted window is written row by row.

Varlen prefill (the reference's contract): grid ``(T / bt, D / bd)`` over 2-D tiles. The tile
and the 8 rows before it (a second, 8-row BlockSpec on x) go to a VMEM buffer; tap k is the
buffer read at a static row offset, masked where it falls before the token's sequence start.
The initial-state terms (non-zero only on the first K-1 tokens of a sequence) are precomputed
per sequence (``ref.initial_state_terms``, ``[S, K-1, D]``, tiny) and added to the rows of the
sequences that start in the tile. The final and tracked windows are gathers done in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import ColumnView, as_array, pallas_call, round_up, silu, tpu_interpret_params
from .ref import (
    TokenStarts,
    check_token_starts,
    final_and_tracked_states,
    initial_state_terms,
    token_starts,
)

_F32 = jnp.float32
_HALO = 8  # rows of x before a tile that the varlen kernel reads (>= K-1, one sublane tile)


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    return y if activation is None else silu(y)


def _lane_block(dim: int, cap: int) -> int:
    """Channel block: the largest multiple of 128 dividing ``dim`` (at most ``cap``)."""
    if dim % 128:
        return dim
    return max(b for b in range(128, min(dim, cap) + 1, 128) if dim % b == 0)


# --------------------------------------------------------------------------- decode update


@dataclasses.dataclass(frozen=True)
class UpdateTpuBlockSizes:
    channels: int = 2048  # a program's channels (a multiple of 128 dividing D, capped)

    @classmethod
    def get_default(cls) -> UpdateTpuBlockSizes:
        return cls()


def _update_kernel(
    k: int, activation, has_bias, slots_ref, state_ref, x_ref, w_ref, *rest
):  # fmt: skip
    del slots_ref
    bias_ref, y_ref, state_out_ref = rest if has_bias else (None, *rest)
    x = x_ref[...].astype(_F32)  # [1, bd]
    acc = w_ref[k - 1 : k, :].astype(_F32) * x
    for tap in range(k - 1):
        acc = acc + w_ref[tap : tap + 1, :].astype(_F32) * state_ref[tap : tap + 1, :].astype(_F32)
    for row in range(k - 2):
        state_out_ref[row : row + 1, :] = state_ref[row + 1 : row + 2, :]
    state_out_ref[k - 2 : k - 1, :] = x.astype(state_out_ref.dtype)
    if bias_ref is not None:
        acc = acc + bias_ref[...].astype(_F32)
    y_ref[...] = _activate(acc, activation).astype(y_ref.dtype)


def causal_conv1d_update_tpu(
    conv_state: jax.Array,  # [S', K-1, D]
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    slots: jax.Array,  # i32[B]
    *,
    activation: str | None = "silu",
    interpret: bool = False,
    block_sizes: UpdateTpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    rows, dim = x.shape
    k = weight.shape[0]
    bd = _lane_block(dim, (block_sizes or UpdateTpuBlockSizes.get_default()).channels)
    state_spec = pl.BlockSpec((None, k - 1, bd), lambda b, j, s: (s[b], 0, j))
    row_spec = pl.BlockSpec((None, 1, bd), lambda b, j, s: (b, 0, j))
    args = [conv_state, x.reshape(rows, 1, dim), weight]
    specs = [state_spec, row_spec, pl.BlockSpec((k, bd), lambda b, j, s: (0, j))]
    if bias is not None:
        args.append(bias.reshape(1, dim))
        specs.append(pl.BlockSpec((1, bd), lambda b, j, s: (0, j)))
    y, new_state = pallas_call(
        functools.partial(_update_kernel, k, activation, bias is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(rows, dim // bd),
            in_specs=specs,
            out_specs=[row_spec, state_spec],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((rows, 1, dim), x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_params(interpret),
        name="causal_conv1d_update",
    )(slots.astype(jnp.int32), *args)
    return y.reshape(rows, dim), new_state


# --------------------------------------------------------------------------- varlen prefill


@dataclasses.dataclass(frozen=True)
class VarlenTpuBlockSizes:
    tokens: int = 256  # a tile's tokens (fewer for short inputs, a multiple of 8)
    channels: int = 512  # a tile's channels (a multiple of 128 dividing D, capped)

    @classmethod
    def get_default(cls) -> VarlenTpuBlockSizes:
        return cls()


def _varlen_kernel(
    k, bt, activation, has_bias, has_init,
    cu_ref, lo_ref, hi_ref, x_ref, halo_ref, start_ref, w_ref, *rest,
):  # fmt: skip
    rest = list(rest)
    bias_ref = rest.pop(0) if has_bias else None
    corr_ref = rest.pop(0) if has_init else None
    y_ref, buf_ref, acc_ref = rest
    i = pl.program_id(0)
    t0 = i * bt
    buf_ref[:_HALO, :] = halo_ref[...].astype(_F32)
    buf_ref[_HALO:, :] = x_ref[...].astype(_F32)
    t = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    start = start_ref[...]  # [bt, 1]
    acc = jnp.zeros(acc_ref.shape, _F32)
    for tap in range(k):
        shift = k - 1 - tap
        tap_rows = buf_ref[_HALO - shift : _HALO - shift + bt, :]
        if shift:
            tap_rows = jnp.where(t - shift >= start, tap_rows, 0.0)
        acc = acc + w_ref[tap : tap + 1, :].astype(_F32) * tap_rows
    acc_ref[...] = acc

    if corr_ref is not None:
        row_ids = jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)

        def add_initial_terms(s, carry):
            seq_start, seq_end = cu_ref[s], cu_ref[s + 1]
            for j in range(k - 1):
                r = seq_start + j - t0
                hit = (row_ids == r) & (seq_start + j < seq_end)
                acc_ref[...] += jnp.where(hit, corr_ref[s, j : j + 1, :], 0.0)
            return carry

        jax.lax.fori_loop(lo_ref[i], hi_ref[i], add_initial_terms, 0)

    out = acc_ref[...]
    if bias_ref is not None:
        out = out + bias_ref[...].astype(_F32)
    y_ref[...] = _activate(out, activation).astype(y_ref.dtype)


def causal_conv1d_varlen_tpu(
    x: jax.Array | ColumnView,  # [T, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D]
    track_ends: jax.Array | None = None,  # i32[S]
    activation: str | None = "silu",
    starts: TokenStarts | None = None,
    interpret: bool = False,
    block_sizes: VarlenTpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    bs = block_sizes or VarlenTpuBlockSizes.get_default()
    x = as_array(x)  # the BlockSpecs tile a whole array
    num_tokens, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    k = weight.shape[0]
    if k - 1 > _HALO:
        raise ValueError(f"the TPU conv kernel supports K <= {_HALO + 1}, got K={k}")
    bt = min(bs.tokens, round_up(num_tokens, _HALO))
    bd = _lane_block(dim, bs.channels)
    padded = round_up(num_tokens, bt)
    if starts is None:
        starts = token_starts(cu_seqlens, num_tokens)
    check_token_starts(starts, num_tokens)
    start = starts.start
    xp = x
    if padded != num_tokens:  # only for token counts that are not a tile multiple
        xp = jnp.pad(x, ((0, padded - num_tokens), (0, 0)))
        start = jnp.pad(start, (0, padded - num_tokens), mode="edge")
    num_blocks = padded // bt
    # Sequences whose first K-1 tokens meet tile i: cu[s] in [t0 - (K-2), t0 + bt).
    t0 = jnp.arange(num_blocks, dtype=jnp.int32) * bt
    seq_starts = cu_seqlens[:-1]
    lo = jnp.searchsorted(seq_starts, t0 - (k - 2), side="left", method="compare_all")
    hi = jnp.searchsorted(seq_starts, t0 + bt, side="left", method="compare_all")

    tile = pl.BlockSpec((bt, bd), lambda i, j, *_: (i, j))
    halo_blocks = bt // _HALO
    halo = pl.BlockSpec((_HALO, bd), lambda i, j, *_: (jnp.maximum(i * halo_blocks - 1, 0), j))
    args = [xp, xp, start.reshape(padded, 1), weight]
    specs = [
        tile,
        halo,
        pl.BlockSpec((bt, 1), lambda i, j, *_: (i, 0)),
        pl.BlockSpec((k, bd), lambda i, j, *_: (0, j)),
    ]
    if bias is not None:
        args.append(bias.reshape(1, dim))
        specs.append(pl.BlockSpec((1, bd), lambda i, j, *_: (0, j)))
    if initial_states is not None:
        args.append(initial_state_terms(weight, initial_states))
        specs.append(pl.BlockSpec((num_seqs, k - 1, bd), lambda i, j, *_: (0, 0, j)))

    y = pallas_call(
        functools.partial(
            _varlen_kernel, k, bt, activation, bias is not None, initial_states is not None
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_blocks, dim // bd),
            in_specs=specs,
            out_specs=tile,
            scratch_shapes=[pltpu.VMEM((_HALO + bt, bd), _F32), pltpu.VMEM((bt, bd), _F32)],
        ),
        out_shape=jax.ShapeDtypeStruct((padded, dim), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_params(interpret),
        name="causal_conv1d_varlen",
    )(cu_seqlens.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), *args)
    final, tracked = final_and_tracked_states(x, initial_states, cu_seqlens, track_ends, k - 1)
    return y[:num_tokens], final, tracked
