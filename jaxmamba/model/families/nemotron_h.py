"""NVIDIA Nemotron-H (`nemotron_h`): Mamba2, attention (GQA, no RoPE), relu² MLP and MoE layers,
one mixer per residual block (`x + mixer(norm(x))`). HF: `NemotronHForCausalLM`.

MoE layers (`E`, Nemotron 3 Nano): relu² experts (no gate) and one relu² shared expert; the
router is float32 — sigmoid scores, `e_score_correction_bias` for the choice only,
group-limited top-k (`n_group`, `topk_group`), optional renormalisation, times
`routed_scaling_factor` (`NemotronHTopkRouter`)."""

from __future__ import annotations

import dataclasses
import math

import jaxmamba.model.families.common as common
from jaxmamba.config import ModelConfig

# Every spelling of a layer type in HF configs: transformers 5 names, legacy names and the
# single-character `hybrid_override_pattern` codes.
_LAYER_TYPE_ALIASES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}
_HF_LAYER_NAMES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp"}


def _layer_types(config: dict) -> tuple[str, ...]:
    field = next(
        (k for k in ("layers_block_type", "layer_types") if config.get(k) is not None), None
    )
    if field is not None:
        raw = list(config[field])
    elif config.get("hybrid_override_pattern") is not None:
        field, raw = "hybrid_override_pattern", list(config["hybrid_override_pattern"])
    else:
        raise ValueError(
            "HF nemotron_h config has no layers_block_type, layer_types or hybrid_override_pattern"
        )
    out = []
    for i, t in enumerate(raw):
        if t not in _LAYER_TYPE_ALIASES:
            raise ValueError(f"HF config {field}[{i}]={t!r} is not a known layer type")
        out.append(_LAYER_TYPE_ALIASES[t])
    return tuple(out)


def from_hf(c: dict, name: str) -> ModelConfig:
    get = common.get
    layer_types = _layer_types(c)
    common.require(c, "mamba_hidden_act", ("silu",), "silu")
    mlp_act = common.require(c, "mlp_hidden_act", ("relu2",), "relu2")
    # transformers' NemotronHAttention never applies RoPE (rope_theta etc. are inert there), so
    # those keys are ignored; an explicit position embedding or a sliding window would change
    # the numbers and is refused.
    pos = c.get("position_embedding_type")
    if pos not in (None, "none"):
        raise ValueError(f"HF config position_embedding_type={pos!r} is unsupported (no RoPE)")
    if c.get("sliding_window") is not None:
        raise ValueError(f"HF config sliding_window={c['sliding_window']!r} is unsupported")
    # num_nextn_predict_layers > 0 adds a multi-token-prediction layer (`mtp.*` tensors): the
    # loader skips it, speculative decoding reads it (`mtp_config`, `mtp_param_map`).
    num_heads = c.get("num_attention_heads", 32)
    hidden = c.get("hidden_size", 4096)
    moe = _moe_fields(c) if "moe" in layer_types else {}
    return ModelConfig(
        model_type="nemotron_h",
        vocab_size=c.get("vocab_size", 131072),
        hidden_size=hidden,
        layer_types=layer_types,
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        mamba_num_heads=c.get("mamba_num_heads", 128),
        mamba_head_dim=c.get("mamba_head_dim", 64),
        n_groups=get(c, "n_groups", "mamba_n_groups", default=8),
        ssm_state_size=c.get("ssm_state_size", 128),
        conv_kernel=get(c, "conv_kernel", "mamba_d_conv", default=4),
        chunk_size=get(c, "chunk_size", "mamba_chunk_size", default=128),
        use_conv_bias=bool(get(c, "use_conv_bias", "mamba_conv_bias", default=True)),
        # The modeling code biases in_proj/out_proj by `use_bias` (not `mamba_proj_bias`).
        mamba_proj_bias=bool(c.get("use_bias", False)),
        # dt is clamped to config.time_step_limit (NVIDIA's modeling code and transformers >=
        # 5.25); time_step_min and time_step_max only initialise dt_bias.
        time_step_limit=tuple(
            common.as_float(v)
            for v in get(c, "time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))
        ),
        residual_in_fp32=bool(c.get("residual_in_fp32", False)),
        **common.attention_fields(c, num_heads, get(c, "head_dim", default=hidden // num_heads)),
        intermediate_size=c.get("intermediate_size", 21504),
        mlp_bias=bool(c.get("mlp_bias", False)),
        mlp_activation=mlp_act,
        **common.special_token_ids(c, bos=1, eos=2, pad=0),
        name=name,
        **moe,
    )


def _moe_fields(c: dict) -> dict:
    get = common.get
    if c.get("moe_latent_size") is not None:
        raise ValueError(
            f"HF config moe_latent_size={c['moe_latent_size']!r} is unsupported: only null"
        )
    return dict(
        num_experts=get(c, "n_routed_experts", "num_local_experts", default=8),
        num_experts_per_tok=c.get("num_experts_per_tok", 2),
        moe_intermediate_size=c.get("moe_intermediate_size", 7688),
        moe_shared_intermediate_size=c.get("moe_shared_expert_intermediate_size", 7688),
        moe_router="sigmoid_grouped",
        moe_num_groups=c.get("n_group", 1),
        moe_topk_groups=c.get("topk_group", 1),
        moe_norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        moe_routed_scaling=common.as_float(c.get("routed_scaling_factor", 1.0)),
    )


def to_hf(cfg: ModelConfig) -> dict:
    lo, hi = cfg.time_step_limit
    if set(cfg.layer_types) - set(_HF_LAYER_NAMES):
        raise ValueError(f"writing nemotron_h layer types {cfg.layer_types} is not implemented")
    return {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        **common.mamba2_hf_keys(cfg),
        "layers_block_type": [_HF_LAYER_NAMES[t] for t in cfg.layer_types],
        "mamba_num_heads": cfg.mamba_num_heads,
        "mamba_head_dim": cfg.mamba_head_dim,
        "ssm_state_size": cfg.ssm_state_size,
        "mamba_hidden_act": "silu",
        "time_step_limit": [lo, hi],
        "num_attention_heads": cfg.num_attention_heads or 1,
        "num_key_value_heads": cfg.num_key_value_heads or 1,
        "head_dim": cfg.head_dim or 1,
        "attention_bias": cfg.attention_bias,
        "intermediate_size": cfg.intermediate_size or 1,
        "mlp_bias": cfg.mlp_bias,
        "mlp_hidden_act": cfg.mlp_activation,
    }


def param_map(cfg: ModelConfig) -> list[common.Entry]:
    plan = [common.embedding("embeddings.weight", cfg)]
    for i, kind in enumerate(cfg.layer_types):
        plan += _block(f"layers_{i}", f"layers.{i}", kind, cfg)
    plan.append(common.norm(("norm_f",), "norm_f", cfg.hidden_size))
    return plan + common.lm_head(cfg)


def _block(ours: str, hf: str, kind: str, cfg: ModelConfig) -> list[common.Entry]:
    """One residual block's norm and mixer under HF layer prefix `hf`."""
    E = cfg.hidden_size
    plan = [common.norm((ours, "norm"), f"{hf}.norm", E)]
    m, hm = (ours, "mixer"), f"{hf}.mixer"
    if kind == "mamba":
        return plan + common.mamba_mixer(m, hm, cfg)
    if kind == "attention":
        return plan + common.attention(m, hm, cfg)
    if kind == "moe":
        return plan + _moe(m, hm, cfg)
    return plan + common.relu2_mlp(m, hm, E, cfg.intermediate_size, cfg.mlp_bias)


def mtp_layer_types(c: dict) -> tuple[str, ...]:
    """The MTP layer's blocks: `mtp_hybrid_override_pattern` (NVIDIA's configs, e.g. "*E":
    attention, then MoE) or `mtp_layers_block_type` (transformers' list). A Mamba block is a
    ValueError naming the field: it would need a recurrent state of its own per slot."""
    fields = {k: c[k] for k in ("mtp_hybrid_override_pattern", "mtp_layers_block_type")
              if c.get(k) is not None}  # fmt: skip
    if not fields:
        raise ValueError("HF config num_nextn_predict_layers=1 without mtp_hybrid_override_pattern "
                         "or mtp_layers_block_type (the MTP layer's blocks)")  # fmt: skip
    parsed = {}
    for field, raw in fields.items():
        if not raw or any(t not in _LAYER_TYPE_ALIASES for t in raw):
            raise ValueError(f"HF config {field}={raw!r} is not a list of known layer types")
        parsed[field] = tuple(_LAYER_TYPE_ALIASES[t] for t in raw)
    if len(set(parsed.values())) > 1:
        raise ValueError(f"HF config {fields} disagree on the MTP layer's blocks")
    field, types = next(iter(parsed.items()))
    if "mamba" in types:
        raise ValueError(f"HF config {field}={fields[field]!r} has a Mamba block; the MTP layer "
                         "runs attention, MLP and MoE blocks (a Mamba block would need its own "
                         "recurrent state per slot)")  # fmt: skip
    return types


def mtp_config(target: ModelConfig, c: dict) -> ModelConfig:
    """The MTP head's config: the target's with the MTP layer's blocks (`mtp_layer_types`),
    and the config's MoE fields when one of them is MoE."""
    types = mtp_layer_types(c)
    moe = _moe_fields(c) if "moe" in types else {}
    return dataclasses.replace(target, layer_types=types, **moe)


def mtp_param_map(cfg: ModelConfig) -> list[common.Entry]:
    """The MTP layer's tensors (`mtp.*`, as vLLM's `nemotron_h_mtp.py` names them): the first
    block also holds `enorm` and `hnorm` (RMS norms of the embedding and hidden inputs) and
    `eh_proj` [E, 2E] over [embedding | hidden], each block its `norm` and `mixer` as the
    target's, and the last block `final_layernorm`. `cfg` is the head's (`mtp_config`)."""
    E, last = cfg.hidden_size, f"mtp.layers.{cfg.num_layers - 1}"
    plan = [
        common.norm(("pre_fc_norm_embedding",), "mtp.layers.0.enorm", E),
        common.norm(("pre_fc_norm_hidden",), "mtp.layers.0.hnorm", E),
        *common.linear(("fc",), "mtp.layers.0.eh_proj", 2 * E, E, False),
    ]
    for i, kind in enumerate(cfg.layer_types):
        plan += _block(f"layers_{i}", f"mtp.layers.{i}", kind, cfg)
    return plan + [common.norm(("norm",), f"{last}.final_layernorm", E)]


def _moe(m: tuple[str, ...], hm: str, cfg: ModelConfig) -> list[common.Entry]:
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    # Checkpoints keep one tensor per expert; we stack them [X, ...].
    up = tuple(f"{hm}.experts.{j}.up_proj.weight" for j in range(X))
    down = tuple(f"{hm}.experts.{j}.down_proj.weight" for j in range(X))
    return [
        common.Entry((*m, "router"), f"{hm}.gate.weight", (X, E), common.transpose, None, True),
        common.vector((*m, "router_bias"), f"{hm}.gate.e_score_correction_bias", X, fp32=True),
        common.Entry((*m, "experts_up"), up, (F, E), common.swap_last, None, False,
                     quantizable=True),
        common.Entry((*m, "experts_down"), down, (E, F), common.swap_last, None, False,
                     quantizable=True),
        *common.relu2_mlp(
            (*m, "shared_expert"), f"{hm}.shared_experts", E, cfg.moe_shared_intermediate_size,
            cfg.mlp_bias,
        ),
    ]  # fmt: skip


FAMILY = common.Family(
    model_type="nemotron_h",
    architecture="NemotronHForCausalLM",
    from_hf=from_hf,
    param_map=param_map,
    # `backbone.` (NVIDIA's exports and transformers' save_pretrained), `model.` (transformers
    # 5 in memory), or none (a bare base model).
    base_prefixes=("backbone.", "model.", ""),
    to_hf=to_hf,
    mtp_param_map=mtp_param_map,
    mtp_config=mtp_config,
)
