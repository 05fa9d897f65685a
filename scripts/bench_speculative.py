"""Speculative decoding on an accelerator (issue 34, docs/speculative.md), two tables:

1. **Verify step vs decode step** (`--model`, random weights): the step time of a verify step
   (rows of 1 + k tokens, n-gram drafts, acceptance and the state commit on device) for each
   k of `--ks` at each batch of `--batches`, against the plain decode step of that batch
   (both the greedy sampler, context `--context` tokens a row). "ratio" is verify / decode:
   speculation pays off where the tokens a verify step emits on average exceed it.
2. **End to end, one stream** (`--e2e`, the trained demo model): tokens/s of
   `LLM.generate` on code-editing prompts (a function, then the request to repeat it with a
   change), greedy, without speculation and with each method of `--e2e-methods` (n-gram
   drafts; the demo's draft model `--e2e-draft`) for each k of `--e2e-ks`; the acceptance
   rate and the mean tokens a verify step emitted. tok/s counts the whole request (prefill
   included), decode tok/s the tokens after the first over the time after it. The greedy
   outputs must equal the non-speculative run's token for token: the script exits with an
   error if one does not.

    python scripts/bench_speculative.py --model nemotron-nano-9b-v2 --ks 1 2 3 4 5 6 7 8 \
        --batches 1 32 128 --e2e --e2e-methods ngram draft_model --out $OUT/spec.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder  # noqa: E402
from jaxmamba.engine.runner import ModelRunner  # noqa: E402
from jaxmamba.model.cache import CacheSpec  # noqa: E402
from jaxmamba.model.families import load_config  # noqa: E402
from jaxmamba.model.params import init_params  # noqa: E402
from jaxmamba.model.speculative import NgramSpec  # noqa: E402

PAGE = 16


def time_steps(runner: ModelRunner, inputs, num_decode: int, steps: int, reps: int) -> float:
    """Median seconds per step: `steps` steps dispatched back to back, synced once, `reps`
    times (after two warm-up repetitions, the first compiling)."""
    times = []
    for rep in range(reps + 2):
        start = time.perf_counter()
        for _ in range(steps):
            out = runner.step(inputs, num_decode, top_logprobs=False, ranks=False)
        jax.block_until_ready(out.packed)
        if rep >= 2:
            times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def step_table(args) -> list[dict]:
    cfg = load_config(args.model)
    dtype = jnp.dtype(args.dtype)
    params = init_params(cfg, dtype, seed=0)
    slots = max(args.batches)
    pages_per_row = -(-(args.context + 2 * max(args.ks) + 2) // PAGE)
    spec = CacheSpec(num_slots=slots, num_pages=slots * pages_per_row, page_size=PAGE)
    rows_of = lambda b, n: [  # noqa: E731
        RowSpec([0] * n, args.context, i, list(range(i * pages_per_row, (i + 1) * pages_per_row)),
                token_from_device=True)
        for i in range(b)
    ]  # fmt: skip
    results = []
    for k in [0, *args.ks]:
        ngram = None if k == 0 else NgramSpec(k, 1, 4)
        runner = ModelRunner(cfg, params, spec, dtype=dtype, impl=args.impl, speculative=ngram)
        if ngram is not None:  # every row `context` tokens long, with a history to search
            state = runner.slot_state.spec
            history = np.random.default_rng(0).integers(0, cfg.vocab_size, state.history.shape)
            runner.slot_state = runner.slot_state._replace(spec=state._replace(
                seq_lens=jnp.full_like(state.seq_lens, args.context),
                history=jnp.asarray(history, jnp.int32)))  # fmt: skip
        builder = StepBuilder(spec, pages_per_row, cfg.vocab_size, cfg.chunk_size,
                              speculative=ngram is not None)  # fmt: skip
        for b in args.batches:
            inputs = builder.build(rows_of(b, 1 + k), Bucket(b * (1 + k), b, b))
            try:
                seconds = time_steps(runner, inputs, b, args.steps, args.reps)
            except Exception as e:  # e.g. out of memory at the largest batch: keep the rest
                print(f"k={k} batch={b}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row = {"k": k, "batch": b, "step_ms": seconds * 1e3}
            results.append(row)
            print(json.dumps(row), flush=True)
        del runner
    base = {r["batch"]: r["step_ms"] for r in results if r["k"] == 0}
    print(f"\n{args.model} ({args.dtype}, context {args.context}): verify step vs decode step")
    print("| k | " + " | ".join(f"batch {b} ms (ratio)" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for k in [0, *args.ks]:
        cells = []
        for b in args.batches:
            r = next((r for r in results if r["k"] == k and r["batch"] == b), None)
            cells.append("-" if r is None or b not in base else
                         f"{r['step_ms']:.2f} ({r['step_ms'] / base[b]:.2f}x)")  # fmt: skip
        print(f"| {'decode' if k == 0 else k} | " + " | ".join(cells) + " |")
    return results


# Code-editing prompts: a function, then the request to write it again with a change; most of
# the answer is in the prompt, which is where prompt lookup pays.
EDITS = [
    ("jaxmamba/engine/allocator.py",
     "# The same class again, with `num_free` renamed to `free_count`:\n"),
    ("jaxmamba/engine/request.py", "# The same dataclass again, with type hints on every field:\n"),
    ("jaxmamba/inputs.py", "# The same code again, with the docstrings removed:\n"),
]  # fmt: skip


def e2e_table(args) -> list[dict]:
    from jaxmamba import LLM, SamplingParams

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prompts = []
    for path, ask in EDITS:
        with open(os.path.join(root, path)) as f:
            source = f.read()[: args.prompt_chars]
        prompts.append(source + "\n\n" + ask + source[: source.index("\n") + 1])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    # Every bucket compiled before timing; no prefix caching: a cache hit's prompt tokens are
    # not in the slot's draft history (docs/speculative.md), and the warm-up must not change
    # what the timed prompts draft from.
    engine = dict(max_num_seqs=1, max_model_len=args.prompt_chars * 3 + args.max_tokens + 64,
                  max_num_batched_tokens=2048, dtype=args.e2e_dtype, precompile=True,
                  enable_prefix_caching=False)  # fmt: skip
    results, reference = [], None
    runs = [(None, 0)] + [(method, k) for method in args.e2e_methods for k in args.e2e_ks]
    for method, k in runs:
        spec = None if method is None else {"method": method, "num_speculative_tokens": k}
        if method == "draft_model":
            spec["model"] = args.e2e_draft
        llm = LLM(args.e2e_model, speculative_config=spec, **engine)
        llm.generate(["def f(x):\n    return x\n"], SamplingParams(max_tokens=8),
                     use_tqdm=False)  # warm up  # fmt: skip
        tokens, seconds, decode_tokens, decode_seconds, outputs = 0, 0.0, 0, 0.0, []
        for prompt in prompts:  # one stream: one request at a time
            start = time.perf_counter()
            request = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds += time.perf_counter() - start
            out = request.outputs[0]
            tokens += len(out.token_ids)
            decode_tokens += len(out.token_ids) - 1
            decode_seconds += request.metrics["decode_s_per_token"] * (len(out.token_ids) - 1)
            outputs.append(out.token_ids)
        stats = llm.stats()
        row = {"method": method or "off", "k": k, "tok_per_s": tokens / seconds,
               "decode_tok_per_s": decode_tokens / decode_seconds,
               "acceptance": stats.get("spec_acceptance_rate"),
               "tokens_per_verify": (stats.get("spec_accepted_tokens", 0)
                                     + stats.get("spec_verify_steps", 0))
                                    / max(stats.get("spec_verify_steps", 0), 1),
               "identical": reference is None or outputs == reference}  # fmt: skip
        reference = reference or outputs
        results.append(row)
        print(json.dumps(row), flush=True)
        del llm
    base, base_decode = results[0]["tok_per_s"], results[0]["decode_tok_per_s"]
    draft = f", draft {args.e2e_draft}" if "draft_model" in args.e2e_methods else ""
    print(f"\n{args.e2e_model}{draft}: one stream, {len(prompts)} code-editing prompts, "
          f"{args.max_tokens} tokens each, greedy")  # fmt: skip
    print("| method | k | tok/s | speed-up | decode tok/s | speed-up | acceptance "
          "| tokens/verify step | identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {r['method']} | {r['k'] or '-'} | {r['tok_per_s']:.1f} "
              f"| {r['tok_per_s'] / base:.2f}x | {r['decode_tok_per_s']:.1f} "
              f"| {r['decode_tok_per_s'] / base_decode:.2f}x | {acc} "
              f"| {r['tokens_per_verify']:.2f} | {r['identical']} |")  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nemotron-nano-9b-v2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--impl", default="auto", choices=("auto", "ref", "pallas"))
    p.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-steps", action="store_true", help="skip the step table")
    p.add_argument("--e2e", action="store_true", help="also the end-to-end single-stream table")
    p.add_argument("--e2e-model", default="nemotron-h-demo")
    p.add_argument("--e2e-dtype", default="auto")
    p.add_argument("--e2e-methods", nargs="+", default=["ngram"], choices=("ngram", "draft_model"),
                   help="the speculative methods of --e2e")  # fmt: skip
    p.add_argument("--e2e-draft", default="nemotron-h-demo-draft",
                   help="method draft_model's draft: a preset or checkpoint directory")  # fmt: skip
    p.add_argument("--e2e-ks", type=int, nargs="+", default=[2, 4, 6, 8])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-chars", type=int, default=1200)
    p.add_argument("--out", help="write every row as JSON here")
    args = p.parse_args()
    out = {"device": str(jax.devices()[0])}
    if not args.no_steps:
        out["steps"] = step_table(args)
    if args.e2e:
        out["e2e"] = e2e_table(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    differ = [(r["method"], r["k"]) for r in out.get("e2e", []) if not r["identical"]]
    if differ:
        raise SystemExit(f"greedy outputs differ from the non-speculative run's: {differ}")


if __name__ == "__main__":
    main()
