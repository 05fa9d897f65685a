"""Gated DeltaNet as Pallas Mosaic TPU kernels (also the CPU interpret-mode kernels).

Prefill: grid ``(HV / hb, NC)`` over the SSD's chunk grid (``ssd.layout``). Value heads are
independent ("parallel"); chunks run in packed order ("arbitrary"), so a head's running state
``f32[Dk, Dv]`` stays in a VMEM scratch across its chunks and goes to HBM only as final and
tracked states. The chunk → sequence map and first-chunk flags come in by scalar prefetch and
drive the index maps of the state blocks. XLA regroups q, k, v into ``[heads, NC, C, D]``
blocks (full-dimension blocks, so any Dk, Dv tile) and the in-chunk cumsum ``γ`` of g and β into
``f32[HV, NC, 2, C]`` rows; the output comes back through the inverse gather. Per chunk (WY
form, positions on sublanes, so every matmul is ``A @ B`` or ``A @ Bᵀ`` but the state update's
``Kᵀ V′``)::

    A  = StrictTril(diag(β) K Kᵀ ⊙ Γ),  T = (I + A)⁻¹
    U  = T diag(β) V,  W = T (diag(β) K ⊙ e^γ),  V′ = U − W S
    O  = (Q ⊙ e^γ) S + Tril(Q Kᵀ ⊙ Γ) V′,  S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ V′

``T`` is built by recursive doubling (``unit_lower_inverse``): the inverses of diagonal blocks
of b rows merge pairwise into those of 2b rows, ``[[T1, 0], [−T2 A21 T1, T2]]``, log2(C) levels
of two MXU matmuls each, in float32. Mosaic has no triangular solve, and a forward substitution
over rows is C serial steps of a dynamic row each; the product form
``(I − A)(I + A²)(I + A⁴)…`` is as few matmuls, but its powers of A grow like binomial
coefficients (C(63, 31) ≈ 1e18 for equal keys at C = 64) and cancel in float32, while every
block the doubling multiplies is a true inverse of a sub-block, as large as T itself. A grid
step takes the value heads of one key head (``TpuBlockSizes.value_heads``): they share q, k and
their Gram matrices, and their independent chains of small matmuls interleave.

Decode: grid ``(B, HV / hb)``, the slot ids scalar-prefetched into the index map of the state
block ``[hb, Dk, Dv]``, which is aliased input → output: the pool is read once and written once,
in place. Gating, the q/k norms and the update run on the VPU (a row of q, k, v and the raw
``a``/``b`` per grid row).

Notation: T tokens, Hk key heads, HV value heads, Dk key dim, Dv value dim, S sequences,
C chunk, NC chunks, B decode rows, S' slots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import dot, pallas_call, softplus, to_column, tpu_interpret_params
from ..ssd.layout import (
    ChunkLayout,
    TrackedRequests,
    build_chunk_layout,
    check_tracked_requests,
    to_chunks,
    tracked_requests,
    tracked_rows,
)

_F32 = jnp.float32
_EPS = 1e-6  # q/k L2 norm, as HF's l2norm


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Prefill: ``value_heads`` per grid step (None: the HV / Hk heads of one key head), which
    share their key head's q, k blocks and ``Q Kᵀ``, ``K Kᵀ``, and whose independent chains of
    small matmuls (the inverse) interleave. Decode: ``max_block_bytes`` of float32 state per
    grid step (x4 in VMEM: in and out, double-buffered)."""

    value_heads: int | None = None
    max_block_bytes: int = 1 << 19

    @classmethod
    def get_default(cls) -> TpuBlockSizes:
        return cls()

    def prefill_heads(self, num_v_heads: int, num_k_heads: int) -> int:
        rep = num_v_heads // num_k_heads
        hb = self.value_heads or rep
        if num_v_heads % hb or (hb % rep and rep % hb):
            raise ValueError(
                f"gdn_prefill_tpu: value_heads must divide HV={num_v_heads} and divide or be "
                f"a multiple of HV/Hk={rep}; got {hb}"
            )
        return hb

    def heads(self, num_v_heads: int, k_dim: int, v_dim: int) -> int:
        """The most value heads (a divisor of HV) whose state block fits ``max_block_bytes``."""
        per_head = k_dim * v_dim * 4
        fits = [hb for hb in range(1, num_v_heads + 1)
                if num_v_heads % hb == 0 and hb * per_head <= self.max_block_bytes]  # fmt: skip
        return max(fits, default=1)


def _l2norm(x: jax.Array) -> jax.Array:  # f32[rows, D], each row
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + _EPS)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)⁻¹`` for a strictly lower-triangular ``f32[C, C]`` ``a``, by
    recursive doubling: ``t`` holds the inverses of the diagonal blocks of ``b`` rows; two of
    them merge into the inverse of their ``2b`` block as ``[[T1, 0], [−T2 A21 T1, T2]]``, which
    is ``t − t E t`` with ``E`` the ``A21`` blocks. log2(C) levels of two MXU matmuls."""
    size = a.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    t = (rows == cols).astype(_F32)
    split = jnp.bitwise_xor(rows, cols)  # < 2b and >= b: same 2b block, different b blocks
    b = 1
    while b < size:
        e = jnp.where((split >= b) & (split < 2 * b) & (rows > cols), a, 0.0)
        t = t - dot(dot(t, e), t)
        b *= 2
    return t


def chunk_update(
    q: jax.Array,  # [C, Dk] dot dtype, normalised and scaled; zero at empty positions
    k: jax.Array,  # [C, Dk] dot dtype, normalised; zero at empty positions
    qk: jax.Array,  # f32[C, C] Q Kᵀ
    kk: jax.Array,  # f32[C, C] K Kᵀ
    v: jax.Array,  # [C, Dv] dot dtype
    gamma_row: jax.Array,  # f32[1, C] in-chunk cumsum of g (g = 0 at empty positions)
    beta_row: jax.Array,  # f32[1, C] (0 at empty positions)
    state: jax.Array,  # f32[Dk, Dv] state entering the chunk
) -> tuple[jax.Array, jax.Array]:
    """One chunk of one value head: ``(O f32[C, Dv], state after the chunk f32[Dk, Dv])``."""
    size = gamma_row.shape[1]
    dd = k.dtype
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)  # i (target position)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)  # j (source position)
    gamma_col, beta_col = to_column(gamma_row), to_column(beta_row)  # [C, 1]
    last = jnp.sum(jnp.where(cols[:1] == size - 1, gamma_row, 0.0), axis=1, keepdims=True)
    # Γ_ij = exp(γ_i − γ_j) for i >= j; masked before exp, so nothing overflows.
    decay = jnp.exp(jnp.where(rows >= cols, gamma_col - gamma_row, -jnp.inf))  # [C, C]

    kf = k.astype(_F32)
    t = unit_lower_inverse(jnp.where(rows > cols, beta_col * kk * decay, 0.0)).astype(dd)
    u = dot(t, (beta_col * v.astype(_F32)).astype(dd))  # [C, Dv]
    w = dot(t, (beta_col * jnp.exp(gamma_col) * kf).astype(dd))  # [C, Dk]
    state_d = state.astype(dd)
    v_new = (u - dot(w.astype(dd), state_d)).astype(dd)  # [C, Dv]

    attn = (qk * decay).astype(dd)  # Γ is 0 above the diagonal
    q_in = (q.astype(_F32) * jnp.exp(gamma_col)).astype(dd)
    o = dot(q_in, state_d) + dot(attn, v_new)  # [C, Dv]
    k_out = (kf * jnp.exp(last - gamma_col)).astype(dd)  # [C, Dk]
    new_state = jnp.exp(last) * state + dot(k_out, v_new, (0, 0))  # [Dk, Dv]
    return o, new_state


def _prefill_kernel(
    # scalar prefetch
    seq_ref,  # i32[NC] sequence whose initial/final state block the chunk uses
    first_ref,  # i32[NC] 1: start from the initial state
    track_ref,  # i32[NC] 1: write the chunk's end state
    slot_ref,  # i32[NC] tracked-state row of the chunk
    # inputs
    q_ref,  # [kb, C, Dk]
    k_ref,  # [kb, C, Dk]
    v_ref,  # [hb, C, Dv]
    gb_ref,  # f32[hb, 2, C] rows γ, β
    init_ref,  # [hb, Dk, Dv]
    # outputs
    o_ref,  # [hb, C, Dv]
    final_ref,  # [hb, Dk, Dv]
    states_ref,  # [hb, Dk, Dv]
    state_scr,  # f32[hb, Dk, Dv]
    *,
    rep: int,
    scale: float,
    use_qk_l2norm: bool,
):
    del seq_ref, slot_ref  # index maps only
    c = pl.program_id(1)
    hb = v_ref.shape[0]

    @pl.when(first_ref[c] != 0)
    def _():
        state_scr[...] = init_ref[...].astype(_F32)

    dd = v_ref.dtype
    keys = []
    for j in range(q_ref.shape[0]):
        q, k = q_ref[j].astype(_F32), k_ref[j].astype(_F32)
        if use_qk_l2norm:
            q, k = _l2norm(q), _l2norm(k)
        q, k = (q * scale).astype(dd), k.astype(dd)
        keys.append((q, k, dot(q, k, (1, 1)), dot(k, k, (1, 1))))
    # The heads' chains are independent: unrolled, their small matmuls interleave.
    for j in range(hb):
        gb = gb_ref[j]
        o, state = chunk_update(
            *keys[j // rep if hb >= rep else 0], v_ref[j], gb[0:1], gb[1:2], state_scr[j]
        )
        state_scr[j] = state
        # Written every chunk; the block goes to HBM when the sequence changes (and at the end).
        final_ref[j] = state.astype(final_ref.dtype)
        o_ref[j] = o.astype(o_ref.dtype)

    @pl.when(track_ref[c] != 0)
    def _():
        states_ref[...] = state_scr[...].astype(states_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "scale", "use_qk_l2norm", "interpret", "block_sizes"),
)
def gdn_prefill_tpu(
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
    interpret=False,
    block_sizes: TpuBlockSizes | None = None,
):
    """Same contract as :func:`jaxmamba.kernels.gdn.gdn_prefill`; the matmuls take v's dtype
    (float32 accumulation; the inverse in float32). ``interpret=True`` runs it under
    ``pltpu.InterpretParams()``."""
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    rep = num_v_heads // num_k_heads
    hb = (block_sizes or TpuBlockSizes.get_default()).prefill_heads(num_v_heads, num_k_heads)
    kb = max(1, hb // rep)  # key heads a step reads
    num_seqs = cu_seqlens.shape[0] - 1
    state_dtype = _F32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    nc = layout.token_index.shape[0]
    idx = layout.token_index
    num_tracked = tracked_rows(state_chunks, nc, False)
    if tracked is None:
        tracked = tracked_requests(nc, state_chunks, False)
    check_tracked_requests(tracked, nc, num_tracked)
    # One output row per requested chunk (in chunk order), gathered per request afterwards.
    track = (tracked.hi > tracked.lo).astype(jnp.int32)
    num_slots = max(1, min(nc, num_tracked))

    # Empty positions read zero q, k, v, g and β: no decay and no update, exact no-ops.
    qc, kc = (to_chunks(x, idx).transpose(2, 0, 1, 3) for x in (q, k))  # [Hk, NC, C, Dk]
    vc = to_chunks(v, idx).transpose(2, 0, 1, 3)  # [HV, NC, C, Dv]
    gc, bc = (to_chunks(x.astype(_F32), idx).transpose(2, 0, 1) for x in (g, beta))
    gb = jnp.stack([jnp.cumsum(gc, axis=-1), bc], axis=2)  # f32[HV, NC, 2, C]
    # Empty sequences are never visited: their final state is the aliased initial state.
    init = (
        jnp.zeros((num_seqs, num_v_heads, k_dim, v_dim), state_dtype)
        if initial_states is None
        else initial_states
    )

    def key_block(h, c, *_):
        return (lax.div(h * hb, rep * kb), c, 0, 0)  # h >= 0: no floor fix-up

    def chunk_block(h, c, *_):
        return (h, c, 0, 0)

    def seq_block(h, c, seq, *_):
        return (seq[c], h, 0, 0)

    def slot_block(h, c, seq, first, track, slot):
        return (slot[c], h, 0, 0)

    qk_spec = pl.BlockSpec((kb, None, chunk_size, k_dim), key_block)
    v_spec = pl.BlockSpec((hb, None, chunk_size, v_dim), chunk_block)
    state_spec = pl.BlockSpec((None, hb, k_dim, v_dim), seq_block)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_v_heads // hb, nc),
        in_specs=[
            qk_spec,
            qk_spec,
            v_spec,
            pl.BlockSpec((hb, None, 2, chunk_size), chunk_block),
            state_spec,
        ],
        out_specs=(
            v_spec,
            state_spec,
            pl.BlockSpec((None, hb, k_dim, v_dim), slot_block),
        ),
        scratch_shapes=[pltpu.VMEM((hb, k_dim, v_dim), _F32)],
    )
    kernel = functools.partial(
        _prefill_kernel, rep=rep, scale=float(scale), use_qk_l2norm=use_qk_l2norm
    )
    oc, final_states, states = pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(
            jax.ShapeDtypeStruct(vc.shape, v.dtype),
            jax.ShapeDtypeStruct(init.shape, state_dtype),
            jax.ShapeDtypeStruct((num_slots, num_v_heads, k_dim, v_dim), state_dtype),
        ),
        # Operand 8 = init after the 4 scalar-prefetch operands and q, k, v, γβ.
        input_output_aliases={8: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret_params(interpret),
        name="gdn_prefill_tpu",
    )(layout.scan_seq, layout.scan_first, track, tracked.rank, qc, kc, vc, gb, init)

    o = oc.transpose(1, 2, 0, 3).reshape(nc * chunk_size, num_v_heads, v_dim)
    o = jnp.zeros_like(v).at[idx.reshape(-1)].set(o, mode="drop")
    if state_chunks is None:
        return o, final_states
    return o, final_states, states[tracked.request_rank[:num_tracked]]


def _pick_row(a: jax.Array, i) -> jax.Array:
    """``a[i:i+1]`` for a dynamic ``i``, as a masked sublane sum."""
    rows = lax.broadcasted_iota(jnp.int32, a.shape, 0)
    return jnp.sum(jnp.where(rows == i, a, 0.0), axis=0, keepdims=True)


def _pick_lane(a: jax.Array, i) -> jax.Array:
    """``a[:, i:i+1]`` for a dynamic ``i``, as a masked lane sum."""
    cols = lax.broadcasted_iota(jnp.int32, a.shape, 1)
    return jnp.sum(jnp.where(cols == i, a, 0.0), axis=1, keepdims=True)


def _decode_kernel(
    slots_ref,
    state_ref,  # [hb, Dk, Dv] this row's slot, value heads [j*hb, (j+1)*hb)
    q_ref,  # [Hk, Dk] the whole row (fetched once per row)
    k_ref,  # [Hk, Dk]
    v_ref,  # [HV, Dv]
    a_ref,  # [1, HV] raw decay input
    b_ref,  # [1, HV] raw beta input
    a_log_ref,  # f32[1, HV]
    dt_bias_ref,  # f32[1, HV]
    o_ref,  # [HV, Dv] the whole row, written after its last head block
    state_out_ref,  # [hb, Dk, Dv]
    o_acc,  # f32[HV, Dv]
    *,
    hb: int,
    rep: int,
    scale: float,
    use_qk_l2norm: bool,
):
    del slots_ref  # index maps only
    blk = pl.program_id(1)
    x = a_ref[...].astype(_F32) + dt_bias_ref[...]
    g = -jnp.exp(a_log_ref[...]) * softplus(x)  # [1, HV]
    beta = jax.nn.sigmoid(b_ref[...].astype(_F32))  # [1, HV]
    q, k = q_ref[...].astype(_F32), k_ref[...].astype(_F32)  # [Hk, Dk]
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    vs = v_ref[...].astype(_F32)  # [HV, Dv]
    o_all = o_acc[...]
    row_ids = lax.broadcasted_iota(jnp.int32, o_all.shape, 0)
    # q and k run along Dk, the state's sublane axis but their lane axis: they move to
    # columns on the VPU (to_column), once per key head when a block holds whole groups.
    columns = {}
    for j in range(hb):
        head = blk * hb + j
        group = j // rep if hb % rep == 0 else j
        if group not in columns:
            key = lax.div(head, rep)
            columns[group] = (to_column(_pick_row(q, key)), to_column(_pick_row(k, key)))
        q_col, k_col = columns[group]  # [Dk, 1]
        decayed = jnp.exp(_pick_lane(g, head)) * state_ref[j].astype(_F32)  # [Dk, Dv]
        predicted = jnp.sum(k_col * decayed, axis=0, keepdims=True)  # [1, Dv]
        delta = _pick_lane(beta, head) * (_pick_row(vs, head) - predicted)
        s = decayed + k_col * delta
        state_out_ref[j] = s.astype(state_out_ref.dtype)
        o = jnp.sum(q_col * s, axis=0, keepdims=True)  # [1, Dv]
        o_all = jnp.where(row_ids == head, o, o_all)
    o_acc[...] = o_all

    @pl.when(blk == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = o_acc[...].astype(o_ref.dtype)


def gdn_decode_tpu(
    state: jax.Array,  # [S', HV, Dk, Dv]
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
    interpret=False,
    block_sizes: TpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as :func:`jaxmamba.kernels.gdn.gdn_decode`: the pool is updated in place
    (aliased); donate it in the jitted caller."""
    rows, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    hb = (block_sizes or TpuBlockSizes.get_default()).heads(num_v_heads, k_dim, v_dim)

    def row_block(r, j, s):
        return (r, 0, 0)

    def whole(r, j, s):
        return (0, 0)

    qk_spec = pl.BlockSpec((None, num_k_heads, k_dim), row_block)
    v_spec = pl.BlockSpec((None, num_v_heads, v_dim), row_block)
    gate_spec = pl.BlockSpec((None, 1, num_v_heads), row_block)
    param_spec = pl.BlockSpec((1, num_v_heads), whole)
    state_spec = pl.BlockSpec((None, hb, k_dim, v_dim), lambda r, j, s: (s[r], j, 0, 0))
    kernel = functools.partial(
        _decode_kernel, hb=hb, rep=num_v_heads // num_k_heads, scale=float(scale),
        use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    o, new_state = pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(rows, num_v_heads // hb),
            in_specs=[state_spec, qk_spec, qk_spec, v_spec, gate_spec, gate_spec]
            + [param_spec] * 2,
            out_specs=[v_spec, state_spec],
            scratch_shapes=[pltpu.VMEM((num_v_heads, v_dim), _F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={1: 1},  # operand 0 is the prefetched slots
        # o's block is the whole row, revisited along the head axis: that axis is sequential.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret_params(interpret),
        name="gdn_decode_tpu",
    )(
        slots.astype(jnp.int32), state, q, k, v,
        a.reshape(rows, 1, num_v_heads), b.reshape(rows, 1, num_v_heads),
        A_log.astype(_F32).reshape(1, num_v_heads), dt_bias.astype(_F32).reshape(1, num_v_heads),
    )  # fmt: skip
    return o, new_state
