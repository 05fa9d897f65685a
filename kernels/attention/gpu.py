"""Paged causal GQA attention over packed rows as a Pallas GPU kernel (Triton lowering).

Grid ``(NB, Hkv, splits)``: a program takes one query block (up to ``tokens_per_block``
consecutive tokens of one row, see ``blocks.py``) and one KV head, and runs an online
softmax over the row's K/V up to the block's largest position, ``block_kv`` positions a step.
Its query tile is ``rows = tokens_per_block x group`` rows — every query head of the KV head's
group for every token — so the row's K/V of that head is read once per block, and a decode
row (one token) reads its pages once per KV head. K/V are gathered through the page table one
position per tile row (``page_table[row, pos // PS] * PS + pos % PS``), so a tile may span
several pages and any page size works. Power-of-two tiles with masked loads cover head dims
and page sizes that are not powers of two.

When there are too few (block, KV head) programs to fill the GPU (decode at small batch), the
KV range is split into ``splits`` static slices (flash-decoding): each program writes its
slice's normalised output and log-sum-exp, and XLA merges the slices.

Notation: T tokens, Hq/Hkv query/KV heads, Dh head dim, PS page size, R rows, MP pages a row,
NB query blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..common import MIN_DOT_DIM, matmul_precision, pallas_call, pow2_at_least, round_up
from .blocks import QueryBlocks, build_query_blocks, check_query_blocks

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    max_rows: int = 128  # query rows (tokens x group) a program, power of two
    block_kv: int = 64  # K/V positions a step, power of two
    num_warps: int | None = None  # None: 4 for tiles of <= 64 rows, else 8
    num_stages: int = 2
    # Split the K/V range when fewer (block, KV head) programs than this would run, into
    # slices of at least `min_split_kv` positions.
    min_programs: int = 512
    min_split_kv: int = 256

    @classmethod
    def get_default(cls) -> GpuBlockSizes:
        return cls()

    def query_rows(self, num_tokens: int, num_rows: int, group: int) -> int:
        """Tile rows: enough for a row's average share of tokens, at least MIN_DOT_DIM and
        ``group``."""
        per_row = -(-num_tokens // max(num_rows, 1))
        cap = max(self.max_rows, pow2_at_least(group))
        return min(cap, max(MIN_DOT_DIM, pow2_at_least(group * per_row)))

    def splits(self, programs: int, context: int) -> int:
        if programs >= self.min_programs:
            return 1
        return max(1, min(-(-self.min_programs // programs), context // self.min_split_kv))


def _kernel(
    # per query block
    start_ref,  # i32[NB]
    length_ref,  # i32[NB]
    row_ref,  # i32[NB]
    max_pos_ref,  # i32[NB]
    page_table_ref,  # i32[R, MP]
    positions_ref,  # i32[T]
    q_ref,  # [T, Hq, Dh]
    k_ref,  # [(NP+1) * PS, Hkv, Dh]
    v_ref,  # [(NP+1) * PS, Hkv, Dh]
    *out_refs,  # o [T, Hq, Dh], or (o f32[S, T, Hq, Dh], lse f32[S, T, Hq]) when split
    scale_log2: float,  # softmax scale * log2(e)
    group: int,
    rows: int,
    block_kv: int,
    head_dim: int,
    page_size: int,
    split_len: int,
):
    # Blocks are in token order, so later blocks of a prefill row attend to more keys: start
    # the heavy ones first, and let the light ones fill the last wave.
    blk = pl.num_programs(0) - 1 - pl.program_id(0)
    kv_head, part = pl.program_id(1), pl.program_id(2)
    start, length, row = start_ref[blk], length_ref[blk], row_ref[blk]
    max_pos = max_pos_ref[blk]

    # Tile row r is token start + r // group, query head kv_head * group + r % group.
    r = jnp.arange(rows, dtype=jnp.int32)
    token_in_block = lax.div(r, group)
    token = start + token_in_block
    head = kv_head * group + lax.rem(r, group)
    row_ok = token_in_block < length
    d = jnp.arange(pow2_at_least(max(head_dim, MIN_DOT_DIM)), dtype=jnp.int32)

    def mask(ok):  # ok [n] -> [n, Dh']: also masks the head-dim padding, where there is any
        if d.shape[0] == head_dim:
            return jnp.broadcast_to(ok[:, None], (ok.shape[0], head_dim))
        return ok[:, None] & (d < head_dim)[None, :]

    q_mask = mask(row_ok)
    q = pltriton.load(q_ref.at[token[:, None], head[:, None], d[None, :]], mask=q_mask, other=0)
    pos = pltriton.load(positions_ref.at[token], mask=row_ok, other=-1)
    precision = matmul_precision(q.dtype)

    lo = part * split_len
    hi = jnp.minimum(lo + split_len, max_pos + 1)
    num_steps = lax.div(jnp.maximum(hi - lo, 0) + block_kv - 1, block_kv)

    def step(i, carry):
        acc, m_prev, l_prev = carry
        kv = lo + i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        kv_ok = kv < hi
        page = pltriton.load(page_table_ref.at[row, lax.div(kv, page_size)], mask=kv_ok, other=0)
        slot = page * page_size + lax.rem(kv, page_size)
        kv_mask = mask(kv_ok)
        # Masked-off positions (past the block's last position) read as 0: never NaN.
        k = pltriton.load(k_ref.at[slot[:, None], kv_head, d[None, :]], mask=kv_mask, other=0)
        v = pltriton.load(v_ref.at[slot[:, None], kv_head, d[None, :]], mask=kv_mask, other=0)
        if k.dtype != q.dtype:  # FP8 pages: upcast in registers, read at 1 byte a value
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=_F32
        )
        # Scores in base 2 (exp2 is one instruction on NVIDIA GPUs, exp is several).
        s = jnp.where(kv[None, :] <= pos[:, None], s * scale_log2, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; exponentiate against 0.
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_ref[:, None])
        alpha = jnp.exp2(m_prev - m_ref)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=_F32)
        return acc * alpha[:, None] + pv, m_new, l_prev * alpha + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((rows, d.shape[0]), _F32),
        jnp.full((rows,), -jnp.inf, _F32),
        jnp.zeros((rows,), _F32),
    )
    acc, m, l = lax.fori_loop(0, num_steps, step, init)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[:, None]
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        o_idx = (token[:, None], head[:, None], d[None, :])
        pltriton.store(o_ref.at[o_idx], out.astype(o_ref.dtype), mask=q_mask)
    else:
        o_ref, lse_ref = out_refs
        o_idx = (part, token[:, None], head[:, None], d[None, :])
        pltriton.store(o_ref.at[o_idx], out, mask=q_mask)
        lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)  # base 2
        pltriton.store(lse_ref.at[part, token, head], lse, mask=row_ok)


def query_blocks_gpu(
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    num_rows: int,
    group: int,
    *,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
) -> QueryBlocks:
    """The query blocks ``paged_attention_gpu`` cuts a step into (``group`` = Hq / Hkv)."""
    del interpret  # the blocks are plain XLA either way
    bs = block_sizes or GpuBlockSizes.get_default()
    rows = bs.query_rows(token_rows.shape[0], num_rows, group)
    return build_query_blocks(token_rows, token_positions, num_rows, rows // group)


def paged_attention_gpu(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    v_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    page_table: jax.Array,  # i32[R, MP]
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    *,
    scale: float,
    blocks: QueryBlocks | None = None,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
) -> jax.Array:
    """Same contract as :func:`jaxmamba.kernels.attention.paged_attention` (plus the layout
    contract of ``blocks.py``); ``blocks`` from ``query_blocks_gpu``, else cut here."""
    bs = block_sizes or GpuBlockSizes.get_default()
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_rows, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    if bs.block_kv < MIN_DOT_DIM or bs.block_kv != pow2_at_least(bs.block_kv):
        raise ValueError(f"block_kv must be a power of two >= {MIN_DOT_DIM}, got {bs.block_kv}")
    rows = bs.query_rows(num_tokens, num_rows, group)
    if blocks is None:
        blocks = build_query_blocks(token_rows, token_positions, num_rows, rows // group)
    check_query_blocks(blocks, num_tokens, num_rows, rows // group)
    num_blocks = blocks.start.shape[0]
    context = max_pages * page_size
    splits = bs.splits(num_blocks * num_kv_heads, context)
    split_len = round_up(-(-context // splits), bs.block_kv)

    flat_shape = (-1, num_kv_heads, head_dim)  # a bitcast: pages are contiguous
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((splits, *q.shape), _F32),
            jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), _F32),
        )
    kernel = functools.partial(
        _kernel,
        scale_log2=float(scale) * math.log2(math.e),
        group=group,
        rows=rows,
        block_kv=bs.block_kv,
        head_dim=head_dim,
        page_size=page_size,
        split_len=split_len,
    )
    out = pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=bs.num_warps or (4 if rows <= 64 else 8), num_stages=bs.num_stages
        ),
        interpret=interpret,
        name="paged_attention_gpu",
    )(
        blocks.start,
        blocks.length,
        blocks.row,
        blocks.max_position,
        page_table.astype(jnp.int32),
        token_positions.astype(jnp.int32),
        q,
        k_pages.reshape(flat_shape),
        v_pages.reshape(flat_shape),
    )
    if splits == 1:
        return out
    o_parts, lse = out
    # Every token's first slice holds position 0, so its log-sum-exp is finite.
    weights = jnp.exp2(lse - jnp.max(lse, axis=0))  # [S, T, Hq]
    o = jnp.sum(weights[..., None] * o_parts, axis=0) / jnp.sum(weights, axis=0)[..., None]
    return o.astype(q.dtype)
