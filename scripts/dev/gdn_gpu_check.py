"""The Gated DeltaNet model path on the GPU: `qwen3-next-tiny` (and, with --model, any GDN
preset at reduced depth) through the runner with `impl="auto"` (the Pallas GPU kernels) and
`impl="ref"` (plain XLA), over a prefill, a chunked extension and decode steps; prints the
largest logit difference of each step and exits non-zero past the tolerance.

    python3 scripts/dev/gdn_gpu_check.py [--model qwen3-next-tiny] [--dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from jaxmamba.engine.runner import ModelRunner  # noqa: E402
from jaxmamba.model.families import config_from_preset  # noqa: E402
from jaxmamba.model.params import init_params  # noqa: E402

from model_helpers import make_runner, prefill_logits, row  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-next-tiny")
    p.add_argument("--layers", type=int, default=8, help="keep the first N of our layers")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tol", type=float, default=2e-3, help="relative to the logits' scale")
    args = p.parse_args()
    cfg = config_from_preset(args.model)
    cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[: args.layers])
    dtype = jnp.dtype(args.dtype)
    params = init_params(cfg, dtype, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, 128).tolist()
    steps = {}
    for impl in ("auto", "ref"):
        spec = make_runner(cfg, params, dtype=dtype).cache_spec
        runner = ModelRunner(cfg, params, spec, dtype=dtype, impl=impl)
        out = [prefill_logits(runner, [row(tokens[:100], 0, 0), row(tokens[:77], 0, 1)])]
        out.append(prefill_logits(runner, [row(tokens[100:120], 100, 0)]))
        for i in range(120, 126):
            out.append(prefill_logits(runner, [row(tokens[i : i + 1], i, 0)]))
        steps[impl] = [np.concatenate(o) for o in out]
    worst = 0.0
    for i, (a, b) in enumerate(zip(steps["auto"], steps["ref"], strict=True)):
        err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))
        worst = max(worst, err)
        print(f"step {i}: max |auto - ref| / max |ref| = {err:.2e}")
    print(f"worst {worst:.2e} (tol {args.tol:.0e})")
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
