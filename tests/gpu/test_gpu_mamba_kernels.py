"""The Mamba2 mixer's Triton kernels compiled at published models' layer shapes, against their
references: the varlen SSD scan, the causal conv (prefill and decode), the gated group
RMSNorm, the selective state update and the fused decode step, each with its default blocks
in each ``get_default`` regime."""

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

from jaxmamba.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen  # noqa: E402
from jaxmamba.kernels.conv1d.gpu import (  # noqa: E402
    causal_conv1d_update_gpu,
    causal_conv1d_varlen_gpu,
)
from jaxmamba.kernels.gated_norm import gated_group_rmsnorm  # noqa: E402
from jaxmamba.kernels.gated_norm.gpu import gated_group_rmsnorm_gpu  # noqa: E402
from jaxmamba.kernels.mamba_decode import mamba2_decode  # noqa: E402
from jaxmamba.kernels.mamba_decode.gpu import mamba2_decode_gpu  # noqa: E402
from jaxmamba.kernels.ssd import build_chunk_layout, ssd_varlen  # noqa: E402
from jaxmamba.kernels.ssd.gpu import ssd_varlen_gpu  # noqa: E402
from jaxmamba.kernels.state_update import selective_state_update  # noqa: E402
from jaxmamba.kernels.state_update.gpu import selective_state_update_gpu  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
MAMBA_PRESETS = ["falcon-h1-7b", "granite-4.0-h-small", "mamba2-2.7b", "nemotron-3-nano-30b-a3b"]


def _mamba_params(rand: Rand, cfg):
    h = cfg.mamba_num_heads
    A = -jnp.exp(rand.uniform((h,), 0.0, 2.5))
    return A, rand.uniform((h,), 0.5, 2.0), rand.uniform((h,), -4.0, -1.0)  # A, D, dt_bias


# ----- SSD -----

# (preset, sequence lengths (proportions of the bucket), bucket tokens, initial states, dtype):
# one sequence is the few-(sequence, head)-pairs regime of `GpuBlockSizes.get_default`, five
# the default one.
SSD_CASES = cases(
    [
        ("nemotron-nano-9b-v2", [1], 1024, False, BF16),
        ("nemotron-nano-9b-v2", [300, 1, 0, 450, 250], 1024, True, BF16),
    ],
    [(p, [300, 1, 0, 450, 250], 1024, True, BF16) for p in MAMBA_PRESETS]
    + [
        ("nemotron-nano-9b-v2", [1], 1024, False, F32),
        ("falcon-h1-7b", [700, 300], 1024, True, F32),
    ],
)


@pytest.mark.parametrize("name,sizes,bucket,with_init,dtype", SSD_CASES)
def test_ssd_kernel_matches_reference_at_model_shapes(name, sizes, bucket, with_init, dtype):
    cfg = preset(name)
    h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    rand, num_tokens, seqs = Rand(0), tokens(bucket), lengths(sizes, bucket)
    real, cu = sum(seqs), cu_seqlens(seqs)
    x = poison(rand.normal((num_tokens, h, p), dtype), real)
    dt = poison(rand.normal((num_tokens, h), dtype), real)
    B = poison(rand.normal((num_tokens, g, n), dtype), real)
    C = poison(rand.normal((num_tokens, g, n), dtype), real)
    z = poison(rand.normal((num_tokens, h, p), dtype), real)
    A, D, dt_bias = _mamba_params(rand, cfg)
    init = rand.normal((len(seqs), h, p, n), F32, 0.5) if with_init else None
    starts = rand.ints((len(seqs),), 4 * cfg.chunk_size) if with_init else None
    layout = build_chunk_layout(cu, num_tokens, cfg.chunk_size, starts)
    # Checkpoints: the state after each non-empty sequence's first chunk.
    state_chunks = layout.seq_first_chunk[np.flatnonzero(seqs)]
    kwargs = dict(chunk_size=cfg.chunk_size, D=D, z=z, dt_bias=dt_bias,
                  dt_limit=tuple(cfg.time_step_limit), initial_states=init,
                  start_positions=starts, layout=layout, state_chunks=state_chunks)  # fmt: skip
    ref = jax.jit(functools.partial(ssd_varlen, impl="ref", **kwargs))(x, dt, A, B, C, cu)
    kernel = functools.partial(ssd_varlen_gpu, interpret=INTERPRET, **kwargs)
    got = jax.jit(kernel)(x, dt, A, B, C, cu)
    assert_close(got[0][:real], ref[0][:real], dtype, "y")
    assert_close(got[1], ref[1], dtype, "final states")
    assert_close(got[2], ref[2], dtype, "checkpoint states")


# ----- conv1d -----

CONV_CASES = cases(
    [("nemotron-nano-9b-v2", "mamba", BF16)],
    [
        ("qwen3.5-9b", "gdn", BF16),
        ("falcon-h1-7b", "mamba", BF16),
        ("nemotron-nano-9b-v2", "mamba", F32),
    ],  # fmt: skip
)


def _conv_dim(cfg, mixer: str) -> int:
    return cfg.conv_dim if mixer == "mamba" else cfg.gdn_conv_dim


@pytest.mark.parametrize("name,mixer,dtype", CONV_CASES)
def test_conv_varlen_kernel_matches_reference_at_model_shapes(name, mixer, dtype):
    cfg = preset(name)
    dim, width = _conv_dim(cfg, mixer), cfg.conv_kernel
    rand, num_tokens, seqs = Rand(1), tokens(1024), lengths([500, 1, 0, 300, 200], 1024)
    real, cu = sum(seqs), cu_seqlens(seqs)
    x = poison(rand.normal((num_tokens, dim), dtype), real)
    weight, bias = rand.normal((width, dim), dtype, 0.5), rand.normal((dim,), dtype)
    init = rand.normal((len(seqs), width - 1, dim), dtype)
    track_ends = jnp.asarray([s // 2 for s in seqs], jnp.int32)
    kwargs = dict(initial_states=init, track_ends=track_ends)
    ref = jax.jit(functools.partial(causal_conv1d_varlen, impl="ref", **kwargs))(
        x, weight, bias, cu
    )
    kernel = functools.partial(causal_conv1d_varlen_gpu, interpret=INTERPRET, **kwargs)
    got = jax.jit(kernel)(x, weight, bias, cu)
    assert_close(got[0][:real], ref[0][:real], dtype, "y")
    assert_close(got[1], ref[1], dtype, "final windows")
    assert_close(got[2], ref[2], dtype, "tracked windows")


def _pool_slots(rand: Rand, rows: int, pool: int) -> jax.Array:
    """Distinct slots for the first rows, the pad slot (pool - 1) for the last two."""
    real = rows - 2
    perm = np.random.default_rng(rows).permutation(pool - 1)[:real]
    return jnp.asarray(np.concatenate([perm, [pool - 1] * 2]), jnp.int32)


def _check_pool(got, ref, dtype, what):
    assert_close(got[:-1], ref[:-1], dtype, what)  # every slot but the pad slot


@pytest.mark.parametrize("name,mixer,dtype", CONV_CASES)
def test_conv_update_kernel_matches_reference_at_model_shapes(name, mixer, dtype):
    cfg = preset(name)
    dim, width, rows, pool = _conv_dim(cfg, mixer), cfg.conv_kernel, 64, 80
    rand = Rand(2)
    state = rand.normal((pool, width - 1, dim), dtype)
    x = rand.normal((rows, dim), dtype)
    weight, bias = rand.normal((width, dim), dtype, 0.5), rand.normal((dim,), dtype)
    slots = _pool_slots(rand, rows, pool)
    ref = jax.jit(functools.partial(causal_conv1d_update, impl="ref"))(state, x, weight, bias,
                                                                        slots)  # fmt: skip
    got = jax.jit(functools.partial(causal_conv1d_update_gpu, interpret=INTERPRET))(
        state, x, weight, bias, slots
    )
    assert_close(got[0][:-2], ref[0][:-2], dtype, "y")
    _check_pool(got[1], ref[1], dtype, "conv windows")


# ----- gated group RMSNorm -----

# (preset, mixer, tokens): Mamba2's norm over n_groups groups, z in the in_proj output at
# column 0; Gated DeltaNet's per value head, z after the conv channels.
NORM_CASES = cases(
    [("nemotron-nano-9b-v2", "mamba", 1024, BF16), ("qwen3.5-9b", "gdn", 256, BF16)],
    [
        ("nemotron-nano-9b-v2", "mamba", 8, BF16),
        ("granite-4.0-h-small", "mamba", 1024, BF16),
        ("nemotron-nano-9b-v2", "mamba", 1024, F32),
    ],  # fmt: skip
)


@pytest.mark.parametrize("name,mixer,num_tokens,dtype", NORM_CASES)
def test_gated_norm_kernel_matches_reference_at_model_shapes(name, mixer, num_tokens, dtype):
    cfg = preset(name)
    if mixer == "mamba":
        width, groups, z_offset, wz = cfg.d_inner, cfg.n_groups, 0, cfg.in_proj_dim
    else:
        width, groups = cfg.gdn_value_dim, cfg.gdn_num_value_heads
        z_offset, wz = cfg.gdn_conv_dim, cfg.gdn_in_proj_dim
    rand, t = Rand(3), tokens(num_tokens) if num_tokens > 8 else num_tokens
    y, z_source = rand.normal((t, width), dtype), rand.normal((t, wz), dtype)
    scale = rand.uniform((width,), 0.5, 1.5)
    kwargs = dict(num_groups=groups, eps=cfg.norm_eps, z_offset=z_offset)
    ref = jax.jit(functools.partial(gated_group_rmsnorm, impl="ref", **kwargs))(y, z_source, scale)
    got = jax.jit(functools.partial(gated_group_rmsnorm_gpu, interpret=INTERPRET, **kwargs))(
        y, z_source, scale
    )
    assert_close(got, ref, dtype, "norm")


# ----- decode: the selective state update and the fused decode step -----

# (preset, rows, dtype): up to 32 rows and above are the two regimes of both ops' defaults.
DECODE_CASES = cases(
    [("nemotron-nano-9b-v2", 8, BF16), ("nemotron-nano-9b-v2", 64, BF16)],
    [
        ("nemotron-3-nano-30b-a3b", 256, BF16),
        ("falcon-h1-7b", 8, BF16),
        ("nemotron-nano-9b-v2", 64, F32),
    ],  # fmt: skip
)


@pytest.mark.parametrize("name,rows,dtype", DECODE_CASES)
def test_state_update_kernel_matches_reference_at_model_shapes(name, rows, dtype):
    cfg = preset(name)
    h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    rand, pool = Rand(4), rows + 8
    state = rand.normal((pool, h, p, n), F32)
    x, dt = rand.normal((rows, h, p), dtype), rand.normal((rows, h), dtype)
    B, C = rand.normal((rows, g, n), dtype), rand.normal((rows, g, n), dtype)
    z = rand.normal((rows, h, p), dtype) if rows > 32 else None
    A, D, dt_bias = _mamba_params(rand, cfg)
    slots = _pool_slots(rand, rows, pool)
    kwargs = dict(D=D, z=z, dt_bias=dt_bias, dt_limit=tuple(cfg.time_step_limit))
    args = (state, x, dt, A, B, C, slots)
    ref = jax.jit(functools.partial(selective_state_update, impl="ref", **kwargs))(*args)
    kernel = functools.partial(selective_state_update_gpu, interpret=INTERPRET, **kwargs)
    got = jax.jit(kernel)(*args)
    assert_close(got[0][:-2], ref[0][:-2], dtype, "y")
    _check_pool(got[1], ref[1], dtype, "states")


@pytest.mark.parametrize("name,rows,dtype", DECODE_CASES)
def test_fused_decode_kernels_match_reference_chain_at_model_shapes(name, rows, dtype):
    cfg = preset(name)
    h, p, n, k = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.conv_kernel
    rand, pool = Rand(5), rows + 8
    conv = rand.normal((pool, k - 1, cfg.conv_dim), dtype)
    ssm = rand.normal((pool, h, p, n), F32)
    zxbcdt = rand.normal((rows, cfg.in_proj_dim), dtype)
    weight, bias = rand.normal((k, cfg.conv_dim), dtype, 0.5), rand.normal((cfg.conv_dim,), dtype)
    A, D, dt_bias = _mamba_params(rand, cfg)
    slots = _pool_slots(rand, rows, pool)
    # Two decode checkpoints: rows 0 and 1 copy their new states into two free slots.
    free = np.setdiff1d(np.arange(pool - 1), np.asarray(slots))[:2]
    pad = pool - 1
    src = jnp.asarray([int(slots[0]), int(slots[1]), pad, pad], jnp.int32)
    dst = jnp.asarray([*free, pad, pad], jnp.int32)
    kwargs = dict(D=D, dt_bias=dt_bias, dt_limit=tuple(cfg.time_step_limit), track_src=src,
                  track_dst=dst)  # fmt: skip
    args = (conv, ssm, zxbcdt, weight, bias, A, slots)
    ref = jax.jit(functools.partial(mamba2_decode, impl="ref", **kwargs))(*args)
    got = jax.jit(functools.partial(mamba2_decode_gpu, interpret=INTERPRET, **kwargs))(*args)
    assert_close(got[0][:-2], ref[0][:-2], dtype, "y")
    _check_pool(got[1], ref[1], dtype, "conv windows")
    _check_pool(got[2], ref[2], dtype, "states and checkpoints")


if FULL:  # the blocks a regime does not pick by default, on the same kernels

    @pytest.mark.parametrize("rows", [8, 256])
    def test_ssd_kernel_both_state_regimes_on_one_shape(rows):
        """The few-pairs blocks on many sequences, and the defaults on one."""
        from jaxmamba.kernels.ssd.gpu import GpuBlockSizes

        cfg = preset("nemotron-nano-9b-v2")
        h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        rand, num_tokens = Rand(6), tokens(1024)
        seqs = lengths([1] * (rows // 8), 1024)
        real, cu = sum(seqs), cu_seqlens(seqs)
        x = poison(rand.normal((num_tokens, h, p), BF16), real)
        dt = poison(rand.normal((num_tokens, h), BF16), real)
        B = poison(rand.normal((num_tokens, g, n), BF16), real)
        C = poison(rand.normal((num_tokens, g, n), BF16), real)
        A, D, dt_bias = _mamba_params(rand, cfg)
        kwargs = dict(chunk_size=cfg.chunk_size, D=D, dt_bias=dt_bias)
        ref = jax.jit(functools.partial(ssd_varlen, impl="ref", **kwargs))(x, dt, A, B, C, cu)
        for bs in (GpuBlockSizes(), GpuBlockSizes(state_block_n=128, state_warps=8,
                                                  state_stages=3)):  # fmt: skip
            kernel = functools.partial(ssd_varlen_gpu, interpret=INTERPRET, block_sizes=bs,
                                       **kwargs)  # fmt: skip
            got = jax.jit(kernel)(x, dt, A, B, C, cu)
            assert_close(got[0][:real], ref[0][:real], BF16, f"y {bs}")
            assert_close(got[1], ref[1], BF16, f"final states {bs}")
