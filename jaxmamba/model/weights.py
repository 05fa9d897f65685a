"""A model's weights, wherever they come from: a converted (Orbax) checkpoint, an HF
checkpoint, or random weights for a YAML preset."""

from __future__ import annotations

from jaxmamba.config import ModelConfig, checkpoint_dir


def load_params(model: str, cfg: ModelConfig, dtype, seed: int):
    """An HF checkpoint (a directory or a checkpoint preset) → its weights; a YAML preset or
    file → random weights from `seed`. The model code is imported here, on use: serving an
    exported artifact never loads it."""
    from jaxmamba.model.params import init_params, param_shapes

    path = checkpoint_dir(model)
    if path is None:
        return init_params(cfg, dtype, seed)
    from jaxmamba.model.orbax_io import is_orbax_model, load_orbax_model

    if is_orbax_model(path):  # `jaxmamba convert` output: weights in Orbax
        return load_orbax_model(path, cfg, dtype)
    from jaxmamba.model.loader import load_hf_checkpoint

    return load_hf_checkpoint(path, cfg, dtype=dtype, expected=param_shapes(cfg, dtype))
