"""Varlen chunked SSD (Mamba2 state-space duality) scan over packed sequences.

Per head: ``h_t = exp(dt_t*A) h_{t-1} + dt_t x_t ⊗ B_t``, ``y_t = h_t·C_t + D x_t``, computed
chunk-wise: a quadratic form inside each chunk plus a sequential pass over chunk states.

Chunk alignment is absolute: a chunk boundary of a sequence sits where
``(start_position + relative_pos) % C == 0``, so the chunk-boundary states are the states at
absolute multiples of C (what prefix caching checkpoints). Token ``r`` of a sequence sits at
offset ``(start + r) % C`` of its chunk; other offsets of a chunk are empty (zero x, B, C, dt).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .dispatch import select_impl


class ChunkLayout(NamedTuple):
    """Where every token of a varlen batch sits in the [NC, C] chunk grid (a pytree)."""

    token_index: jax.Array  # i32[NC, C] packed token of (chunk, offset); T for empty positions
    chunk_seq: jax.Array  # i32[NC] sequence of each chunk; S for unused chunks
    chunk_first: jax.Array  # bool[NC] chunk is its sequence's first
    chunk_end: jax.Array  # i32[NC] relative position just after the chunk's last token
    seq_first_chunk: jax.Array  # i32[S] index of each sequence's first chunk
    seq_last_chunk: jax.Array  # i32[S] index of each sequence's last chunk (clipped if empty)


def num_chunks(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Static chunk count that fits any varlen batch of ``num_tokens`` tokens in S sequences.

    A sequence of length L >= 1 starting at offset o = start % C (0 <= o <= C-1) spans
    n = floor((o + L - 1) / C) + 1 <= floor((L - 2 + C) / C) + 1 <= floor((L - 1) / C) + 2
    chunks, so n < L / C + 2. Summing, sum n < T / C + 2S, and since sum n is an integer,
    sum n <= floor(T / C) + 2S (empty sequences take no chunks).
    """
    return num_tokens // chunk_size + 2 * num_seqs


def build_chunk_layout(
    cu_seqlens: jax.Array,  # i32[S+1]
    num_tokens: int,
    chunk_size: int,
    start_positions: jax.Array | None = None,  # i32[S] absolute position of each first token
) -> ChunkLayout:
    """Chunk layout of a varlen batch; build once per forward and share across layers."""
    num_seqs = cu_seqlens.shape[0] - 1
    nc = num_chunks(num_tokens, num_seqs, chunk_size)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [S]
    if start_positions is None:
        offsets = jnp.zeros((num_seqs,), jnp.int32)
    else:
        offsets = start_positions.astype(jnp.int32) % chunk_size
    seq_chunks = jnp.where(lengths > 0, (offsets + lengths - 1) // chunk_size + 1, 0)
    cu_chunks = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_chunks, dtype=jnp.int32)]
    )  # [S+1]

    c = jnp.arange(nc, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_chunks, c, side="right", method="compare_all").astype(jnp.int32) - 1
    used = c < cu_chunks[-1]
    seq_safe = jnp.clip(seq, 0, num_seqs - 1)
    j = c - cu_chunks[seq_safe]  # chunk index within its sequence
    chunk_rel_start = j * chunk_size - offsets[seq_safe]  # relative position of offset 0
    rel = chunk_rel_start[:, None] + jnp.arange(chunk_size, dtype=jnp.int32)  # [NC, C]
    valid = used[:, None] & (rel >= 0) & (rel < lengths[seq_safe][:, None])
    token_index = jnp.where(valid, cu_seqlens[seq_safe][:, None] + rel, num_tokens)
    chunk_end = jnp.minimum(chunk_rel_start + chunk_size, lengths[seq_safe])
    return ChunkLayout(
        token_index=token_index.astype(jnp.int32),
        chunk_seq=jnp.where(used, seq_safe, num_seqs).astype(jnp.int32),
        chunk_first=used & (j == 0),
        chunk_end=jnp.where(used, chunk_end, 0).astype(jnp.int32),
        seq_first_chunk=jnp.clip(cu_chunks[:-1], 0, nc - 1),
        seq_last_chunk=jnp.clip(cu_chunks[1:] - 1, 0, nc - 1),
    )


def process_dt(
    dt: jax.Array,  # [..., H]
    dt_bias: jax.Array | None,  # [H]
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> jax.Array:
    """float32 ``clip(softplus(dt + dt_bias), *dt_limit)`` (softplus only if requested)."""
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    return jnp.clip(dt, dt_limit[0], dt_limit[1])


def _gather_chunks(a: jax.Array, token_index: jax.Array) -> jax.Array:
    """[T, ...] -> [NC, C, ...] float32; empty positions (index T) read an appended zero row."""
    a = a.astype(jnp.float32)
    a = jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])
    return a[token_index]


def ssd_varlen_ref(
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
):
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    heads_per_group = num_heads // num_groups
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    nc = layout.token_index.shape[0]
    idx = layout.token_index

    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    # Heads split as (G, R): head h uses group h // R.
    xc = _gather_chunks(x, idx).reshape(nc, chunk_size, num_groups, heads_per_group, head_dim)
    dtc = _gather_chunks(dt, idx).reshape(nc, chunk_size, num_groups, heads_per_group)
    bc = _gather_chunks(B, idx)  # [NC, C, G, N]
    cc = _gather_chunks(C, idx)  # [NC, C, G, N]
    a = A.astype(jnp.float32).reshape(num_groups, heads_per_group)

    # Empty positions have dt = 0, so they neither decay nor contribute.
    da_cum = jnp.cumsum(dtc * a, axis=1)  # [NC, C, G, R], non-increasing along C
    dtx = dtc[..., None] * xc  # [NC, C, G, R, P]

    # Intra-chunk (diagonal blocks): y_i += sum_{j<=i} (C_i·B_j) exp(cum_i - cum_j) dt_j x_j.
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    seg = da_cum[:, :, None] - da_cum[:, None, :]  # [NC, Ci, Cj, G, R]
    decay = jnp.exp(jnp.where(causal[None, :, :, None, None], seg, -jnp.inf))
    cb = jnp.einsum("cign,cjgn->cijg", cc, bc)  # [NC, Ci, Cj, G]
    y = jnp.einsum("cijgr,cjgrp->cigrp", cb[..., None] * decay, dtx)

    # Chunk-local end states (from a zero entering state).
    decay_to_end = jnp.exp(da_cum[:, -1:] - da_cum)  # [NC, C, G, R]
    local_states = jnp.einsum("cjgn,cjgr,cjgrp->cgrpn", bc, decay_to_end, dtx)
    chunk_decay = jnp.exp(da_cum[:, -1])  # [NC, G, R]

    # Sequential pass over chunks in packed order; a sequence's first chunk starts from its
    # initial state. Unused chunks (chunk_seq == S) read the appended zero state.
    state_shape = (num_groups, heads_per_group, head_dim, state_size)
    if initial_states is None:
        init = jnp.zeros((num_seqs + 1,) + state_shape, jnp.float32)
    else:
        init = jnp.concatenate(
            [
                initial_states.astype(jnp.float32).reshape((num_seqs,) + state_shape),
                jnp.zeros((1,) + state_shape, jnp.float32),
            ]
        )

    def step(carry, inputs):
        first, seq, dec, local = inputs
        entering = jnp.where(first, init[seq], carry)
        out = entering * dec[..., None, None] + local
        return out, (entering, out)

    # chunk_states of unused chunks are arbitrary (they carry the previous state along).
    _, (entering, chunk_states) = lax.scan(
        step,
        jnp.zeros(state_shape, jnp.float32),
        (layout.chunk_first, layout.chunk_seq, chunk_decay, local_states),
    )

    # Inter-chunk (off-diagonal): y_i += exp(cum_i) C_i · entering state.
    y = y + jnp.einsum("cign,cgrpn,cigr->cigrp", cc, entering, jnp.exp(da_cum))

    y = y.reshape(nc * chunk_size, num_heads, head_dim)
    y = (
        jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)
        .at[idx.reshape(-1)]
        .set(y, mode="drop")
    )
    if D is not None:
        y = y + D.astype(jnp.float32)[:, None] * x.astype(jnp.float32)
    if z is not None:
        y = y * jax.nn.silu(z.astype(jnp.float32))
    y = y.astype(x.dtype)

    chunk_states = chunk_states.reshape(nc, num_heads, head_dim, state_size)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    final_states = jnp.where(
        (lengths > 0)[:, None, None, None],
        chunk_states[layout.seq_last_chunk],
        init[:num_seqs].reshape(num_seqs, num_heads, head_dim, state_size),
    ).astype(state_dtype)
    if return_chunk_states:
        return y, final_states, chunk_states.astype(state_dtype)
    if state_chunks is not None:
        return y, final_states, chunk_states[state_chunks].astype(state_dtype)
    return y, final_states


def _ssd_varlen_tpu(*args, **kwargs):
    from .ssd_pallas_tpu import ssd_varlen_tpu  # lazy: the kernel modules import this one

    return ssd_varlen_tpu(*args, **kwargs)


def _ssd_varlen_gpu(*args, **kwargs):
    from .ssd_pallas_gpu import ssd_varlen_gpu

    return ssd_varlen_gpu(*args, **kwargs)


def ssd_varlen(
    x: jax.Array,  # [T, H, P] activation dtype
    dt: jax.Array,  # [T, H] raw dt (before bias/softplus)
    A: jax.Array,  # [H] negative (A = -exp(A_log))
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    cu_seqlens: jax.Array,  # i32[S+1] monotone; tokens >= cu_seqlens[-1] are padding
    *,
    chunk_size: int,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | None = None,  # [T, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: jax.Array | None = None,  # [S, H, P, N] or None (zeros)
    start_positions: jax.Array | None = None,  # i32[S] or None (zeros)
    layout: ChunkLayout | None = None,  # from build_chunk_layout(..., chunk_size, start_positions)
    return_chunk_states: bool = False,
    state_chunks: jax.Array | None = None,  # i32[K] chunks of `layout` whose end state is wanted
    impl: str = "auto",
):
    """Chunked SSD scan over packed sequences.

    Returns ``(y [T, H, P] x.dtype, final_states [S, H, P, N])`` and, with
    ``return_chunk_states``, ``chunk_states [NC, H, P, N]``: the state after the last token of
    each chunk of ``layout`` (or ``build_chunk_layout(cu_seqlens, T, chunk_size,
    start_positions)``; unused chunks hold arbitrary values), or with ``state_chunks`` only the
    states after those chunks, ``[K, H, P, N]`` (what checkpointing needs; the kernels then
    write K states instead of NC). States have the dtype of ``initial_states`` (float32
    without); an empty sequence's final state is its initial state.

    ``impl`` (see ``dispatch``): the kernels are ``ssd_pallas_tpu`` (Mosaic TPU; also what
    "interpret" runs, under ``pltpu.InterpretParams()``) and ``ssd_pallas_gpu`` (Triton).
    """
    num_tokens, num_heads, head_dim = x.shape if x.ndim == 3 else (None,) * 3
    if x.ndim != 3 or dt.shape != (num_tokens, num_heads) or A.shape != (num_heads,):
        raise ValueError(
            f"expected x [T, H, P], dt [T, H], A [H]; got x {x.shape}, dt {dt.shape}, A {A.shape}"
        )
    if B.ndim != 3 or B.shape[0] != num_tokens or C.shape != B.shape:
        raise ValueError(f"expected B, C [T={num_tokens}, G, N]; got B {B.shape}, C {C.shape}")
    num_groups = B.shape[1]
    if num_heads % num_groups:
        raise ValueError(f"heads H={num_heads} must be a multiple of groups G={num_groups}")
    for name, arr, shape in (
        ("D", D, (num_heads,)),
        ("dt_bias", dt_bias, (num_heads,)),
        ("z", z, x.shape),
    ):
        if arr is not None and arr.shape != shape:
            raise ValueError(f"expected {name} {shape}, got {arr.shape}")
    num_seqs = cu_seqlens.shape[0] - 1
    state_shape = (num_seqs, num_heads, head_dim, B.shape[2])
    if initial_states is not None and initial_states.shape != state_shape:
        raise ValueError(
            f"expected initial_states [S, H, P, N] = {state_shape}, got {initial_states.shape}"
        )
    if start_positions is not None and start_positions.shape != (num_seqs,):
        raise ValueError(f"expected start_positions [S={num_seqs}], got {start_positions.shape}")
    if layout is not None and layout.token_index.shape[1] != chunk_size:
        raise ValueError(
            f"layout was built for chunk size {layout.token_index.shape[1]}, got {chunk_size}"
        )
    if return_chunk_states and state_chunks is not None:
        raise ValueError("pass either return_chunk_states=True or state_chunks, not both")
    if state_chunks is not None and state_chunks.ndim != 1:
        raise ValueError(f"expected state_chunks i32[K], got shape {state_chunks.shape}")
    fn = select_impl(
        "ssd_varlen",
        impl,
        ref=ssd_varlen_ref,
        pallas_tpu=_ssd_varlen_tpu,
        pallas_gpu=_ssd_varlen_gpu,
    )
    return fn(
        x,
        dt,
        A,
        B,
        C,
        cu_seqlens,
        chunk_size=chunk_size,
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        initial_states=initial_states,
        start_positions=start_positions,
        layout=layout,
        return_chunk_states=return_chunk_states,
        state_chunks=state_chunks,
    )
