"""causal_conv1d_varlen / causal_conv1d_update against a float64 numpy direct convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.kernels import ColumnView, causal_conv1d_update, causal_conv1d_varlen
from jaxmamba.kernels.conv1d import windows_at
from jaxmamba.kernels.conv1d.ref import final_and_tracked_states

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
LENGTHS = [1, 7, 0, 8, 9, 29, 0, 3]  # chunk-ish sizes 1, C-1, C, C+1, 3C+5 for C=8; empty rows
PAD = 5


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _f64(a):
    return np.asarray(a).astype(np.float64)  # host-side: no eager device ops


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(rng, lengths, dim, width, dtype, pad=PAD):
    num_tokens = sum(lengths) + pad
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    x[sum(lengths) :] = np.nan  # padding must never reach a real output
    weight = rng.standard_normal((width, dim)).astype(np.float32) / np.sqrt(width)
    bias = rng.standard_normal(dim).astype(np.float32)
    init = rng.standard_normal((len(lengths), width - 1, dim)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(weight), jnp.asarray(bias), jnp.asarray(init)


def _direct_conv(x, weight, bias, cu, init, activation, track_ends):
    """Per sequence: prepend the K-1 initial inputs, then a direct convolution."""
    x, weight, bias = _f64(x), _f64(weight), _f64(bias)
    width = weight.shape[0]
    y = np.full(x.shape, np.nan)
    finals, tracked = [], []
    for s in range(len(cu) - 1):
        start, end = cu[s], cu[s + 1]
        prev = np.zeros((width - 1, x.shape[1])) if init is None else _f64(init[s])
        inp = np.concatenate([prev, x[start:end]])
        for r in range(end - start):
            out = (inp[r : r + width] * weight).sum(0) + bias
            y[start + r] = _silu(out) if activation == "silu" else out
        finals.append(inp[end - start : end - start + width - 1])
        if track_ends is not None:
            tracked.append(inp[track_ends[s] : track_ends[s] + width - 1])
    return y, np.stack(finals), (np.stack(tracked) if tracked else None)


@pytest.mark.parametrize(
    "dtype,with_initial,width,activation",
    [
        (jnp.float32, True, 4, "silu"),
        (jnp.float32, False, 2, None),
        (jnp.bfloat16, True, 4, "silu"),
        (jnp.bfloat16, False, 3, "silu"),
    ],
)
def test_varlen_conv_matches_direct_convolution(dtype, with_initial, width, activation):
    rng = np.random.default_rng(width * 10 + with_initial)
    x, weight, bias, init = _inputs(rng, LENGTHS, 12, width, dtype)
    init = init if with_initial else None
    cu = _cu(LENGTHS)
    track_ends = np.array([rng.integers(0, n + 1) for n in LENGTHS], np.int32)
    track_ends[5] = 1  # inside the initial window: mixes state and tokens

    fn = jax.jit(
        lambda *a: causal_conv1d_varlen(
            *a[:4], initial_states=a[4], track_ends=a[5], activation=activation
        )
    )
    y, final, tracked = fn(x, weight, bias, jnp.asarray(cu), init, jnp.asarray(track_ends))
    y_ref, final_ref, tracked_ref = _direct_conv(x, weight, bias, cu, init, activation, track_ends)

    real = cu[-1]
    assert y.dtype == dtype and final.dtype == jnp.float32
    np.testing.assert_allclose(_f64(y)[:real], y_ref[:real], rtol=TOL[dtype], atol=TOL[dtype])
    # States are copies of inputs: exact.
    np.testing.assert_array_equal(_f64(final), final_ref)
    np.testing.assert_array_equal(_f64(tracked), tracked_ref)


def test_varlen_conv_packed_matches_each_sequence_alone():
    rng = np.random.default_rng(1)
    lengths = [5, 0, 13, 2]
    x, weight, bias, init = _inputs(rng, lengths, 10, 4, jnp.float32, pad=3)
    cu = _cu(lengths)
    fn = jax.jit(lambda *a: causal_conv1d_varlen(*a[:4], initial_states=a[4]))
    y, final, tracked = fn(x, weight, bias, jnp.asarray(cu), init)
    assert tracked is None
    x_np, init_np = np.asarray(x), np.asarray(init)
    for s, n in enumerate(lengths):
        one = jnp.asarray([0, n], jnp.int32)
        y1, final1, _ = fn(x_np[cu[s] : cu[s + 1]], weight, bias, one, init_np[s : s + 1])
        np.testing.assert_allclose(y[cu[s] : cu[s + 1]], y1, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(final[s], final1[0])
    np.testing.assert_array_equal(final[1], init[1])  # empty sequence keeps its state


@pytest.mark.parametrize(
    "dtype,state_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16)]
)
def test_conv_update_matches_direct_window(dtype, state_dtype):
    rng = np.random.default_rng(2)
    width, dim, num_slots = 4, 12, 6
    pool = rng.standard_normal((num_slots + 1, width - 1, dim)).astype(np.float32)
    pool[-1] = np.nan  # the pad slot
    pool = jnp.asarray(pool, state_dtype)
    slots = np.array([3, 6, 0, 5, 6], np.int32)  # two pad rows share the pad slot
    x = rng.standard_normal((5, dim)).astype(np.float32)
    x[slots == num_slots] = np.nan
    x = jnp.asarray(x, dtype)
    weight = jnp.asarray(rng.standard_normal((width, dim)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(dim), jnp.float32)

    y, new_pool = jax.jit(causal_conv1d_update)(pool, x, weight, bias, jnp.asarray(slots))
    assert y.dtype == dtype and new_pool.dtype == state_dtype
    tol = TOL[dtype]
    for b, slot in enumerate(slots):
        if slot == num_slots:
            continue
        window = np.concatenate([_f64(pool[slot]), _f64(x[b])[None]])
        ref = _silu((window * _f64(weight)).sum(0) + _f64(bias))
        np.testing.assert_allclose(_f64(y[b]), ref, rtol=tol, atol=tol)
        np.testing.assert_array_equal(_f64(new_pool[slot]), window[1:])
    untouched = np.array([s for s in range(num_slots) if s not in slots])
    np.testing.assert_array_equal(_f64(new_pool[untouched]), _f64(pool[untouched]))


def test_decode_update_continues_varlen_prefill():
    rng = np.random.default_rng(3)
    lengths = [6, 1, 11]
    x, weight, bias, init = _inputs(rng, lengths, 10, 4, jnp.float32, pad=0)
    cu = _cu(lengths)
    nxt = rng.standard_normal((3, 10)).astype(np.float32)
    varlen = jax.jit(lambda *a: causal_conv1d_varlen(*a[:4], initial_states=a[4]))
    _, final, _ = varlen(x, weight, bias, jnp.asarray(cu), init)
    y_dec, new_states = jax.jit(causal_conv1d_update)(
        final, jnp.asarray(nxt), weight, bias, jnp.arange(3)
    )

    # The same sequences, one token longer, in a single varlen call.
    x_np = np.asarray(x)
    longer = np.concatenate(
        [np.concatenate([x_np[cu[s] : cu[s + 1]], nxt[s : s + 1]]) for s in range(3)]
    )
    cu2 = _cu([n + 1 for n in lengths])
    y2, final2, _ = varlen(jnp.asarray(longer), weight, bias, jnp.asarray(cu2), init)
    np.testing.assert_allclose(y_dec, y2[cu2[1:] - 1], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_states, final2)


@pytest.mark.cpu_only
def test_conv_impl_dispatch_and_shape_errors():
    rng = np.random.default_rng(4)
    x, weight, bias, _ = _inputs(rng, [4], 6, 4, jnp.float32, pad=0)
    cu = jnp.asarray([0, 4], jnp.int32)
    run = jax.jit(causal_conv1d_varlen, static_argnames="impl")
    np.testing.assert_array_equal(
        run(x, weight, bias, cu, impl="ref")[0], run(x, weight, bias, cu)[0]
    )
    with pytest.raises(ValueError, match="CPU"):  # the kernels run on CPU via "interpret"
        causal_conv1d_varlen(x, weight, bias, cu, impl="pallas")
    with pytest.raises(ValueError, match="impl"):
        causal_conv1d_varlen(x, weight, bias, cu, impl="cuda")
    with pytest.raises(ValueError, match=r"\(4, 7\)"):
        causal_conv1d_varlen(x, jnp.zeros((4, 7)), bias, cu)
    with pytest.raises(ValueError, match="initial_states"):
        causal_conv1d_varlen(x, weight, bias, cu, initial_states=jnp.ones((1, 2, 6)))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(jnp.ones((3, 2, 6)), x[:2], weight, bias, jnp.asarray([0, 1]))


def test_conv_windows_read_a_column_view_as_its_slice():
    """The checkpoint windows (gathers of whole rows of the wide array, then the view's
    columns) equal those of the sliced array; the other columns are NaN."""
    rng = np.random.default_rng(5)
    lengths = [5, 0, 13, 2]
    x, _, _, init = _inputs(rng, lengths, 10, 4, jnp.float32, pad=3)
    nan = np.full((x.shape[0], 3), np.nan, np.float32)
    view = ColumnView.of(jnp.asarray(np.concatenate([nan, x, nan], 1)), 3, (10,))
    np.testing.assert_array_equal(view.materialize(), x)
    cu = jnp.asarray(_cu(lengths))
    seqs, ends = jnp.asarray([0, 2, 2, 1, 3]), jnp.asarray([2, 13, 0, 0, 1])
    track = jnp.asarray([5, 0, 7, 1])

    @jax.jit
    def windows(a):  # the checkpoint windows, the final and the tracked ones
        final, tracked = final_and_tracked_states(a, init, cu, track, 3)
        return windows_at(a, init, cu, seqs, ends, 3), final, tracked

    for ours, theirs in zip(windows(view), windows(x), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_column_views_that_do_not_fit_are_rejected():
    wide = jnp.zeros((4, 20), jnp.float32)
    with pytest.raises(ValueError, match=r"W >= 24"):
        ColumnView.of(wide, 8, (2, 8))
    with pytest.raises(ValueError, match=r"\[T, W\] array"):
        ColumnView.of(jnp.zeros((4, 2, 10)), 0, (10,))
    with pytest.raises(ValueError, match=r"weight \(4, 6\)"):  # 8 columns, 6 channels
        causal_conv1d_varlen(
            ColumnView.of(wide, 2, (8,)), jnp.ones((4, 6)), None, jnp.asarray([0, 4], jnp.int32)
        )
