"""Prefix-cache effect on a shared-prefix workload: throughput and TTFT with caching on vs
off, same engine settings, same requests (every request = a shared system prompt + its own
suffix). Each configuration runs the workload once to compile its buckets, then is timed on
a third pass (the second, with fresh suffixes, compiles what a cache hit needs); the shared
prefix stays cached in the "on" engine.

    python scripts/bench_prefix_cache.py --model nemotron-nano-9b-v2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxmamba import LLM, ModelConfig, SamplingParams
from jaxmamba.llm import DTYPES
from jaxmamba.model.params import init_params


def workload(rng, vocab, system_len, suffix_len, n):
    system = rng.integers(0, vocab, system_len).tolist()
    return [system + rng.integers(0, vocab, suffix_len).tolist() for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="nemotron-h-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = p.parse_args()
    cfg = ModelConfig.load(args.model)
    dtype = DTYPES[args.dtype]
    params = jax.block_until_ready(init_params(cfg, dtype, seed=0))
    max_len = args.system_len + args.suffix_len + args.max_tokens + 16
    pages = 2 * args.max_num_seqs * -(-max_len // 16)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    vocab = min(cfg.vocab_size, 256)
    rows = []
    for caching in (False, True):
        # Same slot/page pools for both, so both engines share compiled steps.
        llm = LLM(
            args.model,
            dtype=args.dtype,
            params=params,
            enable_prefix_caching=caching,
            num_state_slots=2 * args.max_num_seqs,
            num_pages=pages,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        rng = np.random.default_rng(0)
        prompts = workload(rng, vocab, args.system_len, args.suffix_len, args.requests)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)  # compiles its buckets
        system = prompts[0][: args.system_len]

        def fresh(system=system, rng=rng):
            return [system + rng.integers(0, vocab, args.suffix_len).tolist()
                    for _ in range(args.requests)]  # fmt: skip

        llm.generate(prompt_token_ids=fresh(), sampling_params=sp)
        warm = time.perf_counter() - start
        prompts = fresh()
        compiles = llm.stats()["compilations"]
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        elapsed = time.perf_counter() - start
        ttft = [o.metrics["ttft_s"] for o in outs]
        cached = sum(o.num_cached_tokens for o in outs)
        total = sum(len(o.prompt_token_ids) for o in outs)
        rows.append((caching, elapsed, args.requests * args.max_tokens / elapsed,
                     float(np.median(ttft)), float(np.max(ttft)), cached / total, warm,
                     llm.stats()["compilations"] - compiles))  # fmt: skip
    print(
        f"\n{args.requests} requests: {args.system_len}-token shared prefix + "
        f"{args.suffix_len}-token suffix, {args.max_tokens} output tokens, {cfg.name}"
    )
    print(
        "| prefix caching | wall time | output tokens/s | median TTFT | max TTFT |"
        " prompt tokens from cache | warm-up passes | compiles in timed pass |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for caching, wall, tps, ttft_med, ttft_max, hit, warm, compiles in rows:
        print(f"| {'on' if caching else 'off'} | {wall:.2f} s | {tps:.1f} | "
              f"{ttft_med * 1e3:.0f} ms | {ttft_max * 1e3:.0f} ms | {hit:.0%} | {warm:.0f} s | "
              f"{compiles} |")  # fmt: skip


if __name__ == "__main__":
    main()
