"""Varlen chunked SSD scan as three Pallas GPU kernels (Triton lowering).

0. **dt pass**, grid ``(H, NC)``: the processed dt, its per-chunk cumsum of ``dt * A`` and
   each position's weight in its chunk's end state, ``dt exp(cum[-1] - cum)``, all
   ``f32[NC, H, C]`` (tiny next to x).
1. **State pass**, grid ``(H, P / state_block_p, N / state_block_n, S)``: one program per
   (head, state slice, sequence) walks that sequence's chunks in order with its slice of the
   running state in registers, doing only ``state = exp(cum[-1]) state + Bᵀ (x ∘ weight)``
   per chunk. The state is carried N-major (``[N, P]``): N is the matmul's M, so B's tile is
   a shared-memory operand of a warpgroup MMA, not a register-held one. Every address of a
   step follows from per-sequence scalars, so nothing in the chain waits on a load of
   metadata. It writes each chunk's *entering* state (``[NC, H, N, P]`` in the dot dtype:
   the output pass feeds it to a matmul anyway), the final states and the requested chunk
   states (``[., H, P, N]``, state dtype), each straight into every output row that asks for
   it (``layout.tracked_requests``): no gather copies them afterwards.
2. **Output pass**, grid ``(H / out_heads, C / out_block_m, NC)``: every (heads of one group,
   block of target rows, chunk) loads C_i and the chunk's B once, computes ``C_i·Bᵀ`` once
   (it is the same for every head of a group), then loops over its heads computing
   ``y_i = Σ_{j<=i} (C_i·B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) C_i·state_in + D x_i``,
   gated by ``silu(z)``, with the whole chunk as source rows masked by position. Every head's
   step has the same shape, so its x and state loads are the pipeliner's async copies,
   issued a head ahead.

Splitting keeps the serial chain short and leaves the bulk of the FLOPs to a pass with
``H / out_heads * NC * C / out_block_m`` independent programs. The price is the entering
states' round trip through HBM, ``NC * H * P * N`` dot-dtype elements (as large as x when
N = C).

Each chunk is read straight from the packed ``[T, ...]`` arrays as a masked window of C rows
starting at the chunk's first token: no regrouping pass, no padding copy. Triton needs
power-of-two blocks: N is padded to a power of two, and the head dim is covered by
power-of-two pieces (80 = 64 + 16), both masked, never padded in memory.

The kernels read x, B, C, dt and z as column ranges of 2-D ``[T, W]`` arrays, each at a static
first column (``ColumnView``): x, B and C straight from the conv output ``[T, H·P + 2·G·N]`` and
dt from the in_proj output, with no slice copies in front of the kernels; separate arrays are
the views of themselves at column 0 (``[T, H, P]`` read as ``[T, H·P]``, a bitcast). A head's
column range is ``first + h·P``, a group's ``first + g·N``: with first columns and row widths
that are multiples of 8 bf16 elements (the 9B's are) the tiles' rows stay 16-byte aligned.

Why the Triton lowering: a chunk is a window of C rows at any token offset, which masked
pointer loads express directly; Mosaic GPU's TMA/WGMMA path wants tile-aligned windows (a
regrouping copy of x). Mosaic GPU was not measured for this op. The design and its
measurements: ``docs/kernels/ssd_gpu.md``.

Notation: T tokens, H heads, P head dim, G groups, N state, S sequences, C chunk, NC chunks."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..common import (
    MIN_DOT_DIM,
    ColumnView,
    as_view,
    dot,
    pallas_call,
    pow2_at_least,
    process_dt,
    round_up,
    silu,
)
from .layout import (
    ChunkLayout,
    TrackedRequests,
    build_chunk_layout,
    check_tracked_requests,
    tracked_requests,
    tracked_rows,
)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Blocks of the three passes (powers of two where marked).

    D·x_i is added on the diagonal of the intra-chunk matrix before its cast to the dot dtype,
    so the matmul with x_j adds it: no second load of x_i, and D is rounded to the dot dtype
    with that matrix's entries (bf16: a relative 2^-9 of the diagonal entry). The state pass
    carries the next chunk's decay, tracking requests and position weights a step ahead, so
    no load of them sits on the serial chain.

    Defaults: the SSD sweeps on the H200 (``scripts/bench_ssd.py --sweep``,
    docs/kernels/ssd_gpu.md); ``get_default`` picks other state-pass blocks for few sequences.
    """

    # Head-dim rows per state-pass program (power of two). At least the head dim: the whole
    # head dim in one program, in power-of-two pieces (80 = 64 + 16), B's tile loaded once a
    # step for all of it.
    state_block_p: int = 128
    state_block_n: int = 64  # state rows per state-pass program (power of two)
    state_warps: int = 4
    state_stages: int = 2
    out_block_m: int = 64  # target rows per output-pass program (power of two)
    out_warps: int = 4
    out_stages: int = 2
    # Heads of one group per output-pass program (power of two), looped: they share C_i, B
    # and C·Bᵀ.
    out_heads: int = 16

    @classmethod
    def get_default(cls, num_seqs: int, num_heads: int) -> GpuBlockSizes:
        """The blocks for ``num_seqs`` sequences of ``num_heads`` heads. With at most 128
        (sequence, head) pairs the state pass's programs are a single wave however they are
        cut, each walking its sequence's chunks in series: there, one program of 8 warps per
        pair (the whole state, N block 128) with a 3-deep pipeline (its shared memory leaves
        one program an SM); more pairs keep more, smaller programs an SM (``python3
        scripts/bench_ssd.py --sweep`` at 1x16384 and 64x256, docs/kernels/ssd_gpu.md)."""
        if num_seqs * num_heads <= 128:
            return cls(state_block_n=128, state_warps=8, state_stages=3)
        return cls()


class _Columns(NamedTuple):
    """The first column of x, B, C and z in the 2-D array the state and output passes read
    each from (the dt pass takes dt's)."""

    x: int
    b: int
    c: int
    z: int


def _pieces(n: int) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` power-of-two pieces (each >= MIN_DOT_DIM) that cover ``n``."""
    remaining = round_up(n, MIN_DOT_DIM)
    pieces, offset = [], 0
    while remaining:
        size = 1 << (remaining.bit_length() - 1)
        pieces.append((offset, size))
        offset += size
        remaining -= size
    return tuple(pieces)


def _dt_kernel(
    a_ref,  # f32[H]
    bias_ref,  # f32[H]
    lo_ref,  # i32[NC] first token of each chunk
    count_ref,  # i32[NC] tokens in each chunk
    dt_ref,  # [T, Wdt] raw dt [T, H] in columns [dt_col, dt_col + H)
    dt_out_ref,  # f32[NC, H, C] processed dt, zero at empty positions
    cum_out_ref,  # f32[NC, H, C] inclusive cumsum of dt * A
    weight_out_ref,  # f32[NC, H, C] dt exp(cum[-1] - cum): weight in the chunk's end state
    *,
    chunk_size: int,
    dt_col: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
):
    h, chunk = pl.program_id(0), pl.program_id(1)
    count = count_ref[chunk]

    @pl.when(count > 0)
    def _():
        pos = jnp.arange(chunk_size)
        t_ok = pos < count
        rows = pl.ds(lo_ref[chunk], chunk_size)
        dt = plgpu.load(dt_ref.at[rows, dt_col + h], mask=t_ok, other=0.0)
        dt = process_dt(dt, bias_ref[h], dt_softplus, dt_limit)
        dt = jnp.where(t_ok, dt, 0.0)  # empty positions: no decay
        cum = lax.cumsum(dt * a_ref[h], axis=0)
        total = jnp.sum(jnp.where(pos == chunk_size - 1, cum, 0.0))  # cum[-1], exactly
        dt_out_ref[chunk, h, :] = dt
        cum_out_ref[chunk, h, :] = cum
        weight_out_ref[chunk, h, :] = dt * jnp.exp(total - cum)


def _state_kernel(
    seq_start_ref,  # i32[S] first token
    seq_len_ref,  # i32[S]
    seq_first_ref,  # i32[S] first chunk
    seq_count_ref,  # i32[S] number of chunks
    count_ref,  # i32[NC] tokens in each chunk
    req_lo_ref,  # i32[NC] chunk c's end state fills tracked rows order[lo[c]:hi[c]]
    req_hi_ref,  # i32[NC]
    order_ref,  # i32[max(K, 1)]
    cum_ref,  # f32[NC, H, C]
    weight_ref,  # f32[NC, H, C]
    x_ref,  # [T, Wx] x [T, H, P] in columns [cols.x, cols.x + H·P)
    b_ref,  # [T, Wb] B [T, G, N] in columns [cols.b, cols.b + G·N)
    *rest,
    chunk_size: int,
    head_dim: int,
    state_size: int,
    heads_per_group: int,
    block_p: int,
    block_n: int,
    p_pieces: tuple[tuple[int, int], ...],
    has_init: bool,
    cols: _Columns,
):
    rest = list(rest)
    init_ref = rest.pop(0) if has_init else None
    entering_ref, final_ref, tracked_ref = rest  # [NC, H, N, P]; [S, H, P, N]; [K', H, P, N]
    h, pb, nb, s = (pl.program_id(i) for i in range(4))
    g = lax.div(h, heads_per_group)
    start, length = seq_start_ref[s], seq_len_ref[s]
    first, seq_chunks = seq_first_ref[s], seq_count_ref[s]
    first_count = count_ref[first]

    pos = jnp.arange(chunk_size)
    n_ok = nb * block_n + jnp.arange(block_n) < state_size
    n_slice = pl.ds(nb * block_n, block_n)
    # The program's head-dim slice in power-of-two pieces (80 = 64 + 16 when one program holds
    # the whole head dim), each carried as its own [N slice, P piece] state tile.
    pieces = [
        (pl.ds(pb * block_p + off, size), pb * block_p + off + jnp.arange(size) < head_dim)
        for off, size in p_pieces
    ]

    def pn_mask(p_ok):  # [P piece, N slice]: the layout of the states in and out
        return p_ok[:, None] & n_ok[None, :]

    b_cols = pl.ds(cols.b + g * state_size + nb * block_n, block_n)
    x_cols = [pl.ds(cols.x + h * head_dim + p.start, p.size) for p, _ in pieces]

    def chunk_factors(chunk):
        """The position weights and end-of-chunk decay of one chunk, and the range of
        ``order`` naming the tracked rows its end state fills (empty: not tracked)."""
        decay = jnp.exp(cum_ref[chunk, h, chunk_size - 1])
        return weight_ref[chunk, h, :], decay, (req_lo_ref[chunk], req_hi_ref[chunk])

    def chunk_loads(j):
        """B's and x's tiles of the sequence's chunk j. Its tokens follow from per-sequence
        scalars alone, so every address is known without a load: only the first chunk can be
        partial at its start."""
        offset = jnp.where(j == 0, 0, first_count + (j - 1) * chunk_size)
        rows = pl.ds(start + offset, chunk_size)
        t_ok = pos < length - offset
        b = plgpu.load(b_ref.at[rows, b_cols], mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        xs = [
            plgpu.load(x_ref.at[rows, x_col], mask=t_ok[:, None] & p_ok[None, :], other=0.0)
            for x_col, (_, p_ok) in zip(x_cols, pieces, strict=True)
        ]
        return b.astype(x_ref.dtype), xs

    def contribution(b, x, weight):
        """Bᵀ [N, C] · (x ∘ weight) [C, P piece]: what the chunk adds to one state piece."""
        xw = (x.astype(jnp.float32) * weight[:, None]).astype(x_ref.dtype)
        return dot(b, xw, (0, 0))

    def advance(chunk, states, b, xs, weight, decay, requests):
        """Store the states entering ``chunk``, step them over it, store them into each
        tracked row that asks for them."""
        new_states = []
        for state, x, (p_slice, p_ok) in zip(states, xs, pieces, strict=True):
            plgpu.store(
                entering_ref.at[chunk, h, n_slice, p_slice],
                state.astype(entering_ref.dtype),
                mask=n_ok[:, None] & p_ok[None, :],
            )
            new_states.append(decay * state + contribution(b, x, weight))

        first_request, end_request = requests

        @pl.when(end_request > first_request)
        def _():
            values = [state.T.astype(tracked_ref.dtype) for state in new_states]

            def store(r, carry):
                row = order_ref[r]
                for value, (p_slice, p_ok) in zip(values, pieces, strict=True):
                    plgpu.store(tracked_ref.at[row, h, p_slice, n_slice], value, mask=pn_mask(p_ok))
                return carry

            lax.fori_loop(first_request, end_request, store, 0)

        return tuple(new_states)

    def step(j, carry):
        states, ahead = carry  # ``ahead``: what the previous step prepared of chunk j
        following = jnp.minimum(j + 1, seq_chunks - 1)
        b, xs = chunk_loads(j)
        (weight, decay, requests), ahead = ahead, chunk_factors(first + following)
        return advance(first + j, states, b, xs, weight, decay, requests), ahead

    def initial_state(p_slice, p_ok):
        if init_ref is None:
            return jnp.zeros((block_n, p_ok.shape[0]), jnp.float32)
        state = plgpu.load(init_ref.at[s, h, p_slice, n_slice], mask=pn_mask(p_ok), other=0.0)
        return state.astype(jnp.float32).T

    states = tuple(initial_state(p_slice, p_ok) for p_slice, p_ok in pieces)
    # ``first`` is a real chunk even for an empty sequence (build_chunk_layout), so the
    # look-ahead before the loop reads in bounds.
    ahead = chunk_factors(first)
    states, _ = lax.fori_loop(0, seq_chunks, step, (states, ahead))
    for state, (p_slice, p_ok) in zip(states, pieces, strict=True):
        plgpu.store(
            final_ref.at[s, h, p_slice, n_slice],
            state.T.astype(final_ref.dtype),
            mask=pn_mask(p_ok),
        )


def _output_kernel(
    d_ref,  # f32[H]
    lo_ref,  # i32[NC]
    count_ref,  # i32[NC]
    x_ref,  # [T, Wx] x [T, H, P] in columns [cols.x, cols.x + H·P)
    b_ref,  # [T, Wb] B [T, G, N] in columns [cols.b, cols.b + G·N)
    c_ref,  # [T, Wc] C [T, G, N] in columns [cols.c, cols.c + G·N)
    dt_ref,  # f32[NC, H, C] processed dt, zero at empty positions
    cum_ref,  # f32[NC, H, C] cumsum of dt * A
    entering_ref,  # [NC, H, N, P] state entering each chunk
    *rest,
    chunk_size: int,
    head_dim: int,
    state_size: int,
    heads_per_group: int,
    heads: int,
    block_m: int,
    block_n: int,
    has_z: bool,
    cols: _Columns,
):
    z_ref = rest[0] if has_z else None  # [T, Wz] z [T, H, P] in columns [cols.z, cols.z + H·P)
    y_ref = rest[-1]
    hb, mb, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    count = count_ref[chunk]

    @pl.when(mb * block_m < count)
    def _():
        first_head = hb * heads
        g = lax.div(first_head, heads_per_group)
        lo = lo_ref[chunk]
        dot_dtype = x_ref.dtype
        n_ok = jnp.arange(block_n) < state_size
        n_slice = pl.ds(0, block_n)
        b_cols = pl.ds(cols.b + g * state_size, block_n)
        c_cols = pl.ds(cols.c + g * state_size, block_n)
        pieces = [
            (pl.ds(off, size), off + jnp.arange(size) < head_dim) for off, size in _pieces(head_dim)
        ]
        target = pl.ds(mb * block_m, block_m)
        rows_i, rows_j = pl.ds(lo + mb * block_m, block_m), pl.ds(lo, chunk_size)
        i_pos, j_pos = mb * block_m + jnp.arange(block_m), jnp.arange(chunk_size)
        # Source rows past the target block carry zero weight (causal): not loaded at all.
        i_ok, j_ok = i_pos < count, j_pos < jnp.minimum(count, (mb + 1) * block_m)
        causal = i_pos[:, None] >= j_pos[None, :]
        c_i = plgpu.load(
            c_ref.at[rows_i, c_cols], mask=i_ok[:, None] & n_ok[None, :], other=0.0
        ).astype(dot_dtype)
        b = plgpu.load(
            b_ref.at[rows_j, b_cols], mask=j_ok[:, None] & n_ok[None, :], other=0.0
        ).astype(dot_dtype)
        cb = dot(c_i, b, (1, 1))  # [block_m, C], shared by the group's heads
        # Where source row j is target row i: D's entries of the matrix.
        diagonal = i_pos[:, None] == j_pos[None, :]

        def head(k, carry):
            h = first_head + k
            dt_j, cum_j = dt_ref[chunk, h, :], cum_ref[chunk, h, :]
            cum_i = cum_ref[chunk, h, target]
            seg = jnp.where(causal, cum_i[:, None] - cum_j[None, :], -jnp.inf)
            m = cb * jnp.exp(seg) * dt_j[None, :]
            m = jnp.where(diagonal, m + d_ref[h], m).astype(dot_dtype)
            decay_i = jnp.exp(cum_i)[:, None]
            for p_slice, p_ok in pieces:
                x_col = pl.ds(cols.x + h * head_dim + p_slice.start, p_slice.size)
                x_j = plgpu.load(
                    x_ref.at[rows_j, x_col], mask=j_ok[:, None] & p_ok[None, :], other=0.0
                )
                s_in = plgpu.load(
                    entering_ref.at[chunk, h, n_slice, p_slice],
                    mask=n_ok[:, None] & p_ok[None, :],
                    other=0.0,
                )
                inter = dot(c_i, s_in)
                y = inter * decay_i + dot(m, x_j)
                if z_ref is not None:
                    z_col = pl.ds(cols.z + h * head_dim + p_slice.start, p_slice.size)
                    zv = plgpu.load(
                        z_ref.at[rows_i, z_col], mask=i_ok[:, None] & p_ok[None, :], other=0.0
                    ).astype(jnp.float32)
                    y = y * silu(zv)
                plgpu.store(
                    y_ref.at[rows_i, h, p_slice],
                    y.astype(y_ref.dtype),
                    mask=i_ok[:, None] & p_ok[None, :],
                )
            return carry

        lax.fori_loop(0, heads, head, 0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk_size",
        "dt_softplus",
        "dt_limit",
        "return_chunk_states",
        "interpret",
        "block_sizes",
    ),
)
def ssd_varlen_gpu(
    x: jax.Array | ColumnView,  # [T, H, P]
    dt: jax.Array | ColumnView,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array | ColumnView,  # [T, G, N]
    C: jax.Array | ColumnView,  # [T, G, N]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    chunk_size: int,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | ColumnView | None = None,  # [T, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: jax.Array | None = None,  # [S, H, P, N]
    start_positions: jax.Array | None = None,  # i32[S]
    layout: ChunkLayout | None = None,
    return_chunk_states: bool = False,
    state_chunks: jax.Array | None = None,  # i32[K]
    tracked: TrackedRequests | None = None,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
):
    """Same contract as :func:`jaxmamba.kernels.ssd.ssd_varlen`."""
    x, dt, B, C = (as_view(a) for a in (x, dt, B, C))
    z = None if z is None else as_view(z)
    cols = _Columns(x.start, B.start, C.start, 0 if z is None else z.start)
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    if not interpret and x.dtype.itemsize == 2 and min(chunk_size, state_size) < MIN_DOT_DIM:
        raise ValueError(
            f"the Triton SSD kernel's 16-bit dots need chunk_size and state size >= "
            f"{MIN_DOT_DIM}, got {chunk_size} and {state_size} in {x.dtype} (impl='auto' runs "
            "the reference for these shapes)"
        )
    num_seqs = cu_seqlens.shape[0] - 1
    bs = block_sizes or GpuBlockSizes.get_default(num_seqs, num_heads)
    for name, value in (
        ("chunk_size", chunk_size),
        ("state_block_p", bs.state_block_p),
        ("state_block_n", bs.state_block_n),
        ("out_block_m", bs.out_block_m),
        ("out_heads", bs.out_heads),
    ):
        if value != pow2_at_least(value):
            raise ValueError(f"Triton SSD kernels need a power-of-two {name}, got {value}")
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    token_lo, token_count = layout.chunk_token_lo, layout.chunk_token_count
    nc = token_lo.shape[0]
    num_tracked = tracked_rows(state_chunks, nc, return_chunk_states)
    requests = tracked
    if requests is None:
        requests = tracked_requests(nc, state_chunks, return_chunk_states)
    check_tracked_requests(requests, nc, num_tracked)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_count = layout.seq_num_chunks
    f32 = jnp.float32
    block_n = pow2_at_least(state_size)
    heads_per_group = num_heads // num_groups
    # Heads per output program: a power of two, so gcd is the largest that divides the group.
    out_heads = math.gcd(bs.out_heads, heads_per_group)

    # Pass 0: dt processing and its per-chunk cumsum, every (head, chunk) at once.
    per_chunk_head = jax.ShapeDtypeStruct((nc, num_heads, chunk_size), f32)
    dt_chunks, cum_chunks, weight_chunks = pallas_call(
        functools.partial(
            _dt_kernel,
            chunk_size=chunk_size,
            dt_col=dt.start,
            dt_softplus=dt_softplus,
            dt_limit=tuple(float(v) for v in dt_limit),
        ),
        grid=(num_heads, nc),
        out_shape=(per_chunk_head,) * 3,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ssd_varlen_gpu_dt",
    )(
        A.astype(f32),
        jnp.zeros((num_heads,), f32) if dt_bias is None else dt_bias.astype(f32),
        token_lo,
        token_count,
        dt.array,
    )

    # Pass 1: the serial walk over each sequence's chunks, carrying only the states.
    block_p = min(bs.state_block_p, pow2_at_least(head_dim))
    # A program holding the whole head dim covers it in power-of-two pieces (80 = 64 + 16).
    p_pieces = _pieces(head_dim) if block_p >= head_dim else ((0, block_p),)
    state_block_n = min(bs.state_block_n, block_n)
    state_operands = [
        cu_seqlens[:-1].astype(jnp.int32),
        lengths.astype(jnp.int32),
        layout.seq_first_chunk.astype(jnp.int32),
        seq_count,
        token_count,
        requests.lo,
        requests.hi,
        requests.order,
        cum_chunks,
        weight_chunks,
        x.array,
        B.array,
    ]
    if initial_states is not None:
        state_operands.append(initial_states)
    state_shape = (num_heads, head_dim, state_size)
    entering, final_states, tracked_states = pallas_call(
        functools.partial(
            _state_kernel,
            chunk_size=chunk_size,
            head_dim=head_dim,
            state_size=state_size,
            heads_per_group=heads_per_group,
            block_p=block_p,
            block_n=state_block_n,
            p_pieces=p_pieces,
            has_init=initial_states is not None,
            cols=cols,
        ),
        grid=(
            num_heads,
            pl.cdiv(head_dim, block_p),
            pl.cdiv(state_size, state_block_n),
            num_seqs,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((nc, num_heads, state_size, head_dim), x.dtype),
            jax.ShapeDtypeStruct((num_seqs, *state_shape), state_dtype),
            jax.ShapeDtypeStruct((max(num_tracked, 1), *state_shape), state_dtype),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=bs.state_warps, num_stages=bs.state_stages),
        interpret=interpret,
        name="ssd_varlen_gpu_states",
    )(*state_operands)

    # Pass 2: every (heads of a group, row block, chunk) independently, looping over its heads.
    block_m = min(bs.out_block_m, chunk_size)
    out_operands = [
        jnp.zeros((num_heads,), f32) if D is None else D.astype(f32),
        token_lo,
        token_count,
        x.array,
        B.array,
        C.array,
        dt_chunks,
        cum_chunks,
        entering,
    ]
    if z is not None:
        out_operands.append(z.array)
    y = pallas_call(
        functools.partial(
            _output_kernel,
            chunk_size=chunk_size,
            head_dim=head_dim,
            state_size=state_size,
            heads_per_group=heads_per_group,
            heads=out_heads,
            block_m=block_m,
            block_n=block_n,
            has_z=z is not None,
            cols=cols,
        ),
        grid=(num_heads // out_heads, chunk_size // block_m, nc),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.out_warps, num_stages=bs.out_stages),
        interpret=interpret,
        name="ssd_varlen_gpu_outputs",
    )(*out_operands)
    if state_chunks is None and not return_chunk_states:
        return y, final_states
    return y, final_states, tracked_states[:num_tracked]
