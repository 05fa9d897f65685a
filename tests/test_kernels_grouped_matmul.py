"""grouped_matmul: the row-block layout of a routing, and the Pallas GPU kernel in interpret
mode against the reference and a float64 numpy loop over the assignments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels.grouped_matmul import (
    assignment_blocks,
    build_expert_blocks,
    grouped_matmul,
    grouped_matmul_ref,
    num_blocks,
)
from jaxmamba.kernels.grouped_matmul.gpu import GpuBlockSizes, grouped_matmul_gpu

# Relative to max |y|: bf16 output rounding dominates; float32 sums differ in order only.
RTOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}
# K = 72 and N = 50: edges along both with these tiles, and several K steps.
SMALL = GpuBlockSizes(block_n=32, block_k=32)


def _routing(T, k, X, seed, skew=False):
    logits = jax.random.normal(jax.random.PRNGKey(seed), (T, X))
    if skew:  # most tokens on a few experts: groups longer than a block
        logits = logits + jnp.arange(X)[::-1] * 0.8
    return np.asarray(jax.lax.top_k(logits, k)[1])


@pytest.mark.parametrize("T, k, X, bm", [(1, 6, 16, 16), (13, 3, 8, 16), (40, 2, 4, 16)])
def test_layout_puts_each_assignment_in_a_block_of_its_expert(T, k, X, bm):
    idx = _routing(T, k, X, seed=T, skew=True)
    lay = jax.tree.map(np.asarray, build_expert_blocks(jnp.asarray(idx), X, bm))
    nb = num_blocks(T * k, X, bm)
    assert lay.rows.shape == (nb * bm,) and lay.block_expert.shape == (nb,)
    pos = lay.position.reshape(T, k)
    assert len(set(lay.position.tolist())) == T * k  # distinct rows
    np.testing.assert_array_equal(lay.rows[pos], np.repeat(np.arange(T)[:, None], k, 1))
    np.testing.assert_array_equal(lay.block_expert[pos // bm], idx)
    # Every other row is padding (token T); used blocks come first, in expert order.
    assert (np.delete(lay.rows, lay.position) == T).all()
    used = lay.block_expert >= 0
    assert used.sum() == sum(-(-np.sum(idx == e) // bm) for e in range(X))
    assert used[: used.sum()].all() and np.all(np.diff(lay.block_expert[used]) >= 0)


def test_assignment_blocks_give_each_assignment_a_block_of_its_expert():
    idx = _routing(3, 4, 16, seed=5)
    lay = jax.tree.map(np.asarray, assignment_blocks(jnp.asarray(idx), 16))
    np.testing.assert_array_equal(lay.block_expert, idx.reshape(-1))
    np.testing.assert_array_equal(lay.rows[lay.position], np.repeat(np.arange(3), 4))
    assert (np.delete(lay.rows, lay.position) == 3).all() and lay.rows.shape == (12 * 16,)


def _case(T, k, X, K, N, bm, dtype, seed, per_assignment=False):
    idx = _routing(T, k, X, seed, skew=True)
    if per_assignment:
        lay = assignment_blocks(jnp.asarray(idx), bm)
    else:
        lay = build_expert_blocks(jnp.asarray(idx), X, bm)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K))
    w = rng.standard_normal((X, K, N)) * K**-0.5
    # Padding rows are NaN: a kernel that mixes rows, or reads a padding row into a real
    # output, fails loudly.
    xp = np.concatenate([x, np.full((1, K), np.nan)])[np.asarray(lay.rows)]
    want = np.stack([[x[t] @ w[idx[t, j]] for j in range(k)] for t in range(T)])  # [T, k, N]
    return jnp.asarray(xp, dtype), jnp.asarray(w, dtype), lay, want


def _assert_close(got, want, dtype):
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err <= RTOL[dtype], f"max relative error {err:.2e} > {RTOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "T, k, X, bm, block_sizes, per_assignment",
    [
        (1, 6, 16, 16, SMALL, False),  # decode: six single-row groups
        (2, 3, 16, 16, SMALL, True),  # decode: a block per assignment
        (29, 3, 8, 16, SMALL, False),  # groups longer than a block
        (29, 3, 8, 32, GpuBlockSizes(block_n=64, block_k=16, num_warps=4, num_stages=2), False),
    ],
)
def test_kernel_matches_reference_and_float64(T, k, X, bm, block_sizes, per_assignment, dtype):
    xp, w, lay, want = _case(T, k, X, 72, 50, bm, dtype, seed=T + bm,
                             per_assignment=per_assignment)  # fmt: skip
    got = grouped_matmul_gpu(xp, w, lay.block_expert, interpret=True, block_sizes=block_sizes)
    assert got.shape == (xp.shape[0], 50) and got.dtype == xp.dtype
    rows = np.asarray(lay.position)
    _assert_close(np.asarray(got, np.float64)[rows].reshape(want.shape), want, dtype)
    ref = grouped_matmul_ref(xp, w, lay.block_expert)
    _assert_close(np.asarray(ref, np.float64)[rows].reshape(want.shape), want, dtype)


def test_dispatch_out_dtype_and_errors():
    xp, w, lay, want = _case(5, 2, 4, 40, 24, 16, jnp.bfloat16, seed=3)
    got = grouped_matmul(xp, w, lay.block_expert, out_dtype=jnp.float32, impl="interpret")
    assert got.dtype == jnp.float32
    rows = np.asarray(lay.position)
    _assert_close(np.asarray(got)[rows].reshape(want.shape), want, jnp.bfloat16)
    assert grouped_matmul(xp, w, lay.block_expert, impl="auto").dtype == jnp.bfloat16  # CPU: ref
    with pytest.raises(ValueError, match="whole blocks"):
        grouped_matmul(xp[:-1], w, lay.block_expert, impl="ref")
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_matmul(xp, w.astype(jnp.float32), lay.block_expert, impl="ref")
    with pytest.raises(ValueError, match="power of two"):
        grouped_matmul_gpu(xp[:-8].reshape(-1, 40), w, lay.block_expert[:-1], interpret=True)


def test_kernel_lowers_for_cuda_with_static_shapes():
    """The Triton lowering (not run: no GPU here) of one decode-sized and one prefill-sized
    call: one kernel each, its grid from the static block count."""
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for rows, nb in ((96, 6), (128 * 40, 40)):
        args = (jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16),
                jax.ShapeDtypeStruct((8, 256, 200), jnp.bfloat16),
                jax.ShapeDtypeStruct((nb,), jnp.int32))  # fmt: skip
        exported = jax.export.export(
            jax.jit(grouped_matmul_gpu), platforms=["cuda"], disabled_checks=[check]
        )(*args)
        text = exported.mlir_module()
        assert text.count("xla.gpu.triton") == 1 and f"grid_x = {nb} : i32" in text
