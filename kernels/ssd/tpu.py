"""Varlen chunked SSD scan as a Pallas Mosaic TPU kernel (also the CPU interpret-mode kernel).

Grid ``(H, NC)``: heads are independent ("parallel"); chunks run in packed order
("arbitrary"), so the running state ``f32[P, N]`` of a head stays in a VMEM scratch across
all of its chunks and never goes to HBM except where asked (final and tracked states). The
chunk → sequence map and first-chunk flags come in by scalar prefetch and drive the
index maps of the initial-state and final-state blocks.

Inputs are regrouped by XLA into the ``[*, NC, *, C]`` chunk grid (positions on lanes), which
keeps every block (8, 128)-tileable for any P and any chunk offset; the output comes back
through the inverse gather. Per chunk the kernel computes, in the transposed domain (``P`` on
sublanes, chunk positions on lanes, so every matmul is ``A @ B`` or ``A @ Bᵀ``):

* ``yᵀ = xᵀ (B Cᵀ ∘ Lᵀ ∘ dt)``  — the intra-chunk quadratic form (MXU),
* ``yᵀ += state Cᵀ ∘ exp(cum)``  — the inter-chunk term from the carried state,
* ``state = exp(cum_last) state + (xᵀ ∘ dt exp(cum_last - cum)) B``.

Notation: T tokens, H heads, P head dim, G groups, N state, S sequences, C chunk, NC chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import (
    ColumnView,
    as_array,
    dot,
    pallas_call,
    process_dt,
    silu,
    to_column,
    to_row,
    tpu_interpret_params,
)
from .layout import (
    ChunkLayout,
    TrackedRequests,
    build_chunk_layout,
    check_tracked_requests,
    to_chunks,
    tracked_requests,
    tracked_rows,
)


def chunk_update(
    xt: jax.Array,  # [P, C] dot dtype; zero at empty positions
    dt_row: jax.Array,  # f32[1, C] processed dt; zero at empty positions
    a,  # f32 scalar A of the head
    b: jax.Array,  # [C, N] dot dtype
    c: jax.Array,  # [C, N] dot dtype
    state: jax.Array,  # f32[P, N] state entering the chunk
) -> tuple[jax.Array, jax.Array]:
    """One chunk of one head: ``(yᵀ f32[P, C], state after the chunk f32[P, N])``.

    Written with 2-D shapes, iotas and keepdims reductions only (no transposes, no scans), so
    it lowers through Mosaic TPU. Empty positions must arrive with ``dt = 0`` and zero x, B, C.
    """
    size = dt_row.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)  # j (source position)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)  # i (target position)
    da_row = dt_row * a  # [1, C]
    # Column forms and the inclusive cumsum via masked reductions (no transposes, no scans).
    dt_col = to_column(dt_row)  # [C, 1]
    cum_col = jnp.sum(jnp.where(cols <= rows, da_row, 0.0), axis=1, keepdims=True)  # [C, 1]
    cum_row = to_row(cum_col)  # [1, C]
    total = jnp.sum(da_row, axis=1, keepdims=True)  # [1, 1]

    # decay[j, i] = exp(cum_i - cum_j) for j <= i; exponents are <= 0, so nothing overflows.
    decay = jnp.exp(jnp.where(rows <= cols, cum_row - cum_col, -jnp.inf))  # [Cj, Ci]
    bc = dot(b, c, (1, 1))  # [Cj, Ci] = B_j · C_i
    mt = (bc * decay * dt_col).astype(xt.dtype)
    yt = dot(xt, mt)  # [P, Ci]
    yt = yt + dot(state.astype(c.dtype), c, (1, 1)) * jnp.exp(cum_row)

    w_row = dt_row * jnp.exp(total - cum_row)  # [1, C] weight of each position in the end state
    xw = (xt.astype(jnp.float32) * w_row).astype(xt.dtype)
    new_state = jnp.exp(total) * state + dot(xw, b)  # [P, N]
    return yt, new_state


def _kernel(
    # scalar prefetch
    seq_ref,  # i32[NC] sequence whose initial/final state block the chunk uses
    first_ref,  # i32[NC] 1: start from the initial state
    track_ref,  # i32[NC] 1: write the chunk's end state
    slot_ref,  # i32[NC] tracked-state row of the chunk
    # inputs
    a_ref,  # f32[H] (SMEM)
    d_ref,  # f32[H] (SMEM)
    xt_ref,  # [P, C]
    dt_ref,  # f32[1, C]
    b_ref,  # [C, N]
    c_ref,  # [C, N]
    init_ref,  # [P, N]
    *rest,
    has_z: bool,
):
    if has_z:
        zt_ref, yt_ref, final_ref, states_ref, state_scr = rest
    else:
        zt_ref = None
        yt_ref, final_ref, states_ref, state_scr = rest
    h, c = pl.program_id(0), pl.program_id(1)

    @pl.when(first_ref[c] != 0)
    def _():
        state_scr[...] = init_ref[...].astype(jnp.float32)

    xt = xt_ref[...]
    dot_dtype = xt.dtype
    yt, state = chunk_update(
        xt,
        dt_ref[...],
        a_ref[h],
        b_ref[...].astype(dot_dtype),
        c_ref[...].astype(dot_dtype),
        state_scr[...],
    )
    state_scr[...] = state
    # Written every chunk; the block goes to HBM when the sequence changes (and at the end).
    final_ref[...] = state.astype(final_ref.dtype)

    @pl.when(track_ref[c] != 0)
    def _():
        states_ref[...] = state.astype(states_ref.dtype)

    yt = yt + d_ref[h] * xt.astype(jnp.float32)
    if zt_ref is not None:
        zt = zt_ref[...].astype(jnp.float32)
        yt = yt * silu(zt)
    yt_ref[...] = yt.astype(yt_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk_size",
        "dt_softplus",
        "dt_limit",
        "return_chunk_states",
        "interpret",
    ),
)
def ssd_varlen_tpu(
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
    interpret=False,
):
    """Same contract as :func:`jaxmamba.kernels.ssd.ssd_varlen`.

    ``interpret=True`` runs it under ``pltpu.InterpretParams()``; explicit params may also be
    passed.
    """
    x, dt, B, C = (as_array(a) for a in (x, dt, B, C))  # the BlockSpecs tile whole arrays
    z = None if z is None else as_array(z)
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    heads_per_group = num_heads // num_groups
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    nc = layout.token_index.shape[0]
    idx = layout.token_index
    num_tracked = tracked_rows(state_chunks, nc, return_chunk_states)
    if tracked is None:
        tracked = tracked_requests(nc, state_chunks, return_chunk_states)
    check_tracked_requests(tracked, nc, num_tracked)
    # One output row per requested chunk (in chunk order), gathered per request afterwards.
    track = (tracked.hi > tracked.lo).astype(jnp.int32)
    num_slots = max(1, min(nc, num_tracked))

    # Unused chunks (after the last used one) continue the last used chunk's sequence with no
    # tokens, so they leave its state and its final-state block unchanged. Chunk 0 always
    # (re)starts from an initial state, which also covers a batch with no tokens at all
    # (``layout.scan_seq``, ``layout.scan_first``).

    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # f32[T, H]
    xt = to_chunks(x, idx).transpose(2, 0, 3, 1)  # [H, NC, P, C]
    dtc = to_chunks(dtp, idx).transpose(2, 0, 1)[:, :, None, :]  # f32[H, NC, 1, C]
    bc = to_chunks(B, idx).transpose(2, 0, 1, 3)  # [G, NC, C, N]
    cc = to_chunks(C, idx).transpose(2, 0, 1, 3)  # [G, NC, C, N]
    a = A.astype(jnp.float32)
    d = jnp.zeros((num_heads,), jnp.float32) if D is None else D.astype(jnp.float32)
    # Empty sequences are never visited: their final state is the aliased initial state.
    init = (
        jnp.zeros((num_seqs, num_heads, head_dim, state_size), state_dtype)
        if initial_states is None
        else initial_states
    )

    def chunk_block(h, c, *_):
        return (h, c, 0, 0)

    def group_block(h, c, *_):
        return (lax.div(h, heads_per_group), c, 0, 0)  # h >= 0: no floor fix-up

    def seq_block(h, c, seq, *_):
        return (seq[c], h, 0, 0)

    def slot_block(h, c, seq, first, track, slot):
        return (slot[c], h, 0, 0)

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    xt_spec = pl.BlockSpec((None, None, head_dim, chunk_size), chunk_block)
    state_spec = pl.BlockSpec((None, None, head_dim, state_size), seq_block)
    in_specs = [
        smem,
        smem,
        xt_spec,
        pl.BlockSpec((None, None, 1, chunk_size), chunk_block),
        pl.BlockSpec((None, None, chunk_size, state_size), group_block),
        pl.BlockSpec((None, None, chunk_size, state_size), group_block),
        state_spec,
    ]
    operands = [a, d, xt, dtc, bc, cc, init]
    if z is not None:
        in_specs.append(xt_spec)
        operands.append(to_chunks(z, idx).transpose(2, 0, 3, 1))
    out_shape = (
        jax.ShapeDtypeStruct(xt.shape, x.dtype),
        jax.ShapeDtypeStruct(init.shape, state_dtype),
        jax.ShapeDtypeStruct((num_slots, num_heads, head_dim, state_size), state_dtype),
    )
    out_specs = (
        xt_spec,
        state_spec,
        pl.BlockSpec((None, None, head_dim, state_size), slot_block),
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_heads, nc),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((head_dim, state_size), jnp.float32)],
    )
    yt, final_states, states = pallas_call(
        functools.partial(_kernel, has_z=z is not None),
        grid_spec=grid_spec,
        out_shape=out_shape,
        # Operand 10 = init after the 4 scalar-prefetch operands and a, d, xt, dt, B, C.
        input_output_aliases={10: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret_params(interpret),
        name="ssd_varlen_tpu",
    )(layout.scan_seq, layout.scan_first, track, tracked.rank, *operands)

    y = yt.transpose(1, 3, 0, 2).reshape(nc * chunk_size, num_heads, head_dim)
    y = jnp.zeros_like(x).at[idx.reshape(-1)].set(y, mode="drop")
    if state_chunks is None and not return_chunk_states:
        return y, final_states
    return y, final_states, states[tracked.request_rank[:num_tracked]]
