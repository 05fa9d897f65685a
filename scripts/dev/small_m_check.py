"""On the GPU: a model's decode step with the small-M matmul kernel against the same step with
XLA's dot — logits, arg-max and SSM states of every row, over several greedy steps from the
same random cache. Random bf16 weights (`bench_cold_start.random_params`).

    python scripts/dev/small_m_check.py --model nemotron-nano-9b-v2 --batch 1 16 [--steps 4]
        [--max-rows 64]   # route steps of up to 64 rows through the kernel (a probe)

`--max-rows` patches the kernel's and the model's row limit for this process, to try the
kernel on buckets above `MAX_ROWS` before changing the limit (how the limit went from 16 to
32 rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_cold_start


def patch_max_rows(rows: int) -> None:
    import jaxmamba.kernels.matmul as matmul
    import jaxmamba.kernels.matmul.gpu as gpu
    import jaxmamba.model.layers as layers

    matmul.MAX_ROWS = gpu.MAX_ROWS = layers.MAX_ROWS = rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="nemotron-nano-9b-v2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-rows", type=int, default=0)
    args = ap.parse_args()
    if args.max_rows:
        patch_max_rows(args.max_rows)

    from bench_cold_start import random_params

    from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
    from jaxmamba.engine.runner import ModelRunner
    from jaxmamba.model.cache import CacheSpec
    from jaxmamba.model.families import load_config

    cfg = load_config(args.model)
    params = random_params(args.model, "bfloat16")
    page = 16
    pages_per_seq = -(-(args.context + args.steps + 1) // page)
    worst = 0.0
    for batch in args.batch:
        spec = CacheSpec(num_slots=batch, num_pages=batch * pages_per_seq, page_size=page)
        runners = {
            name: ModelRunner(cfg, params, spec, dtype=jnp.bfloat16, small_m_impl=small_m)
            for name, small_m in (("xla", "xla"), ("kernel", "auto"))
        }
        leaves, tree = jax.tree.flatten(runners["xla"].cache)
        keys = jax.random.split(jax.random.PRNGKey(batch), len(leaves))
        cache = jax.tree.unflatten(tree, [
            (0.5 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating) else x
            for k, x in zip(keys, leaves, strict=True)
        ])  # fmt: skip
        for r in runners.values():
            r.cache = jax.tree.map(jnp.copy, cache)
        builder = StepBuilder(spec, pages_per_seq, cfg.vocab_size, cfg.chunk_size)
        rng = np.random.default_rng(batch)
        tokens = rng.integers(0, cfg.vocab_size, batch).tolist()
        agree = total = 0
        for step in range(args.steps):
            rows = [
                RowSpec([tokens[b]], args.context + step, b,
                        list(range(b * pages_per_seq, (b + 1) * pages_per_seq)))
                for b in range(batch)
            ]  # fmt: skip
            inputs = builder.build(rows, Bucket(batch, batch, batch))
            start = time.perf_counter()
            logits = {n: np.asarray(r.forward_logits(inputs, batch), np.float32)[:batch]
                      for n, r in runners.items()}  # fmt: skip
            scale = np.abs(logits["xla"]).max()
            err = np.abs(logits["kernel"] - logits["xla"]).max()
            worst = max(worst, err / scale)
            top = {n: v.argmax(-1) for n, v in logits.items()}
            agree += int((top["kernel"] == top["xla"]).sum())
            total += batch
            states = max(
                float(jnp.abs(a[:batch].astype(jnp.float32) - b[:batch].astype(jnp.float32)).max())
                for a, b in zip(runners["xla"].cache.ssm, runners["kernel"].cache.ssm, strict=True)
            )
            print(f"batch {batch} step {step}: max |dlogit| {err:.4f} at logit scale {scale:.2f}, "
                  f"arg-max agrees {int((top['kernel'] == top['xla']).sum())}/{batch}, "
                  f"max |d ssm state| {states:.2e} ({time.perf_counter() - start:.1f} s)",
                  flush=True)  # fmt: skip
            tokens = top["xla"].tolist()  # both runners follow the same greedy path
        print(f"batch {batch}: arg-max agrees on {agree}/{total} rows", flush=True)
    print(f"worst max |dlogit| / logit scale: {worst:.2e}")


if __name__ == "__main__":
    main()
