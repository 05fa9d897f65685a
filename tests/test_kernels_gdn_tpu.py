"""The Mosaic TPU Gated DeltaNet kernels in TPU interpret mode on CPU against the float64 numpy
recurrence (tests/gdn_oracle.py) and the plain-jnp reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_oracle import gating, gdn_sequence, gdn_varlen

from jaxmamba.kernels.gdn import gdn_decode, gdn_decode_ref, gdn_prefill
from jaxmamba.kernels.gdn.tpu import TpuBlockSizes, gdn_decode_tpu, gdn_prefill_tpu
from jaxmamba.kernels.ssd.layout import build_chunk_layout

HK, HV, DK, DV = 2, 6, 24, 40  # head dims off the (8, 128) tiles; 3 value heads per key head
CHUNK = 16
PAD = 5  # NaN padding tokens after the real ones
# bf16 feeds the matmuls bf16 operands (the carried state too); float32 runs at full precision.
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 4e-2}


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _prefill_inputs(rng, lengths, dtype):
    """Random q, k, v (dtype), g, beta (f32), NaN in every padding token, initial states."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu[-1]) + PAD
    arrays = {
        "q": rng.standard_normal((t, HK, DK)),
        "k": rng.standard_normal((t, HK, DK)),
        "v": rng.standard_normal((t, HV, DV)),
        "g": -np.exp(rng.standard_normal((t, HV)) * 0.5 - 1.5),
        "beta": rng.uniform(0.0, 1.0, (t, HV)),
    }
    for a in arrays.values():
        a[cu[-1] :] = np.nan
    out = {n: jnp.asarray(a, dtype if n in "qkv" else jnp.float32) for n, a in arrays.items()}
    out["init"] = jnp.asarray(rng.standard_normal((len(lengths), HV, DK, DV)), jnp.float32)
    return out, cu


PREFILL_CASES = {
    # name: dtype, state dtype, chunk, block sizes (None: through the dispatcher,
    # impl="interpret": the 3 value heads of a key head a grid step)
    "f32": (jnp.float32, jnp.float32, CHUNK, None),
    "f32_c24_one_value_head_a_step": (jnp.float32, jnp.float32, 24, TpuBlockSizes(1)),
    "bf16_two_key_heads_a_step": (jnp.bfloat16, jnp.bfloat16, CHUNK, TpuBlockSizes(6)),
}


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_kernel_matches_recurrence_over_awkward_lengths(case):
    """Lengths 0, 1, C-1, C+3, 3C+5 from unaligned starts, random initial states, NaN padding
    tokens, and the states at requested chunk ends (duplicated, unsorted, negative)."""
    dtype, state_dtype, chunk, block_sizes = PREFILL_CASES[case]
    rng = np.random.default_rng(list(PREFILL_CASES).index(case))
    inp, cu = _prefill_inputs(rng, [0, 1, chunk - 1, chunk + 3, 3 * chunk + 5], dtype)
    init = inp["init"].astype(state_dtype)
    starts = jnp.asarray([7, 0, 5, 13, 2 * chunk + 9], jnp.int32)  # not multiples of C but 0
    layout = build_chunk_layout(jnp.asarray(cu), inp["q"].shape[0], chunk, starts)
    nc = layout.token_index.shape[0]
    used = int(np.sum(np.asarray(layout.chunk_seq) < len(cu) - 1))
    wanted = jnp.asarray([used - 1, 0, 3, used - 1, 2, used - 1 - nc], jnp.int32)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], jnp.asarray(cu))
    kw = dict(chunk_size=chunk, initial_states=init, start_positions=starts, layout=layout,
              state_chunks=wanted)  # fmt: skip
    if block_sizes is None:
        o, final, tracked = gdn_prefill(*args, impl="interpret", **kw)
        ref = gdn_prefill(*args, impl="ref", **kw)
        real = cu[-1]  # padding tokens' outputs are unspecified
        for ours, theirs in zip((o[:real], final, tracked), (ref[0][:real], *ref[1:]), strict=True):
            np.testing.assert_allclose(_f64(ours), _f64(theirs), rtol=2e-5, atol=2e-5)
    else:
        o, final, tracked = gdn_prefill_tpu(
            *args, scale=DK**-0.5, interpret=True, block_sizes=block_sizes, **kw
        )

    seqs, ends = np.asarray(layout.chunk_seq), np.asarray(layout.chunk_end)
    wanted_chunks = np.asarray(wanted) % nc
    keep_at = [[int(ends[c]) for c in wanted_chunks if seqs[c] == s] for s in range(len(cu) - 1)]
    o_ref, final_ref, kept = gdn_varlen(
        *(_f64(inp[n]) for n in ("q", "k", "v", "g", "beta")), cu, _f64(init), DK**-0.5,
        keep_at=keep_at,
    )  # fmt: skip
    real, tol = cu[-1], TOL[dtype]
    assert o.dtype == dtype and final.dtype == tracked.dtype == state_dtype
    np.testing.assert_allclose(_f64(o)[:real], o_ref[:real], rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(final), final_ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(_f64(final[0]), _f64(init[0]))  # the empty sequence
    for row, c in enumerate(wanted_chunks):
        state_ref = kept[seqs[c]][int(ends[c])]
        np.testing.assert_allclose(_f64(tracked[row]), state_ref, rtol=tol, atol=tol)


def _decode_inputs(rng, rows, slots, dtype, state_dtype):
    pool = rng.standard_normal((slots, HV, DK, DV))
    pool[-1] = np.nan  # the pad slot
    return {
        "state": jnp.asarray(pool, state_dtype),
        "q": jnp.asarray(rng.standard_normal((rows, HK, DK)), dtype),
        "k": jnp.asarray(rng.standard_normal((rows, HK, DK)), dtype),
        "v": jnp.asarray(rng.standard_normal((rows, HV, DV)), dtype),
        "a": jnp.asarray(rng.standard_normal((rows, HV)), dtype),
        "b": jnp.asarray(rng.standard_normal((rows, HV)), dtype),
        "A_log": jnp.asarray(rng.standard_normal(HV) * 0.5, jnp.float32),
        "dt_bias": jnp.asarray(rng.standard_normal(HV), jnp.float32),
    }


DECODE_CASES = {
    # name: dtype, state dtype, block sizes
    "f32_two_heads_a_block": (jnp.float32, jnp.float32, TpuBlockSizes(max_block_bytes=DK * DV * 8)),
    "bf16": (jnp.bfloat16, jnp.float32, None),  # through the dispatcher, impl="interpret"
    "bf16_state": (jnp.bfloat16, jnp.bfloat16, TpuBlockSizes()),
}


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_kernel_matches_recurrence_in_place(case):
    """Real rows in scattered slots, pad rows (twice) on the NaN pad slot: real rows match the
    float64 step, the slots no row names are untouched, nothing NaN leaks."""
    dtype, state_dtype, block_sizes = DECODE_CASES[case]
    rng = np.random.default_rng(list(DECODE_CASES).index(case))
    num_slots = 8
    inp = _decode_inputs(rng, rows=5, slots=num_slots, dtype=dtype, state_dtype=state_dtype)
    slots = np.asarray([4, 0, 7, 2, 7], np.int32)  # rows 2 and 4 are pad rows
    real = [0, 1, 3]
    if block_sizes is None:
        kernel = functools.partial(gdn_decode, impl="interpret")
    else:
        kernel = functools.partial(
            gdn_decode_tpu, scale=DK**-0.5, interpret=True, block_sizes=block_sizes
        )
    before = np.asarray(inp["state"].astype(jnp.float32))
    names = ("state", "q", "k", "v", "a", "b", "A_log", "dt_bias")
    ref = gdn_decode_ref(*(inp[n] for n in names), jnp.asarray(slots), scale=DK**-0.5)
    step = jax.jit(kernel, donate_argnums=(0,))  # the pool is updated in place
    o, pool = step(*(inp[n] for n in names), jnp.asarray(slots))

    g, beta = gating(_f64(inp["a"]), _f64(inp["b"]), _f64(inp["A_log"]), _f64(inp["dt_bias"]))
    tol = TOL[dtype] if state_dtype == jnp.float32 else 5e-2
    assert o.dtype == dtype and pool.dtype == state_dtype
    for row in real:
        one = lambda name, r=row: _f64(inp[name])[r : r + 1]  # noqa: E731
        o_ref, s_ref, _ = gdn_sequence(
            one("q"), one("k"), one("v"), g[row : row + 1], beta[row : row + 1],
            before[slots[row]], DK**-0.5,
        )  # fmt: skip
        np.testing.assert_allclose(_f64(o[row]), o_ref[0], rtol=tol, atol=tol)
        np.testing.assert_allclose(_f64(pool[slots[row]]), s_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(o)[real], _f64(ref[0])[real], rtol=tol, atol=tol)
    untouched = sorted(set(range(num_slots - 1)) - set(slots.tolist()))
    np.testing.assert_array_equal(np.asarray(pool.astype(jnp.float32))[untouched],
                                  before[untouched])  # fmt: skip
