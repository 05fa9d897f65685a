"""Varlen chunked SSD scan as a Pallas GPU kernel (Triton lowering).

Grid ``(H, ceil(P / block_p), S)``: one program per (head, slice of the head dim, sequence)
walks that sequence's chunks in order, with the running state ``f32[block_p, N]`` carried in
registers through the loop; nothing but y, the final state and the requested chunk states goes
to HBM. Each chunk is read straight from the packed ``[T, ...]`` arrays as a masked window of C
rows starting at the chunk's first token, so there is no regrouping pass and no padding
copy. Triton needs power-of-two blocks: N is padded to a power of two and P to a multiple of
``block_p`` inside the kernel (masked loads/stores), never in memory.

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
from .ssd_pallas import chunk_meta, chunk_update, gather_tracked


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # H200, 1x8192 (scripts/bench_ssd.py --sweep): 64/8/2 2.68 ms, 32/8/2 4.63 ms,
    # 16/4/2 9.26 ms, 32/4/2 10.1 ms, 32/4/3 10.1 ms (4 warps spill the [C, C] tiles).
    block_p: int = 64  # head-dim rows per program (power of two)
    num_warps: int = 8
    num_stages: int = 2

    @classmethod
    def get_default(cls) -> BlockSizes:
        return cls()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _softplus(v):
    return jnp.maximum(v, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(v)))


def _kernel(
    # per head
    a_ref,  # f32[H]
    d_ref,  # f32[H]
    bias_ref,  # f32[H]
    # per sequence / chunk
    seq_first_ref,  # i32[S] first chunk
    seq_count_ref,  # i32[S] number of chunks
    lo_ref,  # i32[NC] first token of each chunk
    count_ref,  # i32[NC] tokens in each chunk
    track_ref,  # i32[NC]
    slot_ref,  # i32[NC]
    # packed activations
    x_ref,  # [T, H, P]
    dt_ref,  # [T, H]
    b_ref,  # [T, G, N]
    c_ref,  # [T, G, N]
    *rest,
    chunk_size: int,
    head_dim: int,
    state_size: int,
    heads_per_group: int,
    block_p: int,
    block_n: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    has_z: bool,
    has_init: bool,
):
    rest = list(rest)
    z_ref = rest.pop(0) if has_z else None
    init_ref = rest.pop(0) if has_init else None
    y_ref, final_ref, states_ref = rest
    h, pb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = lax.div(h, heads_per_group)
    a, d, bias = a_ref[h], d_ref[h], bias_ref[h]

    p_idx = pb * block_p + jnp.arange(block_p)
    p_ok = p_idx < head_dim
    n_ok = jnp.arange(block_n) < state_size
    state_mask = p_ok[:, None] & n_ok[None, :]
    p_slice, n_slice = pl.ds(pb * block_p, block_p), pl.ds(0, block_n)
    if init_ref is not None:
        state = plgpu.load(init_ref.at[s, h, p_slice, n_slice], mask=state_mask, other=0.0)
        state = state.astype(jnp.float32)
    else:
        state = jnp.zeros((block_p, block_n), jnp.float32)

    def body(j, state):
        chunk = seq_first_ref[s] + j
        lo, count = lo_ref[chunk], count_ref[chunk]
        rows = pl.ds(lo, chunk_size)
        t_ok = jnp.arange(chunk_size) < count
        x_mask = t_ok[:, None] & p_ok[None, :]
        bc_mask = t_ok[:, None] & n_ok[None, :]
        x = plgpu.load(x_ref.at[rows, h, p_slice], mask=x_mask, other=0.0)  # [C, bp]
        b = plgpu.load(b_ref.at[rows, g, n_slice], mask=bc_mask, other=0.0)  # [C, bn]
        c = plgpu.load(c_ref.at[rows, g, n_slice], mask=bc_mask, other=0.0)
        dt = plgpu.load(dt_ref.at[rows, h], mask=t_ok, other=0.0).astype(jnp.float32)
        dt = dt + bias
        if dt_softplus:
            dt = _softplus(dt)
        dt = jnp.clip(dt, dt_limit[0], dt_limit[1])
        dt = jnp.where(t_ok, dt, 0.0)
        yt, state = chunk_update(
            x.T, dt.reshape(1, chunk_size), a, b.astype(x.dtype), c.astype(x.dtype), state
        )
        y = yt.T + d * x.astype(jnp.float32)
        if z_ref is not None:
            zv = plgpu.load(z_ref.at[rows, h, p_slice], mask=x_mask, other=0.0)
            zv = zv.astype(jnp.float32)
            y = y * zv / (1.0 + jnp.exp(-zv))  # silu(z)
        plgpu.store(y_ref.at[rows, h, p_slice], y.astype(y_ref.dtype), mask=x_mask)

        @pl.when(track_ref[chunk] != 0)
        def _():
            plgpu.store(
                states_ref.at[slot_ref[chunk], h, p_slice, n_slice],
                state.astype(states_ref.dtype),
                mask=state_mask,
            )

        return state

    state = lax.fori_loop(0, seq_count_ref[s], body, state)
    plgpu.store(
        final_ref.at[s, h, p_slice, n_slice], state.astype(final_ref.dtype), mask=state_mask
    )


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
    if chunk_size != _pow2(chunk_size) or bs.block_p != _pow2(bs.block_p):
        raise ValueError(
            f"Triton SSD kernel needs power-of-two chunk_size and block_p, got "
            f"chunk_size={chunk_size}, block_p={bs.block_p}"
        )
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    meta = chunk_meta(layout, num_tokens, state_chunks, return_chunk_states)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_count = jnp.where(
        lengths > 0, layout.seq_last_chunk - layout.seq_first_chunk + 1, 0
    ).astype(jnp.int32)

    block_p = min(bs.block_p, _pow2(head_dim))
    f32 = jnp.float32
    per_head = (
        A.astype(f32),
        jnp.zeros((num_heads,), f32) if D is None else D.astype(f32),
        jnp.zeros((num_heads,), f32) if dt_bias is None else dt_bias.astype(f32),
    )
    per_chunk = (
        layout.seq_first_chunk.astype(jnp.int32),
        seq_count,
        meta.token_lo,
        meta.token_count,
        meta.track,
        meta.slot,
    )
    operands = [*per_head, *per_chunk, x, dt, B, C]
    if z is not None:
        operands.append(z)
    if initial_states is not None:
        operands.append(initial_states)
    kernel = functools.partial(
        _kernel,
        chunk_size=chunk_size,
        head_dim=head_dim,
        state_size=state_size,
        heads_per_group=num_heads // num_groups,
        block_p=block_p,
        block_n=_pow2(state_size),
        dt_softplus=dt_softplus,
        dt_limit=tuple(float(v) for v in dt_limit),
        has_z=z is not None,
        has_init=initial_states is not None,
    )
    state_shape = (num_heads, head_dim, state_size)
    y, final_states, states = pl.pallas_call(
        kernel,
        grid=(num_heads, pl.cdiv(head_dim, block_p), num_seqs),
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((num_seqs, *state_shape), state_dtype),
            jax.ShapeDtypeStruct((meta.num_slots, *state_shape), state_dtype),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="ssd_varlen_gpu",
    )(*operands)
    tracked = gather_tracked(states, meta, state_chunks, return_chunk_states)
    if tracked is None:
        return y, final_states
    return y, final_states, tracked
