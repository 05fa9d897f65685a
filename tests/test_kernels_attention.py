"""write_kv / paged_attention against float64 numpy attention over per-row K/V arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import paged_attention, write_kv

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
PAGE_SIZE, MAX_PAGES, NUM_PAGES = 4, 5, 12  # + 1 pad page (index NUM_PAGES)
# Per row: (tokens already cached, tokens in this step). Mixed extend, prefill and decode.
ROWS = [(2, 3), (0, 17), (0, 1), (9, 1)]
PAD_TOKENS = 3

ATTEND = jax.jit(paged_attention, static_argnames=("scale", "block_tokens", "impl"))
WRITE = jax.jit(write_kv)


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _setup(rng, q_heads, kv_heads, head_dim, dtype):
    """Pages (NaN everywhere not written), a shuffled page table, per-row K/V and the step."""
    pad_page = NUM_PAGES
    perm = rng.permutation(NUM_PAGES)
    table = np.full((len(ROWS), MAX_PAGES), pad_page, np.int32)
    used = 0
    for r, (cached, new) in enumerate(ROWS):
        n = -(-(cached + new) // PAGE_SIZE)
        table[r, :n] = perm[used : used + n]
        used += n
    assert used <= NUM_PAGES

    def slot(r, pos):
        return table[r, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE

    shape = (NUM_PAGES + 1, PAGE_SIZE, kv_heads, head_dim)
    k_pages = jnp.full(shape, jnp.nan, dtype)
    v_pages = jnp.full(shape, jnp.nan, dtype)
    row_k = [rng.standard_normal((c + n, kv_heads, head_dim)).astype(np.float32) for c, n in ROWS]
    row_v = [rng.standard_normal((c + n, kv_heads, head_dim)).astype(np.float32) for c, n in ROWS]
    # The cached prefix was written by earlier steps.
    cached = [(r, p) for r, (c, _) in enumerate(ROWS) for p in range(c)]
    k_pages, v_pages = WRITE(
        k_pages, v_pages,
        jnp.asarray(np.stack([row_k[r][p] for r, p in cached]), dtype),
        jnp.asarray(np.stack([row_v[r][p] for r, p in cached]), dtype),
        jnp.asarray([slot(r, p) for r, p in cached], jnp.int32),
    )  # fmt: skip

    step = [(r, p) for r, (c, n) in enumerate(ROWS) for p in range(c, c + n)]
    nan_kv = np.full((PAD_TOKENS, kv_heads, head_dim), np.nan, np.float32)
    k_new = np.concatenate([np.stack([row_k[r][p] for r, p in step]), nan_kv])
    v_new = np.concatenate([np.stack([row_v[r][p] for r, p in step]), nan_kv])
    q = rng.standard_normal((len(step) + PAD_TOKENS, q_heads, head_dim)).astype(np.float32)
    q[len(step) :] = np.nan
    slots = [slot(r, p) for r, p in step] + [pad_page * PAGE_SIZE + i for i in range(PAD_TOKENS)]
    rows = [r for r, _ in step] + [1] * PAD_TOKENS
    positions = [p for _, p in step] + [0] * PAD_TOKENS
    # Round K/V through the cache dtype so the numpy reference sees what the kernel sees.
    row_k = [_f64(jnp.asarray(a, dtype)) for a in row_k]
    row_v = [_f64(jnp.asarray(a, dtype)) for a in row_v]
    return dict(
        k_pages=k_pages, v_pages=v_pages, table=jnp.asarray(table),
        q=jnp.asarray(q, dtype), k=jnp.asarray(k_new, dtype), v=jnp.asarray(v_new, dtype),
        slots=jnp.asarray(slots, jnp.int32), rows=jnp.asarray(rows, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32), row_k=row_k, row_v=row_v,
        num_real=len(step),
    )  # fmt: skip


def _direct_attention(q, rows, positions, row_k, row_v, scale, num_real):
    q = _f64(q)
    group = q.shape[1] // row_k[0].shape[1]
    out = np.full(q.shape, np.nan)
    for t in range(num_real):
        k = np.repeat(row_k[rows[t]][: positions[t] + 1], group, axis=1)  # [L, Hq, Dh]
        v = np.repeat(row_v[rows[t]][: positions[t] + 1], group, axis=1)
        s = np.einsum("hd,lhd->hl", q[t], k) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[t] = np.einsum("hl,lhd->hd", p, v)
    return out


@pytest.mark.parametrize(
    "dtype,q_heads,kv_heads,head_dim,block_tokens",
    [
        (jnp.float32, 4, 4, 8, 64),
        (jnp.float32, 6, 2, 12, 4),
        (jnp.bfloat16, 8, 2, 16, 8),
    ],
)
def test_paged_attention_matches_direct_attention(dtype, q_heads, kv_heads, head_dim, block_tokens):
    rng = np.random.default_rng(q_heads * 10 + kv_heads)
    st = _setup(rng, q_heads, kv_heads, head_dim, dtype)
    k_pages, v_pages = WRITE(st["k_pages"], st["v_pages"], st["k"], st["v"], st["slots"])
    scale = head_dim**-0.5
    o = ATTEND(
        st["q"], k_pages, v_pages, st["table"], st["rows"], st["positions"],
        scale=scale, block_tokens=block_tokens,
    )  # fmt: skip
    assert o.dtype == dtype and o.shape == st["q"].shape
    ref = _direct_attention(
        st["q"], np.asarray(st["rows"]), np.asarray(st["positions"]), st["row_k"], st["row_v"],
        scale, st["num_real"],
    )  # fmt: skip
    n = st["num_real"]
    np.testing.assert_allclose(_f64(o)[:n], ref[:n], rtol=TOL[dtype], atol=TOL[dtype])


def test_write_kv_places_each_token_at_its_slot():
    rng = np.random.default_rng(3)
    st = _setup(rng, 4, 2, 8, jnp.float32)
    k_pages, v_pages = WRITE(st["k_pages"], st["v_pages"], st["k"], st["v"], st["slots"])
    flat_k = np.asarray(k_pages).reshape(-1, 2, 8)
    flat_v = np.asarray(v_pages).reshape(-1, 2, 8)
    n = st["num_real"]
    slots = np.asarray(st["slots"])[:n]
    np.testing.assert_array_equal(flat_k[slots], np.asarray(st["k"])[:n])
    np.testing.assert_array_equal(flat_v[slots], np.asarray(st["v"])[:n])
    # Nothing else changed.
    others = np.setdiff1d(np.arange(flat_k.shape[0]), np.asarray(st["slots"]))
    before = np.asarray(st["k_pages"]).reshape(-1, 2, 8)
    np.testing.assert_array_equal(flat_k[others], before[others])


def test_paged_attention_dispatch_and_shape_errors():
    q = jnp.ones((5, 4, 8))
    pages = jnp.ones((3, 4, 2, 8))
    table = jnp.zeros((2, 2), jnp.int32)
    idx = jnp.zeros((5,), jnp.int32)
    with pytest.raises(ValueError, match="impl must be one of"):
        paged_attention(q, pages, pages, table, idx, idx, scale=1.0, impl="triton")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(jnp.ones((5, 3, 8)), pages, pages, table, idx, idx, scale=1.0)
    with pytest.raises(ValueError, match="token_rows"):
        paged_attention(q, pages, pages, table, idx[:4], idx, scale=1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pages, pages, jnp.ones((5, 2, 8)), jnp.ones((5, 2, 8)), idx[:3])


def test_write_kv_writes_every_token_and_drops_the_pad_page_writes():
    """Real tokens land in their slots; padding tokens (all pointing into the pad page) write
    nothing: the pad page keeps what it held (NaN here), every other slot too."""
    from jaxmamba.kernels.attention import write_kv

    rng = np.random.default_rng(0)
    num_pages, page_size, hkv, dh = 5, 4, 2, 8  # page 4 is the pad sink
    pages = np.full((num_pages, page_size, hkv, dh), np.nan, np.float32)
    real = rng.permutation((num_pages - 1) * page_size)[:9]
    slots = np.concatenate([real, np.full(7, (num_pages - 1) * page_size)]).astype(np.int32)
    k = rng.standard_normal((len(slots), hkv, dh)).astype(np.float32)
    v = rng.standard_normal((len(slots), hkv, dh)).astype(np.float32)
    new_k, new_v = write_kv(jnp.asarray(pages), jnp.asarray(pages), jnp.asarray(k),
                            jnp.asarray(v), jnp.asarray(slots))  # fmt: skip
    for new, src in ((new_k, k), (new_v, v)):
        expected = pages.reshape(-1, hkv, dh).copy()
        expected[real] = src[: len(real)]
        np.testing.assert_array_equal(np.asarray(new).reshape(-1, hkv, dh), expected)
