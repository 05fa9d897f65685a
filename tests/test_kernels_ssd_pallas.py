"""The Pallas SSD kernels (TPU kernel in TPU interpret mode, GPU kernel in interpret mode) against
a float64 numpy recurrence and against ssd_varlen_ref; export for TPU and CUDA on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from test_kernels_ssd import LENGTHS, PAD, _cu, _f64, _inputs, _recurrence

from jaxmamba.kernels import ColumnView, build_chunk_layout, ssd_varlen, ssd_varlen_ref
from jaxmamba.kernels.ssd.gpu import GpuBlockSizes, ssd_varlen_gpu
from jaxmamba.kernels.ssd.layout import tracked_requests
from jaxmamba.kernels.ssd.tpu import ssd_varlen_tpu

CHUNK = 8
# bf16 kernels feed the matmuls bf16 operands (the carried state too, for the inter-chunk
# term), as the Triton SSD kernels do; float32 runs at full precision.
Y_TOL = {jnp.float32: 2e-4, jnp.bfloat16: 3e-2}
STATE_TOL = {jnp.float32: 2e-4, jnp.bfloat16: 2e-2}

REF = jax.jit(ssd_varlen_ref, static_argnames=("chunk_size", "return_chunk_states"))
SSD = jax.jit(ssd_varlen, static_argnames=("chunk_size", "return_chunk_states", "impl"))
KERNELS = {
    "ref": REF,
    "tpu": functools.partial(ssd_varlen_tpu, interpret=True),  # pltpu.InterpretParams()
    "gpu": functools.partial(ssd_varlen_gpu, interpret=True),
    # Several head-dim and state slices in the state pass (the last state slice partly
    # masked when N is 12); several row blocks per chunk, 2 heads per output program.
    "gpu_blocks": functools.partial(
        ssd_varlen_gpu,
        interpret=True,
        block_sizes=GpuBlockSizes(state_block_p=4, state_block_n=8, out_block_m=4, out_heads=2),
    ),
}
GPU_VARIANTS = ["gpu", "gpu_blocks"]


def _call(kernel, inp, cu, *, chunk_size=CHUNK, init=None, starts=None, **kwargs):
    return KERNELS[kernel](
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], jnp.asarray(cu),
        chunk_size=chunk_size, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"],
        initial_states=init, start_positions=None if starts is None else jnp.asarray(starts),
        **kwargs,
    )  # fmt: skip


def _check_against_recurrence(out, inp, cu, init, starts, dtype, chunk_size=CHUNK):
    y, final, chunk_states = out
    y_ref, states = _recurrence(inp, cu, init)
    real = cu[-1]
    assert y.dtype == dtype and final.dtype == jnp.float32
    tol, stol = Y_TOL[dtype], STATE_TOL[dtype]
    np.testing.assert_allclose(_f64(y)[:real], y_ref[:real], rtol=tol, atol=tol)
    final_ref = np.stack([st[-1] for st in states])
    np.testing.assert_allclose(_f64(final), final_ref, rtol=stol, atol=stol)
    layout = build_chunk_layout(
        jnp.asarray(cu), int(cu[-1]) + PAD, chunk_size, None if starts is None else starts
    )
    seqs, ends = np.asarray(layout.chunk_seq), np.asarray(layout.chunk_end)
    for c, (s, e) in enumerate(zip(seqs, ends, strict=True)):
        if s < len(cu) - 1:
            np.testing.assert_allclose(_f64(chunk_states[c]), states[s][e], rtol=stol, atol=stol)


CASES = {
    # name: dtype, heads, head_dim, groups, state, with_initial, unaligned
    "f32_g1_aligned": (jnp.float32, 4, 10, 1, 12, False, False),
    "bf16_p80_g2_init_unaligned": (jnp.bfloat16, 4, 80, 2, 12, True, True),
    "f32_g4_init_unaligned": (jnp.float32, 4, 6, 4, 20, True, True),
    "f32_h6_g3_init_unaligned": (jnp.float32, 6, 10, 3, 12, True, True),  # heads not 2^k
}


@pytest.mark.parametrize(
    "kernel, case", [(kernel, case) for kernel in ["tpu", *GPU_VARIANTS] for case in CASES]
)
def test_kernel_matches_recurrence_over_odd_lengths(kernel, case):
    dtype, heads, head_dim, groups, state, with_initial, unaligned = CASES[case]
    rng = np.random.default_rng(list(CASES).index(case))
    inp = _inputs(rng, LENGTHS, heads, head_dim, groups, state, dtype)
    cu = _cu(LENGTHS)
    init = inp["init"] if with_initial else None
    starts = rng.integers(0, 100, len(LENGTHS)).astype(np.int32) if unaligned else None
    out = _call(kernel, inp, cu, init=init, starts=starts, return_chunk_states=True)
    _check_against_recurrence(out, inp, cu, init, starts, dtype)


@pytest.mark.parametrize("kernel", [*GPU_VARIANTS, "tpu"])
def test_kernel_matches_reference_with_state_chunks(kernel):
    """Chunk 16, P 80 split into P blocks, duplicate and unsorted requested chunks."""
    rng = np.random.default_rng(21)
    lengths = [15, 37, 0, 16, 17]
    inp = _inputs(rng, lengths, heads=4, head_dim=80, groups=2, state=12, dtype=jnp.float32)
    cu = _cu(lengths)
    starts = jnp.asarray([3, 0, 5, 16, 31], jnp.int32)
    wanted = jnp.asarray([5, 0, 5, 2, 7, 1], jnp.int32)  # 8 used chunks; unused ones are arbitrary
    kwargs = dict(chunk_size=16, init=inp["init"], starts=starts, state_chunks=wanted)
    y, final, tracked = _call(kernel, inp, cu, **kwargs)
    ref = REF(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], jnp.asarray(cu),
        chunk_size=16, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"],
        initial_states=inp["init"], start_positions=starts, return_chunk_states=True,
    )  # fmt: skip
    real = cu[-1]
    np.testing.assert_allclose(y[:real], ref[0][:real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, ref[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tracked, ref[2][wanted], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(final[2], inp["init"][2])  # empty sequence keeps its state
    # Negative requests count from the end, as the reference's indexing reads them.
    wanted = jnp.asarray([-8, 3, -8], jnp.int32)
    tracked = _call(kernel, inp, cu, **{**kwargs, "state_chunks": wanted})[2]
    np.testing.assert_allclose(tracked, ref[2][wanted], rtol=1e-5, atol=1e-5)
    none = _call(kernel, inp, cu, **{**kwargs, "state_chunks": jnp.zeros((0,), jnp.int32)})[2]
    assert none.shape == (0, *final.shape[1:])


def _column_views(inp):
    """x, B, C as column views of one array laid out as the conv output (x | B | C) between
    NaN columns, z and dt of another (NaN | z | NaN | dt | NaN), as the in_proj output holds
    them: a read of a wrong column is NaN or another operand's value."""

    def pack(parts):  # parts: arrays [T, ...] or widths of NaN columns
        t = inp["x"].shape[0]
        cols = [np.full((t, p), np.nan, np.float32) if isinstance(p, int)
                else np.asarray(p, np.float32).reshape(t, -1) for p in parts]  # fmt: skip
        wide = jnp.asarray(np.concatenate(cols, axis=1), inp["x"].dtype)
        views, start = [], 0
        for part, col in zip(parts, cols, strict=True):
            if not isinstance(part, int):
                views.append(ColumnView.of(wide, start, part.shape[1:]))
            start += col.shape[1]
        return views

    x, b, c = pack([3, inp["x"], inp["B"], inp["C"], 5])
    z, dt = pack([2, inp["z"], 7, inp["dt"], 1])
    return {**inp, "x": x, "B": b, "C": c, "z": z, "dt": dt}


def _assert_same_scan(ours, theirs, real):
    """Bit for bit: y over the real tokens, the final and the tracked states."""
    (y, final, tracked), (y_t, final_t, tracked_t) = ours, theirs
    np.testing.assert_array_equal(_f64(y)[:real], _f64(y_t)[:real])
    np.testing.assert_array_equal(final, final_t)
    np.testing.assert_array_equal(tracked, tracked_t)


def _view_case(case, seed, lengths=LENGTHS):
    """The case's inputs (NaN padding tokens), and a call of a kernel on them from unaligned
    starts with initial states and repeated tracked chunks."""
    dtype, heads, head_dim, groups, state, _, _ = CASES[case]
    inp = _inputs(np.random.default_rng(seed), lengths, heads, head_dim, groups, state, dtype)
    cu = _cu(lengths)
    starts = np.random.default_rng(seed).integers(0, 100, len(lengths)).astype(np.int32)
    layout = jax.jit(build_chunk_layout, static_argnums=(1, 2))(
        jnp.asarray(cu), int(cu[-1]) + PAD, CHUNK, jnp.asarray(starts)
    )
    # Every sequence's last chunk (an empty one's: the chunk before), and chunk 0 again.
    wanted = jnp.concatenate([layout.seq_last_chunk, jnp.zeros((1,), jnp.int32)])

    def call(kernel, arrays):
        return _call(kernel, arrays, cu, init=inp["init"], starts=starts, state_chunks=wanted)

    return inp, call


@pytest.mark.parametrize(
    "kernel, case",
    # P 80 in two pieces (64 + 16) a program; P 10 in 4-row blocks and N 12 in 8-row ones,
    # the last of each running past the operand's columns, masked.
    [("gpu", "bf16_p80_g2_init_unaligned"), ("gpu_blocks", "f32_h6_g3_init_unaligned")],
)
def test_gpu_kernels_read_column_views_in_place(kernel, case):
    """x, B, C, dt and z as columns of wider arrays whose other columns are NaN: the same
    outputs, bit for bit, as from separate arrays, and the reference's."""
    inp, call = _view_case(case, seed=3)
    views = _column_views(inp)
    ours = call(kernel, views)
    real = _cu(LENGTHS)[-1]
    _assert_same_scan(ours, call(kernel, inp), real)
    ref = call("ref", views)
    dtype = CASES[case][0]
    tol, stol = Y_TOL[dtype], STATE_TOL[dtype]
    np.testing.assert_allclose(_f64(ours[0])[:real], _f64(ref[0])[:real], rtol=tol, atol=tol)
    for state, state_ref in zip(ours[1:], ref[1:], strict=True):
        np.testing.assert_allclose(state, state_ref, rtol=stol, atol=stol)


def test_reference_and_tpu_kernel_take_column_views():
    """They slice the views: the same outputs, bit for bit, as from separate arrays."""
    lengths = [5, 0, 11]
    inp, call = _view_case("f32_h6_g3_init_unaligned", seed=4, lengths=lengths)
    views = _column_views(inp)
    real = _cu(lengths)[-1]
    for kernel in ("ref", "tpu"):
        _assert_same_scan(call(kernel, views), call(kernel, inp), real)


@pytest.mark.parametrize("kernel", GPU_VARIANTS)
def test_gpu_kernel_keeps_initial_states_of_an_all_empty_batch(kernel):
    rng = np.random.default_rng(22)
    lengths = [0, 0, 0]
    inp = _inputs(rng, lengths, heads=2, head_dim=4, groups=1, state=8, dtype=jnp.float32, pad=9)
    y, final = _call(kernel, inp, _cu(lengths), init=inp["init"])
    np.testing.assert_array_equal(final, inp["init"])
    assert y.shape == inp["x"].shape


@pytest.mark.cpu_only
def test_dispatch_interpret_runs_the_tpu_kernel_and_auto_is_the_reference_on_cpu():
    rng = np.random.default_rng(23)
    lengths = [5, 0, 11]
    inp = _inputs(rng, lengths, heads=2, head_dim=4, groups=1, state=8, dtype=jnp.float32)
    cu = jnp.asarray(_cu(lengths))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], cu)
    kwargs = dict(chunk_size=CHUNK, dt_bias=inp["dt_bias"], initial_states=inp["init"])
    ref = SSD(*args, **kwargs, impl="ref")
    auto = SSD(*args, **kwargs, impl="auto")
    interp = SSD(*args, **kwargs, impl="interpret")
    real = int(cu[-1])
    np.testing.assert_array_equal(auto[0][:real], ref[0][:real])
    np.testing.assert_allclose(interp[0][:real], ref[0][:real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(interp[1], ref[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        ssd_varlen(*args, **kwargs, return_chunk_states=True, state_chunks=cu[:2])


def test_16_bit_dots_under_16_run_the_reference_on_gpu_and_the_kernel_refuses_them():
    """Triton's 16-bit MMA needs tile edges of 16 (on an H100 the kernel compiled for a bf16
    chunk and state of 8 and returned wrong values): "auto" on a GPU (`auto_gpu` here) runs
    the reference for them, and the compiled GPU kernel refuses them by name."""
    rng = np.random.default_rng(29)
    lengths = [5, 11]
    inp = _inputs(rng, lengths, heads=2, head_dim=16, groups=1, state=8, dtype=jnp.bfloat16)
    cu = jnp.asarray(_cu(lengths))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], cu)
    kwargs = dict(chunk_size=CHUNK, dt_bias=inp["dt_bias"])
    ref = SSD(*args, **kwargs, impl="ref")
    auto_gpu = SSD(*args, **kwargs, impl="auto_gpu")  # the GPU kernel would not run on CPU
    real = int(cu[-1])
    np.testing.assert_array_equal(auto_gpu[0][:real], ref[0][:real])
    with pytest.raises(ValueError, match="16-bit dots need chunk_size and state size >= 16"):
        ssd_varlen(*args, **kwargs, impl="pallas_gpu")


# A P-block state pass (16 head-dim rows a program) and one head an output program, lowered
# to Triton on CPU beside the defaults.
P_BLOCKS = GpuBlockSizes(state_block_p=16, out_heads=1)


@pytest.mark.parametrize(
    "platform, block_sizes, triton_calls",
    # None: GpuBlockSizes.get_default (3 sequences x 8 heads: one 8-warp program a pair);
    # GpuBlockSizes(): the blocks for many sequences.
    [("tpu", None, 0), ("cuda", None, 3), ("cuda", GpuBlockSizes(), 3), ("cuda", P_BLOCKS, 3)],
)
def test_kernel_exports_for_tpu_and_cuda_on_cpu(platform, block_sizes, triton_calls):
    """Nemotron-Nano mixer shapes (P 80, N 128, chunk 128), bf16, initial and tracked states."""
    tokens, heads, head_dim, groups, state, seqs = 512, 8, 80, 2, 128, 3
    sds = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    kernel = (
        ssd_varlen_tpu
        if platform == "tpu"
        else functools.partial(ssd_varlen_gpu, block_sizes=block_sizes)
    )

    def step(x, dt, A, B, C, cu, D, z, bias, init, starts, wanted):
        return kernel(
            x, dt, A, B, C, cu, chunk_size=128, D=D, z=z, dt_bias=bias, initial_states=init,
            start_positions=starts, state_chunks=wanted,
        )  # fmt: skip

    # The Triton call is a custom call without a compatibility guarantee: allow it explicitly.
    checks = (
        []
        if platform == "tpu"
        else [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )
    exported = export.export(jax.jit(step), platforms=(platform,), disabled_checks=checks)(
        sds((tokens, heads, head_dim), bf16), sds((tokens, heads), bf16), sds((heads,), f32),
        sds((tokens, groups, state), bf16), sds((tokens, groups, state), bf16),
        sds((seqs + 1,), i32), sds((heads,), f32), sds((tokens, heads, head_dim), bf16),
        sds((heads,), f32), sds((seqs, heads, head_dim, state), f32), sds((seqs,), i32),
        sds((seqs,), i32),
    )  # fmt: skip
    assert exported.platforms == (platform,)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == triton_calls
    assert [o.shape for o in exported.out_avals] == [
        (tokens, heads, head_dim),
        (seqs, heads, head_dim, state),
        (seqs, heads, head_dim, state),
    ]


def test_tracked_requests_list_every_row_under_its_chunk():
    """Rows by chunk, as ``chunk_states[state_chunks]`` reads the indices: negative ones count
    from the end, out-of-range ones clamp, duplicates keep every row."""
    num_chunks = 6
    wanted = np.array([3, -1, 9, 0, 3, -9, 5, 3], np.int32)
    expected = np.clip(np.where(wanted < 0, wanted + num_chunks, wanted), 0, num_chunks - 1)
    req = tracked_requests(num_chunks, jnp.asarray(wanted), all_chunks=False)
    lo, hi, order = (np.asarray(a) for a in (req.lo, req.hi, req.order))
    assert req.num_rows == len(wanted)
    for chunk in range(num_chunks):
        rows = sorted(order[lo[chunk] : hi[chunk]].tolist())
        assert rows == np.flatnonzero(expected == chunk).tolist()
    every = tracked_requests(num_chunks, None, all_chunks=True)
    np.testing.assert_array_equal(np.asarray(every.hi) - np.asarray(every.lo), 1)
    none = tracked_requests(num_chunks, None, all_chunks=False)
    assert none.num_rows == 0 and not np.any(np.asarray(none.hi) > np.asarray(none.lo))
