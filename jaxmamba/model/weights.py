"""A model's weights, wherever they come from: a converted (Orbax) checkpoint, an HF
checkpoint (quantized or not), or random weights for a YAML preset."""

from __future__ import annotations

import logging

from jaxmamba.config import ModelConfig, checkpoint_dir

logger = logging.getLogger(__name__)


def checkpoint_quantization(model: str):
    """The quantization scheme of `model`'s HF checkpoint (`quantization.read_quantization`);
    None for a float checkpoint or a preset without one."""
    from jaxmamba.model.orbax_io import is_orbax_model
    from jaxmamba.model.quantization import read_quantization

    path = checkpoint_dir(model)
    if path is None or is_orbax_model(path):
        return None
    return read_quantization(path)


def load_params(model: str, cfg: ModelConfig, dtype, seed: int, quantization: str | None = None):
    """An HF checkpoint (a directory or a checkpoint preset) → its weights; a YAML preset or
    file → random weights from `seed`. The model code is imported here, on use: serving an
    exported artifact never loads it.

    `quantization` ("fp8", "int8"; vLLM's setting) quantizes a float model's projection and
    expert weights once loaded (`quantization.quantize_params`). A quantized checkpoint loads
    as published: "fp8" changes nothing there (its excluded layers stay as they are), and
    another method is refused."""
    from jaxmamba.engine.config import QUANTIZATION_METHODS
    from jaxmamba.model.params import init_params, param_shapes
    from jaxmamba.model.quantization import quantize_params

    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={quantization!r} is unsupported: only {QUANTIZATION_METHODS} or None"
        )
    scheme = checkpoint_quantization(model)
    if scheme is not None and quantization not in (None, "fp8"):
        raise ValueError(
            f"quantization={quantization!r} cannot apply to {model}: it is an FP8 checkpoint "
            f"({scheme.source}); leave quantization unset (or 'fp8')"
        )
    path = checkpoint_dir(model)
    if path is None:
        params = init_params(cfg, dtype, seed)
    else:
        from jaxmamba.model.orbax_io import is_orbax_model, load_orbax_model

        if is_orbax_model(path):  # `jaxmamba convert` output: weights in Orbax
            params = load_orbax_model(path, cfg, dtype)
        else:
            from jaxmamba.model.loader import load_hf_checkpoint

            params = load_hf_checkpoint(path, cfg, dtype=dtype, expected=param_shapes(cfg, dtype))
    if quantization is None or scheme is not None:
        return params
    logger.info("quantization=%s: quantizing the projection and expert weights", quantization)
    return quantize_params(params, cfg, quantization)
