"""ssd_varlen against a float64 numpy token-by-token recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import build_chunk_layout, num_chunks, ssd_varlen

TOL = {jnp.float32: 2e-4, jnp.bfloat16: 3e-2}
STATE_TOL = 2e-4  # states accumulate in float32 from the (possibly bf16-rounded) inputs
CHUNK = 8
LENGTHS = [1, 7, 8, 0, 9, 29, 0, 3]  # 1, C-1, C, C+1, 3C+5 and empty rows
PAD = 5


def _f64(a):
    return np.asarray(a).astype(np.float64)  # host-side: no eager device ops


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _softplus(v):
    return np.log1p(np.exp(-np.abs(v))) + np.maximum(v, 0.0)


def _inputs(rng, lengths, heads, head_dim, groups, state, dtype, pad=PAD):
    """Random SSD inputs; padding tokens are NaN so any leak into a real output fails."""
    num_tokens = sum(lengths) + pad
    real = sum(lengths)

    def tok(*shape, scale=1.0):
        a = (scale * rng.standard_normal((num_tokens,) + shape)).astype(np.float32)
        a[real:] = np.nan
        return jnp.asarray(a, dtype)

    return dict(
        x=tok(heads, head_dim),
        dt=tok(heads),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, heads)), jnp.float32),
        B=tok(groups, state, scale=0.5),
        C=tok(groups, state, scale=0.5),
        D=jnp.asarray(rng.standard_normal(heads), jnp.float32),
        z=tok(heads, head_dim),
        dt_bias=jnp.asarray(rng.uniform(-2.0, 0.0, heads), jnp.float32),
        init=jnp.asarray(rng.standard_normal((len(lengths), heads, head_dim, state)), jnp.float32),
    )


def _recurrence(inp, cu, init, dt_limit=(0.0, np.inf), use_d=True, use_z=True):
    """y [T, H, P] and, per sequence, the states after 0..len tokens ([len+1, H, P, N])."""
    x, dt, b, c = (_f64(inp[k]) for k in ("x", "dt", "B", "C"))
    a, d, z, bias = (_f64(inp[k]) for k in ("A", "D", "z", "dt_bias"))
    heads, groups = x.shape[1], b.shape[1]
    rep = heads // groups
    y = np.full(x.shape, np.nan)
    states = []
    for s in range(len(cu) - 1):
        h = np.zeros((heads,) + x.shape[2:] + b.shape[2:]) if init is None else _f64(init[s])
        seq_states = [h]
        for t in range(cu[s], cu[s + 1]):
            step = np.clip(_softplus(dt[t] + bias), *dt_limit)  # [H]
            bh, ch = np.repeat(b[t], rep, 0), np.repeat(c[t], rep, 0)  # [H, N]
            h = np.exp(step * a)[:, None, None] * h + np.einsum("h,hp,hn->hpn", step, x[t], bh)
            out = np.einsum("hpn,hn->hp", h, ch)
            if use_d:
                out = out + d[:, None] * x[t]
            if use_z:
                out = out * z[t] / (1.0 + np.exp(-z[t]))
            y[t] = out
            seq_states.append(h)
        states.append(np.stack(seq_states))
    return y, states


SSD = jax.jit(
    ssd_varlen,
    static_argnames=("chunk_size", "dt_softplus", "dt_limit", "return_chunk_states", "impl"),
)
LAYOUT = jax.jit(build_chunk_layout, static_argnums=(1, 2))


def _run(inp, cu, *, chunk_size=CHUNK, init=None, starts=None, layout=None):
    return SSD(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], jnp.asarray(cu),
        chunk_size=chunk_size, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"],
        initial_states=init, start_positions=None if starts is None else jnp.asarray(starts),
        layout=layout, return_chunk_states=True,
    )  # fmt: skip


def _check_chunk_states(chunk_states, states, cu, chunk_size, starts):
    """Every used chunk's state equals the recurrence after exactly chunk_end tokens."""
    layout = build_chunk_layout(
        jnp.asarray(cu),
        int(cu[-1]) + PAD,
        chunk_size,
        None if starts is None else jnp.asarray(starts),
    )
    seqs, ends = np.asarray(layout.chunk_seq), np.asarray(layout.chunk_end)
    chunk_states = _f64(chunk_states)
    starts = np.zeros(len(cu) - 1, np.int64) if starts is None else starts
    checked = 0
    for c, (s, e) in enumerate(zip(seqs, ends, strict=True)):
        if s == len(cu) - 1:
            continue
        length = cu[s + 1] - cu[s]
        assert (starts[s] + e) % chunk_size == 0 or e == length  # absolute alignment
        np.testing.assert_allclose(chunk_states[c], states[s][e], rtol=STATE_TOL, atol=STATE_TOL)
        checked += 1
    assert checked > len(cu)  # some sequences span several chunks


@pytest.mark.parametrize(
    "dtype,groups,with_initial,unaligned",
    [
        (jnp.float32, 1, False, False),
        (jnp.float32, 2, True, True),
        (jnp.bfloat16, 4, True, False),
        (jnp.bfloat16, 1, False, True),
    ],
)
def test_ssd_matches_recurrence(dtype, groups, with_initial, unaligned):
    rng = np.random.default_rng(groups * 4 + with_initial * 2 + unaligned)
    inp = _inputs(rng, LENGTHS, heads=4, head_dim=10, groups=groups, state=12, dtype=dtype)
    cu = _cu(LENGTHS)
    init = inp["init"] if with_initial else None
    starts = rng.integers(0, 100, len(LENGTHS)).astype(np.int32) if unaligned else None
    # Unaligned cases also pass the layout in, as the model does (built once per forward).
    layout = (
        LAYOUT(jnp.asarray(cu), int(cu[-1]) + PAD, CHUNK, jnp.asarray(starts))
        if unaligned
        else None
    )
    y, final, chunk_states = _run(inp, cu, init=init, starts=starts, layout=layout)
    y_ref, states = _recurrence(inp, cu, init)

    real = cu[-1]
    assert y.dtype == dtype and final.dtype == jnp.float32
    np.testing.assert_allclose(_f64(y)[:real], y_ref[:real], rtol=TOL[dtype], atol=TOL[dtype])
    final_ref = np.stack([st[-1] for st in states])
    np.testing.assert_allclose(_f64(final), final_ref, rtol=STATE_TOL, atol=STATE_TOL)
    _check_chunk_states(chunk_states, states, cu, CHUNK, starts)


def test_ssd_head_dim_80_chunk_16():
    rng = np.random.default_rng(7)
    lengths = [15, 37, 0, 16, 17]
    inp = _inputs(rng, lengths, heads=4, head_dim=80, groups=2, state=12, dtype=jnp.float32)
    cu = _cu(lengths)
    starts = np.array([3, 0, 5, 16, 31], np.int32)
    y, final, chunk_states = _run(inp, cu, chunk_size=16, init=inp["init"], starts=starts)
    y_ref, states = _recurrence(inp, cu, inp["init"])
    tol = TOL[jnp.float32]
    np.testing.assert_allclose(_f64(y)[: cu[-1]], y_ref[: cu[-1]], rtol=tol, atol=tol)
    final_ref = np.stack([st[-1] for st in states])
    np.testing.assert_allclose(_f64(final), final_ref, rtol=STATE_TOL, atol=STATE_TOL)
    _check_chunk_states(chunk_states, states, cu, 16, starts)


def test_ssd_packed_matches_each_sequence_alone():
    rng = np.random.default_rng(8)
    lengths = [9, 0, 21, 4]
    inp = _inputs(rng, lengths, heads=4, head_dim=6, groups=2, state=10, dtype=jnp.float32, pad=3)
    cu = _cu(lengths)
    starts = np.array([5, 2, 9, 0], np.int32)
    y, final, _ = _run(inp, cu, init=inp["init"], starts=starts)
    host = {k: np.asarray(v) for k, v in inp.items()}
    alone_tokens = max(lengths) + 2  # one padded shape for every single-sequence call
    for s, n in enumerate(lengths):
        one = dict(host, init=host["init"][s : s + 1])
        for k in ("x", "dt", "B", "C", "z"):
            v = np.full((alone_tokens,) + host[k].shape[1:], np.nan, np.float32)
            v[:n] = host[k][cu[s] : cu[s + 1]]
            one[k] = v
        cu1 = np.array([0, n], np.int32)
        y1, final1, _ = _run(one, cu1, init=one["init"], starts=starts[s : s + 1])
        np.testing.assert_allclose(y[cu[s] : cu[s + 1]], y1[:n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(final[s], final1[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(final[1], inp["init"][1])  # empty sequence keeps its state


def test_ssd_without_optional_inputs_and_with_dt_limit():
    rng = np.random.default_rng(9)
    lengths = [11, 5]
    inp = _inputs(rng, lengths, heads=2, head_dim=10, groups=1, state=12, dtype=jnp.float32)
    cu = _cu(lengths)
    dt_limit = (0.05, 0.6)
    fn = jax.jit(
        lambda x, dt, A, B, C, cu, bias: ssd_varlen(
            x, dt, A, B, C, cu, chunk_size=CHUNK, dt_bias=bias, dt_limit=dt_limit
        )
    )
    y, final = fn(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], jnp.asarray(cu), inp["dt_bias"]
    )
    y_ref, states = _recurrence(inp, cu, None, dt_limit=dt_limit, use_d=False, use_z=False)
    tol = TOL[jnp.float32]
    np.testing.assert_allclose(_f64(y)[: cu[-1]], y_ref[: cu[-1]], rtol=tol, atol=tol)
    np.testing.assert_allclose(final, np.stack([st[-1] for st in states]), rtol=tol, atol=tol)


def test_chunk_layout_places_every_token_once_within_static_chunk_count():
    rng = np.random.default_rng(10)
    num_seqs, num_tokens = 6, 6 * (3 * 8 + 1) + 2
    for trial in range(24):
        chunk = (4, 8)[trial % 2]
        lengths = rng.integers(0, 3 * chunk + 2, num_seqs)
        lengths[rng.random(num_seqs) < 0.3] = 0
        # Starting one before a boundary is the worst case for the chunk count.
        starts = np.where(rng.random(num_seqs) < 0.5, chunk - 1, rng.integers(0, 50, num_seqs))
        cu = _cu(lengths)
        layout = LAYOUT(jnp.asarray(cu), num_tokens, chunk, jnp.asarray(starts, jnp.int32))
        layout = jax.tree.map(np.asarray, layout)
        idx, seq = layout.token_index, layout.chunk_seq
        assert idx.shape == (num_chunks(num_tokens, num_seqs, chunk), chunk)
        real = idx[idx < num_tokens]
        np.testing.assert_array_equal(np.sort(real), np.arange(cu[-1]), err_msg=f"trial {trial}")
        # Token r of sequence s sits at offset (start + r) % C; chunks never cross sequences.
        c, o = np.nonzero(idx < num_tokens)
        s = seq[c]
        assert np.all((cu[s] <= idx[c, o]) & (idx[c, o] < cu[s + 1]))
        np.testing.assert_array_equal((starts[s] + idx[c, o] - cu[s]) % chunk, o)
        first, last = layout.seq_first_chunk, layout.seq_last_chunk
        for s, n in enumerate(lengths):
            if n:
                assert layout.chunk_first[first[s]] and seq[first[s]] == seq[last[s]] == s
                assert layout.chunk_end[last[s]] == n
        assert layout.chunk_first.sum() == np.count_nonzero(lengths)


@pytest.mark.cpu_only
def test_ssd_dispatch_and_shape_errors():
    rng = np.random.default_rng(11)
    inp = _inputs(rng, [6, 13], heads=2, head_dim=4, groups=1, state=6, dtype=jnp.float32, pad=0)
    cu = jnp.asarray(_cu([6, 13]))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], cu)
    with pytest.raises(ValueError, match="CPU"):  # the kernels run on CPU via "interpret"
        ssd_varlen(*args, chunk_size=CHUNK, impl="pallas")
    with pytest.raises(ValueError, match="impl"):
        ssd_varlen(*args, chunk_size=CHUNK, impl="triton")
    with pytest.raises(ValueError, match=r"\(19, 3\)"):
        ssd_varlen(inp["x"], jnp.ones((19, 3)), *args[2:], chunk_size=CHUNK)
    with pytest.raises(ValueError, match="multiple of groups"):
        ssd_varlen(*args[:3], jnp.ones((19, 3, 6)), jnp.ones((19, 3, 6)), cu, chunk_size=CHUNK)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_varlen(*args, chunk_size=CHUNK, initial_states=jnp.ones((2, 2, 4, 5)))
    layout = LAYOUT(cu, 19, CHUNK, None)
    with pytest.raises(ValueError, match="chunk size"):
        ssd_varlen(*args, chunk_size=16, layout=layout)
