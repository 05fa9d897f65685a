"""The compute dtypes a model runs in, by name, and what dtype="auto" picks for a model."""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp

from jaxmamba.config import checkpoint_dir

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}

# A checkpoint's `torch_dtype` → the compute dtype of dtype="auto". The engine has no float16
# path, so float16 checkpoints run in bfloat16 (same width, wider exponent).
_AUTO_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


def resolve_dtype(dtype: str, model: str) -> str:
    """The dtype name for `dtype`; "auto" is the checkpoint's `torch_dtype` (float32 when it
    names none), and float32 for random-weight presets."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return dtype
    path = checkpoint_dir(model)
    if path is None:
        return "float32"  # random weights: the exact reference dtype
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"  # load_config reports the unreadable file
    named = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    if named is None:
        return "float32"
    if named not in _AUTO_DTYPES:
        raise ValueError(
            f"{path / 'config.json'} torch_dtype={named!r} is unsupported: "
            f"expected one of {sorted(_AUTO_DTYPES)}, or pass dtype explicitly"
        )
    if named == "float16":
        logger.info("dtype='auto': the float16 checkpoint %s runs in bfloat16", path)
    return _AUTO_DTYPES[named]
