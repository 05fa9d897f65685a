"""The Triton GDN kernels in interpret mode against the float64 token loop (gdn_oracle) and the
jnp reference; export for CUDA on CPU at Qwen3-Next shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_oracle import gating, gdn_sequence, gdn_varlen
from jax import export

from jaxmamba.kernels.gdn import gdn_decode, gdn_decode_ref, gdn_prefill, gdn_prefill_ref
from jaxmamba.kernels.gdn.gpu import (
    DecodeGpuBlockSizes,
    PrefillGpuBlockSizes,
    gdn_decode_gpu,
    gdn_prefill_gpu,
)
from jaxmamba.kernels.ssd.layout import build_chunk_layout

CHUNK = 16
PAD = 5  # padding tokens after the last sequence, NaN
# bf16 kernels feed the matmuls bf16 operands (T, W, U, V' and the state), as FLA's do.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}
DECODE_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

PREFILL = {  # name: (kernel, chunk)
    "gpu": (functools.partial(gdn_prefill_gpu, interpret=True), CHUNK),
    # Several Dv tiles in the state and output passes, the last one partly masked (Dv 40).
    "gpu_tiles": (
        functools.partial(
            gdn_prefill_gpu,
            interpret=True,
            block_sizes=PrefillGpuBlockSizes(state_block_v=16, out_block_v=32),
        ),
        CHUNK,
    ),
    # Chunks of 64 solved in row blocks of 16 (Qwen3-Next's chunk, the default blocks) and 32.
    "gpu_row_blocks": (functools.partial(gdn_prefill_gpu, interpret=True), 64),
    "gpu_row_blocks_32": (
        functools.partial(
            gdn_prefill_gpu, interpret=True, block_sizes=PrefillGpuBlockSizes(wy_sub_block=32)
        ),
        64,
    ),
}
REF = jax.jit(gdn_prefill_ref, static_argnames=("chunk_size", "scale", "use_qk_l2norm"))

CASES = {
    # name: dtype, Hk, HV, Dk, Dv, lengths, start positions (None: zeros), initial states
    "f32_ratio3_odd_dims": (jnp.float32, 2, 6, 24, 40, (0, 1, 15, 19, 53), (0, 5, 16, 7, 3), True),
    "f32_pow2_aligned": (jnp.float32, 1, 2, 32, 16, (16, 35), None, False),
    "bf16_ratio3_odd_dims": (jnp.bfloat16, 1, 3, 24, 40, (3, 0, 53, 1), (13, 2, 30, 0), True),
}


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _prefill_inputs(seed, dtype, hk, hv, dk, dv, lengths, with_init):
    rng = np.random.default_rng(seed)
    real = int(sum(lengths))
    tokens = real + PAD

    def rand(*shape):
        x = rng.standard_normal(shape).astype(np.float32)
        x[real:] = np.nan  # padding tokens must not reach any real output or state
        return x

    q, k, v = rand(tokens, hk, dk), rand(tokens, hk, dk), rand(tokens, hv, dv)
    g, beta = gating(rand(tokens, hv), rand(tokens, hv), rng.standard_normal(hv) * 0.5,
                     rng.standard_normal(hv))  # fmt: skip
    init = None
    if with_init:
        init = (rng.standard_normal((len(lengths), hv, dk, dv)) * 0.5).astype(np.float32)
    # The kernels see the rounded inputs; the oracle gets the same rounded values.
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return dict(q=q, k=k, v=v, g=jnp.asarray(g, jnp.float32), beta=jnp.asarray(beta, jnp.float32),
                init=None if init is None else jnp.asarray(init))  # fmt: skip


def _chunk_ends(cu, starts, chunk_size):
    """The used chunks of the layout: (chunk, sequence, relative end) each."""
    layout = build_chunk_layout(
        jnp.asarray(cu), int(cu[-1]) + PAD, chunk_size,
        None if starts is None else jnp.asarray(starts, jnp.int32),
    )  # fmt: skip
    seqs, ends = np.asarray(layout.chunk_seq), np.asarray(layout.chunk_end)
    return [(c, int(s), int(e)) for c, (s, e) in enumerate(zip(seqs, ends, strict=True))
            if s < len(cu) - 1]  # fmt: skip


@pytest.mark.parametrize(
    "kernel, case",
    [
        *(("gpu", case) for case in CASES),
        ("gpu_tiles", "f32_ratio3_odd_dims"),
        *(("gpu_row_blocks", case) for case in ("f32_ratio3_odd_dims", "bf16_ratio3_odd_dims")),
        ("gpu_row_blocks_32", "f32_ratio3_odd_dims"),
    ],
)
def test_prefill_matches_token_loop_over_odd_lengths(kernel, case):
    """Lengths 0, 1, C-1, C+3, 3C+5, starts off the chunk grid, random initial states, NaN
    padding tokens; the tracked chunk states (duplicates, out of chunk order) too."""
    dtype, hk, hv, dk, dv, lengths, starts, with_init = CASES[case]
    kernel, chunk = PREFILL[kernel]
    if chunk != CHUNK:  # the same shapes of lengths over the larger chunk
        lengths = tuple(n * chunk // CHUNK for n in lengths)
        starts = None if starts is None else tuple(p * chunk // CHUNK for p in starts)
    inp = _prefill_inputs(0, dtype, hk, hv, dk, dv, lengths, with_init)
    cu = _cu(lengths)
    ends = _chunk_ends(cu, starts, chunk)
    wanted = [ends[i][0] for i in (-1, 0, len(ends) // 2, 0)]
    scale = dk**-0.5
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], jnp.asarray(cu))
    kwargs = dict(
        chunk_size=chunk, scale=scale, initial_states=inp["init"],
        start_positions=None if starts is None else jnp.asarray(starts, jnp.int32),
        state_chunks=jnp.asarray(wanted, jnp.int32),
    )  # fmt: skip
    o, final, tracked = kernel(*args, **kwargs)

    init = np.zeros((len(lengths), hv, dk, dv)) if inp["init"] is None else _f64(inp["init"])
    keep = [sorted({e for _, s, e in ends if s == seq}) for seq in range(len(lengths))]
    o_ref, final_ref, kept = gdn_varlen(
        *(_f64(x) for x in (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])), cu, init,
        scale, keep_at=keep,
    )  # fmt: skip
    tol = TOL[dtype]
    real = int(cu[-1])
    assert o.dtype == dtype and final.dtype == jnp.float32 and tracked.shape[0] == len(wanted)
    np.testing.assert_allclose(_f64(o)[:real], o_ref[:real], rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(final), final_ref, rtol=tol, atol=tol)
    by_chunk = {c: (s, e) for c, s, e in ends}
    for row, chunk in enumerate(wanted):
        s, e = by_chunk[chunk]
        np.testing.assert_allclose(_f64(tracked[row]), kept[s][e], rtol=tol, atol=tol)

    # The jnp reference (same chunked form) agrees closely.
    ref = REF(*args, **kwargs)
    rtol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(_f64(o)[:real], _f64(ref[0])[:real], rtol=rtol, atol=rtol)
    for got, want in zip((final, tracked), ref[1:], strict=True):
        np.testing.assert_allclose(_f64(got), _f64(want), rtol=rtol, atol=rtol)


def test_prefill_without_norm_states_in_bf16_and_no_tracking():
    """use_qk_l2norm=False, a bf16 initial state (states come back bf16), no state_chunks:
    two outputs."""
    dtype, hk, hv, dk, dv, lengths = jnp.float32, 1, 2, 16, 16, (21, 4)
    inp = _prefill_inputs(1, dtype, hk, hv, dk, dv, lengths, True)
    # Unnormalised keys: keep the delta rule contractive (|k|^2 beta < 2).
    q, k = inp["q"] * 0.2, inp["k"] * 0.2
    init = inp["init"].astype(jnp.bfloat16)
    cu = _cu(lengths)
    out = PREFILL["gpu"][0](
        q, k, inp["v"], inp["g"], inp["beta"], jnp.asarray(cu), chunk_size=CHUNK, scale=0.5,
        use_qk_l2norm=False, initial_states=init,
    )  # fmt: skip
    assert len(out) == 2 and out[1].dtype == jnp.bfloat16
    o_ref, final_ref, _ = gdn_varlen(
        *(_f64(x) for x in (q, k, inp["v"], inp["g"], inp["beta"])), cu, _f64(init), 0.5,
        use_qk_l2norm=False,
    )  # fmt: skip
    real = int(cu[-1])
    np.testing.assert_allclose(_f64(out[0])[:real], o_ref[:real], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(_f64(out[1]), final_ref, rtol=1e-2, atol=1e-2)


DECODE_CASES = {
    # name: pool dtype, input dtype, Hk, HV, Dk, Dv, block sizes
    "f32_odd_dims_ratio3": (jnp.float32, jnp.float32, 2, 6, 24, 40, None),
    "f32_tiles": (jnp.float32, jnp.float32, 1, 2, 32, 64, DecodeGpuBlockSizes(block_v=16)),
    "bf16_pool": (jnp.bfloat16, jnp.bfloat16, 2, 4, 16, 40, DecodeGpuBlockSizes(block_v=32)),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_updates_its_slots_in_place_and_nothing_else(case):
    """Rows on slots 3 and 0, two pad rows on the NaN pad slot: the oracle's one-token step on
    the used slots, every other slot bit-for-bit unchanged."""
    pool_dtype, dtype, hk, hv, dk, dv, block_sizes = DECODE_CASES[case]
    rng = np.random.default_rng(2)
    num_slots, slots = 6, np.array([3, 0, 5, 5], np.int32)
    rows = len(slots)
    pool = rng.standard_normal((num_slots, hv, dk, dv)).astype(np.float32)
    pool[-1] = np.nan
    pool = jnp.asarray(pool, pool_dtype)
    q, k = (jnp.asarray(rng.standard_normal((rows, hk, dk)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((rows, hv, dv)), dtype)
    a, b = (jnp.asarray(rng.standard_normal((rows, hv)), dtype) for _ in range(2))
    a_log = jnp.asarray(rng.standard_normal(hv) * 0.5, jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(hv), jnp.float32)
    scale = dk**-0.5
    args = (q, k, v, a, b, a_log, dt_bias, jnp.asarray(slots))
    expected_pool = np.array(pool)  # copied before the kernel updates the pool in place
    step = jax.jit(
        functools.partial(gdn_decode_gpu, scale=scale, interpret=True, block_sizes=block_sizes),
        donate_argnums=0,
    )
    o, new_pool = step(pool, *args)

    g, beta = gating(_f64(a), _f64(b), _f64(a_log), _f64(dt_bias))
    tol = DECODE_TOL[pool_dtype]
    assert o.dtype == dtype and new_pool.dtype == pool_dtype
    for row, slot in enumerate(slots[:2]):
        o_ref, s_ref, _ = gdn_sequence(
            _f64(q[row : row + 1]), _f64(k[row : row + 1]), _f64(v[row : row + 1]),
            g[row : row + 1], beta[row : row + 1], np.asarray(expected_pool[slot], np.float64),
            scale,
        )  # fmt: skip
        np.testing.assert_allclose(_f64(o[row]), o_ref[0], rtol=tol, atol=tol)
        np.testing.assert_allclose(_f64(new_pool[slot]), s_ref, rtol=tol, atol=tol)
    for slot in (1, 2, 4):
        np.testing.assert_array_equal(np.asarray(new_pool[slot]), expected_pool[slot])
    # The jnp reference on a fresh copy of the pool agrees.
    o_jnp, pool_jnp = gdn_decode_ref(jnp.asarray(expected_pool), *args, scale=scale)
    np.testing.assert_allclose(_f64(o[:2]), _f64(o_jnp[:2]), rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(new_pool[:-1]), _f64(pool_jnp[:-1]), rtol=tol, atol=tol)


# Qwen3-Next: 16 key heads, 32 value heads of dim 128, chunk 64.
QWEN3_NEXT = dict(hk=16, hv=32, dk=128, dv=128, chunk=64)
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("seqs", [3, 8])  # the two get_default regimes of the state pass
def test_prefill_lowers_for_cuda_at_qwen3_next_shapes(seqs):
    """The dispatcher's ``pallas_gpu`` path, bf16, initial and tracked states: three Triton
    calls (WY, state and output passes)."""
    tokens, s = 512, QWEN3_NEXT
    sds = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32

    def step(q, k, v, g, beta, cu, init, starts, wanted):
        return gdn_prefill(
            q, k, v, g, beta, cu, chunk_size=s["chunk"], initial_states=init,
            start_positions=starts, state_chunks=wanted, impl="pallas_gpu",
        )  # fmt: skip

    exported = export.export(jax.jit(step), platforms=("cuda",), disabled_checks=[TRITON])(
        sds((tokens, s["hk"], s["dk"]), bf16), sds((tokens, s["hk"], s["dk"]), bf16),
        sds((tokens, s["hv"], s["dv"]), bf16), sds((tokens, s["hv"]), f32),
        sds((tokens, s["hv"]), f32), sds((seqs + 1,), i32),
        sds((seqs, s["hv"], s["dk"], s["dv"]), f32), sds((seqs,), i32), sds((2,), i32),
    )  # fmt: skip
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 3
    state = (s["hv"], s["dk"], s["dv"])
    assert [o.shape for o in exported.out_avals] == [
        (tokens, s["hv"], s["dv"]), (seqs, *state), (2, *state)
    ]  # fmt: skip


@pytest.mark.parametrize("rows", [1, 256])
def test_decode_lowers_for_cuda_at_qwen3_next_shapes(rows):
    s = QWEN3_NEXT
    sds = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    step = jax.jit(functools.partial(gdn_decode, impl="pallas_gpu"), donate_argnums=0)
    exported = export.export(step, platforms=("cuda",), disabled_checks=[TRITON])(
        sds((rows + 1, s["hv"], s["dk"], s["dv"]), f32), sds((rows, s["hk"], s["dk"]), bf16),
        sds((rows, s["hk"], s["dk"]), bf16), sds((rows, s["hv"], s["dv"]), bf16),
        sds((rows, s["hv"]), bf16), sds((rows, s["hv"]), bf16), sds((s["hv"],), f32),
        sds((s["hv"],), f32), sds((rows,), i32),
    )  # fmt: skip
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1
    assert exported.out_avals[1].shape == (rows + 1, s["hv"], s["dk"], s["dv"])
