"""A model's weights, wherever they come from: a converted (Orbax) checkpoint, an HF
checkpoint (quantized or not), or random weights for a YAML preset."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from jaxmamba.config import ModelConfig, checkpoint_dir

logger = logging.getLogger(__name__)


def checkpoint_quantization(model: str):
    """The quantization scheme of `model`'s HF checkpoint, or of the FP8 checkpoint that a
    `jaxmamba convert` directory holds as published (`quantization.read_quantization`); None
    for a float checkpoint or a preset without one."""
    from jaxmamba.model.quantization import read_quantization

    path = checkpoint_dir(model)
    return None if path is None else read_quantization(path)


def converted_quantization(model: str) -> str | None:
    """The method ("fp8", "int8") that `jaxmamba convert --quantization` quantized `model`'s
    weights with (`orbax_io.converted_quantization`); None for anything else."""
    from jaxmamba.model.orbax_io import converted_quantization as recorded

    path = checkpoint_dir(model)
    return None if path is None else recorded(path)


def load_params(model: str, cfg: ModelConfig, dtype, seed: int, quantization: str | None = None):
    """An HF checkpoint (a directory or a checkpoint preset) → its weights; a YAML preset or
    file → random weights from `seed`. The model code is imported here, on use: serving an
    exported artifact never loads it.

    `quantization` ("fp8", "int8"; vLLM's setting) quantizes a float model's projection and
    expert weights once loaded (`quantization.quantize_params`). A quantized checkpoint loads
    as published: "fp8" changes nothing there (its excluded layers stay as they are), and
    another method is refused, as is on a `jaxmamba convert --quantization` directory any
    method but the one it was converted with."""
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
    stored = converted_quantization(model)
    if stored is not None and quantization not in (None, stored):
        raise ValueError(
            f"quantization={quantization!r} cannot apply to {model}: `jaxmamba convert "
            f"--quantization {stored}` stored its weights quantized as {stored!r}; leave "
            f"quantization unset (or {stored!r})"
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
    if quantization is None or scheme is not None or stored is not None:
        return params
    logger.info("quantization=%s: quantizing the projection and expert weights", quantization)
    return quantize_params(params, cfg, quantization)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "auto",
                       quantization: str | None = None):  # fmt: skip
    """An HF checkpoint directory -> `dst/` with its config and tokenizer files and the
    weights (in the engine's layout, `dtype`: "auto" keeps the checkpoint's) as an Orbax
    checkpoint in `dst/orbax`; `LLM(dst)` restores it. Returns `dst`.

    The weights are those `load_params(src, ..., quantization)` gives: an FP8 checkpoint's as
    published (its quantization_config or hf_quant_config.json kept), a float one's quantized with
    `quantization` ("fp8", "int8"; recorded in config.json's `jaxmamba_quantization`)."""
    import shutil

    from jaxmamba.model.dtypes import DTYPES, resolve_dtype
    from jaxmamba.model.families import load_config
    from jaxmamba.model.orbax_io import (
        CONVERTED_FILES,
        ORBAX_SUBDIR,
        QUANTIZED_AT_CONVERSION,
        save_params,
    )
    from jaxmamba.model.quantization import read_quantization

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ValueError(f"{dst} exists: pick a new directory")
    if not src.is_dir():
        raise ValueError(f"{src} is not an HF checkpoint directory")
    cfg = load_config(str(src))
    jdtype = DTYPES[resolve_dtype(dtype, str(src))]
    params = load_params(str(src), cfg, jdtype, 0, quantization)
    dst.mkdir(parents=True)
    for name in CONVERTED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = np.dtype(jdtype).name  # what dtype="auto" then restores
    if quantization is not None and read_quantization(src) is None:
        config[QUANTIZED_AT_CONVERSION] = quantization
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_params(dst / ORBAX_SUBDIR, params)
    return dst
