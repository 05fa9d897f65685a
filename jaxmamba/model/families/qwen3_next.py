"""Qwen3-Next (`qwen3_next`): each HF decoder layer is a Gated DeltaNet mixer
(`linear_attention`) or gated attention (`full_attention`: a per-head sigmoid output gate, q/k
RMSNorms, partial RoPE), then a sparse MoE — softmax over all experts, top-k, renormalised when
`norm_topk_prob`; SwiGLU experts; a SwiGLU shared expert scaled by sigmoid(x·w) — or a dense
SwiGLU MLP (`mlp_only_layers`, `decoder_sparse_step`). HF: `Qwen3NextForCausalLM`.

HF's RMSNorms (the blocks', the final one, attention's q/k norms) compute x̂·(1 + w): we store
1 + w. The GDN output norm computes x̂·w and is stored as is. `in_proj_qkvz` and `in_proj_ba`
interleave their outputs per key-head group (`fix_query_key_value_ordering`); we load them
into one `in_proj` with columns [q | k | v | z | b | a].

The config adapter and the parameter map are shared with Qwen3.5 (`qwen3_5`), whose modeling
code derives from this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

import jaxmamba.model.families.common as common
from jaxmamba.config import ModelConfig

_MIXERS = {"linear_attention": "gdn", "full_attention": "attention"}
_HF_MIXERS = {v: k for k, v in _MIXERS.items()}

# Qwen3NextConfig's defaults, for keys a config.json leaves out.
DEFAULTS = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
    decoder_sparse_step=1, norm_topk_prob=True,
)  # fmt: skip

# The GDN prefill's chunk: not an HF setting (transformers' torch path uses 64 as well).
CHUNK_SIZE = 64
_INERT = ("chunk_size", "residual_in_fp32", "mamba_rms_norm")
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "moe_shared_intermediate_size", "moe_router", "moe_num_groups", "moe_topk_groups",
               "moe_norm_topk_prob", "moe_routed_scaling", "moe_shared_expert_gate")  # fmt: skip


def inert(cfg: ModelConfig) -> tuple[str, ...]:
    """The fields of `cfg` that a written config.json need not carry: those HF has no key for
    that these models do not read (no Mamba2 layers; the residual stream is float32 whatever
    residual_in_fp32 says), and the MoE fields of a model without MoE layers."""
    return _INERT + (() if "moe" in cfg.layer_types else _MOE_FIELDS)


def layer_types(c: dict, defaults: dict, ffn: Callable[[int], str]) -> tuple[str, ...]:
    """Our layer types: HF layer i's mixer, then its feed-forward `ffn(i)`."""
    n = common.get(c, "num_hidden_layers", default=defaults["num_hidden_layers"])
    raw = c.get("layer_types")
    if raw is None:
        interval = c.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"HF config full_attention_interval={interval!r} is invalid: > 0")
        raw = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(raw) != n:
        raise ValueError(
            f"HF config layer_types has {len(raw)} entries, expected num_hidden_layers={n}"
        )
    out = []
    for i, t in enumerate(raw):
        if t not in _MIXERS:
            raise ValueError(
                f"HF config layer_types[{i}]={t!r} is unsupported: only 'linear_attention' or "
                "'full_attention'"
            )
        out += [_MIXERS[t], ffn(i)]
    return tuple(out)


def text_model_config(
    c: dict, name: str, *, model_type: str, defaults: dict, ffn: Callable[[int], str],
    norm_topk_prob: bool,
) -> ModelConfig:  # fmt: skip
    """The `ModelConfig` of a Qwen3-Next / Qwen3.5 text model, HF layer i's feed-forward being
    `ffn(i)` ("mlp" or "moe")."""

    def get(key):
        return common.get(c, key, default=defaults[key])

    common.require(c, "hidden_act", ("silu",), "silu")  # the MLPs' and the GDN conv's
    # transformers always gates the attention output (vLLM reads this key; False is ungated).
    common.refuse(c, "attn_output_gate", (None, True))
    types = layer_types(c, defaults, ffn)
    hk, hv = get("linear_num_key_heads"), get("linear_num_value_heads")
    if not (isinstance(hk, int) and isinstance(hv, int) and hk > 0 and hv > 0 and hv % hk == 0):
        raise ValueError(
            f"HF config linear_num_value_heads={hv!r} is unsupported: a multiple of "
            f"linear_num_key_heads={hk!r}"
        )
    head_dim = get("head_dim")
    # Qwen3.5's interleaved M-RoPE (`mrope_section`, `mrope_interleaved` in rope_parameters)
    # rotates each frequency by the temporal, height or width position; for text those three
    # are the token's position, so it is plain RoPE on the first rope_dim dims of each head.
    theta, rope_dim = common.rope(
        c, head_dim, partial_rotary_factor=common.as_float(c.get("partial_rotary_factor", 0.25))
    )
    moe = {}
    if "moe" in types:
        shared = get("shared_expert_intermediate_size")
        if not (isinstance(shared, int) and shared > 0):
            raise ValueError(
                f"HF config shared_expert_intermediate_size={shared!r} is unsupported: > 0 only"
            )
        moe = dict(
            num_experts=get("num_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            moe_shared_intermediate_size=shared,
            moe_router="softmax",
            moe_norm_topk_prob=norm_topk_prob,
            moe_shared_expert_gate=True,
        )
    return ModelConfig(
        model_type=model_type,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        layer_types=types,
        norm_eps=common.as_float(get("rms_norm_eps")),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        mamba_num_heads=0,
        mamba_head_dim=0,
        n_groups=0,
        ssm_state_size=0,
        conv_kernel=get("linear_conv_kernel_dim"),
        chunk_size=CHUNK_SIZE,
        use_conv_bias=False,
        mamba_proj_bias=False,
        time_step_limit=(0.0, float("inf")),
        residual_in_fp32=False,
        mamba_rms_norm=False,
        gdn_num_key_heads=hk,
        gdn_num_value_heads=hv,
        gdn_key_head_dim=get("linear_key_head_dim"),
        gdn_value_head_dim=get("linear_value_head_dim"),
        **common.attention_fields(
            {**c, "num_key_value_heads": get("num_key_value_heads")},
            get("num_attention_heads"),
            head_dim,
        ),
        attention_output_gate=True,
        attention_qk_norm=True,
        rope_theta=theta,
        rope_dim=rope_dim,
        # HF's MLP width: Qwen3-Next has one even where no layer is dense, Qwen3.5-MoE none.
        intermediate_size=get("intermediate_size") if "intermediate_size" in defaults else 0,
        mlp_bias=False,
        mlp_activation="silu_glu",
        **common.special_token_ids(c, bos=None, eos=None, pad=None),
        name=name,
        **moe,
    )


def from_hf(c: dict, name: str) -> ModelConfig:
    def get(key):
        return common.get(c, key, default=DEFAULTS[key])

    experts, step = get("num_experts"), get("decoder_sparse_step")
    if experts and not (isinstance(step, int) and step > 0):
        raise ValueError(f"HF config decoder_sparse_step={step!r} is invalid: expected > 0")
    mlp_only = set(c.get("mlp_only_layers") or ())

    def ffn(i: int) -> str:  # Qwen3NextDecoderLayer's choice
        return "moe" if i not in mlp_only and experts > 0 and (i + 1) % step == 0 else "mlp"

    return text_model_config(
        c, name, model_type="qwen3_next", defaults=DEFAULTS, ffn=ffn,
        norm_topk_prob=bool(get("norm_topk_prob")),
    )  # fmt: skip


def text_hf_keys(cfg: ModelConfig) -> dict:
    """The config.json keys Qwen3-Next and Qwen3.5 spell alike (writing checkpoints)."""
    mixers = cfg.layer_types[0::2]
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": len(mixers),
        "layer_types": [_HF_MIXERS.get(t, t) for t in mixers],
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": common.rotary_factor(cfg.rope_dim, cfg.head_dim),
        },
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "linear_key_head_dim": cfg.gdn_key_head_dim,
        "linear_value_head_dim": cfg.gdn_value_head_dim,
        "linear_num_key_heads": cfg.gdn_num_key_heads,
        "linear_num_value_heads": cfg.gdn_num_value_heads,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (
            list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id
        ),
        "pad_token_id": cfg.pad_token_id,
    }


def moe_hf_keys(cfg: ModelConfig) -> dict:
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.moe_shared_intermediate_size,
    }


def to_hf(cfg: ModelConfig) -> dict:
    ffns = cfg.layer_types[1::2]
    return common.checked_hf_config(
        cfg,
        {
            "model_type": "qwen3_next",
            "architectures": ["Qwen3NextForCausalLM"],
            **text_hf_keys(cfg),
            "intermediate_size": cfg.intermediate_size,
            **moe_hf_keys(cfg),
            "norm_topk_prob": cfg.moe_norm_topk_prob if cfg.num_experts else True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, t in enumerate(ffns) if t != "moe"]
            if cfg.num_experts
            else [],
        },
        from_hf,
        inert(cfg),
    )


def _in_proj_qkvz_ba(m: tuple[str, ...], hm: str, cfg: ModelConfig) -> common.Entry:
    """`in_proj_qkvz` [Hk·(2Dk + 2r·Dv), E] holds per key-head group j [q_j | k_j | v_j | z_j]
    (r = HV/Hk value heads each), `in_proj_ba` [2·HV, E] per group [b_j | a_j]; our in_proj
    is [q | k | v | z | b | a], each head-major."""
    hk, dk, dv = cfg.gdn_num_key_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    r = cfg.gdn_num_value_heads // hk
    group = np.arange(hk * (2 * dk + 2 * r * dv)).reshape(hk, -1)
    ends = np.cumsum([dk, dk, r * dv])
    q, k, v, z = np.split(group, ends, axis=1)
    ba = group.size + np.arange(2 * hk * r).reshape(hk, 2 * r)
    order = np.concatenate([p.ravel() for p in (q, k, v, z, ba[:, :r], ba[:, r:])])
    to_ours, to_hf = common.permuted_rows(order)
    names = (f"{hm}.in_proj_qkvz.weight", f"{hm}.in_proj_ba.weight")
    rows = (group.size, ba.size)
    return common.Entry((*m, "in_proj", "kernel"), names, (sum(rows), cfg.hidden_size), to_ours,
                        to_hf, False, rows=rows, quantizable=True)  # fmt: skip


def param_map_with(
    in_proj: Callable[[tuple[str, ...], str, ModelConfig], common.Entry],
) -> Callable[[ModelConfig], list[common.Entry]]:
    """The parameter map of a Qwen3-Next-like model whose GDN `in_proj` entry is `in_proj`."""

    def param_map(cfg: ModelConfig) -> list[common.Entry]:
        E = cfg.hidden_size
        plan = [common.embedding("embed_tokens.weight", cfg)]
        layers = common.two_block_layers(
            cfg, lambda i: f"layers.{i}", norms=("input_layernorm", "post_attention_layernorm")
        )
        for (m, hf, hf_norm), kind in zip(layers, cfg.layer_types, strict=True):
            plan.append(common.zero_centered_norm((m[0], "norm"), hf_norm, E))
            if kind == "gdn":
                hm = f"{hf}.linear_attn"
                plan += common.gdn_mixer(m, hm, cfg, in_proj(m, hm, cfg))
            else:
                plan += _attention_or_ffn(m, hf, kind, cfg)
        plan.append(common.zero_centered_norm(("norm_f",), "norm", E))
        return plan + common.lm_head(cfg)

    return param_map


def mtp_config(target: ModelConfig, c: dict) -> ModelConfig:
    """The MTP head's config: one gated-attention layer and the feed-forward of the target's
    first layer (vLLM builds the MTP decoder layer as layer 0)."""
    return dataclasses.replace(target, layer_types=("attention", target.layer_types[1]))


def mtp_param_map(cfg: ModelConfig) -> list[common.Entry]:
    """The MTP layer's tensors (`mtp.*`, as vLLM's `qwen3_next_mtp.py` names them): the
    zero-centred norms of the embedding and hidden inputs, `fc` [E, 2E] over [embedding |
    hidden], one decoder layer `mtp.layers.0` (gated attention, then the MLP or MoE of layer
    0), and `mtp.norm`. `cfg` is the head's (`mtp.mtp_config`)."""
    E = cfg.hidden_size
    plan = [
        common.zero_centered_norm(("pre_fc_norm_embedding",), "mtp.pre_fc_norm_embedding", E),
        common.zero_centered_norm(("pre_fc_norm_hidden",), "mtp.pre_fc_norm_hidden", E),
        *common.linear(("fc",), "mtp.fc", 2 * E, E, False),
    ]
    layers = common.two_block_layers(
        cfg, lambda i: f"mtp.layers.{i}", norms=("input_layernorm", "post_attention_layernorm")
    )
    for (m, hf, hf_norm), kind in zip(layers, cfg.layer_types, strict=True):
        plan.append(common.zero_centered_norm((m[0], "norm"), hf_norm, E))
        plan += _attention_or_ffn(m, hf, kind, cfg)
    return plan + [common.zero_centered_norm(("norm",), "mtp.norm", E)]


def _attention_or_ffn(m, hf: str, kind: str, cfg: ModelConfig) -> list[common.Entry]:
    """One block's gated attention, dense MLP or softmax MoE, under HF layer prefix `hf`."""
    if kind == "attention":
        return common.gated_attention(m, f"{hf}.self_attn", cfg)
    if kind == "mlp":
        return common.glu_mlp(m, f"{hf}.mlp", cfg.hidden_size, cfg.intermediate_size, False)
    return common.softmax_moe(m, f"{hf}.mlp", cfg)


FAMILY = common.Family(
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    from_hf=from_hf,
    param_map=param_map_with(_in_proj_qkvz_ba),
    to_hf=to_hf,
    mtp_param_map=mtp_param_map,
    mtp_config=mtp_config,
)
