"""gdn_prefill / gdn_decode (the reference) against the float64 token-by-token oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_oracle import gating, gdn_sequence, gdn_varlen

from jaxmamba.kernels.gdn import gdn_decode, gdn_gating, gdn_prefill
from jaxmamba.kernels.ssd.layout import build_chunk_layout

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}
STATE_TOL = 2e-5  # states accumulate in float32 from the (possibly bf16-rounded) inputs
PAD = 5

PREFILL = jax.jit(
    gdn_prefill, static_argnames=("chunk_size", "scale", "use_qk_l2norm", "impl")
)  # fmt: skip
DECODE = jax.jit(gdn_decode, static_argnames=("scale", "use_qk_l2norm", "impl"))
LAYOUT = jax.jit(build_chunk_layout, static_argnums=(1, 2))


def _f64(a):
    return np.asarray(a).astype(np.float64)  # host-side: no eager device ops


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _gate_params(rng, heads):
    """A_log ~ log U(1, 16) and a random dt_bias: decays from ~0.95 to ~1e-20 a token."""
    A_log = np.log(rng.uniform(1.0, 16.0, heads)).astype(np.float32)
    return A_log, rng.normal(0.0, 1.0, heads).astype(np.float32)


def _prefill_inputs(rng, lengths, hk, hv, dk, dv, dtype, qk_scale=1.0, pad=PAD):
    """Random q, k, v in ``dtype`` and float32 g, beta from the gating of random a, b; the
    padding tokens are NaN so any leak into a real output or state fails."""
    real = sum(lengths)
    num_tokens = real + pad

    def tok(*shape, scale=1.0):
        x = (scale * rng.standard_normal((num_tokens,) + shape)).astype(np.float32)
        x[real:] = np.nan
        return x

    A_log, dt_bias = _gate_params(rng, hv)
    g, beta = gating(tok(hv, scale=2.0), tok(hv, scale=2.0), A_log, dt_bias)
    return dict(
        q=jnp.asarray(tok(hk, dk, scale=qk_scale), dtype),
        k=jnp.asarray(tok(hk, dk, scale=qk_scale), dtype),
        v=jnp.asarray(tok(hv, dv), dtype),
        g=jnp.asarray(g, jnp.float32),
        beta=jnp.asarray(beta, jnp.float32),
    )


def _oracle(inp, cu, init, scale, use_qk_l2norm=True, keep_at=None):
    host = {name: _f64(x) for name, x in inp.items()}
    return gdn_varlen(
        host["q"], host["k"], host["v"], host["g"], host["beta"], cu, init, scale,
        use_qk_l2norm, keep_at,
    )  # fmt: skip


def _tracked_chunks(layout, cu, starts, chunk_size):
    """Chunks whose end is an absolute multiple of C inside a row, and every row's last chunk
    (one requested twice), with the (row, relative length) each one's state is at."""
    seqs, ends = np.asarray(layout.chunk_seq), np.asarray(layout.chunk_end)
    last = np.asarray(layout.seq_last_chunk)
    chunks, where = [], []
    for c, (s, e) in enumerate(zip(seqs, ends, strict=True)):
        if s == len(cu) - 1:
            continue
        length = cu[s + 1] - cu[s]
        if (e < length and (starts[s] + e) % chunk_size == 0) or c == last[s]:
            chunks.append(c)
            where.append((s, int(e)))
    chunks.append(chunks[0])
    where.append(where[0])
    return np.asarray(chunks, np.int32), where


PREFILL_CASES = [
    # dtype, hk, hv, dk, dv, chunk, with_initial, unaligned
    (jnp.float32, 2, 6, 24, 40, 16, True, True),
    (jnp.bfloat16, 2, 6, 24, 40, 64, True, True),
    (jnp.float32, 3, 3, 16, 32, 64, True, True),
    (jnp.bfloat16, 3, 3, 16, 32, 16, False, False),
]


@pytest.mark.parametrize("dtype,hk,hv,dk,dv,chunk,with_initial,unaligned", PREFILL_CASES)
def test_gdn_prefill_matches_recurrence(dtype, hk, hv, dk, dv, chunk, with_initial, unaligned):
    rng = np.random.default_rng(chunk + hv + with_initial)
    lengths = [chunk + 3, 0, 1, 3 * chunk + 5, chunk - 1, 0, 2]
    cu = _cu(lengths)
    num_seqs = len(lengths)
    inp = _prefill_inputs(rng, lengths, hk, hv, dk, dv, dtype)
    scale = dk**-0.5
    init = None
    if with_initial:
        init = rng.standard_normal((num_seqs, hv, dk, dv)).astype(np.float32)
        init[[0, 4]] = 0.0  # rows without an initial state
    starts = np.zeros(num_seqs, np.int32)
    if unaligned:
        starts = rng.integers(0, 5 * chunk, num_seqs).astype(np.int32)
        starts[-1] = chunk - 1  # one token before a boundary
    layout = LAYOUT(jnp.asarray(cu), int(cu[-1]) + PAD, chunk, jnp.asarray(starts))
    state_chunks, where = _tracked_chunks(layout, cu, starts, chunk)
    keep_at = [[e for s, e in where if s == row] for row in range(num_seqs)]

    o, final, tracked = PREFILL(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], jnp.asarray(cu), chunk_size=chunk,
        initial_states=None if init is None else jnp.asarray(init),
        start_positions=jnp.asarray(starts) if unaligned else None,
        layout=layout if unaligned else None, state_chunks=jnp.asarray(state_chunks),
    )  # fmt: skip
    init64 = np.zeros((num_seqs, hv, dk, dv)) if init is None else init
    o_ref, final_ref, kept = _oracle(inp, cu, init64, scale, keep_at=keep_at)

    real = cu[-1]
    assert o.shape == inp["v"].shape and o.dtype == dtype
    assert final.dtype == tracked.dtype == jnp.float32
    assert any(e < lengths[s] for s, e in where)  # some tracked states are inside a row
    np.testing.assert_allclose(_f64(o)[:real], o_ref[:real], rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(_f64(final), final_ref, rtol=STATE_TOL, atol=STATE_TOL)
    tracked_ref = np.stack([kept[s][e] for s, e in where])
    np.testing.assert_allclose(_f64(tracked), tracked_ref, rtol=STATE_TOL, atol=STATE_TOL)
    for s in np.flatnonzero(np.asarray(lengths) == 0):  # an empty row keeps its state
        np.testing.assert_array_equal(final[s], init64[s])


def test_gdn_prefill_without_qk_norm_and_bf16_states():
    rng = np.random.default_rng(3)
    lengths = [21, 0, 9]
    cu = _cu(lengths)
    hk, hv, dk, dv, chunk = 1, 2, 8, 12, 8
    # Unnormalised keys of norm ~1, so the delta rule stays contractive.
    inp = _prefill_inputs(rng, lengths, hk, hv, dk, dv, jnp.float32, qk_scale=dk**-0.5)
    init = rng.standard_normal((len(lengths), hv, dk, dv)).astype(np.float32)
    init_bf16 = jnp.asarray(init, jnp.bfloat16)
    starts = jnp.asarray([3, 0, 12], jnp.int32)
    o, final = PREFILL(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], jnp.asarray(cu), chunk_size=chunk,
        scale=0.7, use_qk_l2norm=False, initial_states=init_bf16, start_positions=starts,
        impl="ref",  # chunk 8: below the Triton kernel's 16 (test_gpu_gdn covers the kernel)
    )  # fmt: skip
    o_ref, final_ref, _ = _oracle(inp, cu, _f64(init_bf16), 0.7, use_qk_l2norm=False)
    tol = TOL[jnp.float32]
    assert final.dtype == jnp.bfloat16
    np.testing.assert_allclose(_f64(o)[: cu[-1]], o_ref[: cu[-1]], rtol=tol, atol=tol)
    tol = TOL[jnp.bfloat16]
    np.testing.assert_allclose(_f64(final), final_ref, rtol=tol, atol=tol)


def test_gdn_gating_matches_oracle():
    rng = np.random.default_rng(4)
    A_log, dt_bias = _gate_params(rng, 6)
    a = (4.0 * rng.standard_normal((5, 6))).astype(np.float32)
    b = (4.0 * rng.standard_normal((5, 6))).astype(np.float32)
    g, beta = gdn_gating(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16),
                         jnp.asarray(A_log), jnp.asarray(dt_bias))  # fmt: skip
    g_ref, beta_ref = gating(_f64(jnp.asarray(a, jnp.bfloat16)),
                             _f64(jnp.asarray(b, jnp.bfloat16)), A_log, dt_bias)  # fmt: skip
    assert g.dtype == beta.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(beta, beta_ref, rtol=1e-5, atol=1e-6)


def _decode_inputs(rng, rows, hk, hv, dk, dv, dtype, real):
    def per_row(*shape):
        x = rng.standard_normal((rows,) + shape).astype(np.float32)
        x[~real] = np.nan
        return jnp.asarray(x, dtype)

    A_log, dt_bias = _gate_params(rng, hv)
    return dict(
        q=per_row(hk, dk), k=per_row(hk, dk), v=per_row(hv, dv),
        a=per_row(hv), b=per_row(hv), A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias),
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype,pool_dtype,hk,hv,dk,dv",
    [
        (jnp.float32, jnp.float32, 2, 6, 24, 40),
        (jnp.bfloat16, jnp.float32, 3, 3, 16, 32),
        (jnp.bfloat16, jnp.bfloat16, 2, 6, 24, 40),
    ],
)
def test_gdn_decode_matches_one_recurrent_step(dtype, pool_dtype, hk, hv, dk, dv):
    rng = np.random.default_rng(hv + dk)
    rows, num_slots = 6, 9
    pad_slot = num_slots
    # Real rows take distinct slots; the last two rows are padding on the pad slot.
    slots = rng.permutation(num_slots)[:rows].astype(np.int32)
    slots[-2:] = pad_slot
    real = slots != pad_slot
    pool = rng.standard_normal((num_slots + 1, hv, dk, dv)).astype(np.float32)
    pool[pad_slot] = np.nan
    pool = jnp.asarray(pool, pool_dtype)
    inp = _decode_inputs(rng, rows, hk, hv, dk, dv, dtype, real)
    scale = dk**-0.5

    o, new_pool = DECODE(
        pool, inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], inp["A_log"], inp["dt_bias"],
        jnp.asarray(slots),
    )  # fmt: skip

    assert o.shape == (rows, hv, dv) and o.dtype == dtype and new_pool.dtype == pool_dtype
    host = {name: _f64(x) for name, x in inp.items()}
    g, beta = gating(host["a"], host["b"], host["A_log"], host["dt_bias"])
    tol, state_tol = TOL[dtype], TOL[pool_dtype]
    for row in np.flatnonzero(real):
        one = slice(row, row + 1)
        o_ref, s_ref, _ = gdn_sequence(
            host["q"][one], host["k"][one], host["v"][one], g[one], beta[one],
            _f64(pool[slots[row]]), scale,
        )  # fmt: skip
        np.testing.assert_allclose(_f64(o[row]), o_ref[0], rtol=tol, atol=tol)
        np.testing.assert_allclose(
            _f64(new_pool[slots[row]]), s_ref, rtol=state_tol, atol=state_tol
        )
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    assert untouched.size
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_gdn_prefill_then_extend_then_decode_matches_one_prefill():
    """Prefill 21 tokens, extend by 30 from position 21 (off the chunk grid), decode one: the
    same outputs and state as one prefill over the 52 tokens."""
    rng = np.random.default_rng(5)
    hk, hv, dk, dv, chunk = 2, 4, 16, 8, 16
    n1, n2, total = 21, 30, 52
    A_log, dt_bias = _gate_params(rng, hv)
    A_log, dt_bias = jnp.asarray(A_log), jnp.asarray(dt_bias)
    q, k = (rng.standard_normal((total, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((total, hv, dv)).astype(np.float32)
    a, b = (rng.standard_normal((total, hv)).astype(np.float32) for _ in range(2))
    g, beta = (np.asarray(x) for x in gdn_gating(jnp.asarray(a), jnp.asarray(b), A_log, dt_bias))
    init = jnp.asarray(rng.standard_normal((1, hv, dk, dv)), jnp.float32)

    def prefill(lo, hi, state):
        """Tokens lo..hi as one row, NaN-padded to one shape for every call."""
        padded = []
        for x in (q, k, v, g, beta):
            p = np.full((total + 3,) + x.shape[1:], np.nan, np.float32)
            p[: hi - lo] = x[lo:hi]
            padded.append(jnp.asarray(p))
        o, final = PREFILL(
            *padded, jnp.asarray([0, hi - lo], jnp.int32), chunk_size=chunk,
            initial_states=state, start_positions=jnp.asarray([lo], jnp.int32),
        )  # fmt: skip
        return np.asarray(o)[: hi - lo], final

    o_full, final_full = prefill(0, total, init)
    o1, state1 = prefill(0, n1, init)
    o2, state2 = prefill(n1, n1 + n2, state1)
    pool = jnp.concatenate([jnp.zeros((1, hv, dk, dv)), state2, jnp.full((1, hv, dk, dv), 7.0)])
    last = slice(total - 1, total)
    o3, pool = DECODE(
        pool, *(jnp.asarray(x[last]) for x in (q, k, v, a, b)), A_log, dt_bias,
        jnp.asarray([1], jnp.int32),
    )  # fmt: skip

    tol = 2e-5
    o_steps = np.concatenate([o1, o2, o3])
    np.testing.assert_allclose(o_steps, o_full, rtol=tol, atol=tol)
    np.testing.assert_allclose(pool[1], final_full[0], rtol=tol, atol=tol)
    np.testing.assert_array_equal(pool[2], np.full((hv, dk, dv), 7.0))


@pytest.mark.cpu_only
def test_gdn_dispatch_and_shape_errors():
    rng = np.random.default_rng(6)
    inp = _prefill_inputs(rng, [6, 13], 1, 2, 4, 8, jnp.float32, pad=0)
    cu = jnp.asarray(_cu([6, 13]))
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu)
    with pytest.raises(ValueError, match="CPU"):  # the kernels run on CPU via "interpret"
        gdn_prefill(*args, chunk_size=8, impl="pallas")
    with pytest.raises(ValueError, match="impl"):
        gdn_prefill(*args, chunk_size=8, impl="triton")
    with pytest.raises(ValueError, match=r"\(19, 3\)"):
        gdn_prefill(*args[:3], jnp.ones((19, 3)), *args[4:], chunk_size=8)
    with pytest.raises(ValueError, match=r"q \(19, 1, 4\), k \(19, 2, 4\)"):
        gdn_prefill(args[0], jnp.ones((19, 2, 4)), *args[2:], chunk_size=8)
    with pytest.raises(ValueError, match="multiple of key heads"):
        qk = jnp.ones((19, 2, 4))
        gdn_prefill(qk, qk, jnp.ones((19, 3, 8)), *args[3:], chunk_size=8)
    with pytest.raises(ValueError, match=r"initial_states.*\(2, 2, 4, 8\).*\(2, 2, 8, 4\)"):
        gdn_prefill(*args, chunk_size=8, initial_states=jnp.ones((2, 2, 8, 4)))
    with pytest.raises(ValueError, match="start_positions"):
        gdn_prefill(*args, chunk_size=8, start_positions=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="chunk size"):
        gdn_prefill(*args, chunk_size=16, layout=LAYOUT(cu, 19, 8, None))

    dec = _decode_inputs(rng, 3, 1, 2, 4, 8, jnp.float32, np.ones(3, bool))
    pool = jnp.zeros((4, 2, 4, 8))
    slots = jnp.asarray([0, 1, 3], jnp.int32)
    dargs = (dec["q"], dec["k"], dec["v"], dec["a"], dec["b"], dec["A_log"], dec["dt_bias"])
    with pytest.raises(ValueError, match=r"state.*\(4, 2, 8, 4\)"):
        gdn_decode(jnp.zeros((4, 2, 8, 4)), *dargs, slots)
    with pytest.raises(ValueError, match=r"slots.*\(2,\)"):
        gdn_decode(pool, *dargs, slots[:2])
    with pytest.raises(ValueError, match=r"A_log.*\(3,\)"):
        gdn_decode(pool, *dargs[:5], jnp.zeros((3,)), dargs[6], slots)
    with pytest.raises(ValueError, match="CPU"):
        gdn_decode(pool, *dargs, slots, impl="pallas")
