"""TII Falcon-H1 (`falcon_h1`): each HF decoder layer runs a Mamba2 mixer and RoPE attention side
by side on the same normed input (`x += ssm_out·mamba(ssm_in·h) + attn_out·attn(attn_in·h)`),
then a SwiGLU MLP — a "parallel" layer and an "mlp" layer of ours. HF: `FalconH1ForCausalLM`.

Its µP multipliers that scale a projection's input or output (ssm_in/ssm_out, the per-section
`ssm_multipliers` of in_proj's output [z | x | B | C | dt], attention_in/out, key_multiplier,
mlp_multipliers) are folded into those weights when loading; embedding_multiplier and
lm_head_multiplier are applied at run time."""

from __future__ import annotations

import numpy as np

import jaxmamba.model.families.common as common
from jaxmamba.config import ModelConfig

_FLOAT_MULTIPLIERS = ("ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier",
                      "attention_out_multiplier", "key_multiplier")  # fmt: skip


def from_hf(c: dict, name: str) -> ModelConfig:
    common.require(c, "hidden_act", ("silu",), "silu")
    hidden = c.get("hidden_size", 4096)
    num_layers = c.get("num_hidden_layers", 32)
    num_heads = c.get("num_attention_heads", 32)
    head_dim = c.get("head_dim") or hidden // num_heads
    d_inner = c.get("mamba_d_ssm") or c.get("mamba_expand", 2) * hidden
    mamba = common.mamba_prefixed_fields(c, d_inner, f"mamba intermediate size {d_inner}")
    proj_bias = mamba["mamba_proj_bias"]
    if bool(c.get("projectors_bias", False)) != proj_bias:
        raise ValueError(
            f"HF config projectors_bias={c.get('projectors_bias')!r} is unsupported: only equal "
            f"to mamba_proj_bias={proj_bias!r}"
        )
    rms_norm = bool(c.get("mamba_rms_norm", False))
    if rms_norm:
        common.require(c, "mamba_norm_before_gate", (False,), True)
    theta, rope_dim = common.rope(c, head_dim)
    scalars = (*_FLOAT_MULTIPLIERS, "embedding_multiplier", "lm_head_multiplier")
    mult = {k: common.finite_multiplier(c, k) for k in scalars}
    for key, n in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
        value = c.get(key)
        if value is not None and (not isinstance(value, list | tuple) or len(value) != n):
            raise ValueError(f"HF config {key}={value!r} is invalid: expected {n} floats")
    return ModelConfig(
        model_type="falcon_h1",
        vocab_size=c.get("vocab_size", 128000),
        hidden_size=hidden,
        layer_types=common.paired_layer_types(["parallel"] * num_layers, "mlp"),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        **mamba,
        mamba_rms_norm=rms_norm,
        residual_in_fp32=True,
        **common.attention_fields(c, num_heads, head_dim),
        intermediate_size=c.get("intermediate_size", 14336),
        mlp_bias=bool(c.get("mlp_bias", False)),
        mlp_activation="silu_glu",
        rope_theta=theta,
        rope_dim=rope_dim,
        weight_multipliers=(
            *((k, (mult[k],)) for k in _FLOAT_MULTIPLIERS),
            ("mlp_multipliers", tuple(c.get("mlp_multipliers") or (1.0, 1.0))),
            ("ssm_multipliers", tuple(c.get("ssm_multipliers") or (1.0,) * 5)),
        ),
        embedding_multiplier=mult["embedding_multiplier"],
        logits_multiplier=mult["lm_head_multiplier"],
        **common.special_token_ids(c, bos=1, eos=2, pad=0),
        name=name,
    )


def mup_vector(cfg: ModelConfig, ssm: list[float]) -> np.ndarray:
    """HF `compute_mup_vector`: one multiplier per section of in_proj's output."""
    gn = cfg.n_groups * cfg.ssm_state_size
    sizes = (cfg.d_inner, cfg.d_inner, gn, gn, cfg.mamba_num_heads)
    return np.concatenate([np.full(n, m, np.float32) for n, m in zip(sizes, ssm, strict=True)])


def param_map(cfg: ModelConfig) -> list[common.Entry]:
    E = cfg.hidden_size
    mult = dict(cfg.weight_multipliers)
    one = lambda key: mult.get(key, (1.0,))[0]  # noqa: E731
    mup = mup_vector(cfg, list(mult.get("ssm_multipliers", (1.0,) * 5)))
    gate_mult, down_mult = mult.get("mlp_multipliers", (1.0, 1.0))
    plan = [common.embedding("embed_tokens.weight", cfg)]
    layers = common.two_block_layers(
        cfg, lambda i: f"layers.{i}", norms=("input_layernorm", "pre_ff_layernorm")
    )
    for (m, hf, hf_norm), kind in zip(layers, cfg.layer_types, strict=True):
        plan.append(common.norm((m[0], "norm"), hf_norm, E))
        if kind == "parallel":
            mamba = common.mamba_mixer(
                (*m, "mamba"), f"{hf}.mamba", cfg,
                in_scale=one("ssm_in_multiplier") * mup, out_scale=one("ssm_out_multiplier"),
            )  # fmt: skip
            if cfg.mamba_proj_bias:  # in_proj's bias sees mup only, not ssm_in_multiplier
                mamba = [_rescale_bias(e, mup) if e.path[-2:] == ("in_proj", "bias") else e
                         for e in mamba]  # fmt: skip
            plan += mamba
            plan += common.attention(
                (*m, "attention"), f"{hf}.self_attn", cfg,
                in_scale=one("attention_in_multiplier"), k_scale=one("key_multiplier"),
                out_scale=one("attention_out_multiplier"),
            )  # fmt: skip
        else:
            plan += common.glu_mlp(
                m, f"{hf}.feed_forward", E, cfg.intermediate_size, cfg.mlp_bias,
                gate_scale=gate_mult, down_scale=down_mult,
            )  # fmt: skip
    plan.append(common.norm(("norm_f",), "final_layernorm", E))
    return plan + common.lm_head(cfg)


def _rescale_bias(e: common.Entry, mup: np.ndarray) -> common.Entry:
    return common.Entry(e.path, e.hf_name, e.hf_shape, common.scaled(common.identity, mup), None,
                        e.fp32)  # fmt: skip


FAMILY = common.Family(
    model_type="falcon_h1",
    architecture="FalconH1ForCausalLM",
    from_hf=from_hf,
    param_map=param_map,
)
