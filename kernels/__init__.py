"""Kernels for jaxmamba: plain-jnp references and Pallas kernels, chosen by ``impl=``.

Notation (dimension letters used in every shape comment):

  T   packed tokens of a step (padded; tokens >= cu_seqlens[-1] are padding)
  S   sequences (rows) of a varlen batch; S' slots of a state pool (the last is the pad slot)
  B   rows of a decode step (one token each)
  H   SSM heads            P   SSM head dim          G   B/C groups (H % G == 0)
  N   SSM state size       K   conv width            D   conv channels
  C   chunk size           NC  number of chunks (static: T // C + 2S)
  Hq, Hkv  query / key-value heads    Dh  attention head dim
  NP  KV pages (+1 pad page)   PS  page size   R  page-table rows   MP  pages per row
  small_m_matmul (a plain matmul) uses its own letters: x [M, K] @ W [K, N]
  gated_group_rmsnorm: y [T, W] (W = H·P in the mixer) in G groups of W/G columns; z a column
  range of a wider z_source [T, Wz] (the in_proj output)

Every op is a package laid out alike: ``__init__.py`` (the dispatcher: the public function),
``ref.py`` (the plain-jnp ``*_ref`` with float32 accumulation), ``tpu.py`` (Mosaic TPU kernel),
``gpu.py`` (Triton-lowered GPU kernel), each kernel with its ``TpuBlockSizes`` /
``GpuBlockSizes`` (``get_default``; the conv's two kernels a platform: ``Varlen*`` and
``Update*``). What a kernel pair shares beyond the reference sits beside them
(``ssd/layout.py``, ``attention/blocks.py``); the small-M matmul and the gated norm have no
TPU kernel. Every public op takes ``impl="auto"|"ref"|"pallas"|"interpret"|...`` (see
``dispatch.py``); helpers shared by all ops are in ``common.py``, among them ``ColumnView``:
an operand held as columns of a wider array (Mamba2's in_proj and conv outputs), which the
prefill ops' GPU kernels read in place.
"""

from .attention import paged_attention, paged_attention_ref, write_kv
from .common import ColumnView, process_dt
from .conv1d import (
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
    conv_window_indices,
    token_seq_ids,
)
from .dispatch import IMPLS, select_impl
from .gated_norm import gated_group_rmsnorm, gated_group_rmsnorm_ref
from .mamba_decode import mamba2_decode, mamba2_decode_ref
from .matmul import small_m_matmul, small_m_matmul_ref
from .ssd import ChunkLayout, build_chunk_layout, num_chunks, ssd_varlen, ssd_varlen_ref
from .state_update import selective_state_update, selective_state_update_ref

__all__ = [
    "IMPLS",
    "ChunkLayout",
    "ColumnView",
    "build_chunk_layout",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "causal_conv1d_varlen",
    "causal_conv1d_varlen_ref",
    "conv_window_indices",
    "gated_group_rmsnorm",
    "gated_group_rmsnorm_ref",
    "mamba2_decode",
    "mamba2_decode_ref",
    "num_chunks",
    "paged_attention",
    "paged_attention_ref",
    "process_dt",
    "select_impl",
    "selective_state_update",
    "selective_state_update_ref",
    "small_m_matmul",
    "small_m_matmul_ref",
    "ssd_varlen",
    "ssd_varlen_ref",
    "token_seq_ids",
    "write_kv",
]
