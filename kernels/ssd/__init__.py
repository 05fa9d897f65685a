"""Varlen chunked SSD (Mamba2 state-space duality) scan over packed sequences.

Per head: ``h_t = exp(dt_t*A) h_{t-1} + dt_t x_t ⊗ B_t``, ``y_t = h_t·C_t + D x_t``, computed
chunk-wise: a quadratic form inside each chunk plus a sequential pass over chunk states, over
the absolute-aligned chunk grid of ``layout.py``. The reference is in ``ref.py``, the Mosaic
TPU kernel in ``tpu.py``, the Triton-lowered GPU kernels in ``gpu.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common import MIN_DOT_DIM, ColumnView, check_optional_shapes, process_dt
from ..dispatch import current_platform, select_impl
from .gpu import ssd_varlen_gpu
from .layout import ChunkLayout, TrackedRequests, build_chunk_layout, num_chunks, tracked_requests
from .ref import ssd_varlen_ref
from .tpu import ssd_varlen_tpu

__all__ = [
    "ChunkLayout",
    "TrackedRequests",
    "build_chunk_layout",
    "num_chunks",
    "process_dt",
    "ssd_varlen",
    "ssd_varlen_ref",
    "tracked_requests",
]


def gpu_dots_too_small(dtype, chunk_size: int, state_size: int) -> bool:
    """Whether the Triton SSD kernel's 16-bit dots would have a tile edge below
    ``MIN_DOT_DIM``: a chunk or state size under 16 in bf16/f16. Triton's 16-bit MMA needs
    edges of 16, and on an H100 such a kernel compiled and returned wrong values (the Falcon-H1,
    Bamba, Granite and Nemotron-H MoE test checkpoints, chunk 8 and state 8: a 0.25 relative
    logit error against HF, the reference 0.013), so ``"auto"`` runs the reference there and
    an explicit ``"pallas"`` is refused. Published models use chunks of 128 or 256 and states
    of 64 or 128."""
    return jnp.dtype(dtype).itemsize == 2 and min(chunk_size, state_size) < MIN_DOT_DIM


def ssd_varlen(
    x: jax.Array | ColumnView,  # [T, H, P] activation dtype
    dt: jax.Array | ColumnView,  # [T, H] raw dt (before bias/softplus)
    A: jax.Array,  # [H] negative (A = -exp(A_log))
    B: jax.Array | ColumnView,  # [T, G, N]
    C: jax.Array | ColumnView,  # [T, G, N]
    cu_seqlens: jax.Array,  # i32[S+1] monotone; tokens >= cu_seqlens[-1] are padding
    *,
    chunk_size: int,
    D: jax.Array | None = None,  # [H]
    z: jax.Array | ColumnView | None = None,  # [T, H, P]
    dt_bias: jax.Array | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: jax.Array | None = None,  # [S, H, P, N] or None (zeros)
    start_positions: jax.Array | None = None,  # i32[S] or None (zeros)
    layout: ChunkLayout | None = None,  # from build_chunk_layout(..., chunk_size, start_positions)
    return_chunk_states: bool = False,
    state_chunks: jax.Array | None = None,  # i32[K] chunks of `layout` whose end state is wanted
    tracked: TrackedRequests | None = None,  # tracked_requests(NC, state_chunks, ...)
    impl: str = "auto",
):
    """Chunked SSD scan over packed sequences.

    Returns ``(y [T, H, P] x.dtype, final_states [S, H, P, N])`` and, with
    ``return_chunk_states``, ``chunk_states [NC, H, P, N]``: the state after the last token of
    each chunk of ``layout`` (or ``build_chunk_layout(cu_seqlens, T, chunk_size,
    start_positions)``; unused chunks hold arbitrary values), or with ``state_chunks`` only the
    states after those chunks, ``[K, H, P, N]`` (what checkpointing needs; the kernels then
    write K states instead of NC); ``tracked`` is ``tracked_requests(NC, state_chunks,
    return_chunk_states)``, built once per step for every layer (else each call builds it).
    States have the dtype of ``initial_states`` (float32
    without); an empty sequence's final state is its initial state.

    ``x``, ``dt``, ``B``, ``C`` and ``z`` may each be a ``ColumnView`` (its columns of a wider
    array: x, B and C of the conv output, dt of the in_proj output): the GPU kernels read them
    in place, the reference and the TPU kernel take their slices.

    ``impl`` (see ``dispatch``): the kernels are ``tpu.ssd_varlen_tpu`` (Mosaic TPU; also what
    "interpret" runs, under ``pltpu.InterpretParams()``) and ``gpu.ssd_varlen_gpu`` (Triton).
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
    check_optional_shapes(D=(D, (num_heads,)), dt_bias=(dt_bias, (num_heads,)), z=(z, x.shape))
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
    if impl in ("auto", "auto_gpu") and gpu_dots_too_small(x.dtype, chunk_size, B.shape[2]):
        if impl == "auto_gpu" or current_platform() == "gpu":
            impl = "ref"
    fn = select_impl(
        "ssd_varlen",
        impl,
        ref=ssd_varlen_ref,
        pallas_tpu=functools.partial(ssd_varlen_tpu, tracked=tracked),
        pallas_gpu=functools.partial(ssd_varlen_gpu, tracked=tracked),
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
