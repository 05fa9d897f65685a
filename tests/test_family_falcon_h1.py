"""Falcon-H1 (`falcon_h1`) against transformers' FalconH1ForCausalLM: random weights, every µP
multiplier away from 1, with and without the Mamba gated norm; fp32 (bf16 once)."""

from __future__ import annotations

import pytest
from family_checks import (
    check_bf16_prefill_logits,
    check_generation,
    check_prefill_logits,
)

from jaxmamba.model.families import load_config

from hf_fixtures import save_random_checkpoint

MULTIPLIERS = dict(
    embedding_multiplier=1.3, lm_head_multiplier=0.6, mlp_multipliers=[0.8, 1.4],
    key_multiplier=0.7, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], ssm_in_multiplier=1.1, ssm_out_multiplier=0.8,
)  # fmt: skip


def make_falcon(path, *, num_layers, n_groups, seed, **kw):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=64,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=n_groups, mamba_d_state=8,
        mamba_chunk_size=8, rope_parameters={"rope_type": "default", "rope_theta": 700.0},
        **kw,
    )  # fmt: skip
    return save_random_checkpoint(FalconH1ForCausalLM(config), path, seed)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_falcon(tmp_path_factory.mktemp("f1"), num_layers=2, n_groups=2, seed=0,
                       **MULTIPLIERS)  # fmt: skip


@pytest.fixture(scope="module")
def normed(tmp_path_factory):
    return make_falcon(
        tmp_path_factory.mktemp("f2"), num_layers=3, n_groups=4, seed=1, mamba_rms_norm=True,
        mamba_norm_before_gate=False, mamba_proj_bias=True, projectors_bias=True,
        attention_bias=True, **MULTIPLIERS,
    )  # fmt: skip


def test_config_pairs_a_parallel_layer_with_an_mlp(plain):
    cfg = load_config(str(plain[0]))
    assert cfg.layer_types == ("parallel", "mlp", "parallel", "mlp")
    assert cfg.mamba_layers == (0, 2) and cfg.attention_layers == (0, 2)
    assert (cfg.embedding_multiplier, cfg.logits_multiplier) == (1.3, 0.6)
    assert dict(cfg.weight_multipliers)["ssm_multipliers"] == (0.9, 1.1, 0.8, 1.2, 0.7)
    assert not cfg.mamba_rms_norm and cfg.rope_dim == 8


def test_prefill_logits_match_hf(plain, normed):
    check_prefill_logits(*plain)
    check_prefill_logits(*normed, seed=1)


def test_bf16_prefill_logits_match_hf_bf16(plain):
    check_bf16_prefill_logits(*plain)


# HF's greedy choice here includes token id vocab_size - 1 (which sampling once always masked).
def test_generation_chunked_prefill_and_prefix_hit_match_hf_generate(plain):
    check_generation(*plain)


def test_norm_before_gate_is_refused():
    from jaxmamba.model.families.falcon_h1 import from_hf

    with pytest.raises(ValueError, match="mamba_norm_before_gate=True"):
        from_hf({"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "x")
