"""Pallas kernels for the causal depthwise conv1d: varlen prefill and the decode update.

Decode update (``[S', K-1, D]`` pool, in place by slot through ``input_output_aliases``):

* TPU: grid ``(B, D / bd)``, the slot ids scalar-prefetched into SMEM pick the state block
  in the index map; the shifted window is written row by row.
* GPU: grid ``(B, D / bd)``, a program loads its K-1 state rows, then stores the shifted
  rows (all loads before any store: input and output are the same memory).

Varlen prefill (the reference's contract: initial states by sequence, final and tracked
windows as outputs). Each token's taps before its sequence's first token come from the
initial state, so the kernels need each token's sequence start (``token_seq_ids``, an O(T)
XLA op). The final and tracked windows are O(S·K·D) gathers done in XLA beside the kernel.

* GPU: grid ``(T / (bt * tiles), D / bd)``; a program covers ``tiles`` consecutive
  ``[bt, bd]`` tiles. One scalar load (the sequence start of the program's last token)
  decides whether the whole span lies inside one sequence past its first K-1 tokens
  (interior). An interior span runs as 1-D channel rows, the last K-1 rows carried from tile
  to tile in registers: each row of x is loaded and converted once, no masks. With
  ``bd = 256 * warps`` a thread holds 8 contiguous channels: 16-byte accesses. The other
  programs (a sequence start nearby, the first one, the ragged end) take a general path over
  2-D tiles: tap j is the tile shifted up by K-1-j rows, clamped row gathers masked by each
  token's sequence start, plus the initial-state terms (``_initial_state_terms``,
  ``[S, K-1, D]`` from XLA) for the first K-1 tokens of each sequence. SiLU runs through
  ``tanh.approx`` by default: the kernel was as much bound by its instructions as by memory
  (``ConvVarlenBlockSizes``). An earlier per-token kernel ("rows", 697 us at 8x2048 on the
  H200 against 229 us now) was removed in the sixth session; docs/benchmarks.md keeps its
  figures.
* TPU: grid ``(T / bt, D / bd)`` over 2-D tiles. The tile and the 8 rows before it (a
  second, 8-row BlockSpec on x) go to a VMEM buffer; tap k is the buffer read at a static
  row offset, masked where it falls before the token's sequence start. The initial-state
  terms (non-zero only on the first K-1 tokens of a sequence) are precomputed per sequence
  (``[S, K-1, D]``, tiny) and added to the rows of the sequences that start in the tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from .state_update_pallas import pow2_divisor, tpu_interpret_params

_F32 = jnp.float32


_LOG2_E = 1.4426950408889634


SILU_FORMS = ("sigmoid", "exp2_rcp", "tanh")


def _silu(y: jax.Array, activation: str | None, form: str = "sigmoid", interpret=False):
    """``y * sigmoid(y)`` in one of ``SILU_FORMS``, which differ in instructions on the GPU
    (the conv prefill kernel issues instructions on two thirds of its cycles, so they count):

    * ``"sigmoid"``: ``jax.nn.sigmoid``: libdevice's accurate ``expf`` (a range reduction
      around ``ex2``), then a reciprocal and a product.
    * ``"exp2_rcp"``: ``y * rcp(1 + 2^(-y log2 e))``: a multiply, an ``ex2``, an add, one
      ``rcp.approx`` and a multiply (two special-function instructions). A plain division
      would add a range check and two scalings, which cannot fire: the denominator is >= 1,
      and an infinite one gives 0 as it should.
    * ``"tanh"``: ``h + h tanh(h)`` with ``h = y / 2`` and PTX's ``tanh.approx``: a multiply,
      one special-function instruction and an FMA. Measured on the H200 against float64
      (``scripts/silu_error.py``): absolute error <= 1.1e-5 for y in [-30, 30], at most 0.05
      of a bf16 spacing of the output for y >= -8. Below -8 (outputs under 2.7e-3) the same
      absolute error is large against the tiny output; ``"exp2_rcp"`` has a relative error
      of ~2e-6 everywhere.

    The inline-assembly forms have no interpreter; under ``interpret`` they run as the
    plain formula they approximate."""
    if activation is None:
        return y
    if form == "sigmoid":
        return y * jax.nn.sigmoid(y)
    if form == "tanh":
        half = y * 0.5
        tanh = jnp.tanh(half) if interpret else pltriton.approx_tanh(half)
        return half + half * tanh
    if form != "exp2_rcp":
        raise ValueError(f"SiLU form must be one of {SILU_FORMS}, got {form!r}")
    denominator = 1.0 + jnp.exp2(y * -_LOG2_E)
    if interpret:
        return y / denominator
    [reciprocal] = pltriton.elementwise_inline_asm(
        "rcp.approx.ftz.f32 $0, $1;",
        args=[denominator],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct.like(denominator)],
    )
    return y * reciprocal


def _lane_block(dim: int, cap: int) -> int:
    """TPU channel block: the largest multiple of 128 dividing ``dim`` (at most ``cap``)."""
    if dim % 128:
        return dim
    return max(b for b in range(128, min(dim, cap) + 1, 128) if dim % b == 0)


# --------------------------------------------------------------------------- decode update


@dataclasses.dataclass(frozen=True)
class ConvUpdateBlockSizes:
    """``gpu_silu``: one of ``SILU_FORMS`` (see ``_silu``). Tanh, the default, measured level
    with sigmoid at batch 1 (2.2 us a step, the kernel a chain of latencies) and 15.0 against
    15.5 us at batch 256 (H200, sixth session's sweep)."""

    tpu_channels: int = 2048
    gpu_channels: int = 256
    gpu_num_warps: int = 2
    gpu_silu: str = "tanh"


def _update_tpu_kernel(
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
    y_ref[...] = _silu(acc, activation).astype(y_ref.dtype)


def causal_conv1d_update_tpu(
    conv_state: jax.Array,  # [S', K-1, D]
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    slots: jax.Array,  # i32[B]
    *,
    activation: str | None = "silu",
    interpret: bool = False,
    block_sizes: ConvUpdateBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    rows, dim = x.shape
    k = weight.shape[0]
    bd = _lane_block(dim, (block_sizes or ConvUpdateBlockSizes()).tpu_channels)
    state_spec = pl.BlockSpec((None, k - 1, bd), lambda b, j, s: (s[b], 0, j))
    row_spec = pl.BlockSpec((None, 1, bd), lambda b, j, s: (b, 0, j))
    args = [conv_state, x.reshape(rows, 1, dim), weight]
    specs = [state_spec, row_spec, pl.BlockSpec((k, bd), lambda b, j, s: (0, j))]
    if bias is not None:
        args.append(bias.reshape(1, dim))
        specs.append(pl.BlockSpec((1, bd), lambda b, j, s: (0, j)))
    y, new_state = pl.pallas_call(
        functools.partial(_update_tpu_kernel, k, activation, bias is not None),
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


def _update_gpu_kernel(
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
    block_sizes: ConvUpdateBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    bs = block_sizes or ConvUpdateBlockSizes()
    rows, dim = x.shape
    k = weight.shape[0]
    bd = pow2_divisor(dim, bs.gpu_channels)
    if bs.gpu_silu not in SILU_FORMS:
        raise ValueError(f"gpu_silu must be one of {SILU_FORMS}, got {bs.gpu_silu!r}")
    act = functools.partial(_silu, activation=activation, form=bs.gpu_silu, interpret=interpret)
    y, new_state = pl.pallas_call(
        functools.partial(_update_gpu_kernel, k, bd, act, bias is not None),
        grid=(rows, dim // bd),
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=bs.gpu_num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_update",
    )(slots.astype(jnp.int32), conv_state, x, weight, *([] if bias is None else [bias]))
    return y, new_state


# --------------------------------------------------------------------------- varlen prefill


@dataclasses.dataclass(frozen=True)
class ConvVarlenBlockSizes:
    """Tile sizes of the varlen kernels (module docstring):

    * GPU: 2-D ``[gpu_tokens, gpu_channels]`` tiles (power-of-two ``gpu_tokens``), a program
      walks ``gpu_tiles`` consecutive tiles, all on the fast path when its whole span is
      interior (one decision a program, so the loop has no branch in it).
      ``gpu_carry_window`` (default): the interior span as 1-D channel rows, the last K-1
      rows carried from tile to tile in registers; without it, tap j is a load of the tile
      shifted by K-1-j rows (each tile reloads and reconverts K-1 rows).
      ``gpu_preload`` (one tile a program, shifted tiles): the fast path's loads are issued
      before the decision, beside the start load, instead of after it: one memory latency a
      program instead of two, for ~16 more registers.

    ``gpu_silu``: how the GPU kernels compute SiLU, one of ``SILU_FORMS`` (see ``_silu``).

    GPU defaults: the fastest of ``scripts/bench_kernels.py --sweep`` on the H200 at 8x2048
    tokens, 12288 channels, inside a busy program (sixth session, 2026-11-29): "tile", 4
    tokens x 1024 channels, 4 warps, 4 tiles a program, the window carried, tanh SiLU:
    229 us, 82 % of the HBM roofline (same run: the fifth session's default, shifted tiles
    and exp2 SiLU, 256 us; SGLang's Triton kernel 317 us). Nsight Compute showed that default
    issuing an instruction on 67 % of a scheduler's cycles at 3.2 TB/s: the kernel was as
    much instruction-bound as memory-bound, and the two changes cut its instructions an
    element from ~16.5 to ~10.3 (SASS of the loop, offline).
    """

    tpu_tokens: int = 256
    tpu_channels: int = 512
    gpu_tokens: int = 4
    gpu_channels: int = 1024
    gpu_num_warps: int = 4
    gpu_num_stages: int = 1
    gpu_tiles: int = 4
    gpu_silu: str = "tanh"
    gpu_preload: bool = True
    gpu_carry_window: bool = True


def _token_starts(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(seq i32[T], start i32[T]): each token's sequence and that sequence's first token."""
    from .conv1d import token_seq_ids  # conv1d imports this module

    seq = token_seq_ids(cu_seqlens, num_tokens)
    return seq, cu_seqlens[seq]


def _windows(x, initial_states, cu_seqlens, ends, width):
    """[S, width, D]: the ``width`` inputs before relative position ``ends[s]`` (no copy of x)."""
    num_tokens = x.shape[0]
    p = ends[:, None] - width + jnp.arange(width, dtype=jnp.int32)  # [S, width]
    from_x = x[jnp.clip(cu_seqlens[:-1, None] + p, 0, num_tokens - 1)].astype(_F32)
    if initial_states is None:
        from_state = jnp.zeros_like(from_x)
    else:
        rows = jnp.clip(width + p, 0, width - 1)  # state row K-1+p for p < 0
        from_state = jnp.take_along_axis(initial_states.astype(_F32), rows[..., None], axis=1)
    state_dtype = _F32 if initial_states is None else initial_states.dtype
    return jnp.where((p >= 0)[..., None], from_x, from_state).astype(state_dtype)


def _initial_state_terms(weight: jax.Array, initial_states: jax.Array) -> jax.Array:
    """f32[S, K-1, D]: row j is the part of token j's output (relative position j < K-1 in
    its sequence) that comes from the initial state: the taps that reach before the start."""
    k = weight.shape[0]
    w, init = weight.astype(_F32), initial_states.astype(_F32)
    rows = []
    for j in range(k - 1):
        term = jnp.zeros_like(init[:, 0])
        for tap in range(k - 1 - j):  # tap reads position j - (K-1) + tap < 0: state row j + tap
            term = term + w[tap] * init[:, j + tap]
        rows.append(term)
    return jnp.stack(rows, axis=1)


def _varlen_outputs(x, y, initial_states, cu_seqlens, track_ends, k):
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    final = _windows(x, initial_states, cu_seqlens, lengths, k - 1)
    tracked = None
    if track_ends is not None:
        tracked = _windows(x, initial_states, cu_seqlens, track_ends, k - 1)
    return y, final, tracked


def _interior_tile(start_ref, t0, bt: int, k: int, num_tokens: int) -> jax.Array:
    """Whether tokens ``[t0, t0 + bt)`` lie inside ``[0, T)`` and inside one sequence past its
    first K-1 tokens, so that every tap is a plain row of x: starts never decrease along the
    tokens, so the last token's start bounds them all (one scalar load)."""
    last = jnp.minimum(t0 + bt - 1, num_tokens - 1)
    return (start_ref[last] <= t0 - (k - 1)) & (t0 + bt <= num_tokens)


def _varlen_gpu_tile_kernel(
    k, bt, bd, tiles, preload, carry_window, act, has_bias, has_init, num_tokens,
    seq_ref, start_ref, x_ref, w_ref, *rest,
):  # fmt: skip
    rest = list(rest)
    bias_ref = rest.pop(0) if has_bias else None
    terms_ref = rest.pop(0) if has_init else None  # f32[S * (K-1), D]: _initial_state_terms
    (y_ref,) = rest
    d = pl.ds(pl.multiple_of(pl.program_id(1) * bd, bd), bd)
    w = [w_ref[tap, d].astype(_F32)[None, :] for tap in range(k)]  # tap K-1: the token
    b = jnp.zeros((1, bd), _F32) if bias_ref is None else bias_ref[d].astype(_F32)[None, :]

    def output(acc):
        return act(acc).astype(y_ref.dtype)

    def convolve(bias, weights, taps):  # the K taps, oldest first, weighted, plus the bias
        acc = bias
        for weight, tap in zip(weights, taps, strict=True):
            acc = acc + weight * tap.astype(_F32)
        return acc

    def interior_from(t0, taps):
        y_ref[pl.ds(t0, bt), d] = output(convolve(b, w, taps))

    def interior(t0):
        # Tap j reads the tile shifted up by K-1-j rows. When a thread holds whole columns of
        # the tile (bd = 256 * warps) the compiler merges the repeated rows into one load
        # each; otherwise the repeats are L1/L2 hits. Either way HBM sees each row about once.
        interior_from(t0, [x_ref[pl.ds(t0 - (k - 1) + tap, bt), d] for tap in range(k)])

    def general(t0):  # sequence starts in the tile, the first tile, or a tile past T
        t = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
        row = jnp.minimum(t, num_tokens - 1)  # every index is clamped into range: gathers
        start = start_ref[row]
        acc = b
        for tap in range(k):
            src = t - (k - 1) + tap
            from_x = x_ref[jnp.clip(src, 0, num_tokens - 1), d].astype(_F32)
            acc = acc + w[tap] * jnp.where((src >= start)[:, None], from_x, 0.0)
        if terms_ref is not None:  # the initial-state taps of each sequence's first K-1 tokens
            rel = t - start
            term_row = seq_ref[row] * (k - 1) + jnp.clip(rel, 0, k - 2)
            acc = acc + jnp.where((rel < k - 1)[:, None], terms_ref[term_row, d], 0.0)
        mask = jnp.broadcast_to((t < num_tokens)[:, None], (bt, bd))
        pltriton.store(y_ref.at[pl.ds(t0, bt), d], output(acc), mask=mask)

    # One decision for the program's span of ``tiles`` tiles, so that the interior loop has
    # no branch in it.
    t_first = pl.program_id(0) * (tiles * bt)
    t_span = tiles * bt
    is_interior = _interior_tile(start_ref, t_first, t_span, k, num_tokens)

    if preload and tiles == 1 and not carry_window and num_tokens >= bt + k - 1:
        # The fast path's loads are issued beside the start load that decides, not after it
        # (one memory latency a program, not two). Their window is clamped into [0, T); it
        # is exactly the taps whenever the fast path is taken (t0 >= K-1, t0 + bt <= T).
        base = jnp.clip(t_first - (k - 1), 0, num_tokens - bt - (k - 1))
        taps = [x_ref[pl.ds(base + tap, bt), d] for tap in range(k)]
        jax.lax.cond(is_interior, lambda: interior_from(t_first, taps), lambda: general(t_first))
        return

    def interior_rows():  # the span as 1-D rows, the window carried from tile to tile
        w_row, b_row = [tap[0] for tap in w], b[0]

        def row(t):
            return x_ref[t, d].astype(_F32)

        def body(j, window):
            t0 = pl.multiple_of(t_first + j * bt, bt)
            rows = [*window, *(row(t0 + i) for i in range(bt))]
            for i in range(bt):
                y_ref[t0 + i, d] = output(convolve(b_row, w_row, rows[i : i + k]))
            return tuple(rows[bt:])

        first = tuple(row(t_first - (k - 1) + r) for r in range(k - 1))
        jax.lax.fori_loop(0, tiles, body, first)

    def each_tile(path):
        def body(j, carry):
            path(pl.multiple_of(t_first + j * bt, bt))
            return carry

        if tiles == 1:
            body(0, 0)
        else:
            jax.lax.fori_loop(0, tiles, body, 0)

    if carry_window:
        jax.lax.cond(is_interior, interior_rows, lambda: each_tile(general))
        return
    jax.lax.cond(is_interior, lambda: each_tile(interior), lambda: each_tile(general))


def causal_conv1d_varlen_gpu(
    x: jax.Array,  # [T, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D]
    track_ends: jax.Array | None = None,  # i32[S]
    activation: str | None = "silu",
    interpret: bool = False,
    block_sizes: ConvVarlenBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    bs = block_sizes or ConvVarlenBlockSizes()
    num_tokens, dim = x.shape
    k = weight.shape[0]
    bt, bd = bs.gpu_tokens, pow2_divisor(dim, bs.gpu_channels)
    if bt & (bt - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two gpu_tokens, got {bt}")
    if bs.gpu_silu not in SILU_FORMS:
        raise ValueError(f"gpu_silu must be one of {SILU_FORMS}, got {bs.gpu_silu!r}")
    act = functools.partial(_silu, activation=activation, form=bs.gpu_silu, interpret=interpret)
    kernel = functools.partial(
        _varlen_gpu_tile_kernel,
        k, bt, bd, bs.gpu_tiles, bs.gpu_preload, bs.gpu_carry_window, act,
        bias is not None, initial_states is not None, num_tokens,
    )  # fmt: skip
    seq, start = _token_starts(cu_seqlens, num_tokens)
    terms = None  # one [bt, bd] gather in the kernel instead of K-1
    if initial_states is not None:
        terms = _initial_state_terms(weight, initial_states).reshape(-1, dim)
    optional = [a for a in (bias, terms) if a is not None]
    y = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, bt * bs.gpu_tiles), dim // bd),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=bs.gpu_num_warps, num_stages=bs.gpu_num_stages
        ),
        interpret=interpret,
        name="causal_conv1d_varlen",
    )(seq, start, x, weight, *optional)
    return _varlen_outputs(x, y, initial_states, cu_seqlens, track_ends, k)


_HALO = 8  # rows of x before a tile that the TPU kernel reads (>= K-1, one sublane tile)


def _varlen_tpu_kernel(
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
    y_ref[...] = _silu(out, activation).astype(y_ref.dtype)


def causal_conv1d_varlen_tpu(
    x: jax.Array,  # [T, D]
    weight: jax.Array,  # [K, D]
    bias: jax.Array | None,  # [D]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    initial_states: jax.Array | None = None,  # [S, K-1, D]
    track_ends: jax.Array | None = None,  # i32[S]
    activation: str | None = "silu",
    interpret: bool = False,
    block_sizes: ConvVarlenBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    bs = block_sizes or ConvVarlenBlockSizes()
    num_tokens, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    k = weight.shape[0]
    if k - 1 > _HALO:
        raise ValueError(f"the TPU conv kernel supports K <= {_HALO + 1}, got K={k}")
    bt = min(bs.tpu_tokens, -(-num_tokens // _HALO) * _HALO)
    bd = _lane_block(dim, bs.tpu_channels)
    padded = -(-num_tokens // bt) * bt
    seq, start = _token_starts(cu_seqlens, num_tokens)
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
        args.append(_initial_state_terms(weight, initial_states))
        specs.append(pl.BlockSpec((num_seqs, k - 1, bd), lambda i, j, *_: (0, 0, j)))

    y = pl.pallas_call(
        functools.partial(
            _varlen_tpu_kernel, k, bt, activation, bias is not None, initial_states is not None
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
    return _varlen_outputs(x, y[:num_tokens], initial_states, cu_seqlens, track_ends, k)
