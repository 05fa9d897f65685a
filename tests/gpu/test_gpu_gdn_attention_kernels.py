"""The Gated DeltaNet and paged-attention Triton kernels compiled at published models' layer
shapes, against their references and, for the delta rule, the float64 token loop
(tests/gdn_oracle.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_tier import (
    FULL,
    INTERPRET,
    Rand,
    assert_close,
    cases,
    cu_seqlens,
    lengths,
    poison,
    preset,
    skip_unless_gpu,
    tokens,
)

skip_unless_gpu()

from gdn_oracle import gdn_varlen, l2norm  # noqa: E402

from jaxmamba.kernels.attention import paged_attention  # noqa: E402
from jaxmamba.kernels.attention.gpu import GpuBlockSizes, paged_attention_gpu  # noqa: E402
from jaxmamba.kernels.gdn import gdn_decode, gdn_gating, gdn_prefill  # noqa: E402
from jaxmamba.kernels.gdn.gpu import gdn_decode_gpu, gdn_prefill_gpu  # noqa: E402
from jaxmamba.kernels.ssd import build_chunk_layout  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, F32), np.float64)


# ----- Gated DeltaNet -----


def _gdn_inputs(rand: Rand, cfg, num_tokens: int, real: int, dtype):
    hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    dk, dv = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    q = poison(rand.normal((num_tokens, hk, dk), dtype), real)
    k = poison(rand.normal((num_tokens, hk, dk), dtype), real)
    v = poison(rand.normal((num_tokens, hv, dv), dtype), real)
    a, b = rand.normal((num_tokens, hv), dtype), rand.normal((num_tokens, hv), dtype)
    A_log, dt_bias = rand.uniform((hv,), -1.0, 1.0), rand.uniform((hv,), -1.0, 1.0)
    return q, k, v, a, b, A_log, dt_bias


# (preset, sequence lengths, bucket tokens, initial states, dtype, against the float64 loop):
# one sequence of 32 value heads is the narrow-tile regime of the state pass, four the default.
GDN_PREFILL_CASES = cases(
    [
        ("qwen3.5-9b", [1], 1024, False, BF16, False),
        ("qwen3.5-9b", [200, 1, 100, 200], 512, True, BF16, True),
    ],
    [
        ("qwen3.5-27b", [300, 1, 0, 450, 250], 1024, True, BF16, False),
        ("qwen3.5-0.8b", [1], 1024, False, BF16, False),
        ("qwen3-next-80b-a3b", [200, 1, 100, 200], 512, True, F32, True),
    ],
)


@pytest.mark.parametrize("name,sizes,bucket,with_init,dtype,oracle", GDN_PREFILL_CASES)
def test_gdn_prefill_kernel_matches_reference_and_float64(name, sizes, bucket, with_init, dtype,
                                                          oracle):  # fmt: skip
    cfg = preset(name)
    hv, dk, dv = cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    rand, num_tokens, seqs = Rand(10), tokens(bucket), lengths(sizes, bucket)
    real, cu = sum(seqs), cu_seqlens(seqs)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(rand, cfg, num_tokens, real, dtype)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    g, beta = poison(g, real), poison(beta, real)
    init = rand.normal((len(seqs), hv, dk, dv), F32, 0.5) if with_init else None
    starts = rand.ints((len(seqs),), 4 * cfg.chunk_size) if with_init else None
    layout = build_chunk_layout(cu, num_tokens, cfg.chunk_size, starts)
    state_chunks = layout.seq_first_chunk[np.flatnonzero(seqs)]
    kwargs = dict(chunk_size=cfg.chunk_size, initial_states=init, start_positions=starts,
                  layout=layout, state_chunks=state_chunks)  # fmt: skip
    args = (q, k, v, g, beta, cu)
    ref = jax.jit(functools.partial(gdn_prefill, impl="ref", **kwargs))(*args)
    got = jax.jit(functools.partial(gdn_prefill_gpu, interpret=INTERPRET, scale=dk**-0.5,
                                    **kwargs))(*args)  # fmt: skip
    assert_close(got[0][:real], ref[0][:real], dtype, "o")
    assert_close(got[1], ref[1], dtype, "final states")
    assert_close(got[2], ref[2], dtype, "checkpoint states")
    if oracle:
        zeros = np.zeros((len(seqs), hv, dk, dv))
        o64, final64, _ = gdn_varlen(*(_f64(x)[:real] for x in (q, k, v, g, beta)),
                                     np.asarray(cu), zeros if init is None else _f64(init),
                                     dk**-0.5)  # fmt: skip
        assert_close(got[0][:real], o64, dtype, "o against float64")
        assert_close(got[1], final64, dtype, "final states against float64")


# (preset, rows, dtype): up to 8 rows and above are the two regimes of the decode defaults.
GDN_DECODE_CASES = cases(
    [("qwen3.5-9b", 8, BF16), ("qwen3.5-9b", 64, BF16)],
    [("qwen3.5-27b", 256, BF16), ("qwen3-next-80b-a3b", 8, F32)],
)


@pytest.mark.parametrize("name,rows,dtype", GDN_DECODE_CASES)
def test_gdn_decode_kernel_matches_reference_and_float64(name, rows, dtype):
    cfg = preset(name)
    hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    dk, dv = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    rand, pool = Rand(11), rows + 8
    state = rand.normal((pool, hv, dk, dv), F32, 0.5)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(rand, cfg, rows, rows, dtype)
    slots = jnp.asarray(
        np.concatenate([np.random.default_rng(rows).permutation(pool - 1)[: rows - 2],
                        [pool - 1] * 2]), jnp.int32,
    )  # fmt: skip
    args = (state, q, k, v, a, b, A_log, dt_bias, slots)
    ref = jax.jit(functools.partial(gdn_decode, impl="ref"))(*args)
    got = jax.jit(functools.partial(gdn_decode_gpu, interpret=INTERPRET, scale=dk**-0.5))(*args)
    real = rows - 2
    assert_close(got[0][:real], ref[0][:real], dtype, "o")
    assert_close(got[1][:-1], ref[1][:-1], dtype, "state pool")
    # One recurrent step in float64 for the real rows.
    g, beta = (_f64(x)[:real] for x in gdn_gating(a, b, A_log, dt_bias))
    r = hv // hk
    qn = np.repeat(l2norm(_f64(q)[:real]), r, axis=1) * dk**-0.5  # [B, HV, Dk]
    kn = np.repeat(l2norm(_f64(k)[:real]), r, axis=1)
    s = _f64(state)[np.asarray(slots)[:real]] * np.exp(g)[..., None, None]  # [B, HV, Dk, Dv]
    delta = beta[..., None] * (_f64(v)[:real] - np.einsum("bhkv,bhk->bhv", s, kn))
    s = s + kn[..., None] * delta[:, :, None, :]
    assert_close(got[0][:real], np.einsum("bhkv,bhk->bhv", s, qn), dtype, "o against float64")
    assert_close(got[1][np.asarray(slots)[:real]], s, dtype, "states against float64")


# ----- paged attention -----

PAGE_SIZE = 16
# Per row (tokens already cached, tokens in this step): decode rows first, then prefill
# chunks, one after a cached prefix that ends mid-page, one of a single token.
ATTENTION_ROWS = [(900, 1), (37, 1), (511, 1), (0, 1), (200, 1), (64, 1), (0, 300), (141, 150),
                  (16, 1)]  # fmt: skip
ATTENTION_CASES = cases(
    [("nemotron-nano-9b-v2", BF16), ("qwen3.5-9b", BF16)],
    [("qwen3-next-80b-a3b", BF16), ("nemotron-3-nano-30b-a3b", BF16), ("qwen3.5-9b", F32)],
)


def _attention_step(rand: Rand, cfg, dtype):
    """A mixed step over shuffled pages; NaN in the pad page and wherever no K/V was written."""
    scale_down = 16 if INTERPRET else 1
    rows = [(-(-c // scale_down), -(-n // scale_down)) for c, n in ATTENTION_ROWS]
    rows.append((0, 0))  # a pad row
    used = [-(-(c + n) // PAGE_SIZE) for c, n in rows]
    max_pages = max(used)
    num_pages = sum(used) + 4
    rng = np.random.default_rng(0)
    perm = rng.permutation(num_pages)
    table = np.full((len(rows), max_pages), num_pages, np.int32)  # pad page: num_pages
    written = np.zeros((num_pages + 1, PAGE_SIZE), bool)
    for r, (c, n) in enumerate(rows):
        pages = perm[sum(used[:r]) : sum(used[:r]) + used[r]]
        table[r, : used[r]] = pages
        for pos in range(c + n):
            written[pages[pos // PAGE_SIZE], pos % PAGE_SIZE] = True
    hkv, dh = cfg.num_key_value_heads, cfg.head_dim
    mask = jnp.asarray(written)[:, :, None, None]
    shape = (num_pages + 1, PAGE_SIZE, hkv, dh)
    k_pages = jnp.where(mask, rand.normal(shape, dtype), jnp.nan).astype(dtype)
    v_pages = jnp.where(mask, rand.normal(shape, dtype), jnp.nan).astype(dtype)
    token_rows = [r for r, (c, n) in enumerate(rows) for _ in range(n)]
    positions = [p for c, n in rows for p in range(c, c + n)]
    real = len(token_rows)
    pad = 8 - real % 8
    token_rows += [len(rows) - 1] * pad  # as ForwardMetadata clamps them
    positions += [0] * pad
    q = poison(rand.normal((real + pad, cfg.num_attention_heads, dh), dtype), real)
    args = (q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(token_rows, jnp.int32),
            jnp.asarray(positions, jnp.int32))  # fmt: skip
    return args, real


@pytest.mark.parametrize("name,dtype", ATTENTION_CASES)
def test_paged_attention_kernel_matches_reference_on_a_mixed_step(name, dtype):
    cfg = preset(name)
    args, real = _attention_step(Rand(12), cfg, dtype)
    scale = cfg.head_dim**-0.5
    ref = jax.jit(functools.partial(paged_attention, impl="ref", scale=scale))(*args)
    sizes = [None]
    if FULL:  # the K/V range split into slices and merged as well
        sizes.append(GpuBlockSizes(min_programs=1 << 20, min_split_kv=64))
    for bs in sizes:
        kernel = functools.partial(paged_attention_gpu, interpret=INTERPRET, scale=scale,
                                   block_sizes=bs)  # fmt: skip
        got = jax.jit(kernel)(*args)
        assert_close(got[:real], ref[:real], dtype, f"attention, blocks {bs or 'default'}")
