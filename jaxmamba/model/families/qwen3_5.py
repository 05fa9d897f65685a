"""Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`): Qwen3-Next's layers (`qwen3_next`), with the
GDN input projections kept apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: ours
is their concatenation) and a dense SwiGLU MLP after every mixer (`qwen3_5_text`) or a sparse
MoE after every mixer (`qwen3_5_moe_text`, top-k weights always renormalised). HF:
`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`.

The published checkpoints are multimodal (`qwen3_5`, `qwen3_5_moe`:
`Qwen3_5ForConditionalGeneration`): we read their `text_config` and serve the text model,
whose tensors live under `model.language_model.`; the loader skips the vision tower
(`model.visual.*`). The MTP layer (`mtp.*`, `mtp_num_hidden_layers`) is named and built as
Qwen3-Next's (`qwen3_next.mtp_param_map`; vLLM's `qwen3_5_mtp.py`): gated attention, then
the model's dense MLP or MoE.
"""

from __future__ import annotations

import jaxmamba.model.families.common as common
import jaxmamba.model.families.qwen3_next as qwen3_next
from jaxmamba.config import ModelConfig

# Qwen3_5TextConfig's and Qwen3_5MoeTextConfig's defaults, for keys a config.json leaves out.
_LINEAR = dict(
    head_dim=256, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
)  # fmt: skip
TEXT_DEFAULTS = dict(
    _LINEAR, vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4,
)  # fmt: skip
MOE_DEFAULTS = dict(
    _LINEAR, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts_per_tok=8, num_experts=256,
)  # fmt: skip

# Text checkpoints (`model.`) and the multimodal ones' language model (`model.language_model.`).
_BASE_PREFIXES = ("model.", "model.language_model.", "")


def text_from_hf(c: dict, name: str) -> ModelConfig:
    return qwen3_next.text_model_config(
        c, name, model_type="qwen3_5_text", defaults=TEXT_DEFAULTS, ffn=lambda i: "mlp",
        norm_topk_prob=False,
    )  # fmt: skip


def moe_text_from_hf(c: dict, name: str) -> ModelConfig:
    experts = common.get(c, "num_experts", default=MOE_DEFAULTS["num_experts"])
    if not (isinstance(experts, int) and experts > 0):
        raise ValueError(f"HF config num_experts={experts!r} is unsupported: > 0 only")
    # Qwen3_5MoeDecoderLayer puts a MoE block in every layer and Qwen3_5MoeTopKRouter always
    # renormalises (mlp_only_layers, decoder_sparse_step and norm_topk_prob are not read).
    return qwen3_next.text_model_config(
        c, name, model_type="qwen3_5_moe_text", defaults=MOE_DEFAULTS, ffn=lambda i: "moe",
        norm_topk_prob=True,
    )  # fmt: skip


def text_to_hf(cfg: ModelConfig) -> dict:
    return common.checked_hf_config(
        cfg,
        {
            "model_type": "qwen3_5_text",
            "architectures": ["Qwen3_5ForCausalLM"],
            **qwen3_next.text_hf_keys(cfg),
            "intermediate_size": cfg.intermediate_size,
        },
        text_from_hf,
        qwen3_next.inert(cfg),
    )


def moe_text_to_hf(cfg: ModelConfig) -> dict:
    return common.checked_hf_config(
        cfg,
        {
            "model_type": "qwen3_5_moe_text",
            "architectures": ["Qwen3_5MoeForCausalLM"],
            **qwen3_next.text_hf_keys(cfg),
            **qwen3_next.moe_hf_keys(cfg),
        },
        moe_text_from_hf,
        qwen3_next.inert(cfg),
    )


def _multimodal_from_hf(text: common.Family):
    """The config adapter of a multimodal checkpoint: its `text_config`, read by `text`."""

    def from_hf(c: dict, name: str) -> ModelConfig:
        t = c.get("text_config")
        if not isinstance(t, dict):
            raise ValueError(f"HF {c.get('model_type')} config has no text_config object")
        kind = t.get("model_type", text.model_type)
        if kind != text.model_type:
            raise ValueError(
                f"HF config text_config.model_type={kind!r} is unsupported: only "
                f"{text.model_type!r}"
            )
        t = dict(t)
        # Qwen3_5ForConditionalGeneration ties its head by the top-level flag (default false).
        t["tie_word_embeddings"] = bool(c.get("tie_word_embeddings", False))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if t.get(key) is None and c.get(key) is not None:
                t[key] = c[key]
        return text.from_hf(t, name)

    return from_hf


def _in_proj(m: tuple[str, ...], hm: str, cfg: ModelConfig) -> common.Entry:
    rows = (cfg.gdn_conv_dim, cfg.gdn_value_dim, cfg.gdn_num_value_heads,
            cfg.gdn_num_value_heads)  # fmt: skip
    names = tuple(f"{hm}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
    return common.Entry((*m, "in_proj", "kernel"), names, (sum(rows), cfg.hidden_size),
                        common.transpose, common.transpose, False, rows=rows,
                        quantizable=True)  # fmt: skip


param_map = qwen3_next.param_map_with(_in_proj)

TEXT = common.Family(
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    from_hf=text_from_hf,
    param_map=param_map,
    base_prefixes=_BASE_PREFIXES,
    to_hf=text_to_hf,
    mtp_param_map=qwen3_next.mtp_param_map,
    mtp_config=qwen3_next.mtp_config,
)
MOE_TEXT = common.Family(
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    from_hf=moe_text_from_hf,
    param_map=param_map,
    base_prefixes=_BASE_PREFIXES,
    to_hf=moe_text_to_hf,
    mtp_param_map=qwen3_next.mtp_param_map,
    mtp_config=qwen3_next.mtp_config,
)
# Config adapters only: they return the text model's ModelConfig (model_type qwen3_5_text or
# qwen3_5_moe_text), which is what the loader and the model see.
MULTIMODAL = common.Family(
    model_type="qwen3_5",
    architecture="Qwen3_5ForConditionalGeneration",
    from_hf=_multimodal_from_hf(TEXT),
    param_map=param_map,
    base_prefixes=("model.language_model.", "model.", ""),
)
MOE_MULTIMODAL = common.Family(
    model_type="qwen3_5_moe",
    architecture="Qwen3_5MoeForConditionalGeneration",
    from_hf=_multimodal_from_hf(MOE_TEXT),
    param_map=param_map,
    base_prefixes=("model.language_model.", "model.", ""),
)
