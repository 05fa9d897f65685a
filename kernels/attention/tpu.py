"""Paged causal GQA attention over packed rows as a Pallas Mosaic TPU kernel (also the CPU
interpret-mode kernel).

Grid ``(NB,)``: one program per query block (up to ``tokens_per_block`` consecutive tokens
of one row, see ``blocks.py``). XLA regroups the queries into ``[NB, Hkv, rows, Dh]``
tiles (tile row ``i * group + j`` is token ``i``, query head ``kv_head * group + j``), so each
KV head's query heads form one 2-D matmul operand. The program walks its row's pages up to
the block's largest position, ``pages_per_step`` pages a step: it DMAs whole pages
``[PS, Hkv, Dh]`` (all KV heads at once, so each page is read once per block) from HBM into
a double-buffered VMEM scratch through the page table (scalar-prefetched into SMEM), fetching
step ``i + 1`` while it computes step ``i``, and keeps the online-softmax state per KV head in
VMEM scratch. The output tiles go back to ``[T, Hq, Dh]`` through the inverse gather.

Why not jax's ``ragged_paged_attention``: it reads K and V from one combined page array
(heads interleaved), which is not this cache's layout; converting would copy the cache.

Notation: T tokens, Hq/Hkv query/KV heads, Dh head dim, PS page size, R rows, MP pages a row,
NB query blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import matmul_precision, pallas_call, round_up, tpu_interpret_params
from .blocks import QueryBlocks, build_query_blocks, check_query_blocks

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    max_rows: int = 128  # query rows (tokens x group) a program
    kv_per_step: int = 256  # K/V positions fetched a step (whole pages, at least one)

    @classmethod
    def get_default(cls) -> TpuBlockSizes:
        return cls()

    def tokens_per_block(self, num_tokens: int, num_rows: int, group: int) -> int:
        per_row = -(-num_tokens // max(num_rows, 1))
        return max(1, min(per_row, self.max_rows // group))


def _kernel(
    # scalar prefetch (SMEM)
    row_ref,  # i32[NB]
    max_pos_ref,  # i32[NB]
    page_table_ref,  # i32[R * MP]
    # inputs
    q_ref,  # [Hkv, rows, Dh] this block's queries
    pos_ref,  # i32[rows, 1] position of each tile row (-1: no token)
    k_hbm,  # [NP+1, PS, Hkv, Dh] (HBM)
    v_hbm,  # [NP+1, PS, Hkv, Dh] (HBM)
    # output
    o_ref,  # [Hkv, rows, Dh]
    # scratch
    k_buf,  # [2, pages_per_step, PS, Hkv, Dh]
    v_buf,  # [2, pages_per_step, PS, Hkv, Dh]
    sems,  # DMA[2, 2] (K / V, buffer)
    m_scr,  # f32[Hkv, rows, 1]
    l_scr,  # f32[Hkv, rows, 1]
    acc_scr,  # f32[Hkv, rows, Dh]
    *,
    scale: float,
    max_pages: int,
):
    blk = pl.program_id(0)
    row, max_pos = row_ref[blk], max_pos_ref[blk]
    _, pages_per_step, page_size, num_kv_heads, head_dim = k_buf.shape
    step_len = pages_per_step * page_size
    num_pages = lax.div(max_pos + page_size, page_size)  # pages holding positions 0..max_pos
    num_steps = lax.div(num_pages + pages_per_step - 1, pages_per_step)

    def for_each_page(step, buf, action):
        """``action(k_copy, v_copy)`` for each needed page of ``step`` (into buffer ``buf``)."""

        def body(i, carry):
            page = page_table_ref[row * max_pages + step * pages_per_step + i]
            action(
                pltpu.make_async_copy(k_hbm.at[page], k_buf.at[buf, i], sems.at[0, buf]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[buf, i], sems.at[1, buf]),
            )
            return carry

        lax.fori_loop(0, jnp.minimum(pages_per_step, num_pages - step * pages_per_step), body, 0)

    def start_fetch(step, buf):
        for_each_page(step, buf, lambda k_copy, v_copy: (k_copy.start(), v_copy.start()))

    def wait_fetch(step, buf):
        for_each_page(step, buf, lambda k_copy, v_copy: (k_copy.wait(), v_copy.wait()))

    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, _F32)
    l_scr[...] = jnp.zeros(l_scr.shape, _F32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, _F32)
    precision = matmul_precision(q_ref.dtype)

    @pl.when(num_steps > 0)
    def _():
        start_fetch(0, 0)

    def step_body(step, carry):
        buf = lax.rem(step, 2)

        @pl.when(step + 1 < num_steps)
        def _():
            start_fetch(step + 1, 1 - buf)

        wait_fetch(step, buf)
        base = step * step_len
        visible = base + lax.broadcasted_iota(jnp.int32, (1, step_len), 1) <= pos_ref[...]
        # Page slots past the block's last page hold stale or never-written data (maybe NaN).
        kv_ok = base + lax.broadcasted_iota(jnp.int32, (step_len, 1), 0) <= max_pos
        for h in range(num_kv_heads):
            k = k_buf[buf, :, :, h, :].reshape(step_len, head_dim)
            v = v_buf[buf, :, :, h, :].reshape(step_len, head_dim)
            if k.dtype != q_ref.dtype:  # FP8 pages: upcast in VMEM
                k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
            v = jnp.where(kv_ok, v, jnp.zeros((), v.dtype))
            s = lax.dot_general(
                q_ref[h], k, (((1,), (1,)), ((), ())), precision=precision,
                preferred_element_type=_F32,
            )  # fmt: skip
            s = jnp.where(visible, s * scale, -jnp.inf)  # [rows, step_len]
            m_prev = m_scr[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key seen yet: avoid inf - inf
            p = jnp.exp(s - m_ref)
            alpha = jnp.exp(m_prev - m_ref)
            l_scr[h] = alpha * l_scr[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=_F32)
            acc_scr[h] = alpha * acc_scr[h] + pv
            m_scr[h] = m_new
        return carry

    lax.fori_loop(0, num_steps, step_body, 0)
    l = l_scr[...]
    o_ref[...] = (acc_scr[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def query_blocks_tpu(
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    num_rows: int,
    group: int,
    *,
    interpret: bool = False,
    block_sizes: TpuBlockSizes | None = None,
) -> QueryBlocks:
    """The query blocks ``paged_attention_tpu`` cuts a step into (``group`` = Hq / Hkv)."""
    del interpret  # the blocks are plain XLA either way
    bs = block_sizes or TpuBlockSizes.get_default()
    tokens_per_block = bs.tokens_per_block(token_rows.shape[0], num_rows, group)
    return build_query_blocks(token_rows, token_positions, num_rows, tokens_per_block)


def paged_attention_tpu(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    v_pages: jax.Array,  # [NP+1, PS, Hkv, Dh]
    page_table: jax.Array,  # i32[R, MP]
    token_rows: jax.Array,  # i32[T]
    token_positions: jax.Array,  # i32[T]
    *,
    scale: float,
    blocks: QueryBlocks | None = None,
    interpret=False,
    block_sizes: TpuBlockSizes | None = None,
) -> jax.Array:
    """Same contract as :func:`jaxmamba.kernels.attention.paged_attention` (plus the layout
    contract of ``blocks.py``); ``blocks`` from ``query_blocks_tpu``, else cut here.
    ``interpret=True`` runs under ``pltpu.InterpretParams()``."""
    bs = block_sizes or TpuBlockSizes.get_default()
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_rows, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    tokens_per_block = bs.tokens_per_block(num_tokens, num_rows, group)
    if blocks is None:
        blocks = build_query_blocks(token_rows, token_positions, num_rows, tokens_per_block)
    check_query_blocks(blocks, num_tokens, num_rows, tokens_per_block)
    num_blocks = blocks.start.shape[0]
    sublanes = 8 * max(1, 4 // q.dtype.itemsize)
    rows = round_up(tokens_per_block * group, sublanes)
    pages_per_step = max(1, min(max_pages, bs.kv_per_step // page_size))

    r = jnp.arange(rows, dtype=jnp.int32)
    token = blocks.start[:, None] + r // group  # [NB, rows]
    has_token = (r // group < blocks.length[:, None]) & (r < tokens_per_block * group)
    token = jnp.minimum(token, num_tokens - 1)
    head = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None] * group + r % group  # [Hkv, rows]
    q_tiles = jnp.where(
        has_token[:, None, :, None], q[token[:, None, :], head[None]], jnp.zeros((), q.dtype)
    )  # [NB, Hkv, rows, Dh]
    tile_pos = jnp.where(has_token, token_positions[token], -1)[..., None]  # [NB, rows, 1]

    tile = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, *_: (b, 0, 0, 0))
    buf_shape = (2, pages_per_step, page_size, num_kv_heads, head_dim)
    stat_shape = (num_kv_heads, rows, 1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_blocks,),
        in_specs=[
            tile,
            pl.BlockSpec((None, rows, 1), lambda b, *_: (b, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=tile,
        scratch_shapes=[
            pltpu.VMEM(buf_shape, k_pages.dtype),
            pltpu.VMEM(buf_shape, v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM(stat_shape, _F32),
            pltpu.VMEM(stat_shape, _F32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), _F32),
        ],
    )
    o_tiles = pallas_call(
        functools.partial(_kernel, scale=float(scale), max_pages=max_pages),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret_params(interpret),
        name="paged_attention_tpu",
    )(
        blocks.row,
        blocks.max_position,
        page_table.astype(jnp.int32).reshape(-1),
        q_tiles,
        tile_pos,
        k_pages,
        v_pages,
    )
    # Token t, query head kv_head * group + j sits at tile row offset * group + j.
    q_heads = jnp.arange(num_q_heads, dtype=jnp.int32)
    tile_row = blocks.token_offset[:, None] * group + q_heads % group  # [T, Hq]
    block = jnp.minimum(blocks.token_block, num_blocks - 1)[:, None]
    return o_tiles[block, q_heads // group, tile_row]
