"""Pallas GPU kernels (Triton lowering) for the causal depthwise conv1d.

Decode update (``[S', K-1, D]`` pool, in place by slot through ``input_output_aliases``):
grid ``(B, D / bd)``; a program loads its K-1 state rows, then stores the shifted rows (all
loads before any store: input and output are the same memory).

Varlen prefill (the reference's contract): grid ``(T / (bt * tiles), D / bd)``; a program
covers ``tiles`` consecutive ``[bt, bd]`` tiles. One scalar load (the sequence start of the
program's last token) decides whether the whole span lies inside one sequence past its first
K-1 tokens (interior). An interior span runs as 1-D channel rows, the last K-1 rows carried
from tile to tile in registers: each row of x is loaded and converted once, no masks. With
``bd = 256 * warps`` a thread holds 8 contiguous channels: 16-byte accesses. The other
programs (a sequence start nearby, the first one, the ragged end) take a general path over
2-D tiles: tap j is the tile shifted up by K-1-j rows, clamped row gathers masked by each
token's sequence start, plus the initial-state terms (``ref.initial_state_terms``,
``[S, K-1, D]`` from XLA) for the first K-1 tokens of each sequence. Each token's sequence
start (an O(T) XLA op) comes in beside x; the final and tracked windows are O(S·K·D) gathers
done in XLA beside the kernel.

x may be D columns of a wider array (a ``ColumnView``: the xBC columns of the in_proj
output), read in place at its static column offset, where a slice would be a copy in front of
the kernel. The 16-byte accesses need that offset and the array's row width to be multiples
of 8 bf16 elements (the 9B's 10240 and 22656 are); otherwise Triton splits the accesses.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import ColumnView, aligned, as_view, pallas_call, pow2_divisor
from ..common import silu as exact_silu
from .ref import (
    TokenStarts,
    check_token_starts,
    final_and_tracked_states,
    initial_state_terms,
    token_starts,
)

_F32 = jnp.float32


def _tanh_approx(h: jax.Array, interpret: bool) -> jax.Array:
    """PTX's ``tanh.approx.f32`` (about 16.5 correct bits). Inline PTX has no interpreter, so
    interpret mode rounds ``jnp.tanh`` to 16 significant bits (relative error <= 2^-16): the
    interpret-mode tests run the approximate form with an error no smaller than the
    instruction's, not the exact function."""
    if not interpret:
        return pltriton.approx_tanh(h)
    bits = jax.lax.bitcast_convert_type(jnp.tanh(h), jnp.uint32)
    rounded = (bits + jnp.uint32(0x80)) & jnp.uint32(0xFFFFFF00)  # 24 -> 16 significant bits
    return jax.lax.bitcast_convert_type(rounded, _F32)


def silu(y: jax.Array, *, approx: bool, interpret: bool = False) -> jax.Array:
    """``y * sigmoid(y)`` on float32 ``y``.

    ``approx`` (the kernels set it for bf16 outputs): ``h + h tanh(h)`` with ``h = y / 2`` and
    ``tanh.approx``, a multiply, one special-function instruction and an FMA, where the exact
    form costs a range-reduced ``exp``, a reciprocal and a product (the prefill kernel issues
    an instruction on two thirds of its cycles, so they count). Its absolute error is
    <= 1.1e-5 for y in [-30, 30], at most 0.05 of a bf16 spacing of the output for y >= -8
    (``python3 scripts/dev/silu_error.py`` on the H200): below the bf16 store's own rounding.
    Otherwise (float32 outputs) the exact form."""
    if not approx:
        return exact_silu(y)
    half = y * 0.5
    return half + half * _tanh_approx(half, interpret)


def _activation(activation: str | None, dtype, interpret: bool):
    """The kernels' activation for outputs of ``dtype``: SiLU (approximate for bf16) or none."""
    if activation is None:
        return lambda y: y
    return functools.partial(silu, approx=jnp.dtype(dtype) == jnp.bfloat16, interpret=interpret)


# --------------------------------------------------------------------------- decode update


@dataclasses.dataclass(frozen=True)
class UpdateGpuBlockSizes:
    channels: int = 256  # a program's channels (the largest power of two dividing D, capped)
    num_warps: int = 2

    @classmethod
    def get_default(cls) -> UpdateGpuBlockSizes:
        return cls()


def _update_kernel(
    k: int, bd: int, act, has_bias, slots_ref, state_ref, x_ref, w_ref, *rest
):  # fmt: skip
    bias_ref, y_ref, state_out_ref = rest if has_bias else (None, *rest)
    row = pl.program_id(0)
    d = pl.ds(pl.multiple_of(pl.program_id(1) * bd, bd), bd)
    slot = slots_ref[row]
    x = x_ref[row, d]
    window = [state_ref[slot, tap, d] for tap in range(k - 1)] + [x.astype(state_ref.dtype)]
    acc = jnp.zeros((bd,), _F32)
    for tap in range(k):
        acc = acc + w_ref[tap, d].astype(_F32) * window[tap].astype(_F32)
    for tap in range(k - 1):
        state_out_ref[slot, tap, d] = window[tap + 1]
    if bias_ref is not None:
        acc = acc + bias_ref[d].astype(_F32)
    y_ref[row, d] = act(acc).astype(y_ref.dtype)


def causal_conv1d_update_gpu(
    conv_state: jax.Array,  # [S', K-1, D]
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    slots: jax.Array,  # i32[B]
    *,
    activation: str | None = "silu",
    interpret: bool = False,
    block_sizes: UpdateGpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    bs = block_sizes or UpdateGpuBlockSizes.get_default()
    rows, dim = x.shape
    k = weight.shape[0]
    bd = pow2_divisor(dim, bs.channels)
    act = _activation(activation, x.dtype, interpret)
    y, new_state = pallas_call(
        functools.partial(_update_kernel, k, bd, act, bias is not None),
        grid=(rows, dim // bd),
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_update",
    )(slots.astype(jnp.int32), conv_state, x, weight, *([] if bias is None else [bias]))
    return y, new_state


# --------------------------------------------------------------------------- varlen prefill


@dataclasses.dataclass(frozen=True)
class VarlenGpuBlockSizes:
    """2-D ``[tokens, channels]`` tiles (power-of-two ``tokens``); a program walks ``tiles``
    consecutive tiles, all on the interior path when its whole span is interior (one
    decision a program, so the loop has no branch in it).

    Defaults: the fastest at 8x2048 tokens, 12288 channels, inside a busy program on the H200
    (``python3 scripts/bench_conv.py --cases conv_prefill --sweep``; docs/benchmarks.md)."""

    tokens: int = 4
    channels: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    tiles: int = 4

    @classmethod
    def get_default(cls) -> VarlenGpuBlockSizes:
        return cls()


def _interior_span(start_ref, t0, span: int, k: int, num_tokens: int) -> jax.Array:
    """Whether tokens ``[t0, t0 + span)`` lie inside ``[0, T)`` and inside one sequence past its
    first K-1 tokens, so that every tap is a plain row of x: starts never decrease along the
    tokens, so the last token's start bounds them all (one scalar load)."""
    last = jnp.minimum(t0 + span - 1, num_tokens - 1)
    return (start_ref[last] <= t0 - (k - 1)) & (t0 + span <= num_tokens)


def _varlen_kernel(
    k, bt, bd, tiles, act, has_bias, has_init, num_tokens, x_col,
    seq_ref, start_ref, x_ref, w_ref, *rest,
):  # fmt: skip
    rest = list(rest)
    bias_ref = rest.pop(0) if has_bias else None
    terms_ref = rest.pop(0) if has_init else None  # f32[S * (K-1), D]: initial_state_terms
    (y_ref,) = rest
    d0 = pl.program_id(1) * bd
    d = pl.ds(pl.multiple_of(d0, bd), bd)
    xd = pl.ds(aligned(x_col + d0, x_col, bd), bd)  # the same channels of x [T, W]
    w = [w_ref[tap, d].astype(_F32) for tap in range(k)]  # tap K-1: the token
    b = jnp.zeros((bd,), _F32) if bias_ref is None else bias_ref[d].astype(_F32)

    def convolve(bias, weights, taps):  # the K taps, oldest first, weighted, plus the bias
        acc = bias
        for weight, tap in zip(weights, taps, strict=True):
            acc = acc + weight * tap.astype(_F32)
        return acc

    t_first = pl.program_id(0) * (tiles * bt)

    def interior():  # the span as 1-D rows, the window carried from tile to tile
        def row(t):
            return x_ref[t, xd].astype(_F32)

        def body(j, window):
            t0 = pl.multiple_of(t_first + j * bt, bt)
            rows = [*window, *(row(t0 + i) for i in range(bt))]
            for i in range(bt):
                y_ref[t0 + i, d] = act(convolve(b, w, rows[i : i + k])).astype(y_ref.dtype)
            return tuple(rows[bt:])

        first = tuple(row(t_first - (k - 1) + r) for r in range(k - 1))
        jax.lax.fori_loop(0, tiles, body, first)

    def general_tile(t0):  # sequence starts in the tile, the first tile, or a tile past T
        t = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
        row = jnp.minimum(t, num_tokens - 1)  # every index is clamped into range: gathers
        start = start_ref[row]
        taps = []
        for tap in range(k):
            src = t - (k - 1) + tap
            from_x = x_ref[jnp.clip(src, 0, num_tokens - 1), xd]
            taps.append(jnp.where((src >= start)[:, None], from_x.astype(_F32), 0.0))
        acc = convolve(b[None, :], [weight[None, :] for weight in w], taps)
        if terms_ref is not None:  # the initial-state taps of each sequence's first K-1 tokens
            rel = t - start
            term_row = seq_ref[row] * (k - 1) + jnp.clip(rel, 0, k - 2)
            acc = acc + jnp.where((rel < k - 1)[:, None], terms_ref[term_row, d], 0.0)
        mask = jnp.broadcast_to((t < num_tokens)[:, None], (bt, bd))
        pltriton.store(y_ref.at[pl.ds(t0, bt), d], act(acc).astype(y_ref.dtype), mask=mask)

    def general():
        def body(j, carry):
            general_tile(pl.multiple_of(t_first + j * bt, bt))
            return carry

        if tiles == 1:
            body(0, 0)
        else:
            jax.lax.fori_loop(0, tiles, body, 0)

    is_interior = _interior_span(start_ref, t_first, tiles * bt, k, num_tokens)
    jax.lax.cond(is_interior, interior, general)


def causal_conv1d_varlen_gpu(
    x: jax.Array | ColumnView,  # [T, D], or D columns of a wider array, read in place
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D]
    track_ends: jax.Array | None = None,  # i32[S]
    activation: str | None = "silu",
    starts: TokenStarts | None = None,
    interpret: bool = False,
    block_sizes: VarlenGpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    bs = block_sizes or VarlenGpuBlockSizes.get_default()
    x = as_view(x)
    num_tokens, dim = x.shape
    k = weight.shape[0]
    bt, bd = bs.tokens, pow2_divisor(dim, bs.channels)
    if bt & (bt - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two tokens block, got {bt}")
    kernel = functools.partial(
        _varlen_kernel,
        k, bt, bd, bs.tiles, _activation(activation, x.dtype, interpret),
        bias is not None, initial_states is not None, num_tokens, x.start,
    )  # fmt: skip
    if starts is None:
        starts = token_starts(cu_seqlens, num_tokens)
    check_token_starts(starts, num_tokens)
    seq, start = starts
    terms = None  # one [bt, bd] gather in the kernel instead of K-1
    if initial_states is not None:
        terms = initial_state_terms(weight, initial_states).reshape(-1, dim)
    optional = [a for a in (bias, terms) if a is not None]
    y = pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, bt * bs.tiles), dim // bd),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="causal_conv1d_varlen",
    )(seq, start, x.array, weight, *optional)
    final, tracked = final_and_tracked_states(x, initial_states, cu_seqlens, track_ends, k - 1)
    return y, final, tracked
