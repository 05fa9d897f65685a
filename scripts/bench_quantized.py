"""Quantized weights on one GPU (docs/quantization.md): does XLA run our FP8 matmul as an FP8
GEMM, how fast are FP8 and int8 projections against bf16, and what does a whole decode step
of the 9B model gain. Random weights; no model hub.

1. **HLO**: `scaled_matmul` (`kernels/matmul/quantized.py`) with FP8 per-channel weights at
   the Nemotron-Nano-9B-v2 projections' (K, N) (from `configs/nemotron-nano-9b-v2.yaml`) and
   M = 1, 128, 2048, lowered and compiled: whether the optimized HLO calls cuBLASLt's FP8
   GEMM (`__cublas$lt$matmul$f8`) on f8e4m3fn operands, "yes"/"no" per shape; for int8
   (weight-only), whether XLA keeps a converted bf16 copy of the weight as a temporary.
2. **Matmuls**: bf16 (`x @ W`, float32 accumulation, as `Linear`'s float path), FP8 and int8
   (`scaled_matmul`), each a program of back-to-back calls over distinct weight buffers (at
   least `--min-program-bytes` of weights, so no call finds its weight in the 60 MB L2);
   the median over `--reps` of one program, divided by its calls.
   Also: quantized MoE experts on the grouped-matmul kernel (`scaled_grouped_matmul`, FP8 x
   FP8 and int8 tiles) against its reference loop, at one MoE expert stack's shape.
3. **Whole decode step** of the 9B preset (`jaxmamba.bench.bench_one_batch`, greedy rows,
   context `--context`): bf16 weights, FP8 weights, FP8 weights + FP8 KV pages, at decode
   batch 1 / 32 / 128; cases are skipped once `--budget-s` is spent.

    python scripts/bench_quantized.py                  # one H200: < 6 minutes (budgeted)
    python scripts/bench_quantized.py --smoke          # CPU: toy shapes, the tiny preset

The tables print as each part ends and once more, together, at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmamba.kernels.matmul.quantized import (  # noqa: E402
    FP8,
    QuantizedWeight,
    scaled_matmul,
)
from jaxmamba.model.families import load_config  # noqa: E402

FP8_GEMM = "__cublas$lt$matmul$f8"
L2_SAFE_BYTES = 256 << 20


def projections(cfg) -> dict[str, tuple[int, int]]:
    """The (K, N) of the model's Mamba and MLP projections (the 9B's largest)."""
    e, d = cfg.hidden_size, cfg.d_inner
    out = {
        "mamba in_proj": (e, 2 * d + 2 * cfg.n_groups * cfg.ssm_state_size + cfg.mamba_num_heads),
        "mamba out_proj": (d, e),
    }
    if cfg.intermediate_size:
        out["mlp up"] = (e, cfg.intermediate_size)
        out["mlp down"] = (cfg.intermediate_size, e)
    return out


def weights(kind: str, k: int, n: int, seed: int):
    """One random weight of `kind`: bf16 `[K, N]`, or FP8/int8 `[N, K]` with per-channel
    scales, as `quantization=` makes them."""
    key = jax.random.key(seed)
    if kind == "bf16":
        return (0.02 * jax.random.normal(key, (k, n), jnp.float32)).astype(jnp.bfloat16)
    w = jax.random.normal(key, (n, k), jnp.float32)
    if kind == "fp8":
        return QuantizedWeight((w * 64).astype(FP8), jnp.full((n, 1), 0.02 / 64, jnp.float32))
    q = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q, jnp.full((n, 1), 0.02 / 40, jnp.float32))


def matmul(x, w):
    if isinstance(w, QuantizedWeight):
        return scaled_matmul(x, w, dtype=jnp.bfloat16)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def hlo_facts(x, w) -> dict:
    """What the optimized HLO of one call says: the GEMM custom calls, FP8 operands, whether a
    bf16 copy of the weight `[N, K]` is an array of the program (not fused into the GEMM's
    operand fetch), the temporaries XLA allocates."""
    compiled = jax.jit(matmul).lower(x, w).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    n, k = w.weight.shape
    return {
        "fp8_gemm": FP8_GEMM in text,
        "f8_operands": "f8e4m3fn" in text,
        "bf16_copy": f"bf16[{n},{k}]" in text or f"bf16[{k},{n}]" in text,
        "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
        "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else -1,
    }


def median_program_time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_matmuls(cfg, rows, reps, min_bytes, on_gpu) -> list[str]:
    hlo_lines = [
        "| projection | K | N | M | FP8 GEMM (cuBLASLt f8) | f8 operands | "
        "int8: bf16 weight copy (temporaries) |",
        "|---|---|---|---|---|---|---|",
    ]
    time_lines = ["| projection | M | bf16 µs | fp8 µs | int8 µs | fp8 / bf16 | int8 / bf16 |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, (k, n) in projections(cfg).items():
        bufs = {}
        for kind in ("bf16", "fp8", "int8"):
            one = nbytes(weights(kind, 16, 16, 0)) / 256  # bytes per weight element
            calls = max(2, -(-min_bytes // int(k * n * one)))
            bufs[kind] = [weights(kind, k, n, s) for s in range(calls)]
        for m in rows:
            x = (jax.random.normal(jax.random.key(m), (m, k), jnp.float32)).astype(jnp.bfloat16)
            try:
                fp8 = hlo_facts(x, bufs["fp8"][0])
                int8 = hlo_facts(x, bufs["int8"][0])
                copy = int8["bf16_copy"]
                hlo_lines.append(
                    f"| {name} | {k} | {n} | {m} | {'yes' if fp8['fp8_gemm'] else 'no'} | "
                    f"{'yes' if fp8['f8_operands'] else 'no'} | {'yes' if copy else 'no'} "
                    f"({int8['temp_bytes'] / 2**20:.1f} MiB) |"
                )
                print(f"{name} M={m}: fp8 custom calls {fp8['custom_calls']}, int8 "
                      f"{int8['custom_calls']}", flush=True)  # fmt: skip
                us = {}
                for kind, ws in bufs.items():
                    program = jax.jit(lambda x, ws: [matmul(x, w) for w in ws])
                    us[kind] = median_program_time(program, (x, ws), reps) / len(ws) * 1e6
                time_lines.append(
                    f"| {name} | {m} | {us['bf16']:.1f} | {us['fp8']:.1f} | {us['int8']:.1f} | "
                    f"{us['fp8'] / us['bf16']:.2f} | {us['int8'] / us['bf16']:.2f} |"
                )
            except Exception:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                time_lines.append(f"| {name} | {m} | failed | | | | |")
            print(time_lines[-1], flush=True)
        del bufs
    if not on_gpu:
        hlo_lines.append("(not a GPU: XLA:CPU has no cuBLASLt, so 'no' is expected)")
    return hlo_lines + [""] + time_lines


def grouped_check(impl: str, smoke: bool) -> list[str]:
    """The quantized grouped matmul on the kernel (`impl`) against the reference loop: the
    largest relative error over the used rows, and both times (per call)."""
    from jaxmamba.kernels.matmul import scaled_grouped_matmul

    lines = ["| quantized experts (grouped matmul) | kernel vs ref max rel err | kernel µs | "
             "ref µs |", "|---|---|---|---|"]  # fmt: skip
    bm, x_experts, k, n = 16, 128, 2688, 1856  # Nemotron 3 Nano's experts [1856 <- 2688]
    if smoke:
        x_experts, k, n = 8, 80, 48
    blocks = x_experts // 2
    block_expert = jnp.arange(blocks, dtype=jnp.int32) * 2  # every other expert
    x = jax.random.normal(jax.random.key(0), (blocks * bm, k), jnp.float32).astype(jnp.bfloat16)
    for kind in ("fp8", "int8"):
        w = weights(kind, k, n * x_experts, 1)
        w = QuantizedWeight(w.weight.reshape(x_experts, n, k), w.scale.reshape(x_experts, n, 1))
        try:
            outs, us = {}, {}
            for which in (impl, "ref"):
                fn = jax.jit(
                    lambda x, w, which=which: scaled_grouped_matmul(
                        x, w, block_expert, dtype=jnp.bfloat16, out_dtype=jnp.float32, impl=which
                    )
                )
                outs[which] = fn(x, w)
                us[which] = median_program_time(fn, (x, w), 5) * 1e6
            a, b = outs[impl], outs["ref"]
            err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
            lines.append(f"| {kind} | {err:.1e} | {us[impl]:.1f} | {us['ref']:.1f} |")
        except Exception as e:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            lines.append(f"| {kind} | FAILED {type(e).__name__}: {str(e)[:120]} | | |")
        print(lines[-1], flush=True)
    return lines


def part_steps(model, batches, context, steps, budget_s, variants, smoke) -> list[str]:
    from jaxmamba.bench import bench_one_batch
    from jaxmamba.model.quantization import quantize_params

    cfg = load_config(model)
    t0 = time.perf_counter()
    if smoke:
        from jaxmamba.model.params import init_params

        base = init_params(cfg, jnp.bfloat16, 0)
    else:  # seconds, where Flax's init would compile the whole model once more
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_cold_start import random_params

        base = random_params(model, "bf16")
    jax.block_until_ready(base)
    params = {"bf16": base}
    for method in sorted({v.split("+")[0] for v in variants} - {"bf16"}):
        params[method] = jax.block_until_ready(quantize_params(base, cfg, method))
    print(f"{model}: weights in {time.perf_counter() - t0:.0f} s "
          + ", ".join(f"{k} {nbytes(v) / 2**30:.2f} GiB" for k, v in params.items()),
          flush=True)  # fmt: skip
    results = {}
    for batch in batches:
        for variant in variants:
            if time.perf_counter() - t0 > budget_s:
                print(f"budget spent: skipping {variant} b{batch}", flush=True)
                continue
            weights_kind, _, kv = variant.partition("+")
            start = time.perf_counter()
            try:
                (res,) = bench_one_batch(
                    cfg, params[weights_kind], batch=batch, input_len=context, output_len=steps,
                    dtype=jnp.bfloat16, repeats=3, phases=("decode",), fill_cache=False,
                    kv_dtype="fp8" if kv == "fp8kv" else "auto", log=lambda m: None,
                )  # fmt: skip
                results[variant, batch] = res.seconds
                print(f"{variant} b{batch}: {res.seconds * 1e3:.2f} ms/step "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    lines = [f"| decode step, ctx {context} | " + " | ".join(f"b{b} ms" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]  # fmt: skip
    for variant in variants:
        cells = []
        for b in batches:
            t, ref = results.get((variant, b)), results.get(("bf16", b))
            cell = "—" if t is None else f"{t * 1e3:.2f}"
            if t is not None and ref is not None and variant != "bf16":
                cell += f" ({t / ref:.2f}x)"
            cells.append(cell)
        lines.append(f"| {variant.replace('+fp8kv', ' + fp8 KV')} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="nemotron-nano-9b-v2")
    p.add_argument("--rows", default="1,128,2048", help="matmul M values")
    p.add_argument("--batches", default="1,32,128", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="decode context length")
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    p.add_argument("--variants", default="bf16,fp8,fp8+fp8kv",
                   help="whole-step variants: bf16, fp8, int8, each optionally +fp8kv")  # fmt: skip
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--min-program-bytes", type=int, default=L2_SAFE_BYTES)
    p.add_argument("--budget-s", type=float, default=210,
                   help="whole-step part: no case starts after this many seconds")  # fmt: skip
    p.add_argument("--skip-steps", action="store_true", help="parts 1-2 only")
    p.add_argument("--smoke", action="store_true", help="CPU: toy shapes, the tiny preset")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if args.smoke:
        args.model, args.rows, args.batches = "nemotron-h-tiny", "1,16", "1,2"
        args.context, args.steps, args.reps, args.min_program_bytes = 16, 2, 2, 1 << 16
    elif not on_gpu:
        raise SystemExit("needs a GPU (or --smoke on a CPU)")
    t0 = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    cfg = load_config(args.model)
    rows = [int(r) for r in args.rows.split(",")]
    tables = part_matmuls(cfg, rows, args.reps, args.min_program_bytes, on_gpu)
    tables += [""] + grouped_check("pallas_gpu" if on_gpu else "interpret", args.smoke)
    print("\n".join(tables), flush=True)
    if not args.skip_steps:
        batches = [int(b) for b in args.batches.split(",")]
        variants = args.variants.split(",")
        step_table = part_steps(args.model, batches, args.context, args.steps,
                                args.budget_s, variants, args.smoke)  # fmt: skip
        tables += [""] + step_table
    print(f"\n== {args.model} on {jax.devices()[0].device_kind}, total "
          f"{time.perf_counter() - t0:.0f} s ==")  # fmt: skip
    print("\n".join(tables))


if __name__ == "__main__":
    main()
