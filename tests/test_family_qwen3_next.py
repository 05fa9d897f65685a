"""Qwen3-Next (`qwen3_next`) against transformers' Qwen3NextForCausalLM: random weights, heads
that divide awkwardly (3 value heads per key head, Dk != Dv, partial RoPE on 10 of 40 dims),
Gated DeltaNet and gated attention, MoE with a dense mlp_only layer; fp32 (bf16 once)."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from family_checks import (
    assert_logits_close,
    check_bf16_prefill_logits,
    check_generation,
    check_prefill_logits,
    hf_logits,
)

from jaxmamba.model.families import config_from_hf, get_family, hf_config_from, load_config
from jaxmamba.model.loader import checkpoint_param_shapes, load_hf_checkpoint, save_hf_checkpoint
from jaxmamba.model.moe import route_softmax
from jaxmamba.model.params import param_shapes

from hf_fixtures import make_qwen3_next_checkpoint


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("q1"), seed=0)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """No experts (every layer dense), tied embeddings, attention biases, eos ids listed."""
    return make_qwen3_next_checkpoint(
        tmp_path_factory.mktemp("q2"), layer_types=["full_attention", "linear_attention"],
        seed=1, num_experts=0, tie_word_embeddings=True, attention_bias=True,
        eos_token_id=[2, 5],
    )  # fmt: skip


def hf_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_config_reads_the_layers_heads_rope_and_moe(moe, dense):
    cfg = load_config(str(moe[0]))
    assert cfg.layer_types == ("gdn", "moe", "attention", "mlp", "gdn", "moe", "gdn", "moe")
    assert (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads) == (2, 6)
    assert (cfg.gdn_key_head_dim, cfg.gdn_value_head_dim, cfg.conv_kernel) == (24, 40, 4)
    assert (cfg.chunk_size, cfg.mamba_num_heads, cfg.use_conv_bias) == (64, 0, False)
    assert (cfg.head_dim, cfg.rope_dim, cfg.rope_theta) == (40, 10, 1000.0)
    assert cfg.attention_output_gate and cfg.attention_qk_norm and not cfg.attention_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 16)
    assert (cfg.moe_router, cfg.moe_norm_topk_prob, cfg.moe_shared_expert_gate) == (
        "softmax",
        True,
        True,
    )
    assert (cfg.moe_shared_intermediate_size, cfg.intermediate_size) == (24, 48)
    d = load_config(str(dense[0]))
    assert d.layer_types == ("attention", "mlp", "gdn", "mlp") and d.num_experts == 0
    assert d.tie_word_embeddings and d.attention_bias and d.eos_token_ids == (2, 5)


def test_config_round_trips_through_transformers(moe, dense):
    from transformers import Qwen3NextConfig

    for path, _ in (moe, dense):
        cfg = load_config(str(path))
        hf = Qwen3NextConfig(**hf_config_from(cfg))
        assert config_from_hf(hf.to_dict()) == dataclasses.replace(cfg, name="")
    cfg = load_config(str(moe[0]))
    with pytest.raises(ValueError, match="moe_router"):
        hf_config_from(dataclasses.replace(cfg, moe_router="softmax_topk"))


def test_parameter_map_matches_the_model_parameters(moe, dense):
    for path, _ in (moe, dense):
        cfg = load_config(str(path))
        assert checkpoint_param_shapes(cfg, jnp.bfloat16) == param_shapes(cfg, jnp.bfloat16)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_type='yarn'"),
        ("layer_types", ["linear_attention", "sliding_attention"] * 2, r"layer_types\[1\]"),
        ("layer_types", ["linear_attention"], "num_hidden_layers=4"),
        ("linear_num_value_heads", 5, "linear_num_value_heads=5"),
        ("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0"),
        ("decoder_sparse_step", 0, "decoder_sparse_step=0"),
        ("attn_output_gate", False, "attn_output_gate=False"),
    ],
)
def test_unsupported_values_are_refused_naming_the_field(moe, key, value, match):
    config = {**hf_config(moe[0]), key: value}
    with pytest.raises(ValueError, match=match):
        config_from_hf(config)


def test_kimi_linear_is_refused_naming_its_per_channel_decay():
    config = {"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": [1, 2]}}
    for call in (lambda: get_family("kimi_linear"), lambda: config_from_hf(config)):
        with pytest.raises(ValueError, match=r"kimi_linear.*kda_layers.*per key channel"):
            call()


def test_in_proj_columns_are_hf_q_k_v_z_b_a_in_head_order(moe):
    path, model = moe
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    gdn = model.model.layers[0].linear_attn
    x = torch.randn(1, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
    ours = x[0].numpy() @ np.asarray(params["layers_0"]["mixer"]["in_proj"]["kernel"])
    kd, vd, hv = cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.gdn_num_value_heads
    parts = np.split(ours, np.cumsum([kd, kd, vd, vd, hv]), axis=1)
    for name, a, b in zip("qkvzba", parts, hf, strict=True):
        np.testing.assert_allclose(a, b.reshape(7, -1).numpy(), atol=1e-5, err_msg=name)


def test_router_matches_hf_topk_router(moe):
    gate = moe[1].model.layers[0].mlp.gate
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, hf_w, hf_idx = gate(x)
    w, idx = route_softmax(jnp.asarray(logits.numpy()), 2, True)
    np.testing.assert_array_equal(np.asarray(idx), hf_idx.numpy())
    np.testing.assert_allclose(np.asarray(w), hf_w.numpy(), rtol=1e-5)


def test_fused_expert_layout_loads_like_per_expert_tensors(moe, tmp_path):
    """transformers holds the experts fused (`experts.gate_up_proj`, `experts.down_proj`);
    save_pretrained writes them per expert. A checkpoint of either loads the same."""
    from safetensors.torch import save_file

    path, model = moe
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    per_expert = load_hf_checkpoint(path, dtype=np.float32)
    fused = load_hf_checkpoint(tmp_path, dtype=np.float32)
    for a, b in zip(jax.tree.leaves(per_expert), jax.tree.leaves(fused), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_checkpoint_loads_in_transformers_with_the_same_logits(moe, dense, tmp_path):
    from transformers import Qwen3NextForCausalLM

    prompt = list(range(3, 40))
    for i, (path, model) in enumerate((moe, dense)):
        params = load_hf_checkpoint(path, dtype=np.float32)
        save_hf_checkpoint(params, load_config(str(path)), tmp_path / f"out{i}")
        again = Qwen3NextForCausalLM.from_pretrained(tmp_path / f"out{i}").float().eval()
        assert_logits_close(hf_logits(again, prompt), hf_logits(model, prompt), rel=1e-6)


def test_qwen3_next_80b_a3b_has_its_published_size():
    config = {
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "partial_rotary_factor": 0.25, "rope_theta": 10000000, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True,
    }  # fmt: skip
    cfg = config_from_hf(config)
    assert (cfg.num_recurrent_layers, cfg.num_attention_layers, cfg.rope_dim) == (36, 12, 64)
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(checkpoint_param_shapes(cfg)))
    idle = 48 * (512 - 10) * 3 * 2048 * 512
    # The model card: 80B parameters, 3B activated (3.25B here, embeddings and head aside).
    assert 79.0e9 < total < 81.5e9, total
    active = total - idle - 2 * 151936 * 2048
    assert 3.0e9 < active < 3.4e9, active


def test_prefill_logits_match_hf(moe, dense):
    check_prefill_logits(*moe, lengths=[1, 63, 101, 66])
    check_prefill_logits(*dense, seed=1, lengths=[5, 64, 70])


def test_bf16_prefill_logits_match_hf_bf16(dense):
    check_bf16_prefill_logits(*dense, length=70)


def test_generation_chunked_prefill_and_prefix_hit_match_hf_generate(moe):
    check_generation(*moe)
