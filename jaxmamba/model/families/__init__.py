"""The model-family registry: one module per HF `model_type`. Host side (numpy only).

A family is
  * a config adapter: HF `config.json` -> the frozen `ModelConfig` (its block structure is
    `ModelConfig.layer_types`: one entry per pre-norm residual sub-block, so an HF decoder
    layer with a mixer and a feed-forward is two of ours), raising on every field whose value
    we do not implement, naming it;
  * a parameter map: our param paths <- HF tensor names and layouts (`common.Entry`),
    constant multipliers folded into the weights where HF applies them to a projection.
The engine, the cache, the metadata and the kernels are shared and never ask which family
runs; the model reads only `ModelConfig` fields. Adding a family is a module here and a line
in `FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxmamba.config import ModelConfig
    from jaxmamba.model.families.common import Entry


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the HF `architectures[0]` of its causal LM
    from_hf: Callable[[dict, str], ModelConfig]  # config.json dict, name -> ModelConfig
    param_map: Callable[[ModelConfig], list[Entry]]
    # Prefixes of the base model in checkpoints, tried in order; the first is what we write.
    base_prefixes: tuple[str, ...] = ("model.", "")
    # ModelConfig -> config.json dict, for writing checkpoints (None: not implemented).
    to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None


def _registry() -> dict[str, Family]:
    from jaxmamba.model.families import (
        bamba,
        falcon_h1,
        granitemoehybrid,
        mamba2,
        nemotron_h,
        qwen3_5,
        qwen3_next,
    )

    families = (nemotron_h.FAMILY, mamba2.FAMILY, bamba.FAMILY, granitemoehybrid.FAMILY,
                falcon_h1.FAMILY, qwen3_next.FAMILY, qwen3_5.TEXT, qwen3_5.MOE_TEXT,
                qwen3_5.MULTIMODAL, qwen3_5.MOE_MULTIMODAL)  # fmt: skip
    return {f.model_type: f for f in families}


_FAMILIES: dict[str, Family] | None = None

# Model types close to a registered family whose difference we do not implement, and why.
UNSUPPORTED = {
    "kimi_linear": (
        "its linear_attention layers (linear_attn_config.kda_layers) are Kimi Delta Attention, "
        "whose decay is per key channel (f_a_proj/f_b_proj), where Gated DeltaNet's is one "
        "scalar per head (A_log, dt_bias); its full_attention layers are MLA (kv_lora_rank)"
    ),
}


def families() -> dict[str, Family]:
    """Every registered family by `model_type`."""
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _registry()
    return _FAMILIES


def get_family(model_type: str) -> Family:
    registry = families()
    if model_type in UNSUPPORTED:
        raise ValueError(f"unsupported model_type {model_type!r}: {UNSUPPORTED[model_type]}")
    if model_type not in registry:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {tuple(sorted(registry))}"
        )
    return registry[model_type]
