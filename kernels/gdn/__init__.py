"""Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention): the chunked gated delta rule over
packed sequences (prefill/extend) and the fused recurrent decode update on a slot pool.

Per value head h (key head ``h // (HV // Hk)``), state ``S`` of shape ``[Dk, Dv]``:

    q, k  <- L2-normalised (eps 1e-6, as HF ``l2norm``), q also times ``scale`` (Dk^-0.5)
    S_t   =  e^{g_t} S_{t-1} + k_t [beta_t (v_t - e^{g_t} S_{t-1}^T k_t)]^T
    o_t   =  S_t^T q_t

The prefill op takes the log decay ``g`` and ``beta`` already computed (elementwise; XLA
fuses them into their producer); the decode op computes them itself from the raw ``a``/``b``
projections (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``), so one kernel
does the gating, the q/k norms and the state update, reading and writing the pool in place.

The chunk grid is the SSD's (``ssd.layout``): chunk boundaries sit at absolute multiples of
``chunk_size``, so the state after a chunk is the state at an absolute multiple of C, which is
what prefix-cache checkpoints are taken from (``state_chunks``/``tracked``, as ``ssd_varlen``).

The reference is in ``ref.py`` (the WY chunked form in jnp, float32), the Mosaic TPU kernels
in ``tpu.py``, the Triton-lowered GPU kernels in ``gpu.py``.
"""

from __future__ import annotations

import jax

from ..dispatch import select_impl
from ..ssd.layout import ChunkLayout, TrackedRequests
from .gpu import gdn_decode_gpu, gdn_prefill_gpu
from .ref import gdn_decode_ref, gdn_gating, gdn_prefill_ref
from .tpu import gdn_decode_tpu, gdn_prefill_tpu

__all__ = ["gdn_decode", "gdn_decode_ref", "gdn_gating", "gdn_prefill", "gdn_prefill_ref"]


def _check_heads(q, k, v, what: str) -> tuple[int, int, int, int]:
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"{what}: expected q, k [T, Hk, Dk] and v [T, HV, Dv]; got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"{what}: value heads HV={hv} must be a multiple of key heads Hk={hk}")
    return hk, dk, hv, dv


def gdn_prefill(
    q: jax.Array,  # [T, Hk, Dk] activation dtype (after the conv; not yet normalised)
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, HV, Dv]
    g: jax.Array,  # f32[T, HV] log decay (<= 0)
    beta: jax.Array,  # f32[T, HV]
    cu_seqlens: jax.Array,  # i32[S+1] monotone; tokens >= cu_seqlens[-1] are padding
    *,
    chunk_size: int,
    scale: float | None = None,  # None: Dk ** -0.5
    use_qk_l2norm: bool = True,
    initial_states: jax.Array | None = None,  # [S, HV, Dk, Dv] or None (zeros)
    start_positions: jax.Array | None = None,  # i32[S] or None (zeros)
    layout: ChunkLayout | None = None,  # build_chunk_layout(cu_seqlens, T, C, start_positions)
    state_chunks: jax.Array | None = None,  # i32[KC] chunks of `layout` whose end state is wanted
    tracked: TrackedRequests | None = None,  # tracked_requests(NC, state_chunks, False)
    impl: str = "auto",
):
    """Chunked gated delta rule over packed sequences.

    Returns ``(o [T, HV, Dv] v.dtype, final_states [S, HV, Dk, Dv])`` and, with
    ``state_chunks``, a third output ``[KC, HV, Dk, Dv]``: the state after each of those
    chunks. States have the dtype of ``initial_states`` (float32 without); an empty
    sequence's final state is its initial state. Padding tokens' outputs are unspecified.
    """
    hk, dk, hv, dv = _check_heads(q, k, v, "gdn_prefill")
    num_tokens = q.shape[0]
    if g.shape != (num_tokens, hv) or beta.shape != (num_tokens, hv):
        raise ValueError(
            f"gdn_prefill: expected g, beta [T={num_tokens}, HV={hv}]; got g {g.shape}, "
            f"beta {beta.shape}"
        )
    num_seqs = cu_seqlens.shape[0] - 1
    if initial_states is not None and initial_states.shape != (num_seqs, hv, dk, dv):
        raise ValueError(
            f"gdn_prefill: expected initial_states [S, HV, Dk, Dv] = {(num_seqs, hv, dk, dv)}, "
            f"got {initial_states.shape}"
        )
    if start_positions is not None and start_positions.shape != (num_seqs,):
        raise ValueError(f"gdn_prefill: expected start_positions [S={num_seqs}], got "
                         f"{start_positions.shape}")  # fmt: skip
    if layout is not None and layout.token_index.shape[1] != chunk_size:
        raise ValueError(f"gdn_prefill: layout was built for chunk size "
                         f"{layout.token_index.shape[1]}, got {chunk_size}")  # fmt: skip
    if state_chunks is not None and state_chunks.ndim != 1:
        raise ValueError(f"gdn_prefill: expected state_chunks i32[KC], got {state_chunks.shape}")
    fn = select_impl(
        "gdn_prefill", impl, ref=gdn_prefill_ref, pallas_tpu=gdn_prefill_tpu,
        pallas_gpu=gdn_prefill_gpu,
    )  # fmt: skip
    return fn(
        q, k, v, g, beta, cu_seqlens, chunk_size=chunk_size,
        scale=dk**-0.5 if scale is None else scale, use_qk_l2norm=use_qk_l2norm,
        initial_states=initial_states, start_positions=start_positions, layout=layout,
        state_chunks=state_chunks, tracked=tracked,
    )  # fmt: skip


def gdn_decode(
    state: jax.Array,  # [S', HV, Dk, Dv] slot pool (f32 default, or bf16); S'-1 is the pad slot
    q: jax.Array,  # [B, Hk, Dk] activation dtype (after the conv update)
    k: jax.Array,  # [B, Hk, Dk]
    v: jax.Array,  # [B, HV, Dv]
    a: jax.Array,  # [B, HV] raw decay input (before dt_bias / softplus)
    b: jax.Array,  # [B, HV] raw beta input (before sigmoid)
    A_log: jax.Array,  # f32[HV]
    dt_bias: jax.Array,  # f32[HV]
    slots: jax.Array,  # i32[B] slot of each row (pad rows -> pad slot, duplicates allowed there)
    *,
    scale: float | None = None,  # None: Dk ** -0.5
    use_qk_l2norm: bool = True,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One decode token per row: gating, q/k norms and the delta-rule update in one op.

    Returns ``(o [B, HV, Dv] v.dtype, new_state [S', HV, Dk, Dv] state.dtype)``. The Pallas
    kernels update ``state`` in place (aliased); donate it in the jitted caller.
    """
    hk, dk, hv, dv = _check_heads(q, k, v, "gdn_decode")
    rows = q.shape[0]
    if state.ndim != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"gdn_decode: expected state [S', HV={hv}, Dk={dk}, Dv={dv}], got "
                         f"{state.shape}")  # fmt: skip
    if a.shape != (rows, hv) or b.shape != (rows, hv) or slots.shape != (rows,):
        raise ValueError(f"gdn_decode: expected a, b [B={rows}, HV={hv}] and slots [B]; got "
                         f"a {a.shape}, b {b.shape}, slots {slots.shape}")  # fmt: skip
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"gdn_decode: expected A_log, dt_bias [HV={hv}]; got {A_log.shape}, "
                         f"{dt_bias.shape}")  # fmt: skip
    fn = select_impl(
        "gdn_decode", impl, ref=gdn_decode_ref, pallas_tpu=gdn_decode_tpu,
        pallas_gpu=gdn_decode_gpu,
    )  # fmt: skip
    return fn(
        state, q, k, v, a, b, A_log, dt_bias, slots,
        scale=dk**-0.5 if scale is None else scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
