"""The decode projections' small-M matmul (its ``TUNED`` sizes and its defaults) and the MoE
grouped matmul compiled at published models' shapes, against their references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_tier import INTERPRET, Rand, assert_close, cases, preset, skip_unless_gpu, tokens

skip_unless_gpu()

from jaxmamba.kernels.grouped_matmul import (  # noqa: E402
    assignment_blocks,
    build_expert_blocks,
    grouped_matmul_ref,
)
from jaxmamba.kernels.grouped_matmul.gpu import grouped_matmul_gpu  # noqa: E402
from jaxmamba.kernels.matmul import small_m_matmul_ref  # noqa: E402
from jaxmamba.kernels.matmul.gpu import TUNED, GpuBlockSizes, small_m_matmul_gpu  # noqa: E402
from jaxmamba.model.moe import kernel_block_rows  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
ROWS_OF_CLASS = {1: 1, 16: 16, 32: 32}

# (K, N, M): two TUNED entries (Nemotron-Nano-9B-v2's in_proj at M = 1, out_proj at M = 32) and
# Qwen3.5-9B's MLP down at M = 8, which no entry names (the defaults).
MATMUL_CASES = cases(
    [(4480, 22656, 1, BF16), (10240, 4480, 32, BF16), (12288, 4096, 8, BF16)],
    [(k, n, ROWS_OF_CLASS[c], BF16) for (k, n, c) in TUNED if (k, n, c) not in
     ((4480, 22656, 1), (10240, 4480, 32))]
    + [(4096, 24576, 16, BF16), (4480, 22656, 1, F32), (15680, 4480, 32, F32)],
)  # fmt: skip


@pytest.mark.parametrize("k,n,m,dtype", MATMUL_CASES)
def test_small_m_matmul_kernel_matches_reference_with_its_sizes(k, n, m, dtype):
    if INTERPRET:  # the same row class and split logic at a toy K and N
        k, n = 256, 384
    rand = Rand(20)
    x, w = rand.normal((m, k), dtype), rand.normal((k, n), dtype, k**-0.5)
    sizes = GpuBlockSizes.for_shape(k, n, m)
    want = small_m_matmul_ref(x, w)
    got = jax.jit(functools.partial(small_m_matmul_gpu, interpret=INTERPRET))(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, want, dtype, f"x @ w with {sizes}")


# (preset, tokens, dtype): Qwen3-Next's 512 experts (16-row blocks: the decode-shaped
# defaults) and Nemotron-3-Nano's 128 experts at 1024 tokens (64-row blocks: the compute tiles).
GROUPED_CASES = cases(
    [("qwen3-next-80b-a3b", 256, BF16), ("nemotron-3-nano-30b-a3b", 1024, BF16)],
    [
        ("qwen3-next-80b-a3b", 4, BF16),
        ("granite-4.0-h-small", 1024, BF16),
        ("qwen3.5-35b-a3b", 2048, BF16),
        ("nemotron-3-nano-30b-a3b", 256, F32),
    ],  # fmt: skip
)


@pytest.mark.parametrize("name,num_tokens,dtype", GROUPED_CASES)
def test_grouped_matmul_kernel_matches_reference_on_model_routing(name, num_tokens, dtype):
    cfg = preset(name, toy="qwen3-next-tiny")  # the tiny preset with experts
    x_count, top, hidden = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    glu = 2 if cfg.mlp_activation.endswith("glu") else 1
    width = glu * cfg.moe_intermediate_size
    t = tokens(num_tokens) if num_tokens > 8 else num_tokens
    rand = Rand(21)
    # Skewed routing (some experts hot, some unused), each token's experts distinct.
    rng = np.random.default_rng(t)
    popularity = np.log(rng.dirichlet(np.full(x_count, 0.3)) + 1e-6)
    scores = popularity + rng.gumbel(size=(t, x_count))  # top-k of these: sampled by popularity
    idx = jnp.asarray(np.argsort(-scores, axis=1)[:, :top], jnp.int32)
    block = kernel_block_rows(t * top, x_count)
    few = 4 * t * top <= x_count  # as the model lays them out
    layout = assignment_blocks(idx, block) if few else build_expert_blocks(idx, x_count, block)
    x = rand.normal((t, hidden), dtype)
    xp = jnp.concatenate([x, jnp.full((1, hidden), jnp.nan, dtype)])[layout.rows]
    w = rand.normal((x_count, hidden, width), dtype, hidden**-0.5)
    rows = layout.position  # the rows of real assignments; the others are unspecified
    want = jax.jit(functools.partial(grouped_matmul_ref, out_dtype=F32))(xp, w, layout.block_expert)
    got = jax.jit(functools.partial(grouped_matmul_gpu, out_dtype=F32, interpret=INTERPRET))(
        xp, w, layout.block_expert
    )
    assert_close(got[rows], want[rows], dtype, f"up projection, {block}-row blocks")
