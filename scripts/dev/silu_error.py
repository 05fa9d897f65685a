"""Error of the GPU conv kernels' SiLU (``jaxmamba.kernels.conv1d.gpu.silu``), exact and
approximate (``tanh.approx``, the bf16 outputs' form), on the GPU against float64, over a
dense sweep of float32 inputs: the inline assembly has no interpreter, so its error can only
be read on the device.

    python3 scripts/dev/silu_error.py [--points 2000001] [--limit 30]
    python3 scripts/dev/silu_error.py --smoke    # CPU: interpret mode (jnp.tanh), few points

Per form and input range: the largest absolute error, the largest error relative to
|SiLU(y)|, and the largest error in units of the bf16 spacing at SiLU(y) (the kernels store
bf16: under half a spacing, the form's error is smaller than the store's own rounding).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxmamba.kernels.conv1d.gpu import silu

BLOCK = 1024
FORMS = {"exact": False, "tanh.approx": True}  # name: silu's ``approx``
RANGES = ((-30.0, -8.0), (-8.0, -2.0), (-2.0, 0.0), (0.0, 2.0), (2.0, 30.0))


def silu_on_device(y: jax.Array, approx: bool, interpret: bool) -> jax.Array:
    def kernel(y_ref, out_ref):
        out_ref[...] = silu(y_ref[...], approx=approx, interpret=interpret)

    return pl.pallas_call(
        kernel,
        grid=(y.shape[0] // BLOCK,),
        in_specs=[pl.BlockSpec((BLOCK,), lambda i: (i,))],
        out_specs=pl.BlockSpec((BLOCK,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(y.shape, jnp.float32),
        interpret=interpret,
    )(y)


def bf16_spacing(v: np.ndarray) -> np.ndarray:
    """The gap between bf16 numbers at |v| (8 significant bits)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(v), np.finfo(np.float32).tiny)))
    return np.exp2(exponent - 7)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", type=int, default=2_000_001)
    parser.add_argument("--limit", type=float, default=30.0)
    parser.add_argument("--smoke", action="store_true", help="CPU: interpret mode, 10k points")
    args = parser.parse_args()
    if args.smoke:
        args.points = min(args.points, 10_000)
    points = -(-args.points // BLOCK) * BLOCK
    y = np.linspace(-args.limit, args.limit, points, dtype=np.float32)
    exact = y.astype(np.float64) / (1.0 + np.exp(-y.astype(np.float64)))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {points} inputs")
    print("| form | y range | max abs err | max rel err | max err / bf16 spacing |")
    print("|---|---|---|---|---|")
    for form, approx in FORMS.items():
        run = functools.partial(silu_on_device, approx=approx, interpret=args.smoke)
        got = np.asarray(jax.jit(run)(jnp.asarray(y)))
        err = np.abs(got.astype(np.float64) - exact)
        for lo, hi in RANGES:
            m = (y >= lo) & (y < hi)
            rel = err[m] / np.maximum(np.abs(exact[m]), 1e-30)
            ulps = err[m] / bf16_spacing(exact[m])
            print(
                f"| {form} | [{lo:g}, {hi:g}) | {err[m].max():.2e} | {rel.max():.2e} | "
                f"{ulps.max():.3f} |"
            )


if __name__ == "__main__":
    main()
