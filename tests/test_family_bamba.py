"""Bamba (`bamba`) against transformers' BambaForCausalLM: random weights, fp32 (bf16 once)."""

from __future__ import annotations

import pytest
from family_checks import (
    check_bf16_prefill_logits,
    check_generation,
    check_prefill_logits,
)

from jaxmamba.model.families import load_config

from hf_fixtures import save_random_checkpoint


def make_bamba(path, *, attn_layer_indices, n_groups, seed, **kw):
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=40,
        num_hidden_layers=3, attn_layer_indices=attn_layer_indices,
        num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=n_groups, mamba_d_state=8,
        mamba_chunk_size=8, rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        **kw,
    )  # fmt: skip
    return save_random_checkpoint(BambaForCausalLM(config), path, seed)


@pytest.fixture(scope="module")
def mamba_first(tmp_path_factory):
    return make_bamba(tmp_path_factory.mktemp("b1"), attn_layer_indices=[1], n_groups=2, seed=0)


@pytest.fixture(scope="module")
def attention_first(tmp_path_factory):
    return make_bamba(
        tmp_path_factory.mktemp("b2"), attn_layer_indices=[0, 2], n_groups=4, seed=1,
        mamba_proj_bias=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
    )  # fmt: skip


def test_config_maps_each_hf_layer_to_a_mixer_and_a_swiglu_mlp(mamba_first):
    cfg = load_config(str(mamba_first[0]))
    assert cfg.layer_types == ("mamba", "mlp", "attention", "mlp", "mamba", "mlp")
    assert (cfg.mlp_activation, cfg.rope_theta, cfg.head_dim, cfg.rope_dim) == (
        "silu_glu",
        300.0,
        8,
        4,
    )


def test_prefill_logits_match_hf(mamba_first, attention_first):
    check_prefill_logits(*mamba_first)
    check_prefill_logits(*attention_first, seed=1)


def test_bf16_prefill_logits_match_hf_bf16(mamba_first):
    check_bf16_prefill_logits(*mamba_first)


def test_generation_chunked_prefill_and_prefix_hit_match_hf_generate(mamba_first):
    check_generation(*mamba_first)


def test_unsupported_rope_type_is_named():
    from jaxmamba.model.families.bamba import from_hf

    with pytest.raises(ValueError, match="rope_type='yarn'"):
        from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "x")
