"""The gated delta rule in plain jnp (float32 throughout): the kernels' reference. Prefill is
the chunked WY form over the SSD's chunk grid (``ssd.layout``); decode is one recurrent step
on a slot pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

from ..common import softplus
from ..ssd.layout import ChunkLayout, TrackedRequests, build_chunk_layout, to_chunks

_HIGHEST = lax.Precision.HIGHEST


def gdn_gating(
    a: jax.Array,  # [..., HV] raw decay input
    b: jax.Array,  # [..., HV] raw beta input
    A_log: jax.Array,  # f32[HV]
    dt_bias: jax.Array,  # f32[HV]
) -> tuple[jax.Array, jax.Array]:
    """``(g, beta)`` in float32: ``g = -exp(A_log)·softplus(a + dt_bias)``, ``beta = σ(b)``."""
    x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus(x)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def _l2norm(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _value_heads_qk(q, k, num_v_heads, scale, use_qk_l2norm):
    """q, k [..., Hk, Dk] -> float32 [..., HV, Dk], normalised and q scaled; value head h reads
    key head h // (HV // Hk)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    rep = num_v_heads // q.shape[-2]
    return jnp.repeat(q * scale, rep, axis=-2), jnp.repeat(k, rep, axis=-2)


def gdn_prefill_ref(
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
):
    """Chunked gated delta rule over packed sequences (see ``gdn_prefill``). ``tracked`` is
    the kernels' write plan for the requested states; the reference gathers them instead."""
    del tracked
    num_tokens, num_v_heads, v_dim = v.shape
    k_dim = q.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    state_dtype = jnp.float32 if initial_states is None else initial_states.dtype
    if layout is None:
        layout = build_chunk_layout(cu_seqlens, num_tokens, chunk_size, start_positions)
    idx = layout.token_index

    # Chunk tensors as [NC, HV, C, ...]. Empty positions read zero q, k, v, g and beta: no
    # decay (g = 0) and no update (beta = 0, k = 0), so they are exact no-ops.
    q, k = _value_heads_qk(q, k, num_v_heads, scale, use_qk_l2norm)
    qc, kc, vc = (
        jnp.swapaxes(to_chunks(x.astype(jnp.float32), idx), 1, 2) for x in (q, k, v)
    )  # [NC, HV, C, Dk | Dv]
    gc, bc = (jnp.swapaxes(to_chunks(x.astype(jnp.float32), idx), 1, 2) for x in (g, beta))

    gamma = jnp.cumsum(gc, axis=-1)  # [NC, HV, C], non-increasing along C
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    # Γ_ij = exp(γ_i - γ_j) for i >= j, else 0; masked before exp so nothing overflows.
    decay = jnp.exp(jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))

    # T = (I + A)⁻¹, A = StrictTril(diag(β) K Kᵀ ⊙ Γ): the solves read lhs's strict lower
    # triangle only (unit_diagonal), so its diagonal (β_i k_i·k_i) is never used.
    kk = jnp.einsum("nhid,nhjd->nhij", kc, kc, precision=_HIGHEST)
    lhs = bc[..., :, None] * kk * decay  # [NC, HV, C, C]
    u = solve_triangular(lhs, bc[..., None] * vc, lower=True, unit_diagonal=True)
    w = solve_triangular(
        lhs, (bc * jnp.exp(gamma))[..., None] * kc, lower=True, unit_diagonal=True
    )  # u [NC, HV, C, Dv], w [NC, HV, C, Dk]
    qk = jnp.einsum("nhid,nhjd->nhij", qc, kc, precision=_HIGHEST) * decay
    q_in = qc * jnp.exp(gamma)[..., None]  # [NC, HV, C, Dk]
    k_out = kc * jnp.exp(gamma[..., -1:] - gamma)[..., None]  # [NC, HV, C, Dk]
    chunk_decay = jnp.exp(gamma[..., -1])  # [NC, HV]

    # Sequential pass over chunks in packed order; a sequence's first chunk starts from its
    # initial state. Unused chunks (chunk_seq == S) read the appended zero state.
    state_shape = (num_v_heads, k_dim, v_dim)
    init = jnp.zeros((num_seqs + 1,) + state_shape, jnp.float32)
    if initial_states is not None:
        init = init.at[:num_seqs].set(initial_states.astype(jnp.float32))

    def step(carry, inputs):
        first, seq, u, w, k_out, dec = inputs
        entering = jnp.where(first, init[seq], carry)
        v_new = u - jnp.einsum("hid,hde->hie", w, entering, precision=_HIGHEST)
        out = dec[:, None, None] * entering + jnp.einsum(
            "hid,hie->hde", k_out, v_new, precision=_HIGHEST
        )
        return out, (entering, out)

    # chunk_states of unused chunks are arbitrary (they carry the previous state along).
    _, (entering, chunk_states) = lax.scan(
        step,
        jnp.zeros(state_shape, jnp.float32),
        (layout.chunk_first, layout.chunk_seq, u, w, k_out, chunk_decay),
    )

    v_new = u - jnp.einsum("nhid,nhde->nhie", w, entering, precision=_HIGHEST)
    o = jnp.einsum("nhid,nhde->nhie", q_in, entering, precision=_HIGHEST) + jnp.einsum(
        "nhij,nhje->nhie", qk, v_new, precision=_HIGHEST
    )  # [NC, HV, C, Dv]
    o = jnp.swapaxes(o, 1, 2).reshape(-1, num_v_heads, v_dim)
    o = (
        jnp.zeros((num_tokens, num_v_heads, v_dim), jnp.float32)
        .at[idx.reshape(-1)]
        .set(o, mode="drop")
        .astype(v.dtype)
    )

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    final_states = jnp.where(
        (lengths > 0)[:, None, None, None], chunk_states[layout.seq_last_chunk], init[:num_seqs]
    ).astype(state_dtype)
    if state_chunks is not None:
        return o, final_states, chunk_states[state_chunks].astype(state_dtype)
    return o, final_states


def gdn_decode_ref(
    state: jax.Array,  # [S', HV, Dk, Dv] slot pool
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
) -> tuple[jax.Array, jax.Array]:
    """One recurrent step per row on the slot pool (see ``gdn_decode``)."""
    g, beta = gdn_gating(a, b, A_log, dt_bias)  # [B, HV]
    q, k = _value_heads_qk(q, k, v.shape[1], scale, use_qk_l2norm)  # [B, HV, Dk]
    s = jnp.exp(g)[..., None, None] * state[slots].astype(jnp.float32)  # [B, HV, Dk, Dv]
    predicted = jnp.einsum("bhde,bhd->bhe", s, k, precision=_HIGHEST)
    delta = beta[..., None] * (v.astype(jnp.float32) - predicted)  # [B, HV, Dv]
    s = s + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("bhde,bhd->bhe", s, q, precision=_HIGHEST)
    return o.astype(v.dtype), state.at[slots].set(s.astype(state.dtype))
