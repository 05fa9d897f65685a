"""What every module of the GPU tier shares: when it runs, at which shapes, and how close is
close enough.

The tier runs on a CUDA GPU (``jax.default_backend() == "gpu"``): each kernel compiled by
Triton (``interpret=False``) at the per-layer shapes of the presets in ``configs/``.
Elsewhere every module skips at collection, unless ``JAXMAMBA_GPU_TIER_INTERPRET=1``: then
the same tests run on any backend with the kernels interpreted and every shape swapped for its
family's tiny preset (``TOY``) and a sixteenth of the tokens, which checks the tier's own
logic on CPU. ``--gpu-full`` (tests/conftest.py; env ``JAXMAMBA_GPU_TIER=full``) adds the
rest of the presets, float32 and the block-size regimes the default selection leaves out.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.config import ModelConfig
from jaxmamba.model.families import config_from_preset

INTERPRET = os.environ.get("JAXMAMBA_GPU_TIER_INTERPRET") == "1"
FULL = os.environ.get("JAXMAMBA_GPU_TIER") == "full"
ON_GPU = jax.default_backend() == "gpu"

# Each published model's stand-in under JAXMAMBA_GPU_TIER_INTERPRET: a tiny preset of its
# family, so the interpreted kernels see the same kinds of layers in seconds.
TOY = {
    "nemotron-nano-9b-v2": "nemotron-h-tiny",
    "nemotron-3-nano-30b-a3b": "nemotron-h-tiny",
    "falcon-h1-7b": "nemotron-h-tiny",
    "granite-4.0-h-small": "nemotron-h-tiny",
    "mamba2-2.7b": "nemotron-h-tiny",
    "qwen3.5-9b": "qwen3-next-tiny",
    "qwen3.5-27b": "qwen3-next-tiny",
    "qwen3.5-0.8b": "qwen3-next-tiny",
    "qwen3.5-35b-a3b": "qwen3-next-tiny",
    "qwen3-next-80b-a3b": "qwen3-next-tiny",
}

# Largest |kernel - reference| over the largest |reference|, by dtype. bf16: a few bf16
# ulps (2^-8) of the output's scale, where the kernel and the reference round their bf16
# operands and partial results at different points. float32: the GPU kernels' dots run on
# tensor cores in tf32 (10-bit mantissa), the references in full float32.
TOL = {jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float32): 5e-3}


def skip_unless_gpu() -> None:
    """Skip the calling module at collection unless the tier can run here."""
    if not (ON_GPU or INTERPRET):
        pytest.skip(
            f"GPU tier: jax.default_backend() is {jax.default_backend()!r}, not 'gpu' "
            "(JAXMAMBA_GPU_TIER_INTERPRET=1 runs it interpreted at toy shapes)",
            allow_module_level=True,
        )


def cases(quick: list, full: list) -> list:
    """The default selection, plus ``full`` under ``--gpu-full``."""
    return quick + full if FULL else quick


def preset(name: str, toy: str | None = None) -> ModelConfig:
    """The config of preset ``name``; when interpreting, ``toy`` or its family's tiny preset."""
    return config_from_preset((toy or TOY.get(name, name)) if INTERPRET else name)


def tokens(n: int) -> int:
    """A case's token count: ``n`` on the GPU, a sixteenth (at least 8) when interpreting."""
    return max(8, n // 16) if INTERPRET else n


def lengths(sizes: list[int], total: int) -> list[int]:
    """Sequence lengths in the proportions of ``sizes`` (zeros stay empty) that sum to at most
    ``tokens(total)``, leaving padding tokens at the end of the bucket."""
    budget = tokens(total) - 3
    scale = budget / sum(sizes)
    return [min(s, max(1, int(s * scale))) if s else 0 for s in sizes]


def cu_seqlens(seq_lengths: list[int]) -> jax.Array:
    return jnp.asarray(np.concatenate([[0], np.cumsum(seq_lengths)]), jnp.int32)


class Rand:
    """Random arrays made on the device (model-shape inputs would take seconds on the host)."""

    def __init__(self, seed: int):
        self.key = jax.random.key(seed)

    def _next(self):
        self.key, key = jax.random.split(self.key)
        return key

    def normal(self, shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
        return (scale * jax.random.normal(self._next(), shape, jnp.float32)).astype(dtype)

    def uniform(self, shape, lo=0.0, hi=1.0) -> jax.Array:
        return jax.random.uniform(self._next(), shape, jnp.float32, lo, hi)

    def ints(self, shape, hi: int) -> jax.Array:
        return jax.random.randint(self._next(), shape, 0, hi, jnp.int32)


def poison(x: jax.Array, real: int) -> jax.Array:
    """NaN in the padding tokens (rows ``real:``): a kernel that lets them reach a real
    output or state fails loudly."""
    return x.at[real:].set(jnp.nan)


def assert_close(got, want, dtype, what: str, tol: float | None = None) -> float:
    """``max |got - want| / max |want| <= tol`` (``TOL[dtype]`` by default), and no NaN or
    inf in ``got`` where ``want`` is finite. Returns the error."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape}"
    finite = np.isfinite(want)
    bad = finite & ~np.isfinite(got)
    assert not bad.any(), f"{what}: {bad.sum()} non-finite values where the reference is finite"
    tol = TOL[jnp.dtype(dtype)] if tol is None else tol
    scale = max(np.abs(want[finite]).max(initial=0.0), 1e-6)
    err = float(np.abs(got - want)[finite].max(initial=0.0) / scale)
    assert err <= tol, f"{what}: max |kernel - ref| / max |ref| = {err:.2e} > {tol:.0e}"
    return err


def truncated(cfg: ModelConfig, layer_types: tuple[str, ...], **changes) -> ModelConfig:
    """``cfg`` with only ``layer_types`` (and other fields changed): a published model's
    layer shapes at a fraction of its weights."""
    return dataclasses.replace(cfg, layer_types=tuple(layer_types), **changes)
