"""selective_state_update against a float64 numpy recurrence step, and against ssd_varlen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import selective_state_update, ssd_varlen

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
NUM_SLOTS = 6  # + 1 pad slot
SLOTS = np.array([4, 6, 0, 2, 6], np.int32)  # two pad rows share the pad slot (6)

UPDATE = jax.jit(selective_state_update, static_argnames=("dt_softplus", "dt_limit", "impl"))


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _softplus(v):
    return np.log1p(np.exp(-np.abs(v))) + np.maximum(v, 0.0)


def _inputs(rng, rows, heads, head_dim, groups, state, dtype, state_dtype):
    pool = rng.standard_normal((NUM_SLOTS + 1, heads, head_dim, state)).astype(np.float32)
    pool[-1] = np.nan
    pad = SLOTS[:rows] == NUM_SLOTS

    def row(*shape, scale=1.0):
        a = (scale * rng.standard_normal((rows,) + shape)).astype(np.float32)
        a[pad] = np.nan
        return jnp.asarray(a, dtype)

    return dict(
        state=jnp.asarray(pool, state_dtype),
        x=row(heads, head_dim),
        dt=row(heads),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, heads)), jnp.float32),
        B=row(groups, state, scale=0.5),
        C=row(groups, state, scale=0.5),
        D=jnp.asarray(rng.standard_normal(heads), jnp.float32),
        z=row(heads, head_dim),
        dt_bias=jnp.asarray(rng.uniform(-2.0, 0.0, heads), jnp.float32),
    )


@pytest.mark.parametrize(
    "dtype,state_dtype,groups,head_dim",
    [
        (jnp.float32, jnp.float32, 1, 10),
        (jnp.float32, jnp.float32, 2, 80),
        (jnp.bfloat16, jnp.float32, 4, 10),
        (jnp.bfloat16, jnp.bfloat16, 2, 10),
    ],
)
def test_state_update_matches_recurrence_step(dtype, state_dtype, groups, head_dim):
    rng = np.random.default_rng(groups + head_dim)
    heads, state = 4, 12
    inp = _inputs(rng, len(SLOTS), heads, head_dim, groups, state, dtype, state_dtype)
    y, new_pool = UPDATE(
        inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], jnp.asarray(SLOTS),
        D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"],
    )  # fmt: skip
    assert y.dtype == dtype and new_pool.dtype == state_dtype

    pool, x, dt, b, c, z = (_f64(inp[k]) for k in ("state", "x", "dt", "B", "C", "z"))
    a, d, bias = _f64(inp["A"]), _f64(inp["D"]), _f64(inp["dt_bias"])
    rep = heads // groups
    tol = max(TOL[dtype], TOL[state_dtype])
    for r, slot in enumerate(SLOTS):
        if slot == NUM_SLOTS:
            continue
        step = _softplus(dt[r] + bias)
        h = np.exp(step * a)[:, None, None] * pool[slot] + np.einsum(
            "h,hp,hn->hpn", step, x[r], np.repeat(b[r], rep, 0)
        )
        out = np.einsum("hpn,hn->hp", h, np.repeat(c[r], rep, 0)) + d[:, None] * x[r]
        out = out * z[r] / (1.0 + np.exp(-z[r]))
        np.testing.assert_allclose(_f64(y[r]), out, rtol=tol, atol=tol)
        np.testing.assert_allclose(_f64(new_pool[slot]), h, rtol=tol, atol=tol)
    untouched = np.setdiff1d(np.arange(NUM_SLOTS), SLOTS)
    np.testing.assert_array_equal(_f64(new_pool)[untouched], pool[untouched])


def test_decode_steps_continue_ssd_prefill():
    """Prefill n tokens with ssd_varlen, then decode 3 tokens: same as prefilling n + 3."""
    rng = np.random.default_rng(5)
    heads, head_dim, groups, state, chunk = 4, 6, 2, 8, 8
    lengths = np.array([5, 11], np.int32)
    steps = 3
    total = int(lengths.sum()) + steps * len(lengths)
    a = jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, heads)), jnp.float32)
    d = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    bias = jnp.asarray(rng.uniform(-2.0, 0.0, heads), jnp.float32)
    full = dict(
        x=rng.standard_normal((total, heads, head_dim)),
        dt=rng.standard_normal((total, heads)),
        B=0.5 * rng.standard_normal((total, groups, state)),
        C=0.5 * rng.standard_normal((total, groups, state)),
        z=rng.standard_normal((total, heads, head_dim)),
    )
    full = {k: v.astype(np.float32) for k, v in full.items()}
    ssd = jax.jit(ssd_varlen, static_argnames=("chunk_size",))

    def ssd_run(arrays, cu):
        return ssd(
            *(jnp.asarray(arrays[k]) for k in ("x", "dt")), a,
            *(jnp.asarray(arrays[k]) for k in ("B", "C")), jnp.asarray(cu, jnp.int32),
            chunk_size=chunk, D=d, z=jnp.asarray(arrays["z"]), dt_bias=bias,
        )  # fmt: skip

    long_lengths = lengths + steps
    cu_long = np.concatenate([[0], np.cumsum(long_lengths)])
    y_long, final_long = ssd_run(full, cu_long)

    # Same tokens: prefix of each sequence prefilled, then decoded one token per step.
    prefix_idx = np.concatenate(
        [np.arange(cu_long[s], cu_long[s] + n) for s, n in enumerate(lengths)]
    )
    # Padded to the same token count (NaN tail) so both prefills share one compilation.
    prefix = {k: np.full_like(v, np.nan) for k, v in full.items()}
    for k, v in full.items():
        prefix[k][: len(prefix_idx)] = v[prefix_idx]
    _, pool = ssd_run(prefix, np.concatenate([[0], np.cumsum(lengths)]))
    pool = jnp.concatenate([pool, jnp.full((1,) + pool.shape[1:], jnp.nan)])  # + pad slot
    slots = jnp.asarray([1, 0, 2], jnp.int32)  # rows: seq 1, seq 0, a pad row
    for step in range(steps):
        idx = np.array([cu_long[1] + lengths[1] + step, cu_long[0] + lengths[0] + step, 0])
        tok = {k: v[idx] for k, v in full.items()}
        y_dec, pool = UPDATE(
            pool, *(jnp.asarray(tok[k]) for k in ("x", "dt")), a,
            *(jnp.asarray(tok[k]) for k in ("B", "C")), slots,
            D=d, z=jnp.asarray(tok["z"]), dt_bias=bias,
        )  # fmt: skip
        np.testing.assert_allclose(y_dec[:2], np.asarray(y_long)[idx[:2]], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pool[:2], final_long, rtol=1e-4, atol=1e-4)


@pytest.mark.cpu_only
def test_state_update_dispatch_and_shape_errors():
    rng = np.random.default_rng(6)
    inp = _inputs(rng, 5, 4, 10, 2, 12, jnp.float32, jnp.float32)
    args = [inp[k] for k in ("state", "x", "dt", "A", "B", "C")] + [jnp.asarray(SLOTS)]
    with pytest.raises(ValueError, match="CPU"):  # the kernels run on CPU via "interpret"
        selective_state_update(*args, impl="pallas")
    with pytest.raises(ValueError, match=r"\(5, 3\)"):
        selective_state_update(*args[:2], jnp.ones((5, 3)), *args[3:])
    with pytest.raises(ValueError, match="H % G"):
        selective_state_update(*args[:4], jnp.ones((5, 3, 12)), jnp.ones((5, 3, 12)), args[6])
    with pytest.raises(ValueError, match="slots"):
        selective_state_update(*args[:6], jnp.asarray([0, 1]))
