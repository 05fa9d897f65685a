"""Small random HF checkpoints (transformers, float32) for loader and parity tests.

Every parameter is redrawn at random: HF's init sets norms to 1, D to 1, biases to 0 and
A_log to log(1..H), values that would hide transposes, swapped heads and missing terms.

Tensor-name prefixes written by transformers 5.24's `save_pretrained`: `backbone.` for both
models (`backbone.embeddings.weight`, `backbone.layers.{i}.mixer...`, `backbone.norm_f.weight`)
plus `lm_head.weight`. NemotronH lives under `model.` in memory, but save_pretrained reverses
its checkpoint conversion mapping (`backbone.` -> `model.`) on the way out. Mamba2 does not
write a tied `lm_head.weight`; NemotronH declares no tied weights and always writes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a state space model keeps a fixed size state "
    "while attention keeps every key and value. mamba layers scan the sequence in chunks; "
    "hybrid models mix mamba, attention and mlp layers. hello world, hello jax!"
)

PATTERN_TO_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@torch.no_grad()
def perturb_parameters(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter (and MoE score-correction buffer) at random while keeping the
    network numerically tame."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if leaf == "A_log":
            # A = -exp(A_log) in [-4, -0.25]: decays neither instantly nor never.
            p.copy_(torch.log(0.25 + 3.75 * rand(*p.shape)))
        elif leaf == "D":
            p.copy_(1.0 + 0.5 * randn(*p.shape))
        elif leaf == "dt_bias":
            dt = 0.005 + 0.2 * rand(*p.shape)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1, then dt lands in range
        elif "norm" in parent:
            p.copy_(1.0 + 0.2 * randn(*p.shape))
        elif leaf == "bias":
            p.copy_(0.1 * randn(*p.shape))
        elif parent == "conv1d":
            p.copy_(randn(*p.shape) / math.sqrt(p.shape[-1]))
        elif "embed" in name or name == "lm_head.weight":
            # 2/sqrt(E): logits of std ~2 (tied head or not), peaked but not saturated, so
            # greedy picks have clear margins.
            p.copy_(2.0 * randn(*p.shape) / math.sqrt(p.shape[-1]))
        elif p.ndim in (2, 3):
            # Linears [out, in] and stacked experts [X, out, in]: unit-variance outputs, halved
            # so the residual stream grows slowly with depth; routers get clear preferences.
            gain = 2.0 if "gate" in parent or "router" in name else 0.5
            p.copy_(gain * randn(*p.shape) / math.sqrt(p.shape[-1]))
        else:
            raise AssertionError(f"perturb_parameters: unhandled parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * randn(*b.shape))


def save_random_checkpoint(model: torch.nn.Module, path, seed: int):
    """`model` in float32, eval mode, its parameters redrawn (`perturb_parameters`), saved to
    `path` by `save_pretrained`; returns (path, model)."""
    model = model.float().eval()
    perturb_parameters(model, seed)
    model.save_pretrained(path)
    return path, model


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A small BPE tokenizer (<pad>=0, <s>=1, </s>=2, <unk>=3) with at most vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )


def _save(model, path: Path, max_shard_size, with_tokenizer: bool, vocab_size: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        write_tokenizer(path, vocab_size)


def make_nemotron_h_checkpoint(
    path,
    *,
    pattern: str = "M-M*-",
    n_groups: int = 2,
    vocab_size: int = 97,
    hidden_size: int = 48,
    mamba_num_heads: int = 6,
    mamba_head_dim: int = 8,
    ssm_state_size: int = 12,
    chunk_size: int = 8,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 12,
    intermediate_size: int = 64,
    tie: bool = False,
    seed: int = 0,
    max_shard_size=None,
    with_tokenizer: bool = False,
    **overrides,
):
    """Save a random float32 NemotronHForCausalLM to `path`; returns (path, torch_model)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    config = NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        layers_block_type=[PATTERN_TO_TYPE[c] for c in pattern],
        mamba_num_heads=mamba_num_heads,
        mamba_head_dim=mamba_head_dim,
        n_groups=n_groups,
        ssm_state_size=ssm_state_size,
        conv_kernel=4,
        chunk_size=chunk_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    model = NemotronHForCausalLM(config).float().eval()
    perturb_parameters(model, seed)
    if tie:
        # transformers 5.24 NemotronH declares no tied weights, so make the head equal the
        # embedding explicitly: the torch model then computes what a tied model computes.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embeddings.weight)
    _save(model, path, max_shard_size, with_tokenizer, vocab_size)
    return path, model


def make_mamba2_checkpoint(
    path,
    *,
    num_layers: int = 3,
    hidden_size: int = 48,
    num_heads: int = 6,
    head_dim: int = 16,
    n_groups: int = 2,
    state_size: int = 12,
    chunk_size: int = 8,
    vocab_size: int = 97,
    tie: bool = True,
    seed: int = 0,
    max_shard_size=None,
    with_tokenizer: bool = False,
    **overrides,
):
    """Save a random float32 Mamba2ForCausalLM to `path`; returns (path, torch_model)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    expand, rem = divmod(num_heads * head_dim, hidden_size)
    assert rem == 0, "num_heads * head_dim must be a multiple of hidden_size"
    config = Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        expand=expand,
        n_groups=n_groups,
        state_size=state_size,
        conv_kernel=4,
        chunk_size=chunk_size,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    model = Mamba2ForCausalLM(config).float().eval()
    perturb_parameters(model, seed)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.backbone.embeddings.weight.data_ptr()
    _save(model, path, max_shard_size, with_tokenizer, vocab_size)
    return path, model


def edit_tokenizer(
    path: Path,
    *,
    bos_post_processor: bool,
    add_bos_token: bool | None = None,
    chat_template: str | None = None,
) -> None:
    """Give the tokenizer that `write_tokenizer` saved in `path` a post-processor that
    prepends <s> (or none), and `add_bos_token` / `chat_template` in tokenizer_config.json.
    Its `tokenizer_class` is the generic one: without it, transformers 5 picks the model
    type's class (GPTNeoXTokenizer for mamba2), which replaces tokenizer.json's pipeline."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = (
        processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", bos)]
        )
        if bos_post_processor
        else None
    )
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key, value in (("add_bos_token", add_bos_token), ("chat_template", chat_template)):
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "tokenizer_config.json").write_text(json.dumps(config))


# Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): head counts and sizes that divide awkwardly —
# 3 value heads per key head, Dk != Dv, head_dim 40 with partial_rotary_factor 0.25 (rope_dim
# 10), hidden 32 smaller than every head's width. No pad id: HF `generate` would mask the pad id
# wherever a random prompt holds it.
GDN_TINY = dict(
    vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=24,
    linear_value_head_dim=40, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=None,
)  # fmt: skip
GDN_LAYERS = ("linear_attention", "full_attention", "linear_attention", "linear_attention")
GDN_MOE = dict(
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)  # fmt: skip


def _rope(theta: float, **mrope) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25, **mrope}


def make_qwen3_next_checkpoint(path, *, layer_types=GDN_LAYERS, seed: int = 0, **overrides):
    """Save a random float32 Qwen3NextForCausalLM (MoE after every layer but layer 1, which
    has a dense MLP) to `path`; returns (path, torch_model)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kwargs = dict(
        GDN_TINY, **GDN_MOE, layer_types=list(layer_types), num_hidden_layers=len(layer_types),
        intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
        rope_parameters=_rope(1000.0),
    )  # fmt: skip
    torch.manual_seed(seed)
    config = Qwen3NextConfig(**{**kwargs, **overrides})
    return save_random_checkpoint(Qwen3NextForCausalLM(config), Path(path), seed)


def make_qwen3_5_checkpoint(
    path, *, moe: bool = False, multimodal: bool = False, layer_types=GDN_LAYERS, seed: int = 0,
    **overrides,
):  # fmt: skip
    """Save a random float32 Qwen3.5 model to `path`; returns (path, torch_model). Dense
    (`Qwen3_5ForCausalLM`) or MoE (`Qwen3_5MoeForCausalLM`); `multimodal`: the
    `Qwen3_5(Moe)ForConditionalGeneration` the published checkpoints are, with a tiny vision
    tower left at HF's initialisation (only the text model is redrawn). Its RoPE carries
    M-RoPE's `mrope_section`/`mrope_interleaved`, as the published configs do."""
    import transformers as tf

    text = dict(
        GDN_TINY, layer_types=list(layer_types), num_hidden_layers=len(layer_types),
        rope_parameters=_rope(1000.0, mrope_section=[2, 2, 1], mrope_interleaved=True),
    )  # fmt: skip
    text.update(GDN_MOE if moe else dict(intermediate_size=48))
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    torch.manual_seed(seed)
    if not multimodal:
        config = getattr(tf, f"{prefix}TextConfig")(**{**text, **overrides})
        return save_random_checkpoint(getattr(tf, f"{prefix}ForCausalLM")(config), Path(path), seed)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  patch_size=4, num_position_embeddings=16)  # fmt: skip
    tie = overrides.pop("tie_word_embeddings", False)
    config = getattr(tf, f"{prefix}Config")(
        text_config={**text, **overrides}, vision_config=vision, tie_word_embeddings=tie
    )
    model = getattr(tf, f"{prefix}ForConditionalGeneration")(config).float().eval()
    perturb_parameters(model.model.language_model, seed)
    if not tie:
        with torch.no_grad():
            model.lm_head.weight.copy_(2.0 * torch.randn(model.lm_head.weight.shape) / 32**0.5)
    model.save_pretrained(path)
    return Path(path), model
