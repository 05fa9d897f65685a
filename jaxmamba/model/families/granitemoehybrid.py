"""IBM Granite 4.0-H (`granitemoehybrid`): each HF decoder layer is a Mamba2 mixer or attention
(RoPE or none, as `position_embedding_type` says; scale `attention_multiplier`), then a MoE
(top-k softmax router, SwiGLU experts) plus a shared SwiGLU expert — or the shared MLP alone
when `num_local_experts` is 0. Embedding, residual and logits multipliers (µP). HF:
`GraniteMoeHybridForCausalLM`."""

from __future__ import annotations

import jaxmamba.model.families.common as common
from jaxmamba.config import ModelConfig

_MIXERS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
           "full_attention": "attention"}  # fmt: skip


def from_hf(c: dict, name: str) -> ModelConfig:
    common.require(c, "hidden_act", ("silu",), "silu")
    raw = c.get("layer_types") or c.get("layers_block_type")
    if raw is None:
        raise ValueError("HF granitemoehybrid config has no layer_types")
    mixers = []
    for i, t in enumerate(raw):
        if t not in _MIXERS:
            raise ValueError(f"HF config layer_types[{i}]={t!r} is not a known layer type")
        mixers.append(_MIXERS[t])
    experts = c.get("num_local_experts", 0) or 0
    shared = c.get("shared_intermediate_size", 1024)
    if not shared:
        raise ValueError(f"HF config shared_intermediate_size={shared!r} is unsupported: > 0 only")
    hidden = c.get("hidden_size", 1024)
    num_heads = c.get("num_attention_heads", 32)
    head_dim = hidden // num_heads  # GraniteMoeHybridAttention: hidden / heads
    pos = c.get("position_embedding_type")
    theta, rope_dim = common.rope(c, head_dim) if pos == "rope" else (0.0, 0)
    d_inner = c.get("mamba_expand", 2) * hidden
    mamba = common.mamba_prefixed_fields(c, d_inner, f"mamba_expand*hidden_size={d_inner}")
    scaling = common.finite_multiplier(c, "logits_scaling")
    moe = {}
    if experts:
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok", 2),
            moe_intermediate_size=c.get("intermediate_size", 512),
            moe_shared_intermediate_size=shared,
            moe_router="softmax_topk",
        )
    return ModelConfig(
        model_type="granitemoehybrid",
        vocab_size=c.get("vocab_size", 32000),
        hidden_size=hidden,
        layer_types=common.paired_layer_types(mixers, "moe" if experts else "mlp"),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        **mamba,
        residual_in_fp32=True,
        **common.attention_fields(c, num_heads, head_dim),
        intermediate_size=0 if experts else shared,
        mlp_bias=False,
        mlp_activation="silu_glu",
        rope_theta=theta,
        rope_dim=rope_dim,
        attention_scale=common.finite_multiplier(c, "attention_multiplier"),
        embedding_multiplier=common.finite_multiplier(c, "embedding_multiplier"),
        residual_multiplier=common.finite_multiplier(c, "residual_multiplier"),
        logits_multiplier=1.0 / scaling,
        **common.special_token_ids(c, bos=1, eos=2, pad=None),
        name=name,
        **moe,
    )


def param_map(cfg: ModelConfig) -> list[common.Entry]:
    E = cfg.hidden_size
    plan = [common.embedding("embed_tokens.weight", cfg)]
    layers = common.two_block_layers(
        cfg, lambda i: f"layers.{i}", norms=("input_layernorm", "post_attention_layernorm")
    )
    for (m, hf, hf_norm), kind in zip(layers, cfg.layer_types, strict=True):
        plan.append(common.norm((m[0], "norm"), hf_norm, E))
        if kind == "mamba":
            plan += common.mamba_mixer(m, f"{hf}.mamba", cfg)
        elif kind == "attention":
            plan += common.attention(m, f"{hf}.self_attn", cfg)
        elif kind == "mlp":
            plan += common.fused_glu_mlp(
                m, f"{hf}.shared_mlp", E, cfg.intermediate_size, up="input_linear",
                down="output_linear",
            )  # fmt: skip
        else:
            X, F = cfg.num_experts, cfg.moe_intermediate_size
            moe = f"{hf}.block_sparse_moe"
            plan += [
                common.Entry((*m, "router", "kernel"), f"{moe}.router.layer.weight", (X, E),
                             common.transpose, common.transpose, False),
                common.Entry((*m, "experts_up"), f"{moe}.input_linear.weight", (X, 2 * F, E),
                             common.swap_last, common.swap_last, False, quantizable=True),
                common.Entry((*m, "experts_down"), f"{moe}.output_linear.weight", (X, E, F),
                             common.swap_last, common.swap_last, False, quantizable=True),
            ]  # fmt: skip
            plan += common.fused_glu_mlp(
                (*m, "shared_expert"), f"{hf}.shared_mlp", E, cfg.moe_shared_intermediate_size,
                up="input_linear", down="output_linear",
            )  # fmt: skip
    plan.append(common.norm(("norm_f",), "norm", E))
    return plan + common.lm_head(cfg)


FAMILY = common.Family(
    model_type="granitemoehybrid",
    architecture="GraniteMoeHybridForCausalLM",
    from_hf=from_hf,
    param_map=param_map,
)
