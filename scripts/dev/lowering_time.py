"""Seconds to trace and lower (`jax.export`) a model's step per bucket for a platform, with
how many Pallas kernels were traced and lowered (Triton or Mosaic) on the way. Needs no
device of the platform (jax 0.10.2; with 0.11 the Pallas GPU lowering asks for a GPU).

    python scripts/dev/lowering_time.py --model nemotron-nano-9b-v2 --platform cuda \\
        --buckets 1x1x1 32x32x32 256x256x256 512x72x64 512x8x0

The kernel counts patch two private JAX functions (`_trace_kernel_to_jaxpr` and the
platform's lowering entry), so they read zero where a JAX version renamed them.
"""

from __future__ import annotations

import argparse
import time


def _counting(module, name: str, counts: dict, key: str) -> None:
    fn = getattr(module, name, None)
    if fn is None:
        return

    def counted(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    setattr(module, name, counted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="nemotron-nano-9b-v2")
    ap.add_argument("--platform", default="cuda", choices=["cuda", "tpu", "cpu"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--buckets", nargs="+", default=["1x1x1", "32x32x32", "512x72x64"],
                    help="TxBxD buckets of the scheduler")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=2, help="exports of each bucket (the first "
                    "pays one-time imports and caches)")  # fmt: skip
    args = ap.parse_args()

    import jax.numpy as jnp
    from jax._src.pallas import pallas_call as pallas_call_module

    from jaxmamba.engine.batch import Bucket
    from jaxmamba.export.writer import _setup, export_step
    from jaxmamba.model.params import param_shapes

    counts = {"traced": 0, "lowered": 0}
    _counting(pallas_call_module, "_trace_kernel_to_jaxpr", counts, "traced")
    if args.platform == "cuda":
        from jax._src.pallas.triton import lowering as triton_lowering

        _counting(triton_lowering, "lower_jaxpr_to_triton_module", counts, "lowered")
    elif args.platform == "tpu":
        from jax._src.pallas.mosaic import lowering as mosaic_lowering

        _counting(mosaic_lowering, "lower_jaxpr_to_pipelined_module", counts, "lowered")

    engine = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    _, cfg, _, spec, builder, _ = _setup(args.model, engine, "bf16")
    params = param_shapes(cfg, jnp.bfloat16)
    rows = []
    for text in args.buckets:
        bucket = Bucket(*(int(x) for x in text.split("x")))
        first = None
        for i in range(args.repeats):
            counts.update(traced=0, lowered=0)
            start = time.perf_counter()
            export_step(cfg, spec, jnp.bfloat16, params, builder, bucket, args.platform)
            seconds = time.perf_counter() - start
            print(f"{text} export {i + 1}: {seconds:.1f} s, kernels traced {counts['traced']}, "
                  f"lowered {counts['lowered']}", flush=True)  # fmt: skip
            first = first or (seconds, dict(counts))
        rows.append((text, first, (seconds, dict(counts))))
    # The first export of a bucket traces its kernels unless an earlier bucket traced them at
    # the same shapes; the last one shows what is left once every kernel is traced.
    print(f"\n| bucket | first export | kernels traced / lowered | export {args.repeats} |")
    print("|---|---|---|---|")
    for text, (s1, c1), (s2, _) in rows:
        print(f"| {text} | {s1:.1f} s | {c1['traced']} / {c1['lowered']} | {s2:.1f} s |")


if __name__ == "__main__":
    main()
