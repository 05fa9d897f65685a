"""The model-family registry, one module per HF `model_type`, and the readers of model specs
and HF configs (`load_config`, `config_from_hf`, `hf_config_from`). Host side (numpy only).

A family is
  * a config adapter: HF `config.json` -> the frozen `ModelConfig` (its block structure is
    `ModelConfig.layer_types`: one entry per pre-norm residual sub-block, so an HF decoder
    layer with a mixer and a feed-forward is two of ours), raising on every field whose value
    we do not implement, naming it;
  * a parameter map: our param paths <- HF tensor names and layouts (`common.Entry`),
    constant multipliers folded into the weights where HF applies them to a projection.
The engine, the cache, the metadata and the kernels are shared and never ask which family
runs; the model reads only `ModelConfig` fields. Adding a family is a module here, a line
in `FAMILIES` and its `model_type` in `jaxmamba.config.MODEL_TYPES`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from jaxmamba.config import ModelConfig, list_presets, preset_path
from jaxmamba.model.families import (
    bamba,
    falcon_h1,
    granitemoehybrid,
    mamba2,
    nemotron_h,
    qwen3_5,
    qwen3_next,
)
from jaxmamba.model.families.common import Family, with_eos_ids

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (nemotron_h.FAMILY, mamba2.FAMILY, bamba.FAMILY, granitemoehybrid.FAMILY,
              falcon_h1.FAMILY, qwen3_next.FAMILY, qwen3_5.TEXT, qwen3_5.MOE_TEXT,
              qwen3_5.MULTIMODAL, qwen3_5.MOE_MULTIMODAL)
}  # fmt: skip

# Model types close to a registered family whose difference we do not implement, and why.
UNSUPPORTED = {
    "kimi_linear": (
        "its linear_attention layers (linear_attn_config.kda_layers) are Kimi Delta Attention, "
        "whose decay is per key channel (f_a_proj/f_b_proj), where Gated DeltaNet's is one "
        "scalar per head (A_log, dt_bias); its full_attention layers are MLA (kv_lora_rank)"
    ),
}


def get_family(model_type: str) -> Family:
    if model_type in UNSUPPORTED:
        raise ValueError(f"unsupported model_type {model_type!r}: {UNSUPPORTED[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {tuple(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def config_from_hf(config: dict[str, Any] | str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of an HF `config.json` (a dict, the file, or the directory holding
    it), read by the family of its `model_type`. Read from a file, the stop ids also include
    those of the `generation_config.json` beside it."""
    name, generation = "", {}
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        name = path.parent.name
        config = _read_json(path, "HF config")
        generation_path = path.parent / "generation_config.json"
        if generation_path.is_file():
            generation = _read_json(generation_path, "generation config")
    cfg = get_family(config.get("model_type")).from_hf(config, name)
    # HF and vLLM stop on every eos id of both files; config.json's first one leads.
    # A multimodal checkpoint (Qwen3.5's top-level config) keeps the text model's ids in
    # its text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return with_eos_ids(
        cfg,
        ("HF config", config),
        ("HF config text_config", text),
        ("generation_config.json", generation),
    )


def hf_config_from(cfg: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict that transformers loads as the model of `cfg`."""
    family = get_family(cfg.model_type)
    if family.to_hf is None:
        raise ValueError(f"writing a {cfg.model_type} config.json is not implemented")
    return family.to_hf(cfg)


def config_from_preset(name: str) -> ModelConfig:
    """A preset's config: `configs/<name>.yaml`, or the checkpoint in `configs/<name>/`."""
    path = preset_path(name)
    if path is None:
        raise ValueError(f"unknown model preset {name!r}; available: {list_presets()}")
    return config_from_hf(path) if path.is_dir() else ModelConfig.from_yaml(path)


def load_config(spec: str | os.PathLike | ModelConfig) -> ModelConfig:
    """The `ModelConfig` a model spec names: a preset name, a YAML file, an HF config.json, or
    a directory holding config.json."""
    if isinstance(spec, ModelConfig):
        return spec
    path = Path(spec)
    if path.is_dir():
        return config_from_hf(path)
    if path.suffix in (".yaml", ".yml"):
        return ModelConfig.from_yaml(path)
    if path.suffix == ".json":
        return config_from_hf(path)
    if _HUB_ID.fullmatch(str(spec)) and not path.exists():
        raise ValueError(
            f"model {str(spec)!r} is neither a local directory nor a preset, and jaxmamba "
            "does not reach model hubs: download the checkpoint first (e.g. `hf download "
            f"{spec} --local-dir DIR`) and pass that folder as the model; presets: "
            f"{list_presets()}"
        )
    if os.sep in str(spec) or path.exists():
        raise ValueError(
            f"model spec {str(spec)!r} is neither a directory with config.json, "
            "a .yaml file nor a .json file"
        )
    return config_from_preset(str(spec))


# A model hub's repository id, `owner/name` (Hugging Face's form).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{what} {path} is not a JSON object")
    return d
