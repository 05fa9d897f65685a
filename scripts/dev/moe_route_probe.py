"""Which experts a whole-model decode step routes to, per MoE layer, on this backend.

`python3 scripts/dev/moe_route_probe.py [--shrink] [--batch 32]`: the preset's random weights
(`bench_moe.fast_random_params`), one decode step of `--batch` rows through
`bench.bench_one_batch` (`fill_cache=False`: random states), the router's choices read back
with a debug callback (a diagnostic: it puts the host in the step). Prints, per MoE layer, the
distinct experts hit against the uniform-routing expectation (`bench.experts_hit`) and whether
any router logit is not finite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_moe  # noqa: E402

import jaxmamba.model.moe as moe  # noqa: E402
from jaxmamba import bench  # noqa: E402
from jaxmamba.model.families import load_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    p.add_argument("--shrink", action="store_true")
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    cfg = load_config(args.model)
    if args.shrink:
        cfg = bench_moe.shrink(cfg)
    seen: list[tuple[np.ndarray, bool]] = []
    route = moe.route_sigmoid_grouped

    def probed(logits, *a, **k):
        weights, idx = route(logits, *a, **k)
        finite = jnp.isfinite(logits).all()
        jax.debug.callback(lambda i, f: seen.append((np.asarray(i), bool(f))), idx, finite)
        return weights, idx

    moe.route_sigmoid_grouped = probed
    params = jax.block_until_ready(bench_moe.fast_random_params(cfg, jnp.bfloat16))
    bench.bench_one_batch(
        cfg, params, batch=args.batch, input_len=64, output_len=1, dtype=jnp.bfloat16,
        repeats=1, phases=("decode",), fill_cache=False, log=lambda m: None,
    )  # fmt: skip
    jax.effects_barrier()
    moe_layers = cfg.layer_types.count("moe")
    expected = bench.experts_hit(cfg, args.batch)
    print(f"{jax.devices()[0].device_kind}: {len(seen)} router calls, {moe_layers} MoE layers, "
          f"uniform routing hits {expected:.1f} experts a layer at batch {args.batch}")  # fmt: skip
    for n, (idx, finite) in enumerate(seen[:moe_layers]):
        rows = idx[: args.batch]
        print(f"layer {n:2d}: {len(np.unique(rows)):3d} distinct experts, logits finite {finite}, "
              f"top-1 of the first rows {rows[:6, 0].tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
