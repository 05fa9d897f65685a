"""IBM Bamba (`bamba`): each HF decoder layer is a Mamba2 mixer or RoPE attention (on half of
each head), then a SwiGLU MLP, each pre-norm residual — two of our layers. HF:
`BambaForCausalLM`."""

from __future__ import annotations

import jaxmamba.model.families.common as common
from jaxmamba.config import ModelConfig


def from_hf(c: dict, name: str) -> ModelConfig:
    common.require(c, "hidden_act", ("silu",), "silu")
    num_layers = c.get("num_hidden_layers", 32)
    attn = set(c.get("attn_layer_indices") or ())
    if any(not 0 <= i < num_layers for i in attn):
        raise ValueError(
            f"HF config attn_layer_indices={sorted(attn)} is invalid: expected indices in "
            f"[0, num_hidden_layers={num_layers})"
        )
    mixers = ["attention" if i in attn else "mamba" for i in range(num_layers)]
    hidden = c.get("hidden_size", 4096)
    num_heads = c.get("num_attention_heads", 32)
    d_inner = c.get("mamba_expand", 2) * hidden
    mamba = common.mamba_prefixed_fields(c, d_inner, f"mamba_expand*hidden_size={d_inner}")
    # BambaAttention has no head_dim field: heads are hidden_size / num_attention_heads, and
    # BambaConfig hard-codes partial_rotary_factor 0.5.
    head_dim = hidden // num_heads
    theta, rope_dim = common.rope(c, head_dim, partial_rotary_factor=0.5)
    return ModelConfig(
        model_type="bamba",
        vocab_size=c.get("vocab_size", 128000),
        hidden_size=hidden,
        layer_types=common.paired_layer_types(mixers, "mlp"),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        **mamba,
        residual_in_fp32=True,
        **common.attention_fields(c, num_heads, head_dim),
        intermediate_size=c.get("intermediate_size", 14336),
        mlp_bias=bool(c.get("mlp_bias", False)),
        mlp_activation="silu_glu",
        rope_theta=theta,
        rope_dim=rope_dim,
        **common.special_token_ids(c, bos=1, eos=2, pad=0),
        name=name,
    )


def param_map(cfg: ModelConfig) -> list[common.Entry]:
    E = cfg.hidden_size
    plan = [common.embedding("embed_tokens.weight", cfg)]
    layers = common.two_block_layers(
        cfg, lambda i: f"layers.{i}", norms=("input_layernorm", "pre_ff_layernorm")
    )
    for (m, hf, hf_norm), kind in zip(layers, cfg.layer_types, strict=True):
        plan.append(common.norm((m[0], "norm"), hf_norm, E))
        if kind == "mamba":
            plan += common.mamba_mixer(m, f"{hf}.mamba", cfg)
        elif kind == "attention":
            plan += common.attention(m, f"{hf}.self_attn", cfg)
        else:
            plan += common.glu_mlp(m, f"{hf}.feed_forward", E, cfg.intermediate_size, cfg.mlp_bias)
    plan.append(common.norm(("norm_f",), "final_layernorm", E))
    return plan + common.lm_head(cfg)


FAMILY = common.Family(
    model_type="bamba", architecture="BambaForCausalLM", from_hf=from_hf, param_map=param_map
)
