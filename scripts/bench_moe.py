"""MoE on an accelerator, one process: the routed-expert matmuls of the model's MoE layers by
method and step size, then the whole model (prefill and decode cases of `bench_one_batch`).

    python3 scripts/bench_moe.py --model nemotron-3-nano-30b-a3b --budget-s 200 --out $OUT/moe.json

Weights are random (normal, std 0.02; norms 1), drawn on the device one small program per
distinct shape, without tracing the model's init. Micro cases: `--layers` consecutive MoE
layers (distinct weights, as in the model) chained in one jitted call, routing from random
logits (uniform), time per layer = median call / layers. Methods: `kernel` (the Pallas
grouped matmul), `blocked` (the same layout, the reference's loop over 256-row blocks),
`gathered` (each assignment gathers its expert), `ragged` (XLA's `ragged_dot`). Roofline:
the experts hit read once at the HBM ceiling, or the routed FLOPs at the bf16 ceiling,
whichever is longer. Every case prints as it finishes; a failing case is reported and
skipped; no case starts once `--budget-s` is spent. `--shrink` runs tiny shapes (CPU check).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba import bench
from jaxmamba.config import ModelConfig
from jaxmamba.kernels.grouped_matmul.gpu import GpuBlockSizes
from jaxmamba.model import moe
from jaxmamba.model.families import load_config
from jaxmamba.model.params import param_shapes

# (tokens, method, kernel block sizes or None): the decisive cases first.
MICRO = [
    (1, "kernel", None), (1, "gathered", None), (1, "ragged", None),
    (16384, "kernel", None), (16384, "blocked", None),
    (32, "kernel", None), (32, "gathered", None), (32, "blocked", None),
    (128, "kernel", None), (128, "blocked", None),
    (2048, "kernel", None), (2048, "blocked", None), (2048, "ragged", None),
    (1, "kernel", GpuBlockSizes(block_n=32, block_k=128, num_warps=4, num_stages=4)),
    (16384, "kernel", GpuBlockSizes(block_n=128, block_k=64, num_warps=4, num_stages=4)),
    (2048, "kernel", GpuBlockSizes(block_n=128, block_k=64, num_warps=4, num_stages=3)),
]  # fmt: skip


def shrink(cfg: ModelConfig) -> ModelConfig:
    """The preset's structure at toy sizes, for a CPU run of this script."""
    return dataclasses.replace(
        cfg, vocab_size=256, hidden_size=64, layer_types=cfg.layer_types[:8],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_experts=16, moe_intermediate_size=32, moe_shared_intermediate_size=48,
    )  # fmt: skip


def fast_random_params(cfg: ModelConfig, dtype, seed: int = 0):
    leaves, tree = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def draw(key, shape, dt):
        return jax.random.normal(key, shape, dt) * 0.02

    out = [
        jnp.ones(leaf.shape, leaf.dtype) if "norm" in jax.tree_util.keystr(path).lower()
        else draw(key, leaf.shape, leaf.dtype)
        for key, (path, leaf) in zip(keys, leaves, strict=True)
    ]  # fmt: skip
    return jax.tree_util.tree_unflatten(tree, out)


def moe_weights(params, layers: int):
    """(up, down) of the first `layers` MoE layers."""
    ups, downs = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if "experts_up" in name:
            ups[name.replace("experts_up", "")] = leaf
        elif "experts_down" in name:
            downs[name.replace("experts_down", "")] = leaf
    names = sorted(ups)[:layers]
    return [ups[n] for n in names], [downs[n] for n in names]


def experts_fn(method: str, activation: str, block_sizes):
    def one(x, weights, idx, up, down):
        if method == "kernel":
            if block_sizes is None:
                return moe.blocked_experts(x, weights, idx, up, down, activation, x.dtype,
                                           impl="pallas")  # fmt: skip
            return kernel_with(x, weights, idx, up, down, activation, block_sizes)
        if method == "blocked":
            return moe.blocked_experts(x, weights, idx, up, down, activation, x.dtype, impl="ref")
        return moe.grouped_experts(x, weights, idx, up, down, activation, x.dtype, method=method)

    @jax.jit
    def chain(x, weights, idxs, ups, downs):
        for idx, up, down in zip(idxs, ups, downs, strict=True):
            x = (x.astype(jnp.float32) + one(x, weights, idx, up, down)).astype(x.dtype)
        return x

    return chain


def kernel_with(x, weights, idx, up, down, activation, block_sizes):
    """`moe.blocked_experts` on the kernel with explicit block sizes (a sweep point)."""
    from jaxmamba.kernels.grouped_matmul import build_expert_blocks
    from jaxmamba.kernels.grouped_matmul.gpu import grouped_matmul_gpu

    T, k = idx.shape
    X, E = up.shape[0], x.shape[-1]
    layout = build_expert_blocks(idx, X, moe.kernel_block_rows(T * k, X))
    xp = jnp.concatenate([x, jnp.zeros((1, E), x.dtype)])[layout.rows]
    gmm = functools.partial(grouped_matmul_gpu, block_sizes=block_sizes)
    h = moe.activate(gmm(xp, up, layout.block_expert, out_dtype=jnp.float32), activation)
    y = gmm(h.astype(x.dtype), down, layout.block_expert)
    y = y[layout.position].astype(jnp.float32).reshape(T, k, E)
    return jnp.sum(y * weights[..., None], axis=1)


def micro_case(cfg, ups, downs, tokens, method, block_sizes, reps):
    X, k, E = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    layers = len(ups)
    keys = jax.random.split(jax.random.PRNGKey(tokens), layers + 2)
    x = jax.random.normal(keys[0], (tokens, E), ups[0].dtype)
    weights = jax.random.uniform(keys[1], (tokens, k), jnp.float32) / k
    idxs = [jax.lax.top_k(jax.random.normal(key, (tokens, X)), k)[1] for key in keys[2:]]
    fn = experts_fn(method, cfg.mlp_activation, block_sizes)
    start = time.perf_counter()
    jax.block_until_ready(fn(x, weights, idxs, ups, downs))
    compile_s = time.perf_counter() - start
    per_layer = bench.median_time(lambda: fn(x, weights, idxs, ups, downs), reps) / layers
    hit = float(np.mean([len(np.unique(np.asarray(i))) for i in idxs]))
    expert_bytes = (ups[0][0].size + downs[0][0].size) * ups[0].dtype.itemsize
    flops = 2.0 * tokens * k * (ups[0][0].size + downs[0][0].size)
    roofline = max(hit * expert_bytes / bench.PEAK_HBM_BYTES, flops / bench.PEAK_BF16_FLOPS)
    return {
        "tokens": tokens, "method": method, "block_sizes": block_sizes and str(block_sizes),
        "us_per_layer": per_layer * 1e6, "roofline_us": roofline * 1e6,
        "x_roofline": per_layer / roofline, "experts_hit": hit, "compile_s": compile_s,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    p.add_argument("--shrink", action="store_true", help="toy sizes (a CPU check)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers per micro call")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--micro", nargs="*", default=None, help="tokens to keep (default: all)")
    p.add_argument("--cases", nargs="*", default=["p8x2048", "d1", "d128", "d32"])
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--out", default="moe.json")
    p.add_argument(
        "--uniform-routing", action="store_true",
        help="whole-model cases: the router's logits are replaced by fixed random ones per "
        "token (uniform, distinct rows), because random weights route every row alike in "
        "the deeper layers (scripts/dev/moe_route_probe.py)",
    )  # fmt: skip
    args = p.parse_args()
    t0 = time.perf_counter()
    cfg = load_config(args.model)
    if args.shrink:
        cfg = shrink(cfg)
    dtype = jnp.bfloat16
    params = jax.block_until_ready(fast_random_params(cfg, dtype))
    n_all, n_active = bench.count_params(params), bench.active_params(cfg, params)
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "params": n_all, "active_params": n_active, "micro": [], "whole": []}  # fmt: skip
    print(f"{record['device']}, jax {jax.__version__}: {args.model} random bf16, "
          f"{n_all / 1e9:.2f}B params, {n_active / 1e9:.2f}B active, "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip

    def spent():
        return time.perf_counter() - t0 > args.budget_s

    ups, downs = moe_weights(params, args.layers)
    kernel_ok = True
    micro = [c for c in MICRO if args.micro is None or str(c[0]) in args.micro]
    for tokens, method, bs in micro:
        if spent():
            print(f"budget spent: skipping micro T={tokens} {method}", flush=True)
            continue
        if args.shrink and method == "kernel" and jax.default_backend() == "cpu":
            method_impl = "skipped on CPU (interpret mode is checked by the tests)"
            print(f"micro T={tokens} kernel: {method_impl}", flush=True)
            continue
        try:
            r = micro_case(cfg, ups, downs, tokens, method, bs, args.reps)
            record["micro"].append(r)
            print(f"micro T={tokens:>5} {method:8s}{' ' + r['block_sizes'] if bs else ''}: "
                  f"{r['us_per_layer']:9.1f} us/layer, roofline {r['roofline_us']:7.1f} us "
                  f"({r['x_roofline']:.2f}x), {r['experts_hit']:.0f} experts hit, "
                  f"compile {r['compile_s']:.1f} s", flush=True)  # fmt: skip
        except Exception:  # noqa: BLE001 - report and carry on
            traceback.print_exc()
            record["micro"].append({"tokens": tokens, "method": method,
                                    "error": traceback.format_exc()[-2000:]})  # fmt: skip
            if method == "kernel" and bs is None:
                kernel_ok = False
    if not kernel_ok:
        # Label it: the whole model then runs the reference's blocked loop for MoE layers.
        print("kernel failed: whole-model cases use moe.blocked_experts on the reference")
        moe.has_kernel = lambda impl: False
        record["whole_moe_method"] = "blocked (reference loop; the kernel failed)"

    if args.uniform_routing:
        route = moe.route_sigmoid_grouped

        def uniform(logits, *a, **k):
            # Fixed across steps and layers, distinct across rows: the experts hit are those
            # of uniform routing (bench.experts_hit); the router's own matmul still runs.
            noise = jax.random.normal(jax.random.PRNGKey(7), logits.shape, logits.dtype)
            return route(logits * 0 + noise, *a, **k)

        moe.route_sigmoid_grouped = uniform
        record["whole_routing"] = "uniform (random logits per token)"

    for case in args.cases:
        if spent():
            print(f"budget spent: skipping {case}", flush=True)
            continue
        start = time.perf_counter()
        if case[0] == "p":
            phase, (batch, length) = "prefill", map(int, case[1:].split("x"))
        else:
            phase, batch, length = "decode", int(case[1:]), args.decode_context
        try:
            (res,) = bench.bench_one_batch(
                cfg, params, batch=batch, input_len=length, output_len=args.output_len,
                dtype=dtype, repeats=3, phases=(phase,), fill_cache=False,
                log=lambda m: print(m, flush=True),
            )  # fmt: skip
            if phase == "prefill":
                work = bench.prefill_flops(cfg, params, batch, length)
                unit = f"{work / 1e12:.1f} TFLOP (active), {res.utilisation:.1%} MFU"
            else:
                work = bench.decode_bytes(cfg, params, batch, length + args.output_len // 2,
                                          dtype)  # fmt: skip
                unit = f"{work / 1e9:.2f} GB (experts hit), {res.utilisation:.1%} of HBM"
            record["whole"].append(dict(res.__dict__, case=case, work=work))
            print(f"whole {case}: {res.seconds * 1e3:.2f} ms/step, {res.tokens_per_s:,.0f} tok/s, "
                  f"{unit}, case {time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            record["whole"].append({"case": case, "error": traceback.format_exc()[-2000:]})
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("\n| T | method | µs/layer | roofline µs | x roofline | experts hit |")
    print("|---|---|---|---|---|---|")
    for r in record["micro"]:
        if "error" not in r:
            name = r["method"] + (f" {r['block_sizes']}" if r["block_sizes"] else "")
            print(f"| {r['tokens']} | {name} | {r['us_per_layer']:.1f} | {r['roofline_us']:.1f} | "
                  f"{r['x_roofline']:.2f} | {r['experts_hit']:.0f} |")  # fmt: skip
    print(bench.format_results([bench.BenchResult(**{k: w[k] for k in (
        "phase", "batch", "input_len", "seconds", "tokens_per_s", "utilisation")})
        for w in record["whole"] if "error" not in w]))  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
