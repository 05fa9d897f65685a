"""The Pallas paged-attention kernels (TPU kernel in TPU interpret mode, GPU kernel in interpret
mode) against a float64 numpy loop and paged_attention_ref, on mixed steps laid out the way
ForwardMetadata lays them out: decode rows first, then prefill chunks, then padding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.kernels import paged_attention, paged_attention_ref
from jaxmamba.kernels.attention.blocks import build_query_blocks, num_query_blocks
from jaxmamba.kernels.attention.gpu import GpuBlockSizes, paged_attention_gpu
from jaxmamba.kernels.attention.tpu import TpuBlockSizes, paged_attention_tpu
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.metadata import ForwardMetadata

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Per row: (tokens already cached, tokens in this step). Decode rows (one token) come first;
# prefill chunks of odd lengths, some starting mid-page after a cached prefix, one of length 1.
DECODE = [(9, 1), (0, 1), (21, 1)]
PREFILL = [(5, 7), (0, 11), (6, 1), (13, 17)]
PAD_ROWS, PAD_TOKENS = 1, 3
MAX_PAGES = 10

REF = jax.jit(paged_attention_ref, static_argnames=("scale", "block_tokens"))
# On a GPU machine the Triton kernel also runs compiled, on the same NaN-poisoned steps.
ON_GPU = jax.default_backend() == "gpu"
KERNELS = [
    "tpu",
    "gpu",
    pytest.param("gpu_compiled", marks=pytest.mark.skipif(not ON_GPU, reason="needs a GPU")),
]
# name: dtype, Hq, Hkv, Dh, page size, GPU block sizes, TPU block sizes
CASES = {
    "f32_group1": (jnp.float32, 4, 4, 16, 8, GpuBlockSizes(), TpuBlockSizes()),
    # Several blocks per prefill chunk, 16-position K/V tiles spanning 4-token pages, a head
    # dim that is not a power of two; the TPU kernel fetches 2 pages a step.
    "bf16_group3_dh24_ps4": (
        jnp.bfloat16,
        6,
        2,
        24,
        4,
        GpuBlockSizes(max_rows=16, block_kv=16),
        TpuBlockSizes(max_rows=8, kv_per_step=8),
    ),  # fmt: skip
    # The GPU kernel splits each block's K/V range into 16-position slices and merges them.
    "f32_group4_split": (
        jnp.float32,
        8,
        2,
        16,
        16,
        GpuBlockSizes(block_kv=16, min_programs=1 << 20, min_split_kv=16),
        TpuBlockSizes(kv_per_step=16),
    ),  # fmt: skip
    "bf16_group4_dh32": (jnp.bfloat16, 4, 1, 32, 8, GpuBlockSizes(), TpuBlockSizes()),
}


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32)).astype(np.float64)


def _step(rng, q_heads, kv_heads, head_dim, page_size, dtype):
    """A mixed step over shuffled pages. NaN everywhere no K/V was written: the pad page, the
    rest of each row's last page, and the spare pages that unused page-table entries name."""
    rows = DECODE + PREFILL + [(0, 0)] * PAD_ROWS
    used = [-(-(c + n) // page_size) for c, n in rows]
    num_pages = sum(used) + 6
    pad_page = num_pages
    perm = rng.permutation(num_pages)
    spare = perm[sum(used) :]
    table = np.full((len(rows), MAX_PAGES), pad_page, np.int32)
    for r, n in enumerate(used):
        table[r, :n] = perm[sum(used[:r]) : sum(used[:r]) + n]
        if r < len(rows) - PAD_ROWS:
            table[r, n:] = rng.choice(spare, MAX_PAGES - n)

    shape = (num_pages + 1, page_size, kv_heads, head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    row_k, row_v = [], []
    for r, (c, n) in enumerate(rows):
        k = rng.standard_normal((c + n, kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((c + n, kv_heads, head_dim)).astype(np.float32)
        for p in range(c + n):
            page = table[r, p // page_size]
            k_pages[page, p % page_size], v_pages[page, p % page_size] = k[p], v[p]
        # What the kernels see: K/V rounded to the cache dtype.
        row_k.append(_f64(jnp.asarray(k, dtype)))
        row_v.append(_f64(jnp.asarray(v, dtype)))

    token_rows = [r for r, (c, n) in enumerate(rows) for _ in range(n)]
    positions = [p for c, n in rows for p in range(c, c + n)]
    num_real = len(token_rows)
    token_rows += [len(rows) - 1] * PAD_TOKENS  # as ForwardMetadata clamps them
    positions += [0] * PAD_TOKENS
    q = rng.standard_normal((len(token_rows), q_heads, head_dim)).astype(np.float32)
    q[num_real:] = np.nan
    args = (
        jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
        jnp.asarray(table), jnp.asarray(token_rows, jnp.int32), jnp.asarray(positions, jnp.int32),
    )  # fmt: skip
    return args, row_k, row_v, num_real


def _direct_attention(q, token_rows, positions, row_k, row_v, scale, num_real):
    q = _f64(q)
    group = q.shape[1] // row_k[0].shape[1]
    out = np.empty((num_real,) + q.shape[1:])
    for t in range(num_real):
        k = np.repeat(row_k[token_rows[t]][: positions[t] + 1], group, axis=1)  # [L, Hq, Dh]
        v = np.repeat(row_v[token_rows[t]][: positions[t] + 1], group, axis=1)
        s = np.einsum("hd,lhd->hl", q[t], k) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[t] = np.einsum("hl,lhd->hd", p / p.sum(-1, keepdims=True), v)
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_numpy_and_reference_on_mixed_step(kernel, case):
    dtype, q_heads, kv_heads, head_dim, page_size, gpu_sizes, tpu_sizes = CASES[case]
    rng = np.random.default_rng(list(CASES).index(case))
    args, row_k, row_v, n = _step(rng, q_heads, kv_heads, head_dim, page_size, dtype)
    scale = head_dim**-0.5
    if kernel == "tpu":
        fn = functools.partial(paged_attention_tpu, interpret=True, block_sizes=tpu_sizes)
    else:
        interpret = kernel == "gpu"
        fn = functools.partial(paged_attention_gpu, interpret=interpret, block_sizes=gpu_sizes)
    out = jax.jit(functools.partial(fn, scale=scale))(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    expected = _direct_attention(args[0], args[4], args[5], row_k, row_v, scale, n)
    tol = TOL[dtype]
    np.testing.assert_allclose(_f64(out)[:n], expected, rtol=tol, atol=tol)
    ref = REF(*args, scale=scale, block_tokens=16)
    np.testing.assert_allclose(_f64(out)[:n], _f64(ref)[:n], rtol=tol, atol=tol)


def test_kernels_on_metadata_from_the_step_builder():
    """The kernels' layout contract holds for what StepBuilder + ForwardMetadata produce: a
    mixed bucket with fewer decode rows than reserved (a dummy row on the pad page), empty
    padding rows and padding tokens."""
    page_size, heads, head_dim = 4, 2, 16
    spec = CacheSpec(num_slots=8, num_pages=64, page_size=page_size)
    rng = np.random.default_rng(7)
    free_pages = iter(rng.permutation(spec.num_pages).tolist())
    rows = []
    for slot, (cached, new) in enumerate([(6, 1), (0, 9), (5, 6)]):  # one decode, two prefill
        pages = [next(free_pages) for _ in range(-(-(cached + new) // page_size))]
        rows.append(RowSpec(rng.integers(0, 100, new).tolist(), cached, slot, pages))
    inputs = StepBuilder(spec, 8, 100, 8).build(rows, Bucket(24, 5, 2), num_decode_rows=1)
    meta = ForwardMetadata.build(
        inputs, num_decode=2, chunk_size=8, page_size=page_size,
        pad_page=spec.pad_page, pad_slot=spec.pad_slot,
    )  # fmt: skip
    # The dummy decode row reads the pad page (NaN here): only real rows' outputs are checked.
    on_pad_page = np.asarray(meta.page_table)[np.asarray(meta.token_rows), 0] == spec.pad_page
    valid = np.asarray(meta.token_valid) & ~on_pad_page
    assert valid.sum() == 1 + 9 + 6
    shape = (spec.num_pages + 1, page_size, heads, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32).at[spec.pad_page].set(jnp.nan)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32).at[spec.pad_page].set(jnp.nan)
    q = jnp.asarray(rng.standard_normal((24, 2 * heads, head_dim)), jnp.float32)
    args = (q, k_pages, v_pages, meta.page_table, meta.token_rows, meta.positions)
    ref = np.asarray(REF(*args, scale=0.25, block_tokens=8))[valid]
    for fn in (paged_attention_tpu, paged_attention_gpu):
        out = np.asarray(jax.jit(functools.partial(fn, scale=0.25, interpret=True))(*args))
        assert np.isfinite(out[valid]).all()
        np.testing.assert_allclose(out[valid], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 8])
def test_query_blocks_cover_each_token_once_with_one_row_per_block(tokens_per_block):
    num_tokens, num_rows = 40, 6
    build = jax.jit(build_query_blocks, static_argnums=(2, 3))
    rng = np.random.default_rng(tokens_per_block)
    for _ in range(20):
        num_real = int(rng.integers(1, num_tokens + 1))
        lengths = rng.multinomial(num_real, np.ones(num_rows) / num_rows)
        rows = np.repeat(np.arange(num_rows), lengths)
        pad_row = rng.integers(0, num_rows)  # padding tokens may continue the last row's run
        rows = np.concatenate([rows, np.full(num_tokens - rows.size, pad_row)]).astype(np.int32)
        positions = rng.integers(0, 50, num_tokens).astype(np.int32)
        blocks = jax.tree.map(np.asarray, build(rows, positions, num_rows, tokens_per_block))
        assert blocks.start.shape == (num_query_blocks(num_tokens, num_rows, tokens_per_block),)
        covered = np.zeros(num_tokens, int)
        for b, (s, n) in enumerate(zip(blocks.start, blocks.length, strict=True)):
            assert 0 <= n <= tokens_per_block
            if n == 0:
                assert blocks.max_position[b] == -1
                continue
            assert (rows[s : s + n] == blocks.row[b]).all()
            assert blocks.max_position[b] == positions[s : s + n].max()
            covered[s : s + n] += 1
            np.testing.assert_array_equal(blocks.token_block[s : s + n], b)
            np.testing.assert_array_equal(blocks.token_offset[s : s + n], np.arange(n))
        np.testing.assert_array_equal(covered, 1)


@pytest.mark.cpu_only
def test_dispatch_picks_the_platform_kernels():
    args = _step(np.random.default_rng(0), 4, 2, 16, 8, jnp.float32)[0]
    for impl in ("pallas_tpu", "pallas_gpu"):
        text = jax.jit(functools.partial(paged_attention, scale=0.25, impl=impl)).trace(*args)
        name = f"paged_attention_{impl[-3:]}"
        assert name in str(text.jaxpr), impl
    auto = jax.jit(functools.partial(paged_attention, scale=0.25, impl="auto")).trace(*args)
    assert "pallas_call" not in str(auto.jaxpr)  # CPU: the reference
    with pytest.raises(ValueError, match="CPU"):
        paged_attention(*args, scale=0.25, impl="pallas")
