"""The grouped-matmul MoE path (`impl="auto"`: the Pallas kernel on CUDA) against the gathered
reference at the Nemotron 3 Nano expert shapes, uniform random routing:
`python3 scripts/dev/moe_kernel_check.py [--tokens 1 32 128] [--small]`."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxmamba.model.moe import grouped_experts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 32, 128])
    p.add_argument("--small", action="store_true", help="toy shapes (a CPU check)")
    args = p.parse_args()
    E, F, X, k = (64, 32, 16, 6) if args.small else (2688, 1856, 128, 6)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    w_up = jax.random.normal(keys[1], (X, E, F), jnp.bfloat16) * 0.02
    w_down = jax.random.normal(keys[2], (X, F, E), jnp.bfloat16) * 0.02
    for T in args.tokens:
        x = jax.random.normal(jax.random.fold_in(keys[0], T), (T, E), jnp.bfloat16)
        idx = jax.lax.top_k(jax.random.normal(jax.random.fold_in(keys[3], T), (T, X)), k)[1]
        w = jax.random.uniform(jax.random.fold_in(keys[4], T), (T, k))
        out = grouped_experts(x, w, idx, w_up, w_down, "relu2", jnp.bfloat16)
        ref = grouped_experts(x, w, idx, w_up, w_down, "relu2", jnp.bfloat16, impl="ref",
                              method="gathered")  # fmt: skip
        err = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
        print(f"T={T:4d}: max |auto - gathered ref| / max |ref| = {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
