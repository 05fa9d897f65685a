"""Model configuration: one frozen dataclass, its checks, and our YAML format. Presets, HF
`config.json` files and model specs are read by `jaxmamba.model.families` (`load_config`,
`config_from_hf`), which knows every family.

Dimension letters used in comments: E hidden, V vocab, H mamba heads, P mamba head dim,
G groups, N state size, K conv width, F MLP width, Hq/Hkv attention heads, Dh head dim;
Gated DeltaNet: Hk key heads, HV value heads, Dk / Dv their head dims.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Presets are package data of `jaxmamba.configs` (the repo's configs/ folder).
CONFIGS_DIR = Path(str(importlib.resources.files("jaxmamba.configs")))

# The HF model types of the families in `jaxmamba.model.families` (a test keeps the two equal).
MODEL_TYPES = ("nemotron_h", "mamba2", "bamba", "granitemoehybrid", "falcon_h1", "qwen3_next",
               "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")  # fmt: skip
LAYER_TYPES = ("mamba", "attention", "mlp", "moe", "parallel", "gdn")
MLP_ACTIVATIONS = ("relu2", "silu_glu")
MOE_ROUTERS = ("softmax_topk", "softmax", "sigmoid_grouped")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float
    tie_word_embeddings: bool
    # Mamba2 mixer.
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    residual_in_fp32: bool
    # Attention (zero when the model has no attention layers).
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    # MLP (zero when the model has no MLP layers).
    intermediate_size: int
    mlp_bias: bool
    mlp_activation: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    name: str = ""
    # Every id that ends generation (config.json and generation_config.json may list several);
    # `eos_token_id` is the first of them. Left empty, it is `(eos_token_id,)`.
    eos_token_ids: tuple[int, ...] = ()
    # ----- what the other families need; the defaults are the Nemotron-H/Mamba2 behaviour -----
    # Mamba2 output gate: rmsnorm(y * silu(z)) per group when True, y * silu(z) when False.
    mamba_rms_norm: bool = True
    # Attention: RoPE (rope_theta 0: none) on the first rope_dim dims of each head (0: all).
    rope_theta: float = 0.0
    rope_dim: int = 0
    attention_scale: float = 0.0  # 0: head_dim**-0.5
    # Multipliers applied at run time (others are folded into weights by the family's map).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # on every sub-block's output before the residual add
    logits_multiplier: float = 1.0
    # Constant multipliers the family's parameter map folds into weights when loading, by HF
    # config key: ((key, (values...)), ...). They change no shape; random weights ignore them.
    weight_multipliers: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # "moe" layers: X routed experts (top-k), plus a shared expert when its width is > 0.
    # Experts and the shared expert use mlp_activation.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0
    # softmax_topk: softmax over the top-k router logits (Granite). softmax: softmax over all
    # experts, the top-k of those, renormalised when moe_norm_topk_prob (Qwen3-Next, Qwen3.5).
    # sigmoid_grouped: sigmoid
    # scores + correction bias, top-k within the best moe_topk_groups of moe_num_groups groups,
    # optional renormalisation, times moe_routed_scaling (DeepSeek-V3 / Nemotron-H).
    moe_router: str = "softmax_topk"
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    moe_norm_topk_prob: bool = False
    moe_routed_scaling: float = 1.0
    # The shared expert's output is scaled by sigmoid(x · w), w [E] (Qwen3-Next, Qwen3.5).
    moe_shared_expert_gate: bool = False
    # Attention: a per-head output gate (q_proj yields [q | gate] per head; the output is
    # o · sigmoid(gate)) and RMSNorm of q and k over each head (Qwen3-Next, Qwen3.5).
    attention_output_gate: bool = False
    attention_qk_norm: bool = False
    # "gdn" layers (Gated DeltaNet): Hk key heads and HV value heads of Dk / Dv dims; the conv
    # over [q | k | v] has width conv_kernel, and the chunked prefill uses chunk_size.
    gdn_num_key_heads: int = 0
    gdn_num_value_heads: int = 0
    gdn_key_head_dim: int = 0
    gdn_value_head_dim: int = 0

    def __post_init__(self) -> None:
        # Normalise YAML/JSON lists so equality and hashing behave.
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "time_step_limit", tuple(float(v) for v in self.time_step_limit))
        object.__setattr__(
            self,
            "weight_multipliers",
            tuple((str(k), tuple(float(x) for x in v)) for k, v in self.weight_multipliers),
        )
        eos_ids = self.eos_token_ids
        if isinstance(eos_ids, list | tuple):
            eos_ids = tuple(dict.fromkeys(eos_ids))  # ordered, without repeats
        if not eos_ids and self.eos_token_id is not None:
            eos_ids = (self.eos_token_id,)
        object.__setattr__(self, "eos_token_ids", eos_ids)
        if self.eos_token_id is None and eos_ids:
            object.__setattr__(self, "eos_token_id", eos_ids[0])
        self._validate()

    def _validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            _bad("model_type", self.model_type, f"one of {tuple(sorted(MODEL_TYPES))}")
        if not self.layer_types:
            _bad("layer_types", self.layer_types, "at least one layer")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                _bad(f"layer_types[{i}]", t, f"one of {LAYER_TYPES}")
        if self.model_type == "mamba2" and set(self.layer_types) != {"mamba"}:
            _bad("layer_types", self.layer_types, "only 'mamba' layers for model_type mamba2")

        positive = ["vocab_size", "hidden_size", "conv_kernel", "chunk_size"]
        if self.mamba_layers:
            positive += ["mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size"]
        if self.gdn_layers:
            positive += ["gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim",
                         "gdn_value_head_dim"]  # fmt: skip
        if self.attention_layers:
            positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
        if "mlp" in self.layer_types or "parallel" in self.layer_types:
            positive += ["intermediate_size"]
        if "moe" in self.layer_types:
            positive += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _bad(field, value, "a positive int")
        if not (isinstance(self.norm_eps, int | float) and self.norm_eps > 0):
            _bad("norm_eps", self.norm_eps, "a positive float")

        if self.mamba_layers and self.mamba_num_heads % self.n_groups:
            _bad("n_groups", self.n_groups, f"a divisor of mamba_num_heads={self.mamba_num_heads}")
        if self.gdn_layers and self.gdn_num_value_heads % self.gdn_num_key_heads:
            _bad("gdn_num_value_heads", self.gdn_num_value_heads,
                 f"a multiple of gdn_num_key_heads={self.gdn_num_key_heads}")  # fmt: skip
        if self.gdn_layers and self.mamba_layers:
            # One chunk layout a step serves every recurrent layer; the two mixers' chunk
            # sizes would differ.
            _bad("layer_types", self.layer_types, "Mamba2 or Gated DeltaNet layers, not both")
        if self.attention_layers and self.num_attention_heads % self.num_key_value_heads:
            _bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
            )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            _bad("mlp_activation", self.mlp_activation, f"one of {MLP_ACTIVATIONS}")
        self._validate_extensions()
        if len(self.time_step_limit) != 2:
            _bad("time_step_limit", self.time_step_limit, "a pair (min, max)")
        lo, hi = self.time_step_limit
        if not (0.0 <= lo < hi) or math.isnan(hi):
            _bad("time_step_limit", self.time_step_limit, "0 <= min < max (max may be inf)")
        for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, field)
            if value is not None and not _is_id(value, self.vocab_size):
                _bad(field, value, f"None or an id in [0, vocab_size={self.vocab_size})")
        if not isinstance(self.eos_token_ids, tuple) or not all(
            _is_id(i, self.vocab_size) for i in self.eos_token_ids
        ):
            _bad("eos_token_ids", self.eos_token_ids, f"ids in [0, vocab_size={self.vocab_size})")
        if self.eos_token_id is not None and self.eos_token_id not in self.eos_token_ids:
            _bad(
                "eos_token_ids",
                self.eos_token_ids,
                f"a set holding eos_token_id={self.eos_token_id}",
            )

    def _validate_extensions(self) -> None:
        for field in ("rope_theta", "attention_scale", "moe_routed_scaling"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                _bad(field, value, "a finite float >= 0")
        for field in ("embedding_multiplier", "residual_multiplier", "logits_multiplier"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and math.isfinite(value)):
                _bad(field, value, "a finite float")
        if self.rope_theta and self.attention_layers:
            if self.rope_dim % 2 or not 0 <= self.rope_dim <= self.head_dim:
                _bad("rope_dim", self.rope_dim, f"even, in [0, head_dim={self.head_dim}]")
        if "moe" in self.layer_types:
            if self.moe_router not in MOE_ROUTERS:
                _bad("moe_router", self.moe_router, f"one of {MOE_ROUTERS}")
            if self.num_experts_per_tok > self.num_experts:
                _bad("num_experts_per_tok", self.num_experts_per_tok,
                     f"at most num_experts={self.num_experts}")  # fmt: skip
            g = self.moe_num_groups
            if not isinstance(g, int) or g <= 0 or self.num_experts % g:
                _bad("moe_num_groups", g, f"a divisor of num_experts={self.num_experts}")
            if not 0 < self.moe_topk_groups <= g:
                _bad("moe_topk_groups", self.moe_topk_groups, f"in [1, moe_num_groups={g}]")
            if self.moe_router == "sigmoid_grouped" and g > 1 and self.num_experts // g < 2:
                _bad("moe_num_groups", g, "groups of at least 2 experts (scored by their top 2)")
            if self.moe_shared_intermediate_size < 0:
                _bad("moe_shared_intermediate_size", self.moe_shared_intermediate_size, ">= 0")

    # ----- derived sizes -----

    @property
    def d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        # [z (d_inner) | xBC (conv_dim) | dt (H)]
        return self.d_inner + self.conv_dim + self.mamba_num_heads

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_num_key_heads * self.gdn_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_num_value_heads * self.gdn_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        # The conv runs over [q | k | v].
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_in_proj_dim(self) -> int:
        # [q | k | v (gdn_conv_dim) | z (HV·Dv) | b (HV) | a (HV)]
        return self.gdn_conv_dim + self.gdn_value_dim + 2 * self.gdn_num_value_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Layers with a Mamba2 mixer (and so a conv and an SSM state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("mamba", "parallel"))

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Layers with a Gated DeltaNet mixer (a conv and a recurrent state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "gdn")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Layers that hold a recurrent state in the slot pools (Mamba2 or Gated DeltaNet), in
        order: their index here is their entry in `StateCache.conv` / `StateCache.ssm`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("mamba", "parallel", "gdn"))

    @property
    def num_recurrent_layers(self) -> int:
        return len(self.recurrent_layers)

    def recurrent_state_shapes(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv window and recurrent state shapes in recurrent layer `layer` (a
        model layer index): Mamba2 `([K-1, conv_dim], [H, P, N])`, Gated DeltaNet
        `([K-1, gdn_conv_dim], [HV, Dk, Dv])`."""
        if self.layer_types[layer] == "gdn":
            state = (self.gdn_num_value_heads, self.gdn_key_head_dim, self.gdn_value_head_dim)
            return (self.conv_kernel - 1, self.gdn_conv_dim), state
        state = (self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size)
        return (self.conv_kernel - 1, self.conv_dim), state

    def slot_state_elements(self) -> tuple[int, int]:
        """Elements of one slot's conv windows and recurrent states, summed over every
        recurrent layer."""
        conv = state = 0
        for layer in self.recurrent_layers:
            c, s = self.recurrent_state_shapes(layer)
            conv, state = conv + math.prod(c), state + math.prod(s)
        return conv, state

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with attention (and so a paged KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("attention", "parallel"))

    @property
    def num_mamba_layers(self) -> int:
        return len(self.mamba_layers)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layers)

    # ----- (de)serialisation of our own format -----

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["time_step_limit"] = list(self.time_step_limit)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["weight_multipliers"] = [[k, list(v)] for k, v in self.weight_multipliers]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "dict") -> ModelConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a mapping of ModelConfig fields, got {type(d)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{source}: unknown ModelConfig fields {unknown}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in d and f.default is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"{source}: missing ModelConfig fields {missing}")
        return cls(**d)

    def to_yaml(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        try:
            d = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read model config YAML {path}: {e}") from e
        if isinstance(d, dict):
            d.setdefault("name", path.stem)
        return cls.from_dict(d, source=str(path))


def list_presets() -> list[str]:
    yamls = [p.stem for p in CONFIGS_DIR.glob("*.yaml")]
    checkpoints = [p.parent.name for p in CONFIGS_DIR.glob("*/config.json")]
    return sorted(yamls + checkpoints)


def preset_path(name: str) -> Path | None:
    """The YAML file or checkpoint directory of preset `name`, or None if there is none."""
    if not name or os.sep in name or name.startswith("."):
        return None
    if (path := CONFIGS_DIR / f"{name}.yaml").is_file():
        return path
    if (path := CONFIGS_DIR / name / "config.json").is_file():
        return path.parent
    return None


def checkpoint_dir(spec: str | os.PathLike) -> Path | None:
    """The HF checkpoint directory that a model spec names: the directory itself, or the
    directory of a checkpoint preset; None for YAML presets and files (random weights)."""
    path = Path(spec)
    if path.is_dir():
        return path
    preset = preset_path(str(spec))
    return preset if preset is not None and preset.is_dir() else None


def _bad(field: str, value: Any, expected: str) -> None:
    raise ValueError(f"ModelConfig.{field}={value!r} is invalid: expected {expected}")


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size
