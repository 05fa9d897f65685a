"""Granite 4.0-H (`granitemoehybrid`) against transformers' GraniteMoeHybridForCausalLM: random
weights, µP multipliers away from 1, MoE and dense, RoPE and none; fp32 (bf16 once)."""

from __future__ import annotations

import pytest
from family_checks import (
    check_bf16_prefill_logits,
    check_generation,
    check_prefill_logits,
)

from jaxmamba.model.families import load_config

from hf_fixtures import save_random_checkpoint


def make_granite(path, *, layer_types, n_groups, seed, **kw):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=97, hidden_size=32, intermediate_size=24, shared_intermediate_size=40,
        num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=n_groups, mamba_d_state=8,
        mamba_chunk_size=8, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw,
    )  # fmt: skip
    return save_random_checkpoint(GraniteMoeHybridForCausalLM(config), path, seed)


@pytest.fixture(scope="module")
def moe_rope(tmp_path_factory):
    return make_granite(
        tmp_path_factory.mktemp("g1"), layer_types=["mamba", "attention", "mamba"], n_groups=2,
        seed=0, num_local_experts=6, num_experts_per_tok=2, position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2,
        logits_scaling=2.5, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dense_nope(tmp_path_factory):
    return make_granite(
        tmp_path_factory.mktemp("g2"), layer_types=["attention", "mamba"], n_groups=4, seed=1,
        num_local_experts=0, position_embedding_type="nope", residual_multiplier=0.5,
        mamba_proj_bias=True, attention_bias=True,
    )  # fmt: skip


def test_config_reads_the_multipliers_and_the_moe(moe_rope, dense_nope):
    cfg = load_config(str(moe_rope[0]))
    assert cfg.layer_types == ("mamba", "moe", "attention", "moe", "mamba", "moe")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 24)
    assert (cfg.moe_shared_intermediate_size, cfg.rope_theta, cfg.rope_dim) == (40, 500.0, 8)
    assert (cfg.attention_scale, cfg.embedding_multiplier, cfg.residual_multiplier) == (
        0.2,
        1.5,
        0.7,
    )
    assert cfg.logits_multiplier == pytest.approx(1 / 2.5)
    dense = load_config(str(dense_nope[0]))
    assert dense.layer_types == ("attention", "mlp", "mamba", "mlp") and dense.rope_theta == 0
    assert dense.intermediate_size == 40 and dense.num_experts == 0


def test_prefill_logits_match_hf(moe_rope, dense_nope):
    check_prefill_logits(*moe_rope)
    check_prefill_logits(*dense_nope, seed=1)


def test_bf16_prefill_logits_match_hf_bf16(dense_nope):
    check_bf16_prefill_logits(*dense_nope)


def test_generation_chunked_prefill_and_prefix_hit_match_hf_generate(moe_rope):
    check_generation(*moe_rope)
