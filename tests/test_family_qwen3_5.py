"""Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`, and the published multimodal `qwen3_5` /
`qwen3_5_moe` checkpoints served as text models) against transformers' Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM and Qwen3_5ForConditionalGeneration: random weights, heads that divide
awkwardly, interleaved M-RoPE on text positions; fp32 (bf16 once)."""

from __future__ import annotations

import dataclasses
import json
import logging

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

from jaxmamba.model.families import config_from_hf, hf_config_from, load_config
from jaxmamba.model.loader import checkpoint_param_shapes, load_hf_checkpoint, save_hf_checkpoint
from jaxmamba.model.params import param_shapes

from hf_fixtures import make_qwen3_5_checkpoint


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_qwen3_5_checkpoint(
        tmp_path_factory.mktemp("d"), seed=0, tie_word_embeddings=True, attention_bias=True
    )


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("m"), moe=True, seed=1)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """Qwen3_5ForConditionalGeneration, as published: the text model under
    `model.language_model.`, a vision tower, and (added here) multi-token-prediction tensors."""
    from safetensors.torch import load_file, save_file

    path, model = make_qwen3_5_checkpoint(tmp_path_factory.mktemp("v"), multimodal=True, seed=2)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(32, 64)
    save_file(tensors, str(path / "model.safetensors"))
    return path, model


def test_config_reads_the_text_models(dense, moe, multimodal):
    d = load_config(str(dense[0]))
    assert (d.model_type, d.layer_types) == (
        "qwen3_5_text",
        ("gdn", "mlp", "attention", "mlp", "gdn", "mlp", "gdn", "mlp"),
    )
    assert (d.gdn_num_key_heads, d.gdn_num_value_heads, d.gdn_key_head_dim) == (2, 6, 24)
    assert (d.gdn_value_head_dim, d.chunk_size, d.rope_dim, d.intermediate_size) == (40, 64, 10, 48)
    assert d.tie_word_embeddings and d.attention_bias and d.num_experts == 0
    m = load_config(str(moe[0]))
    assert m.model_type == "qwen3_5_moe_text" and set(m.layer_types[1::2]) == {"moe"}
    assert (m.num_experts, m.moe_router, m.moe_norm_topk_prob, m.moe_shared_expert_gate) == (
        6,
        "softmax",
        True,
        True,
    )
    v = load_config(str(multimodal[0]))
    assert v == dataclasses.replace(d, name=v.name, tie_word_embeddings=False, attention_bias=False)


def test_config_round_trips_through_transformers(dense, moe):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    for (path, _), cls in ((dense, Qwen3_5TextConfig), (moe, Qwen3_5MoeTextConfig)):
        cfg = load_config(str(path))
        hf = cls(**hf_config_from(cfg))
        assert config_from_hf(hf.to_dict()) == dataclasses.replace(cfg, name="")
    cfg = load_config(str(moe[0]))
    with pytest.raises(ValueError, match="moe_norm_topk_prob"):
        hf_config_from(dataclasses.replace(cfg, moe_norm_topk_prob=False))


def test_parameter_map_matches_the_model_parameters(dense, moe):
    for path, _ in (dense, moe):
        cfg = load_config(str(path))
        assert checkpoint_param_shapes(cfg, jnp.bfloat16) == param_shapes(cfg, jnp.bfloat16)


def test_unsupported_values_are_refused_naming_the_field(moe, multimodal):
    config = json.loads((moe[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="num_experts=0"):
        config_from_hf({**config, "num_experts": 0})
    with pytest.raises(ValueError, match="rope_type='mrope'"):
        config_from_hf({**config, "rope_parameters": {"rope_type": "mrope"}})
    top = json.loads((multimodal[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="text_config.model_type='qwen3_5_moe_text'"):
        config_from_hf({**top, "text_config": {**top["text_config"], **config}})
    with pytest.raises(ValueError, match="no text_config"):
        config_from_hf({**top, "text_config": None})


def test_in_proj_columns_are_hf_q_k_v_z_b_a(dense):
    path, model = dense
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    gdn = model.model.layers[0].linear_attn
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = torch.cat(
            [gdn.in_proj_qkv(x), gdn.in_proj_z(x), gdn.in_proj_b(x), gdn.in_proj_a(x)], 1
        )
    ours = x.numpy() @ np.asarray(params["layers_0"]["mixer"]["in_proj"]["kernel"])
    np.testing.assert_allclose(ours, hf.numpy(), atol=1e-5)


def test_multimodal_checkpoint_loads_its_text_model_skipping_vision_and_mtp(multimodal, caplog):
    path, model = multimodal
    cfg = load_config(str(path))
    with caplog.at_level(logging.INFO, logger="jaxmamba.model.loader"):
        params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    vision = sum(1 for n, _ in model.named_parameters() if n.startswith("model.visual."))
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert lines == [f"{path}: skipping {vision} vision-tower tensors"]
    text = model.model.language_model
    np.testing.assert_array_equal(
        np.asarray(params["embed"]["embedding"]), text.embed_tokens.weight.detach().numpy()
    )
    np.testing.assert_array_equal(
        np.asarray(params["lm_head"]["kernel"]), model.lm_head.weight.detach().numpy().T
    )


def test_saved_checkpoint_loads_in_transformers_with_the_same_logits(dense, moe, tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    prompt = list(range(3, 40))
    for (path, model), cls in ((dense, Qwen3_5ForCausalLM), (moe, Qwen3_5MoeForCausalLM)):
        params = load_hf_checkpoint(path, dtype=np.float32)
        save_hf_checkpoint(params, load_config(str(path)), tmp_path / path.name)
        again = cls.from_pretrained(tmp_path / path.name).float().eval()
        assert_logits_close(hf_logits(again, prompt), hf_logits(model, prompt), rel=1e-6)
        reloaded = load_hf_checkpoint(tmp_path / path.name, dtype=np.float32)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefill_logits_match_hf(dense, moe, multimodal):
    check_prefill_logits(*dense, lengths=[1, 63, 101, 66])
    check_prefill_logits(*moe, seed=1, lengths=[5, 64, 70])
    # The multimodal model on text: its M-RoPE positions (get_rope_index) are the text's.
    check_prefill_logits(*multimodal, seed=2, lengths=[3, 65])


def test_bf16_prefill_logits_match_hf_bf16(dense):
    check_bf16_prefill_logits(*dense, length=70)


def test_generation_chunked_prefill_and_prefix_hit_match_hf_generate(moe):
    check_generation(*moe)


def test_multimodal_config_stops_on_its_text_configs_eos_and_the_generation_configs(
    multimodal, tmp_path
):
    """Published Qwen3.5 configs keep eos_token_id inside text_config; generation_config.json
    may list more stop ids (<|im_end|>): the engine stops on all of them."""
    import json
    import shutil

    path = tmp_path / "mm"
    shutil.copytree(multimodal[0], path)
    config = json.loads((path / "config.json").read_text())
    config.pop("eos_token_id", None)
    config["text_config"]["eos_token_id"] = 7
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    cfg = config_from_hf(path)
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (7, (7, 9))
