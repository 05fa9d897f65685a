"""Benchmark the Gated DeltaNet kernels on one GPU against flash-linear-attention's Triton
kernels (the `fla-core` wheel), at Qwen3-Next's per-layer shapes: 16 key heads, 32 value
heads, head dims 128, chunk 64; bf16 q/k/v, float32 state.

* prefill ``1x8192`` and ``8x4096`` (initial states, half of them zero): our ``gdn_prefill``
  (Pallas) and the XLA reference against fla's ``chunk_gated_delta_rule`` (varlen, initial and
  final states, q/k L2 norm in the kernel). Roofline: q, k, v, g, beta read once, o written
  once, the states read and written once, or the chunked form's FLOPs at peak.
* decode batch ``1``, ``64``, ``256``: our ``gdn_decode`` (gating, q/k norms and the update in
  one kernel, in place on a slot pool) against fla's ``fused_recurrent_gated_delta_rule``
  with the gate and the beta sigmoid in the kernel, a step per launch, captured in one CUDA
  graph. Roofline: the state read and written once (2 MiB a row), plus q, k, v, a, b and o.

Every kernel's outputs are checked against the XLA reference before it is timed.

    PYTHONPATH=$PWD/.fla python scripts/bench_gdn.py [--cases ...] [--reps 30]
    python scripts/bench_gdn.py --smoke        # CPU: interpret mode, toy shapes

fla is not part of this repo: unpack ``fla/`` from the ``fla-core`` wheel (and ``einops/``
from its wheel) into the ignored folder ``.fla`` and carry it. Timing method: see
``bench_common.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.kernels.gdn import gdn_decode, gdn_gating, gdn_prefill


class GdnShapes(NamedTuple):
    key_heads: int  # Hk
    value_heads: int  # HV
    key_dim: int  # Dk
    value_dim: int  # Dv
    chunk: int  # C


QWEN3_NEXT = GdnShapes(16, 32, 128, 128, 64)
SMOKE = GdnShapes(2, 4, 16, 32, 16)
# Steps a decode program: enough distinct slots that the states do not sit in L2 (60 MB).
STEPS = {1: 64, 64: 4, 256: 2}


def shapes(args) -> GdnShapes:
    return SMOKE if args.smoke else QWEN3_NEXT


@functools.cache
def fla_ops():
    """fla's two kernels, or None (saying why) without fla on PYTHONPATH or a CUDA device."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError as e:
        print(f"fla not importable ({e}); timing ours and XLA's only")
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def gate_params(s: GdnShapes, rng) -> tuple[np.ndarray, np.ndarray]:
    a_log = np.log(rng.uniform(1.0, 16.0, s.value_heads)).astype(np.float32)
    dt_bias = rng.standard_normal(s.value_heads).astype(np.float32)
    return a_log, dt_bias


# --------------------------------------------------------------------------- prefill


def prefill_roofline(s: GdnShapes, tokens: int, seqs: int) -> float:
    io = tokens * (2 * s.key_heads * s.key_dim + 2 * s.value_heads * s.value_dim) * 2
    io += tokens * s.value_heads * 2 * 4  # g, beta
    io += 2 * seqs * s.value_heads * s.key_dim * s.value_dim * 4  # initial and final states
    per_head = s.chunk * (3 * s.key_dim + 2 * s.value_dim) + 3 * s.key_dim * s.value_dim
    return bc.roofline(io, 2.0 * tokens * s.value_heads * per_head)


def run_prefill(seqs: int, length: int, args, table: bc.Table) -> None:
    s = shapes(args)
    if args.smoke:
        length = min(length, 40)
    tokens = seqs * length
    case = f"prefill {seqs}x{length}"
    print(f"\n{case} (Hk {s.key_heads}, HV {s.value_heads}, Dk {s.key_dim}, Dv {s.value_dim})")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((tokens, s.key_heads, s.key_dim)).astype(np.float32)
    k = rng.standard_normal((tokens, s.key_heads, s.key_dim)).astype(np.float32)
    v = rng.standard_normal((tokens, s.value_heads, s.value_dim)).astype(np.float32)
    a = rng.standard_normal((tokens, s.value_heads)).astype(np.float32)
    b = rng.standard_normal((tokens, s.value_heads)).astype(np.float32)
    a_log, dt_bias = gate_params(s, rng)
    g, beta = (np.asarray(x) for x in gdn_gating(a, b, a_log, dt_bias))
    beta = np.asarray(jnp.asarray(beta, bc.ACT).astype(jnp.float32))  # fla's beta is bf16
    init = 0.1 * rng.standard_normal((seqs, s.value_heads, s.key_dim, s.value_dim))
    init[::2] = 0.0
    init = init.astype(np.float32)
    cu = np.arange(seqs + 1, dtype=np.int32) * length
    qd, kd, vd = (jnp.asarray(x, bc.ACT) for x in (q, k, v))
    args_dev = (qd, kd, vd, jnp.asarray(g), jnp.asarray(beta), jnp.asarray(cu))

    def program(impl):
        fn = functools.partial(gdn_prefill, chunk_size=s.chunk, impl=impl)
        return jax.jit(lambda q, k, v, g, beta, cu, init: fn(q, k, v, g, beta, cu,
                                                              initial_states=init))  # fmt: skip

    init_dev = jnp.asarray(init)
    ours, ref = program(bc.kernel_impl(args)), program("ref")
    want_o, want_final = ref(*args_dev, init_dev)
    got_o, got_final = ours(*args_dev, init_dev)
    bc.check(f"{case} o", got_o, want_o, 2e-2)
    bc.check(f"{case} final states", got_final, want_final, 1e-2)
    row = bc.Row(
        case,
        ours=bc.median_time(lambda: ours(*args_dev, init_dev), args.reps),
        xla=bc.median_time(lambda: ref(*args_dev, init_dev), args.reps),
        roof=prefill_roofline(s, tokens, seqs),
    )
    ops = fla_ops()
    if ops is not None and not args.smoke:
        want = (np.asarray(want_o), np.asarray(want_final))
        row.peer = fla_prefill_time(ops[0], (q, k, v, g, beta, cu, init), s, want, args.reps)
    table.add(row)


def fla_prefill_time(chunk_fn, host, s: GdnShapes, want, reps: int) -> float:
    import torch

    q, k, v, g, beta, cu, init = host
    t = lambda x, dt=None: bc.to_torch(x, dt)  # noqa: E731
    args = (t(q, torch.bfloat16)[None], t(k, torch.bfloat16)[None], t(v, torch.bfloat16)[None],
            t(g)[None], t(beta, torch.bfloat16)[None])  # fmt: skip
    cu_t = torch.from_numpy(cu).long().cuda()
    kw = dict(scale=s.key_dim**-0.5, initial_state=t(init), output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)  # fmt: skip

    def call():
        return chunk_fn(*args, **kw)

    o, final = call()
    torch.cuda.synchronize()
    bc.check("fla o", o[0].float().cpu().numpy(), want[0], 2e-2)
    bc.check("fla final states", final.float().cpu().numpy(), want[1], 1e-2)
    seconds = bc.torch_time(call, reps)
    print(f"  fla chunk_gated_delta_rule: {seconds * 1e6:.1f} us")
    return seconds


# --------------------------------------------------------------------------- decode


def decode_roofline(s: GdnShapes, rows: int) -> float:
    state = s.value_heads * s.key_dim * s.value_dim * 4
    io = (2 * s.key_heads * s.key_dim + 2 * s.value_heads * s.value_dim) * 2
    io += 2 * s.value_heads * 2  # a, b
    return bc.roofline(rows * (2 * state + io))


def run_decode(rows: int, args, table: bc.Table) -> None:
    s = shapes(args)
    steps = STEPS[rows] if not args.smoke else 2
    case = f"decode b{rows}"
    print(f"\n{case} ({steps} steps a program)")
    rng = np.random.default_rng(1)
    slots_total = rows * steps
    pool = 0.1 * rng.standard_normal((slots_total + 1, s.value_heads, s.key_dim, s.value_dim))
    pools = bc.Pools(pool.astype(np.float32), jnp.float32)
    a_log, dt_bias = (jnp.asarray(x) for x in gate_params(s, rng))

    def per_row(*shape, dtype=bc.ACT):
        return jnp.asarray(rng.standard_normal((rows, *shape)), dtype)

    inputs = []
    for i in range(steps):
        slots = jnp.asarray(np.arange(i * rows, (i + 1) * rows, dtype=np.int32))
        inputs.append((per_row(s.key_heads, s.key_dim), per_row(s.key_heads, s.key_dim),
                       per_row(s.value_heads, s.value_dim), per_row(s.value_heads),
                       per_row(s.value_heads), slots))  # fmt: skip

    def step_op(impl="ref", kernel=None):
        def op(pool, q, k, v, a, b, slots):
            if kernel is not None:
                return kernel(pool, q, k, v, a, b, a_log, dt_bias, slots, scale=s.key_dim**-0.5,
                              use_qk_l2norm=True)  # fmt: skip
            return gdn_decode(pool, q, k, v, a, b, a_log, dt_bias, slots, impl=impl)

        return op

    want = decode_program_outputs(step_op("ref"), pools, inputs)

    def checked(name, program):
        _, ys = program(pools.fresh(), inputs)
        bc.check(f"{case} {name} o", np.stack([np.asarray(y, np.float32) for y in ys]), want[0],
                 2e-2)  # fmt: skip

    roof = decode_roofline(s, rows)
    row, busy = bc.time_decode(case, step_op, checked, pools, inputs, args=args,
                               max_calls=256, roof=roof, variants={})  # fmt: skip
    ops = fla_ops()
    if ops is not None and not args.smoke:
        row.peer = fla_decode_time(ops[1], pool, inputs, (a_log, dt_bias), s, want, args.reps)
    table.add(row, busy)


def decode_program_outputs(op, pools: bc.Pools, inputs):
    program = bc.decode_program(op)
    pool, ys = program(pools.fresh(), inputs)
    return np.stack([np.asarray(y, np.float32) for y in ys]), np.asarray(pool)


def fla_decode_time(recurrent_fn, pool, inputs, gate, s: GdnShapes, want, reps: int) -> float:
    """fla's fused recurrent kernel a step, each step's rows reading their own states (a
    gathered ``[B, HV, K, V]`` tensor) and writing final states, the gate and the beta
    sigmoid in the kernel."""
    import torch

    a_log, dt_bias = (bc.to_torch(np.asarray(x)) for x in gate)
    steps = []
    for q, k, v, a, b, slots in inputs:
        rows = q.shape[0]
        t = lambda x: bc.to_torch(np.asarray(x, np.float32), torch.bfloat16)[None]  # noqa: E731
        state = bc.to_torch(pool[np.asarray(slots)])
        cu = torch.arange(rows + 1, device="cuda", dtype=torch.long)
        steps.append(dict(q=t(q), k=t(k), v=t(v), g=bc.to_torch(np.asarray(a))[None],
                          beta=t(b), initial_state=state, cu_seqlens=cu))  # fmt: skip

    def step(i):
        o, _ = recurrent_fn(**steps[i], scale=s.key_dim**-0.5, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)  # fmt: skip
        return o[0]

    return bc.sglang_steps_time("decode", step, len(steps), reps, want[0][0], peer="fla")


CASES = {
    "prefill_1x8192": functools.partial(run_prefill, 1, 8192),
    "prefill_8x4096": functools.partial(run_prefill, 8, 4096),
    "decode_1": functools.partial(run_decode, 1),
    "decode_64": functools.partial(run_decode, 64),
    "decode_256": functools.partial(run_decode, 256),
}

if __name__ == "__main__":
    bc.main_for(__doc__, CASES, peer="fla")
