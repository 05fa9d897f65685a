"""Varlen chunked SSD scan as two Pallas GPU kernels (Triton lowering).

1. **State pass**, grid ``(H, ceil(P / state_block_p), S)``: one program per (head, slice of
   the head dim, sequence) walks that sequence's chunks in order with the running state
   ``f32[state_block_p, N]`` in registers. Per chunk it does only what the recurrence needs:
   the processed dt, its 1-D cumsum times A, and ``state = exp(total) state + (x w)ᵀ B`` (one
   ``[block_p, C] @ [C, N]`` matmul). It writes each chunk's *entering* state (in the dot dtype:
   the output pass feeds it to a matmul anyway), the processed dt and cumsum ``f32[NC, H, C]``,
   the final states and the requested chunk states (state dtype).
2. **Output pass**, grid ``(H, C / out_block_m, NC)``: every (head, block of target rows,
   chunk) independently computes
   ``y_i = Σ_{j<=i} (C_i·B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) C_i·state_in + D x_i``,
   gated by ``silu(z)``, walking only the source blocks at or below the diagonal.

Splitting makes the serial chain short (one small matmul per chunk) and leaves the bulk of
the FLOPs to a pass with ``H * NC * C / out_block_m`` independent programs. The price is the
entering states' round trip through HBM, ``NC * H * P * N`` dot-dtype elements (as large as x
when N = C).

Each chunk is read straight from the packed ``[T, ...]`` arrays as a masked window of C rows
starting at the chunk's first token: no regrouping pass, no padding copy. Triton needs
power-of-two blocks: N is padded to a power of two, and the head dim is covered by
power-of-two pieces (80 = 64 + 16 in the output pass), both masked, never padded in memory.

Why the Triton lowering and not Mosaic GPU: see ``scripts/bench_ssd.py``'s docstring.

Notation: T tokens, H heads, P head dim, G groups, N state, S sequences, C chunk, NC chunks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .ssd import ChunkLayout, build_chunk_layout
from .ssd_pallas import chunk_meta, gather_tracked

MIN_DOT_DIM = 16  # Triton's smallest matmul block edge


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    state_block_p: int = 16  # head-dim rows per state-pass program (power of two)
    state_warps: int = 4
    state_stages: int = 3
    out_block_m: int = 64  # target rows per output-pass program (power of two)
    out_warps: int = 4
    out_stages: int = 2

    @classmethod
    def get_default(cls) -> BlockSizes:
        return cls()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pieces(n: int) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` power-of-two pieces (each >= MIN_DOT_DIM) that cover ``n``."""
    remaining = -(-n // MIN_DOT_DIM) * MIN_DOT_DIM
    pieces, offset = [], 0
    while remaining:
        size = 1 << (remaining.bit_length() - 1)
        pieces.append((offset, size))
        offset += size
        remaining -= size
    return tuple(pieces)


def _softplus(v):
    return jnp.maximum(v, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(v)))


def _dot(a, b, contract: tuple[int, int]):
    """2-D matmul contracting ``a``'s and ``b``'s given dims, float32 accumulation."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _state_kernel(
    a_ref,  # f32[H]
    bias_ref,  # f32[H]
    seq_first_ref,  # i32[S] first chunk
    seq_count_ref,  # i32[S] number of chunks
    lo_ref,  # i32[NC] first token of each chunk
    count_ref,  # i32[NC] tokens in each chunk
    track_ref,  # i32[NC]
    slot_ref,  # i32[NC]
    x_ref,  # [T, H, P]
    dt_ref,  # [T, H]
    b_ref,  # [T, G, N]
    *rest,
    chunk_size: int,
    head_dim: int,
    state_size: int,
    heads_per_group: int,
    block_p: int,
    block_n: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    has_init: bool,
):
    rest = list(rest)
    init_ref = rest.pop(0) if has_init else None
    dt_out_ref, cum_out_ref, entering_ref, final_ref, tracked_ref = rest
    h, pb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = lax.div(h, heads_per_group)
    a, bias = a_ref[h], bias_ref[h]
    first, seq_chunks = seq_first_ref[s], seq_count_ref[s]

    pos = jnp.arange(chunk_size)
    p_ok = pb * block_p + jnp.arange(block_p) < head_dim
    n_ok = jnp.arange(block_n) < state_size
    state_mask = p_ok[:, None] & n_ok[None, :]
    p_slice, n_slice = pl.ds(pb * block_p, block_p), pl.ds(0, block_n)
    dot_dtype = x_ref.dtype

    def load(j):
        """Raw tiles of the sequence's chunk j."""
        chunk = first + j
        count = count_ref[chunk]
        rows = pl.ds(lo_ref[chunk], chunk_size)
        t_ok = pos < count
        x = plgpu.load(x_ref.at[rows, h, p_slice], mask=t_ok[:, None] & p_ok[None, :], other=0.0)
        b = plgpu.load(b_ref.at[rows, g, n_slice], mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        dt = plgpu.load(dt_ref.at[rows, h], mask=t_ok, other=0.0)
        return chunk, t_ok, x, b, dt

    def step(state, tiles):
        chunk, t_ok, x, b, dt = tiles
        dt = dt.astype(jnp.float32) + bias
        if dt_softplus:
            dt = _softplus(dt)
        dt = jnp.where(t_ok, jnp.clip(dt, dt_limit[0], dt_limit[1]), 0.0)  # empty: no decay
        cum = lax.cumsum(dt * a, axis=0)  # [C]
        total = jnp.sum(jnp.where(pos == chunk_size - 1, cum, 0.0))  # cum[-1], exactly

        @pl.when(pb == 0)
        def _():
            dt_out_ref[chunk, h, :] = dt
            cum_out_ref[chunk, h, :] = cum

        entering = entering_ref.at[chunk, h, p_slice, n_slice]
        plgpu.store(entering, state.astype(entering_ref.dtype), mask=state_mask)
        w = dt * jnp.exp(total - cum)  # weight of each position in the chunk's end state
        xw = (x.astype(jnp.float32) * w[:, None]).astype(dot_dtype)  # [C, block_p]
        state = jnp.exp(total) * state + _dot(xw, b.astype(dot_dtype), (0, 0))

        @pl.when(track_ref[chunk] != 0)
        def _():
            plgpu.store(
                tracked_ref.at[slot_ref[chunk], h, p_slice, n_slice],
                state.astype(tracked_ref.dtype),
                mask=state_mask,
            )

        return state

    if init_ref is not None:
        state = plgpu.load(init_ref.at[s, h, p_slice, n_slice], mask=state_mask, other=0.0)
        state = state.astype(jnp.float32)
    else:
        state = jnp.zeros((block_p, block_n), jnp.float32)
    state = lax.fori_loop(0, seq_chunks, lambda j, state: step(state, load(j)), state)
    plgpu.store(
        final_ref.at[s, h, p_slice, n_slice], state.astype(final_ref.dtype), mask=state_mask
    )


def _output_kernel(
    d_ref,  # f32[H]
    lo_ref,  # i32[NC]
    count_ref,  # i32[NC]
    x_ref,  # [T, H, P]
    b_ref,  # [T, G, N]
    c_ref,  # [T, G, N]
    dt_ref,  # f32[NC, H, C] processed dt, zero at empty positions
    cum_ref,  # f32[NC, H, C] cumsum of dt * A
    entering_ref,  # [NC, H, P, N] state entering each chunk
    *rest,
    head_dim: int,
    state_size: int,
    heads_per_group: int,
    block_m: int,
    block_n: int,
    has_z: bool,
):
    z_ref = rest[0] if has_z else None
    y_ref = rest[-1]
    h, mb, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    count = count_ref[chunk]

    @pl.when(mb * block_m < count)
    def _():
        g = lax.div(h, heads_per_group)
        lo = lo_ref[chunk]
        dot_dtype = x_ref.dtype
        n_ok = jnp.arange(block_n) < state_size
        n_slice = pl.ds(0, block_n)
        pieces = [
            (pl.ds(off, size), off + jnp.arange(size) < head_dim) for off, size in _pieces(head_dim)
        ]
        i_pos = mb * block_m + jnp.arange(block_m)
        i_ok = i_pos < count
        rows_i = pl.ds(lo + mb * block_m, block_m)
        c_i = plgpu.load(
            c_ref.at[rows_i, g, n_slice], mask=i_ok[:, None] & n_ok[None, :], other=0.0
        )
        c_i = c_i.astype(dot_dtype)
        cum_i = cum_ref[chunk, h, pl.ds(mb * block_m, block_m)]

        # Inter-chunk term: exp(cum_i) C_i · state_in.
        accs = []
        for p_slice, p_ok in pieces:
            s_in = plgpu.load(
                entering_ref.at[chunk, h, p_slice, n_slice],
                mask=p_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            accs.append(_dot(c_i, s_in, (1, 1)) * jnp.exp(cum_i)[:, None])  # [block_m, piece]

        def source_block(kb, accs):
            j_pos = kb * block_m + jnp.arange(block_m)
            j_ok = j_pos < count
            rows_j = pl.ds(lo + kb * block_m, block_m)
            b_j = plgpu.load(
                b_ref.at[rows_j, g, n_slice], mask=j_ok[:, None] & n_ok[None, :], other=0.0
            )
            dt_j = dt_ref[chunk, h, pl.ds(kb * block_m, block_m)]
            cum_j = cum_ref[chunk, h, pl.ds(kb * block_m, block_m)]
            # exp(cum_i - cum_j) <= 1 on and below the diagonal; above it is masked before exp.
            causal = i_pos[:, None] >= j_pos[None, :]
            decay = jnp.exp(jnp.where(causal, cum_i[:, None] - cum_j[None, :], -jnp.inf))
            cb = _dot(c_i, b_j.astype(dot_dtype), (1, 1))  # [i, j] = C_i · B_j
            m = (cb * decay * dt_j[None, :]).astype(dot_dtype)
            updated = []
            for acc, (p_slice, p_ok) in zip(accs, pieces, strict=True):
                x_j = plgpu.load(
                    x_ref.at[rows_j, h, p_slice], mask=j_ok[:, None] & p_ok[None, :], other=0.0
                )
                updated.append(acc + _dot(m, x_j, (1, 0)))
            return updated

        accs = lax.fori_loop(0, mb + 1, source_block, accs)
        d = d_ref[h]
        for acc, (p_slice, p_ok) in zip(accs, pieces, strict=True):
            mask = i_ok[:, None] & p_ok[None, :]
            x_i = plgpu.load(x_ref.at[rows_i, h, p_slice], mask=mask, other=0.0)
            y = acc + d * x_i.astype(jnp.float32)
            if z_ref is not None:
                zv = plgpu.load(z_ref.at[rows_i, h, p_slice], mask=mask, other=0.0)
                zv = zv.astype(jnp.float32)
                y = y * zv / (1.0 + jnp.exp(-zv))  # silu(z)
            plgpu.store(y_ref.at[rows_i, h, p_slice], y.astype(y_ref.dtype), mask=mask)


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
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H]
    A: jax.Array,  # [H]
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    chunk_size: int,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | None = None,  # [T, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: jax.Array | None = None,  # [S, H, P, N]
    start_positions: jax.Array | None = None,  # i32[S]
    layout: ChunkLayout | None = None,
    return_chunk_states: bool = False,
    state_chunks: jax.Array | None = None,  # i32[K]
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
):
    """Same contract as :func:`jaxmamba.kernels.ssd.ssd_varlen`."""
    bs = block_sizes or BlockSizes.get_default()
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    for name, value in (
        ("chunk_size", chunk_size),
        ("state_block_p", bs.state_block_p),
        ("out_block_m", bs.out_block_m),
    ):
        if value != _pow2(value):
            raise ValueError(f"Triton SSD kernels need a power-of-two {name}, got {value}")
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    meta = chunk_meta(layout, num_tokens, state_chunks, return_chunk_states)
    nc = meta.token_lo.shape[0]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_count = jnp.where(
        lengths > 0, layout.seq_last_chunk - layout.seq_first_chunk + 1, 0
    ).astype(jnp.int32)
    f32 = jnp.float32
    block_n = _pow2(state_size)
    heads_per_group = num_heads // num_groups

    # Pass 1: the serial walk over each sequence's chunks.
    block_p = min(bs.state_block_p, _pow2(head_dim))
    state_operands = [
        A.astype(f32),
        jnp.zeros((num_heads,), f32) if dt_bias is None else dt_bias.astype(f32),
        layout.seq_first_chunk.astype(jnp.int32),
        seq_count,
        meta.token_lo,
        meta.token_count,
        meta.track,
        meta.slot,
        x,
        dt,
        B,
    ]
    if initial_states is not None:
        state_operands.append(initial_states)
    state_shape = (num_heads, head_dim, state_size)
    dt_chunks, cum_chunks, entering, final_states, tracked = pl.pallas_call(
        functools.partial(
            _state_kernel,
            chunk_size=chunk_size,
            head_dim=head_dim,
            state_size=state_size,
            heads_per_group=heads_per_group,
            block_p=block_p,
            block_n=block_n,
            dt_softplus=dt_softplus,
            dt_limit=tuple(float(v) for v in dt_limit),
            has_init=initial_states is not None,
        ),
        grid=(num_heads, pl.cdiv(head_dim, block_p), num_seqs),
        out_shape=(
            jax.ShapeDtypeStruct((nc, num_heads, chunk_size), f32),
            jax.ShapeDtypeStruct((nc, num_heads, chunk_size), f32),
            jax.ShapeDtypeStruct((nc, *state_shape), x.dtype),
            jax.ShapeDtypeStruct((num_seqs, *state_shape), state_dtype),
            jax.ShapeDtypeStruct((meta.num_slots, *state_shape), state_dtype),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=bs.state_warps, num_stages=bs.state_stages),
        interpret=interpret,
        name="ssd_varlen_gpu_states",
    )(*state_operands)

    # Pass 2: every (head, row block, chunk) independently.
    block_m = min(bs.out_block_m, chunk_size)
    out_operands = [
        jnp.zeros((num_heads,), f32) if D is None else D.astype(f32),
        meta.token_lo,
        meta.token_count,
        x,
        B,
        C,
        dt_chunks,
        cum_chunks,
        entering,
    ]
    if z is not None:
        out_operands.append(z)
    y = pl.pallas_call(
        functools.partial(
            _output_kernel,
            head_dim=head_dim,
            state_size=state_size,
            heads_per_group=heads_per_group,
            block_m=block_m,
            block_n=block_n,
            has_z=z is not None,
        ),
        grid=(num_heads, chunk_size // block_m, nc),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.out_warps, num_stages=bs.out_stages),
        interpret=interpret,
        name="ssd_varlen_gpu_outputs",
    )(*out_operands)
    tracked = gather_tracked(tracked, meta, state_chunks, return_chunk_states)
    if tracked is None:
        return y, final_states
    return y, final_states, tracked
