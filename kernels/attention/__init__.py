"""Paged KV cache writes and causal GQA attention over paged K/V (no RoPE).

The reference and the cache write are in ``ref.py``, the query blocks both kernels share in
``blocks.py``, the Mosaic TPU kernel in ``tpu.py``, the Triton-lowered GPU kernel in ``gpu.py``.
"""

from __future__ import annotations

import functools

import jax

from ..dispatch import select_impl
from .blocks import QueryBlocks
from .gpu import paged_attention_gpu, query_blocks_gpu
from .ref import paged_attention_ref, write_kv
from .tpu import paged_attention_tpu, query_blocks_tpu

__all__ = [
    "QueryBlocks",
    "attention_query_blocks",
    "paged_attention",
    "paged_attention_ref",
    "write_kv",
]


def attention_query_blocks(
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    num_rows: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    impl: str = "auto",
) -> QueryBlocks | None:
    """The query blocks the kernel ``impl`` selects cuts a step into, for every attention
    layer of the step to share (``paged_attention(..., blocks=)``); None for the reference,
    which needs none."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    fn = select_impl(
        "attention_query_blocks",
        impl,
        ref=lambda *args, **kwargs: None,
        pallas_tpu=query_blocks_tpu,
        pallas_gpu=query_blocks_gpu,
    )
    return fn(token_rows, token_positions, num_rows, num_q_heads // num_kv_heads)


def paged_attention(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [NP+1, PS, Hkv, Dh] last page is the pad sink
    v_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    page_table: jax.Array,  # i32[R, MP] pages of each row; pad entries point at the pad page
    token_rows: jax.Array,  # i32[T] row of each token (pad tokens: any in-range row)
    token_positions: jax.Array,  # i32[T] absolute position of each token
    *,
    scale: float,
    block_tokens: int = 64,
    blocks: QueryBlocks | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Causal GQA attention over paged K/V: token t attends to its row's keys at positions
    ``0..token_positions[t]`` (its own K/V already written). Query head h uses KV head
    ``h // (Hq // Hkv)``. Returns ``o [T, Hq, Dh]`` in ``q.dtype``. The pages may be
    float8_e4m3fn (an FP8 KV cache): every implementation upcasts what it reads to
    ``q.dtype``; the pages' scales are the caller's to apply (``jaxmamba/model/attention.py``).

    ``impl`` (see ``dispatch``): the kernels are ``tpu.paged_attention_tpu`` (Mosaic TPU; also
    what "interpret" runs, under ``pltpu.InterpretParams()``) and ``gpu.paged_attention_gpu``
    (Triton). They cut the packed tokens into blocks of consecutive tokens of one row and need
    the layout ``ForwardMetadata`` produces (each row's tokens consecutive, padding tokens last;
    see ``blocks.py``); ``blocks`` are those cuts, from ``attention_query_blocks`` with the
    same ``impl`` (else each call cuts its own). The reference takes any layout: it processes
    ``block_tokens`` tokens at a time, each gathering its row's whole page list, so its peak
    memory is
    ``block_tokens * MP * PS * Hkv * Dh`` per K and V.
    """
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"expected q [T, Hq, Dh], k_pages/v_pages [NP+1, PS, Hkv, Dh]; got q {q.shape}, "
            f"k_pages {k_pages.shape}, v_pages {v_pages.shape}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads {num_q_heads} must be a multiple of kv heads {num_kv_heads} and head dims "
            f"must match; got q {q.shape}, k_pages {k_pages.shape}"
        )
    if page_table.ndim != 2:
        raise ValueError(f"expected page_table [R, MP], got {page_table.shape}")
    if token_rows.shape != (num_tokens,) or token_positions.shape != (num_tokens,):
        raise ValueError(
            f"expected token_rows, token_positions [T={num_tokens}]; got "
            f"{token_rows.shape}, {token_positions.shape}"
        )
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    fn = select_impl(
        "paged_attention",
        impl,
        ref=functools.partial(paged_attention_ref, block_tokens=block_tokens),
        pallas_tpu=functools.partial(paged_attention_tpu, blocks=blocks),
        pallas_gpu=functools.partial(paged_attention_gpu, blocks=blocks),
    )
    return fn(q, k_pages, v_pages, page_table, token_rows, token_positions, scale=scale)
