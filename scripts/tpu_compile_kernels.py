"""Compile the Mosaic TPU kernels with the real TPU compiler (libtpu), without a TPU.

Run it with the python that ``scripts/setup_tpu_venv.sh`` prints: a venv with ``jax[tpu]`` at
this project's jax version and this checkout installed (the kernels come from
``jaxmamba.kernels``). Prints one ``OK <case>`` line per kernel and exits non-zero on the
first failure. Shapes: Nemotron-Nano-9B-v2's Mamba layer (H 128, P 80, G 8, N 128,
conv_dim 12288, K 4), bf16 activations, fp32 SSM state, bf16 conv state; its attention layer
(40 query / 8 KV heads of 128) over a bf16 paged cache of 16-token pages; Qwen3-Next's Gated
DeltaNet layer (16 key / 32 value heads of 128, chunk 64), bf16 activations, fp32 state.

    TPU_PYTHON=$(scripts/setup_tpu_venv.sh .venv/bin/python)
    $TPU_PYTHON scripts/tpu_compile_kernels.py [--topology v6e:2x2]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmamba.kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    paged_attention,
    selective_state_update,
)
from jaxmamba.kernels.gdn import gdn_decode, gdn_prefill

H, P, G, N, DIM, K = 128, 80, 8, 128, 12288, 4
HQ, HKV, DH, PAGE, MAX_PAGES = 40, 8, 128, 16, 256
HK, HV, DK, DV, GDN_CHUNK = 16, 32, 128, 128, 64
ACT, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def cases(slots: int, rows: int, tokens: int, seqs: int):
    """(name, fn, donate_argnums, arg shapes/dtypes) for every TPU kernel of this file's ops."""
    ssu = functools.partial(selective_state_update, dt_softplus=True, impl="pallas_tpu")
    yield (
        "selective_state_update",
        lambda st, x, dt, a, b, c, s, d, z, bias: ssu(
            st, x, dt, a, b, c, s, D=d, z=z, dt_bias=bias
        ),
        (0,),
        [((slots, H, P, N), F32), ((rows, H, P), ACT), ((rows, H), ACT), ((H,), F32)]
        + [((rows, G, N), ACT)] * 2
        + [((rows,), I32), ((H,), F32), ((rows, H, P), ACT), ((H,), F32)],
    )
    yield (
        "causal_conv1d_update",
        lambda st, x, w, b, s: causal_conv1d_update(st, x, w, b, s, impl="pallas_tpu"),
        (0,),
        [((slots, K - 1, DIM), ACT), ((rows, DIM), ACT), ((K, DIM), ACT), ((DIM,), ACT)]
        + [((rows,), I32)],
    )
    yield (
        "causal_conv1d_varlen",
        lambda x, w, b, cu, init, te: causal_conv1d_varlen(
            x, w, b, cu, initial_states=init, track_ends=te, impl="pallas_tpu"
        ),
        (),
        [((tokens, DIM), ACT), ((K, DIM), ACT), ((DIM,), ACT), ((seqs + 1,), I32)]
        + [((seqs, K - 1, DIM), ACT), ((seqs,), I32)],
    )
    attend = functools.partial(paged_attention, scale=DH**-0.5, impl="pallas_tpu")
    pages = ((rows * MAX_PAGES + 1, PAGE, HKV, DH), ACT)
    for name, num_tokens, num_rows in (("prefill", tokens, seqs), ("decode", rows, rows)):
        yield (
            f"paged_attention_{name}",
            attend,
            (),
            [((num_tokens, HQ, DH), ACT), pages, pages, ((num_rows, MAX_PAGES), I32)]
            + [((num_tokens,), I32)] * 2,
        )
    yield (
        "gdn_prefill",
        lambda q, k, v, g, beta, cu, init, starts, wanted: gdn_prefill(
            q, k, v, g, beta, cu, chunk_size=GDN_CHUNK, initial_states=init,
            start_positions=starts, state_chunks=wanted, impl="pallas_tpu",
        ),
        (),
        [((tokens, HK, DK), ACT)] * 2 + [((tokens, HV, DV), ACT)] + [((tokens, HV), F32)] * 2
        + [((seqs + 1,), I32), ((seqs, HV, DK, DV), F32), ((seqs,), I32), ((seqs,), I32)],
    )  # fmt: skip
    yield (
        "gdn_decode",
        lambda st, q, k, v, a, b, a_log, bias, s: gdn_decode(
            st, q, k, v, a, b, a_log, bias, s, impl="pallas_tpu"
        ),
        (0,),
        [((slots, HV, DK, DV), F32)] + [((rows, HK, DK), ACT)] * 2 + [((rows, HV, DV), ACT)]
        + [((rows, HV), ACT)] * 2 + [((HV,), F32)] * 2 + [((rows,), I32)],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", default="v6e:2x2")
    args = parser.parse_args()
    topo = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    device = topo.devices[0]
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    print(f"topology {args.topology}: {len(topo.devices)} x {device.device_kind}")
    for name, fn, donate, shapes in cases(slots=257, rows=256, tokens=2048, seqs=8):
        specs = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
        compiled = jax.jit(fn, donate_argnums=donate).lower(*specs).compile()
        text = compiled.as_text() or ""
        assert "custom-call" in text or "tpu_custom_call" in text, f"{name}: no Mosaic kernel"
        mem = compiled.memory_analysis()
        extra = f" temp {mem.temp_size_in_bytes >> 20} MiB" if mem is not None else ""
        print(f"OK {name}{extra}", flush=True)


if __name__ == "__main__":
    main()
