"""Prefix-cache effect on a shared-system-prompt workload: TTFT p50/p99 and throughput with
caching off and on, same engine settings, same pools (so both share compiled steps). Every
request = one shared system prompt + its own question; all arrive together (one `generate`).

Passes per engine: a warm-up with system prompt A (compiles), then timed ones with a new
system prompt B:

* off: one timed pass (nothing is ever reused).
* on, cold: B has never been seen; the requests arrive together, so the best achievable is
  that the first computes B once and checkpoints at its last block boundary (the branch
  point) while the others wait for that checkpoint and resume from it.
* on, warm: B again with fresh questions: every request resumes from B's checkpoint at once.

The "on" engine runs a cold and a warm pass on A first, so neither timed pass compiles.
With `--precompile`, every bucket is compiled up front instead (in parallel threads) and the
passes on A are skipped; `--decode-buckets`/`--token-buckets` replace the power-of-two
bucket ladders (fewer compiles, more padding; the same for both engines).

    python scripts/bench_prefix_cache.py --model nemotron-nano-9b-v2 --dtype bfloat16 \\
        --requests 64 --system-len 2048 --suffix-len 128 --max-tokens 128
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba import LLM, SamplingParams
from jaxmamba.llm import DTYPES
from jaxmamba.model.families import load_config
from jaxmamba.model.params import init_params, param_shapes


def fast_random_params(cfg, dtype, seed: int = 0):
    """Random weights without tracing the model's init (which takes ~70 s on the 9B): normal
    with std 0.02, norm weights 1; one small RNG program per distinct shape."""
    shapes = param_shapes(cfg, dtype)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    draw = jax.jit(lambda key, shape, dt: jax.random.normal(key, shape, dt) * 0.02,
                   static_argnums=(1, 2))  # fmt: skip
    out = []
    for key, (path, leaf) in zip(keys, leaves, strict=True):
        if "norm" in jax.tree_util.keystr(path).lower():
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        else:
            out.append(draw(key, leaf.shape, leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def timed(llm, prompts, sp):
    compiles = llm.stats()["compilations"]
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = np.array([o.metrics["ttft_s"] for o in outs])
    cached = sum(o.num_cached_tokens for o in outs)
    total = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "wall_s": wall,
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "cached_fraction": cached / total,
        "compiles": llm.stats()["compilations"] - compiles,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-h-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --requests")
    p.add_argument("--max-prefill-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--decode-buckets", type=int, nargs="+", default=None)
    p.add_argument("--token-buckets", type=int, nargs="+", default=None)
    p.add_argument("--precompile", action="store_true", help="compile every bucket up front")
    p.add_argument("--fast-init", action="store_true", help="fast_random_params, not init_params")
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="skip sizing the cache from device memory (no probe compiles)",
    )
    args = p.parse_args()
    cfg = load_config(args.model)
    dtype = DTYPES[args.dtype]
    init = fast_random_params if args.fast_init else init_params
    params = jax.block_until_ready(init(cfg, dtype, seed=0))
    seqs = args.max_num_seqs or args.requests
    max_len = args.system_len + args.suffix_len + args.max_tokens + 16
    pages = 2 * seqs * -(-max_len // 16)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    vocab = min(cfg.vocab_size, 256)
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, vocab, args.system_len).tolist() for _ in range(2)]

    def workload(system):
        return [system + rng.integers(0, vocab, args.suffix_len).tolist()
                for _ in range(args.requests)]  # fmt: skip

    timed_prompts = {"off": workload(systems[1])}
    timed_prompts["cold"] = timed_prompts["off"]  # the same requests: their tokens must agree
    timed_prompts["warm"] = workload(systems[1])
    results, out_dir = {}, os.environ.get("OUT")
    for caching in (False, True):
        start = time.perf_counter()
        llm = LLM(
            args.model, dtype=args.dtype, params=params, enable_prefix_caching=caching,
            num_state_slots=2 * seqs, num_pages=pages, max_num_seqs=seqs, max_model_len=max_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_seqs=args.max_prefill_seqs,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        )  # fmt: skip
        llm.engine.scheduler.use_buckets(args.decode_buckets, args.token_buckets)
        if args.precompile:
            llm.engine.precompile(show_progress=False)
        else:
            warm_up = workload(systems[0])
            llm.generate(prompt_token_ids=warm_up, sampling_params=sp, use_tqdm=False)
            if caching:
                llm.generate(prompt_token_ids=workload(systems[0]), sampling_params=sp,
                             use_tqdm=False)  # fmt: skip
        warm = time.perf_counter() - start
        print(f"caching={caching}: warm-up {warm:.0f} s, {llm.stats()['compilations']} compiles",
              flush=True)  # fmt: skip
        passes = ["cold", "warm"] if caching else ["off"]
        for name in passes:
            results[name] = timed(llm, timed_prompts[name], sp)
            results[name]["warmup_s"] = warm
            results[name]["stats"] = llm.stats()
            print(name, {k: v for k, v in results[name].items() if k not in ("tokens", "stats")},
                  flush=True)  # fmt: skip
            if out_dir:
                with open(os.path.join(out_dir, "prefix_cache.json"), "w") as f:
                    json.dump({k: {**v, "tokens": None} for k, v in results.items()}, f, indent=1)
        del llm
        gc.collect()
    print(
        f"\n{args.requests} requests arriving together: {args.system_len}-token shared system "
        f"prompt + {args.suffix_len}-token question each, {args.max_tokens} output tokens, "
        f"{cfg.name} {args.dtype}"
    )
    print("| prefix caching | wall time | output tokens/s | TTFT p50 | TTFT p99 |"
          " prompt tokens from cache | compiles in timed pass |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    labels = {"off": "off", "cold": "on, B new (cold)", "warm": "on, B cached (warm)"}
    for name, r in results.items():
        print(f"| {labels[name]} | {r['wall_s']:.2f} s | {r['output_tokens_per_s']:.0f} | "
              f"{r['ttft_p50_s'] * 1e3:.0f} ms | {r['ttft_p99_s'] * 1e3:.0f} ms | "
              f"{r['cached_fraction']:.0%} | {r['compiles']} |")  # fmt: skip
    off = results["off"]["ttft_p50_s"]
    for name in ("cold", "warm"):
        print(f"TTFT p50 {name} / off = {results[name]['ttft_p50_s'] / off:.3f}")
    # The same greedy tokens whether the prefix came from the cache or not (bf16: the first
    # few tokens; later ones may drift apart on near-ties).
    same = [a[:4] == b[:4] for a, b in zip(results["off"]["tokens"], results["cold"]["tokens"],
                                           strict=True)]  # fmt: skip
    print(f"first 4 tokens equal, off vs cold: {sum(same)}/{len(same)}")


if __name__ == "__main__":
    main()
