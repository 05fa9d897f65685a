"""Pure Mamba2 LMs (`mamba2`): every layer a Mamba2 mixer. HF: `Mamba2ForCausalLM`."""

from __future__ import annotations

import jaxmamba.model.families.common as common
from jaxmamba.config import ModelConfig


def from_hf(c: dict, name: str) -> ModelConfig:
    common.require(c, "hidden_act", ("silu",), "silu")
    hidden = c.get("hidden_size", 4096)
    num_heads = c.get("num_heads", 128)
    head_dim = c.get("head_dim", 64)
    expand = c.get("expand", 2)
    if expand * hidden != num_heads * head_dim:
        raise ValueError(
            f"HF mamba2 config expand*hidden_size={expand}*{hidden} != "
            f"num_heads*head_dim={num_heads}*{head_dim}"
        )
    return ModelConfig(
        model_type="mamba2",
        vocab_size=c.get("vocab_size", 32768),
        hidden_size=hidden,
        layer_types=("mamba",) * c.get("num_hidden_layers", 64),
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        mamba_num_heads=num_heads,
        mamba_head_dim=head_dim,
        n_groups=c.get("n_groups", 8),
        ssm_state_size=c.get("state_size", 128),
        conv_kernel=c.get("conv_kernel", 4),
        chunk_size=c.get("chunk_size", 256),
        use_conv_bias=bool(c.get("use_conv_bias", True)),
        mamba_proj_bias=bool(c.get("use_bias", False)),
        time_step_limit=common.time_step_limit(c),
        residual_in_fp32=bool(c.get("residual_in_fp32", True)),
        num_attention_heads=0,
        num_key_value_heads=0,
        head_dim=0,
        attention_bias=False,
        intermediate_size=0,
        mlp_bias=False,
        mlp_activation="relu2",
        **common.special_token_ids(c, bos=0, eos=2, pad=1),
        name=name,
    )


def to_hf(cfg: ModelConfig) -> dict:
    expand, rem = divmod(cfg.d_inner, cfg.hidden_size)
    if rem:
        raise ValueError(
            f"ModelConfig.mamba_num_heads={cfg.mamba_num_heads!r} is invalid: expected "
            "d_inner a multiple of hidden_size"
        )
    lo, hi = cfg.time_step_limit
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        **common.mamba2_hf_keys(cfg),
        "num_hidden_layers": cfg.num_layers,
        "num_heads": cfg.mamba_num_heads,
        "head_dim": cfg.mamba_head_dim,
        "state_size": cfg.ssm_state_size,
        "expand": expand,
        "hidden_act": "silu",
        "time_step_limit": [lo, hi],
    }


def param_map(cfg: ModelConfig) -> list[common.Entry]:
    E = cfg.hidden_size
    # mamba_ssm checkpoints spell the embedding `embedding.weight`.
    plan = [common.embedding("embeddings.weight", cfg, alt_names=("embedding.weight",))]
    for i in range(cfg.num_layers):
        plan.append(common.norm((f"layers_{i}", "norm"), f"layers.{i}.norm", E))
        plan += common.mamba_mixer((f"layers_{i}", "mixer"), f"layers.{i}.mixer", cfg)
    plan.append(common.norm(("norm_f",), "norm_f", E))
    return plan + common.lm_head(cfg)


FAMILY = common.Family(
    model_type="mamba2",
    architecture="Mamba2ForCausalLM",
    from_hf=from_hf,
    param_map=param_map,
    base_prefixes=("backbone.", "model.", ""),
    to_hf=to_hf,
)
