"""Gated DeltaNet as Pallas GPU kernels (Triton lowering): three passes for prefill, one for
decode.

Prefill walks the SSD's chunk grid (``ssd.layout``: boundaries at absolute multiples of C).
A chunk's tokens are a run of packed rows starting at ``chunk_token_lo``; the kernels read
it as a masked window of C rows and number its tokens 0..count-1 (the empty offsets of a
sequence's first chunk act as the identity step, so where they sit does not matter).

1. **WY pass**, grid ``(HV, NC)``: per (value head, chunk), with γ the in-chunk cumsum of g
   and ``A = StrictTril(diag(β) K Kᵀ ⊙ Γ)``, solves ``(I + A) W = diag(β e^γ) K`` and
   ``(I + A) U = diag(β) V`` (``[NC, HV, C, D*]``, dot dtype) in row blocks of
   ``wy_sub_block``: each diagonal block is inverted by forward substitution on a register
   tile (row i from the rows above it; never powers of A, which overflow for repeated keys),
   then ``X_b = T_bb (Y_b - Σ_{c<b} A_bc X_c)``. Also writes γ (``f32[NC, HV, C]``) and the
   normalised keys in the chunk layout (``[NC, Hk, C, Dk]``, zero past a chunk's end), so
   the later passes read K at a fixed offset and never normalise it again.
2. **State pass**, grid ``(HV, Dv / state_block_v, S)``: one program per (value head, Dv
   tile, sequence) walks the sequence's chunks in order with its ``[Dk, block_v]`` slice of
   the running state in registers: ``V' = U - W S`` (written over U in place: U is aliased
   to V'), ``S <- e^{γ_C} S + Kᵀ (V' ⊙ e^{γ_C - γ})``. It writes each chunk's *entering*
   state (``[NC, HV, Dk, Dv]``, dot dtype, what the output pass multiplies), the final
   states and each requested chunk-end state straight into the tracked rows that ask for it
   (``TrackedRequests``, as the SSD's state pass).
3. **Output pass**, grid ``(HV, Dv / out_block_v, NC)``: every chunk independently,
   ``O = (Q ⊙ e^γ) S_in + Tril(Q Kᵀ ⊙ Γ) V'``.

Only the state pass is serial, and it does two ``[C, Dk] x [Dk, block_v]``-sized matmuls a
chunk; the inverse and the intra-chunk attention are spread over ``HV * NC`` programs. The
price is W, U/V', K and the entering states' round trip through HBM.

Decode, grid ``(Dv / block_v, HV, B)``: a program gates (``g = -exp(A_log)
softplus(a + dt_bias)``, ``β = σ(b)``), L2-normalises its row's q and k, loads its
``[Dk, block_v]`` state tile of the row's slot, updates it and writes it back in place (the
pool is aliased input→output), with ``o`` from the new tile. The state is read and written
once; everything else a program loads is a few hundred bytes.

Head dims that are not powers of two are padded to the next one in registers (masked loads
and stores, never padded in memory), and at least ``MIN_DOT_DIM`` where they feed a matmul.
bf16 inputs feed the matmuls bf16 operands (T, W, U, V' and the state as a matmul operand)
with float32 accumulation; the carried state stays float32.

Why the Triton lowering: a chunk is a window of C rows at any token offset and decode is a
gather by slot, both of which masked pointer loads express directly (as for the SSD).

Notation: T tokens, Hk key heads, HV value heads, Dk key dim, Dv value dim, S sequences,
S' slots, B rows, C chunk, NC chunks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..common import MIN_DOT_DIM, dot, pallas_call, pow2_at_least, softplus
from ..ssd.layout import (
    ChunkLayout,
    TrackedRequests,
    build_chunk_layout,
    check_tracked_requests,
    tracked_requests,
    tracked_rows,
)

_F32 = jnp.float32
_L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class PrefillGpuBlockSizes:
    """Tiles and launch options of the three prefill passes (blocks are powers of two, capped
    by the padded head dim). Defaults: the fastest per pass at Qwen3-Next's shapes on the
    H200 (``scripts/dev/gdn_prefill_passes.py``, docs/benchmarks.md)."""

    wy_sub_block: int = 16  # rows of the WY pass's diagonal blocks (the chunk: one block)
    wy_warps: int = 2
    state_block_v: int = 64  # Dv columns of the running state a state-pass program carries
    state_warps: int = 4
    state_stages: int = 3
    out_block_v: int = 128  # Dv columns an output-pass program computes
    out_warps: int = 4
    out_stages: int = 2

    @classmethod
    def get_default(cls, num_seqs: int, num_v_heads: int) -> PrefillGpuBlockSizes:
        """The blocks for ``num_seqs`` sequences of ``num_v_heads`` value heads: with few
        (sequence, head) pairs the serial state pass is cut into narrower Dv tiles, so more
        programs walk the chunks side by side."""
        if num_seqs * num_v_heads <= 64:
            return cls(state_block_v=32)
        return cls()


@dataclasses.dataclass(frozen=True)
class DecodeGpuBlockSizes:
    """The decode kernel's tile: ``[Dk, block_v]`` of one (row, value head). The defaults
    are unswept first choices (``scripts/bench_gdn.py`` times them)."""

    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def get_default(cls, rows: int) -> DecodeGpuBlockSizes:
        """Few rows: narrower tiles, so a small batch still spreads over the SMs."""
        if rows <= 8:
            return cls(block_v=32, num_warps=2)
        return cls()


def _l2norm(x: jax.Array) -> jax.Array:  # [..., D] f32, normalised over the last axis
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


def _cols(start, size: int, limit: int):
    """``(pl.ds(start, size), mask or None)`` of a power-of-two tile over ``limit`` columns."""
    ok = None
    if limit % size or size > limit:
        ok = start + jnp.arange(size) < limit
    return pl.ds(start, size), ok


def _axis_masks(oks):
    """The mask of a 1-D or 2-D tile from its per-axis masks (None: all in bounds)."""
    if len(oks) == 1:
        return oks[0]
    rows, cols = oks
    if rows is None and cols is None:
        return None
    if rows is None:
        return cols[None, :]
    if cols is None:
        return rows[:, None]
    return rows[:, None] & cols[None, :]


def _load(ref, oks):
    mask = _axis_masks(oks)
    return plgpu.load(ref, mask=mask, other=None if mask is None else 0.0)


def _store(ref, value, oks):
    plgpu.store(ref, value, mask=_axis_masks(oks))


@dataclasses.dataclass(frozen=True)
class _Dims:
    chunk_size: int
    dk: int
    dv: int
    bk: int  # Dk padded (power of two, >= MIN_DOT_DIM)
    heads_per_key: int  # HV // Hk
    scale: float
    use_qk_l2norm: bool


def _load_qk(ref, rows, t_ok, kh, dims: _Dims, dot_dtype):
    """``[C, bk]`` rows of q or k of key head ``kh`` (zero outside the chunk), normalised."""
    cols, k_ok = _cols(0, dims.bk, dims.dk)
    x = _load(ref.at[rows, kh, cols], (t_ok, k_ok)).astype(_F32)
    if dims.use_qk_l2norm:
        x = _l2norm(x)
    # Rounded to the dot dtype once, as every matmul and product takes it.
    return x.astype(dot_dtype).astype(_F32)


def _segment_decay(gamma: jax.Array, keep: jax.Array) -> jax.Array:
    """``exp(γ_i - γ_j)`` where ``keep[i, j]``, else 0 (the exponent masked, not the value:
    above the diagonal it would overflow)."""
    return jnp.exp(jnp.where(keep, gamma[:, None] - gamma[None, :], -jnp.inf))


def _invert_unit_lower(ats: list[jax.Array]) -> list[jax.Array]:  # f32[B, B] each
    """``(I + A)⁻¹`` of several strictly lower ``A`` at once, each given as ``at = Aᵀ``, by
    forward substitution: row i of T is ``e_i - Σ_{j<i} A[i, j] T[j, :]``, rows >= i of the
    carry still I. The blocks share the loop, so their row updates overlap."""
    size = ats[0].shape[0]
    pos = jnp.arange(size)
    i_idx, j_idx = pos[:, None], pos[None, :]

    def substitute(i, ts):
        out = []
        for at, t in zip(ats, ts, strict=True):
            a_i = jnp.sum(jnp.where(j_idx == i, at, 0.0), axis=1)  # [B] A[i, j] over j
            row = jnp.where(pos == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * t, axis=0)
            out.append(jnp.where(i_idx == i, row[None, :], t))
        return tuple(out)

    eye = (i_idx == j_idx).astype(_F32)
    return list(lax.fori_loop(1, size, substitute, tuple(eye for _ in ats)))


def _wy_kernel(
    lo_ref,  # i32[NC] first token of each chunk
    count_ref,  # i32[NC] tokens in each chunk
    k_ref,  # [T, Hk, Dk]
    v_ref,  # [T, HV, Dv]
    g_ref,  # f32[T, HV]
    beta_ref,  # f32[T, HV]
    w_ref,  # [NC, HV, C, Dk] T (diag(β e^γ) K)
    u_ref,  # [NC, HV, C, Dv] T diag(β) V
    gamma_ref,  # f32[NC, HV, C] in-chunk cumsum of g
    kn_ref,  # [NC, Hk, C, Dk] K normalised, rounded to the dot dtype, 0 past the chunk's end
    *,
    dims: _Dims,
    bvp: int,
    sub: int,
):
    h, chunk = pl.program_id(0), pl.program_id(1)
    count = count_ref[chunk]

    @pl.when(count > 0)
    def _():
        dot_dtype = w_ref.dtype
        kh = lax.div(h, dims.heads_per_key)
        k_cols, k_ok = _cols(0, dims.bk, dims.dk)
        v_cols, v_ok = _cols(0, bvp, dims.dv)
        pos = jnp.arange(sub)
        upper = pos[None, :] > pos[:, None]
        lo = lo_ref[chunk]
        # The chunk in blocks of ``sub`` rows: row block b holds tokens [b sub, (b+1) sub).
        ks, gammas, betas, t_oks = [], [], [], []
        offset = jnp.zeros((), _F32)
        for b in range(dims.chunk_size // sub):
            t_ok = b * sub + pos < count
            rows = pl.ds(lo + b * sub, sub)
            ks.append(_load_qk(k_ref, rows, t_ok, kh, dims, dot_dtype).astype(dot_dtype))
            g = jnp.where(t_ok, _load(g_ref.at[rows, h], (t_ok,)), 0.0)
            betas.append(jnp.where(t_ok, _load(beta_ref.at[rows, h], (t_ok,)), 0.0))
            gammas.append(lax.cumsum(g, axis=0) + offset)
            offset = offset + jnp.sum(g)
            t_oks.append(t_ok)
            gamma_ref[chunk, h, pl.ds(b * sub, sub)] = gammas[b]

        @pl.when(lax.rem(h, dims.heads_per_key) == 0)  # the key head's first value head
        def _():
            for b, k in enumerate(ks):
                _store(kn_ref.at[chunk, kh, pl.ds(b * sub, sub), k_cols], k, (None, k_ok))

        # A[i, j] = β_i (k_i · k_j) e^{γ_i - γ_j} for i > j. The diagonal blocks are inverted
        # by substitution, transposed (``at[j, i] = A[i, j]``: the column of ``at`` a row of T
        # needs is a row reduction, no layout change); (I + A) X = Y is then solved block by
        # block, X_b = T_bb (Y_b - Σ_{c<b} A_bc X_c), for X = W and X = U at once.
        diag_ats = [
            jnp.where(upper, beta[None, :] * dot(k, k, (1, 1)) * _segment_decay(-gamma, upper), 0.0)
            for k, gamma, beta in zip(ks, gammas, betas, strict=True)
        ]
        diag_inv = _invert_unit_lower(diag_ats)
        ws, us = [], []
        for b, (k, gamma, beta, t_ok) in enumerate(zip(ks, gammas, betas, t_oks, strict=True)):
            rows = pl.ds(lo + b * sub, sub)
            v = _load(v_ref.at[rows, h, v_cols], (t_ok, v_ok)).astype(_F32)
            y_w = k.astype(_F32) * (beta * jnp.exp(gamma))[:, None]
            y_u = v * beta[:, None]
            for c in range(b):
                decay = jnp.exp(gamma[:, None] - gammas[c][None, :])  # i > j: exponent <= 0
                a_bc = (beta[:, None] * dot(k, ks[c], (1, 1)) * decay).astype(dot_dtype)
                y_w = y_w - dot(a_bc, ws[c])
                y_u = y_u - dot(a_bc, us[c])
            t_bb = diag_inv[b].astype(dot_dtype)
            ws.append(dot(t_bb, y_w.astype(dot_dtype)).astype(dot_dtype))
            us.append(dot(t_bb, y_u.astype(dot_dtype)).astype(dot_dtype))
            block = pl.ds(b * sub, sub)
            _store(w_ref.at[chunk, h, block, k_cols], ws[b], (None, k_ok))
            _store(u_ref.at[chunk, h, block, v_cols], us[b], (None, v_ok))


def _state_kernel(
    seq_first_ref,  # i32[S] first chunk
    seq_count_ref,  # i32[S] chunks
    req_lo_ref,  # i32[NC] chunk c's end state fills tracked rows order[lo[c]:hi[c]]
    req_hi_ref,  # i32[NC]
    order_ref,  # i32[max(K, 1)]
    kn_ref,  # [NC, Hk, C, Dk]
    w_ref,  # [NC, HV, C, Dk]
    gamma_ref,  # f32[NC, HV, C]
    u_ref,  # [NC, HV, C, Dv] (aliased to vnew_ref)
    *rest,
    dims: _Dims,
    block_v: int,
    has_init: bool,
):
    rest = list(rest)
    init_ref = rest.pop(0) if has_init else None  # [S, HV, Dk, Dv]
    # [NC, HV, C, Dv]; [NC, HV, Dk, Dv]; [S, HV, Dk, Dv]; [K', HV, Dk, Dv]
    vnew_ref, entering_ref, final_ref, tracked_ref = rest
    h, vb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c = dims.chunk_size
    dot_dtype = w_ref.dtype
    kh = lax.div(h, dims.heads_per_key)
    first, seq_chunks = seq_first_ref[s], seq_count_ref[s]
    k_cols, k_ok = _cols(0, dims.bk, dims.dk)
    v_cols, v_ok = _cols(vb * block_v, block_v, dims.dv)
    state_oks = (k_ok, v_ok)
    c_rows = pl.ds(0, c)

    def step(j, state):  # state: f32[bk, block_v] entering chunk first + j
        chunk = first + j
        k = _load(kn_ref.at[chunk, kh, c_rows, k_cols], (None, k_ok))
        w = _load(w_ref.at[chunk, h, c_rows, k_cols], (None, k_ok))
        u = _load(u_ref.at[chunk, h, c_rows, v_cols], (None, v_ok)).astype(_F32)
        gamma = gamma_ref[chunk, h, :]
        last = gamma_ref[chunk, h, c - 1]
        state_in = state.astype(dot_dtype)
        _store(entering_ref.at[chunk, h, k_cols, v_cols], state_in, state_oks)
        vnew = u - dot(w, state_in)
        _store(vnew_ref.at[chunk, h, c_rows, v_cols], vnew.astype(dot_dtype), (None, v_ok))
        # The decay to the chunk's end on V' ([C, block_v]) rather than on K ([C, Dk]).
        vnew_decayed = (vnew * jnp.exp(last - gamma)[:, None]).astype(dot_dtype)
        state = jnp.exp(last) * state + dot(k, vnew_decayed, (0, 0))

        first_request, end_request = req_lo_ref[chunk], req_hi_ref[chunk]

        @pl.when(end_request > first_request)
        def _():
            value = state.astype(tracked_ref.dtype)

            def store(r, carry):
                _store(tracked_ref.at[order_ref[r], h, k_cols, v_cols], value, state_oks)
                return carry

            lax.fori_loop(first_request, end_request, store, 0)

        return state

    if init_ref is None:
        state = jnp.zeros((dims.bk, block_v), _F32)
    else:
        state = _load(init_ref.at[s, h, k_cols, v_cols], state_oks).astype(_F32)
    state = lax.fori_loop(0, seq_chunks, step, state)
    _store(final_ref.at[s, h, k_cols, v_cols], state.astype(final_ref.dtype), state_oks)


def _output_kernel(
    lo_ref,  # i32[NC]
    count_ref,  # i32[NC]
    q_ref,  # [T, Hk, Dk]
    kn_ref,  # [NC, Hk, C, Dk]
    gamma_ref,  # f32[NC, HV, C]
    vnew_ref,  # [NC, HV, C, Dv]
    entering_ref,  # [NC, HV, Dk, Dv]
    o_ref,  # [T, HV, Dv]
    *,
    dims: _Dims,
    block_v: int,
):
    h, vb, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    count = count_ref[chunk]
    c = dims.chunk_size

    @pl.when(count > 0)
    def _():
        dot_dtype = vnew_ref.dtype
        kh = lax.div(h, dims.heads_per_key)
        pos = jnp.arange(c)
        t_ok = pos < count
        rows = pl.ds(lo_ref[chunk], c)
        k_cols, k_ok = _cols(0, dims.bk, dims.dk)
        v_cols, v_ok = _cols(vb * block_v, block_v, dims.dv)
        q = _load_qk(q_ref, rows, t_ok, kh, dims, dot_dtype) * dims.scale
        k = _load(kn_ref.at[chunk, kh, pl.ds(0, c), k_cols], (None, k_ok))
        gamma = gamma_ref[chunk, h, :]
        causal = pos[:, None] >= pos[None, :]
        qk = dot(q.astype(dot_dtype), k, (1, 1))
        m = (qk * _segment_decay(gamma, causal)).astype(dot_dtype)
        s_in = _load(entering_ref.at[chunk, h, k_cols, v_cols], (k_ok, v_ok))
        vnew = _load(vnew_ref.at[chunk, h, pl.ds(0, c), v_cols], (None, v_ok))
        q_decayed = (q * jnp.exp(gamma)[:, None]).astype(dot_dtype)
        o = dot(q_decayed, s_in) + dot(m, vnew)
        _store(o_ref.at[rows, h, v_cols], o.astype(o_ref.dtype), (t_ok, v_ok))


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "scale", "use_qk_l2norm", "interpret", "block_sizes"),
)
def gdn_prefill_gpu(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, HV, Dv]
    g: jax.Array,  # f32[T, HV]
    beta: jax.Array,  # f32[T, HV]
    cu_seqlens: jax.Array,  # i32[S+1]
    *,
    chunk_size: int,
    scale: float,
    use_qk_l2norm: bool = True,
    initial_states: jax.Array | None = None,  # [S, HV, Dk, Dv]
    start_positions: jax.Array | None = None,  # i32[S]
    layout: ChunkLayout | None = None,
    state_chunks: jax.Array | None = None,  # i32[KC]
    tracked: TrackedRequests | None = None,
    interpret: bool = False,
    block_sizes: PrefillGpuBlockSizes | None = None,
):
    """Same contract as :func:`jaxmamba.kernels.gdn.gdn_prefill`."""
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    bs = block_sizes or PrefillGpuBlockSizes.get_default(num_seqs, num_v_heads)
    for name, value in (
        ("chunk_size", chunk_size),
        ("wy_sub_block", bs.wy_sub_block),
        ("state_block_v", bs.state_block_v),
        ("out_block_v", bs.out_block_v),
    ):
        if value != pow2_at_least(value) or value < MIN_DOT_DIM:
            raise ValueError(
                f"Triton GDN kernels need a power-of-two {name} >= {MIN_DOT_DIM}, got {value}"
            )
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    nc = layout.chunk_token_lo.shape[0]
    num_tracked = tracked_rows(state_chunks, nc, False)
    requests = tracked_requests(nc, state_chunks, False) if tracked is None else tracked
    check_tracked_requests(requests, nc, num_tracked)
    state_dtype = _F32 if initial_states is None else initial_states.dtype
    dims = _Dims(
        chunk_size=chunk_size, dk=dk, dv=dv, bk=max(pow2_at_least(dk), MIN_DOT_DIM),
        heads_per_key=num_v_heads // num_k_heads, scale=float(scale),
        use_qk_l2norm=bool(use_qk_l2norm),
    )  # fmt: skip
    lo, count = layout.chunk_token_lo, layout.chunk_token_count

    w, u, gamma, kn = _wy_pass(lo, count, k, v, g, beta, dims=dims, bs=bs, interpret=interpret)
    vnew, entering, final_states, tracked_states = _state_pass(
        layout, requests, kn, w, gamma, u, initial_states, dims=dims, bs=bs,
        num_tracked=num_tracked, state_dtype=state_dtype, interpret=interpret,
    )  # fmt: skip
    o = _output_pass(lo, count, q, kn, gamma, vnew, entering, dims=dims, bs=bs, interpret=interpret)
    if state_chunks is None:
        return o, final_states
    return o, final_states, tracked_states[:num_tracked]


def _wy_pass(lo, count, k, v, g, beta, *, dims: _Dims, bs: PrefillGpuBlockSizes, interpret):
    """Pass 1: W, U, γ and the normalised keys of every (value head, chunk) at once."""
    nc, (num_v_heads, dv) = lo.shape[0], v.shape[1:]
    per_chunk = (nc, num_v_heads, dims.chunk_size)
    sub = min(bs.wy_sub_block, dims.chunk_size)
    return pallas_call(
        functools.partial(_wy_kernel, dims=dims, bvp=max(pow2_at_least(dv), MIN_DOT_DIM), sub=sub),
        grid=(num_v_heads, nc),
        out_shape=(
            jax.ShapeDtypeStruct((*per_chunk, dims.dk), v.dtype),
            jax.ShapeDtypeStruct((*per_chunk, dv), v.dtype),
            jax.ShapeDtypeStruct(per_chunk, _F32),
            jax.ShapeDtypeStruct((nc, k.shape[1], dims.chunk_size, dims.dk), v.dtype),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=bs.wy_warps, num_stages=1),
        interpret=interpret,
        name="gdn_prefill_gpu_wy",
    )(lo, count, k, v, g.astype(_F32), beta.astype(_F32))


def _state_pass(
    layout: ChunkLayout,
    requests: TrackedRequests,
    kn,
    w,
    gamma,
    u,
    initial_states,
    *,
    dims: _Dims,
    bs: PrefillGpuBlockSizes,
    num_tracked: int,
    state_dtype,
    interpret,
):
    """Pass 2: the serial walk over each sequence's chunks; V' replaces U in place."""
    num_seqs = layout.seq_first_chunk.shape[0]
    nc, num_v_heads = u.shape[:2]
    block_v = min(bs.state_block_v, max(pow2_at_least(dims.dv), MIN_DOT_DIM))
    operands = [
        layout.seq_first_chunk.astype(jnp.int32),
        layout.seq_num_chunks.astype(jnp.int32),
        requests.lo,
        requests.hi,
        requests.order,
        kn,
        w,
        gamma,
        u,
    ]
    if initial_states is not None:
        operands.append(initial_states)
    state_shape = (num_v_heads, dims.dk, dims.dv)
    return pallas_call(
        functools.partial(
            _state_kernel, dims=dims, block_v=block_v, has_init=initial_states is not None
        ),
        grid=(num_v_heads, pl.cdiv(dims.dv, block_v), num_seqs),
        out_shape=(
            jax.ShapeDtypeStruct(u.shape, u.dtype),
            jax.ShapeDtypeStruct((nc, *state_shape), u.dtype),
            jax.ShapeDtypeStruct((num_seqs, *state_shape), state_dtype),
            jax.ShapeDtypeStruct((max(num_tracked, 1), *state_shape), state_dtype),
        ),
        input_output_aliases={8: 0},
        compiler_params=plgpu.CompilerParams(num_warps=bs.state_warps, num_stages=bs.state_stages),
        interpret=interpret,
        name="gdn_prefill_gpu_states",
    )(*operands)


def _output_pass(
    lo, count, q, kn, gamma, vnew, entering, *, dims: _Dims, bs: PrefillGpuBlockSizes, interpret
):
    """Pass 3: every (value head, Dv tile, chunk) independently."""
    nc, num_v_heads = vnew.shape[:2]
    block_v = min(bs.out_block_v, max(pow2_at_least(dims.dv), MIN_DOT_DIM))
    return pallas_call(
        functools.partial(_output_kernel, dims=dims, block_v=block_v),
        grid=(num_v_heads, pl.cdiv(dims.dv, block_v), nc),
        out_shape=jax.ShapeDtypeStruct((q.shape[0], num_v_heads, dims.dv), vnew.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.out_warps, num_stages=bs.out_stages),
        interpret=interpret,
        name="gdn_prefill_gpu_outputs",
    )(lo, count, q, kn, gamma, vnew, entering)


def _decode_kernel(
    slots_ref,  # i32[B]
    a_log_ref,  # f32[HV]
    dt_bias_ref,  # f32[HV]
    q_ref,  # [B, Hk, Dk]
    k_ref,  # [B, Hk, Dk]
    v_ref,  # [B, HV, Dv]
    a_ref,  # [B, HV]
    b_ref,  # [B, HV]
    state_ref,  # [S', HV, Dk, Dv] (aliased to state_out_ref)
    o_ref,  # [B, HV, Dv]
    state_out_ref,  # [S', HV, Dk, Dv]
    *,
    dims: _Dims,
    block_v: int,
):
    vb, h, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[row]
    kh = lax.div(h, dims.heads_per_key)
    k_cols, k_ok = _cols(0, dims.bk, dims.dk)
    v_cols, v_ok = _cols(vb * block_v, block_v, dims.dv)
    # The state first: the slot is then the only latency in front of it.
    state = _load(state_ref.at[slot, h, k_cols, v_cols], (k_ok, v_ok))
    q = _load(q_ref.at[row, kh, k_cols], (k_ok,)).astype(_F32)
    k = _load(k_ref.at[row, kh, k_cols], (k_ok,)).astype(_F32)
    v = _load(v_ref.at[row, h, v_cols], (v_ok,)).astype(_F32)
    a, b = a_ref[row, h].astype(_F32), b_ref[row, h].astype(_F32)
    decay = jnp.exp(-jnp.exp(a_log_ref[h]) * softplus(a + dt_bias_ref[h]))
    beta = jax.nn.sigmoid(b)
    if dims.use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * dims.scale
    state = decay * state.astype(_F32)  # [bk, block_v]
    delta = beta * (v - jnp.sum(state * k[:, None], axis=0))  # [block_v]
    state = state + k[:, None] * delta[None, :]
    _store(state_out_ref.at[slot, h, k_cols, v_cols], state.astype(state_out_ref.dtype),
           (k_ok, v_ok))  # fmt: skip
    o = jnp.sum(state * q[:, None], axis=0)
    plgpu.store(o_ref.at[row, h, v_cols], o.astype(o_ref.dtype), mask=v_ok)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "block_sizes"))
def gdn_decode_gpu(
    state: jax.Array,  # [S', HV, Dk, Dv] slot pool (S'-1 the pad slot)
    q: jax.Array,  # [B, Hk, Dk]
    k: jax.Array,  # [B, Hk, Dk]
    v: jax.Array,  # [B, HV, Dv]
    a: jax.Array,  # [B, HV]
    b: jax.Array,  # [B, HV]
    A_log: jax.Array,  # f32[HV]
    dt_bias: jax.Array,  # f32[HV]
    slots: jax.Array,  # i32[B]
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    block_sizes: DecodeGpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as :func:`jaxmamba.kernels.gdn.gdn_decode`; ``state`` is updated in
    place (donate it in the jitted caller)."""
    rows, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    bs = block_sizes or DecodeGpuBlockSizes.get_default(rows)
    if bs.block_v != pow2_at_least(bs.block_v):
        raise ValueError(f"Triton GDN decode needs a power-of-two block_v, got {bs.block_v}")
    dims = _Dims(
        chunk_size=1, dk=dk, dv=dv, bk=pow2_at_least(dk), heads_per_key=num_v_heads // num_k_heads,
        scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm),
    )  # fmt: skip
    block_v = min(bs.block_v, pow2_at_least(dv))
    o, new_state = pallas_call(
        functools.partial(_decode_kernel, dims=dims, block_v=block_v),
        # Dv tiles vary fastest: neighbouring programs stream one slot's contiguous state.
        grid=(pl.cdiv(dv, block_v), num_v_heads, rows),
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ),
        input_output_aliases={8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="gdn_decode_gpu",
    )(
        slots.astype(jnp.int32), A_log.astype(_F32), dt_bias.astype(_F32), q, k, v, a, b,
        state,
    )  # fmt: skip
    return o, new_state
