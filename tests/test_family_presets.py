"""The family presets: published shapes, and the parameter map agrees with the model's tree."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from jaxmamba.model.families import config_from_hf, config_from_preset, hf_config_from
from jaxmamba.model.loader import checkpoint_param_shapes
from jaxmamba.model.params import param_shapes

PRESETS = ["nemotron-3-nano-30b-a3b", "granite-4.0-h-small", "falcon-h1-7b"]
GDN_PRESETS = ["qwen3-next-80b-a3b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b"]


def _count(tree) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(tree))


@pytest.mark.parametrize("preset", PRESETS + GDN_PRESETS)
def test_parameter_map_matches_the_model_parameters(preset):
    cfg = config_from_preset(preset)
    assert checkpoint_param_shapes(cfg, jnp.bfloat16) == param_shapes(cfg, jnp.bfloat16)


def test_nemotron_3_nano_has_its_published_size():
    cfg = config_from_preset("nemotron-3-nano-30b-a3b")
    assert (cfg.num_mamba_layers, cfg.num_attention_layers, cfg.layer_types.count("moe")) == (
        23,
        6,
        23,
    )
    total = _count(checkpoint_param_shapes(cfg))
    per_expert = 2 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = 23 * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    # The model card: 31.6B total, 3.2B active without embeddings (3.5B with them).
    assert 31.0e9 < total < 32.2e9, total
    assert 3.3e9 < total - idle < 3.7e9, total - idle


@pytest.mark.parametrize("preset", GDN_PRESETS + ["qwen3-next-tiny", "qwen3.5-0.8b"])
def test_gdn_presets_are_what_their_config_json_reads_as(preset):
    """A preset written as an HF config.json reads back as itself: its fields are exactly
    what the family adapter makes of the published config."""
    cfg = config_from_preset(preset)
    back = config_from_hf(hf_config_from(cfg))
    assert dataclasses.replace(back, name=cfg.name) == cfg
