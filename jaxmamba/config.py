"""Model configuration: one frozen dataclass, built from a preset, a YAML file or an HF config.

Dimension letters used in comments: E hidden, V vocab, H mamba heads, P mamba head dim,
G groups, N state size, K conv width, F MLP width, Hq/Hkv attention heads, Dh head dim.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Presets are package data of `jaxmamba.configs` (the repo's configs/ folder).
CONFIGS_DIR = Path(str(importlib.resources.files("jaxmamba.configs")))

LAYER_TYPES = ("mamba", "attention", "mlp")
MODEL_TYPES = ("nemotron_h", "mamba2")
MLP_ACTIVATIONS = ("relu2",)

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
}
_MOE_LAYER_TYPES = ("moe", "E")

_HF_LAYER_NAMES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp"}


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

    def __post_init__(self) -> None:
        # Normalise YAML/JSON lists so equality and hashing behave.
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "time_step_limit", tuple(float(v) for v in self.time_step_limit))
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
            _bad("model_type", self.model_type, f"one of {MODEL_TYPES}")
        if not self.layer_types:
            _bad("layer_types", self.layer_types, "at least one layer")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                _bad(f"layer_types[{i}]", t, f"one of {LAYER_TYPES}")
        if self.model_type == "mamba2" and set(self.layer_types) != {"mamba"}:
            _bad("layer_types", self.layer_types, "only 'mamba' layers for model_type mamba2")

        positive = ["vocab_size", "hidden_size"]
        positive += ["mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size"]
        positive += ["conv_kernel", "chunk_size"]
        if self.attention_layers:
            positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
        if "mlp" in self.layer_types:
            positive += ["intermediate_size"]
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _bad(field, value, "a positive int")
        if not (isinstance(self.norm_eps, int | float) and self.norm_eps > 0):
            _bad("norm_eps", self.norm_eps, "a positive float")

        if self.mamba_num_heads % self.n_groups:
            _bad("n_groups", self.n_groups, f"a divisor of mamba_num_heads={self.mamba_num_heads}")
        if self.attention_layers and self.num_attention_heads % self.num_key_value_heads:
            _bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
            )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            _bad("mlp_activation", self.mlp_activation, f"one of {MLP_ACTIVATIONS}")
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
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mamba")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "attention")

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
            if f.name not in d and f.name not in ("name", "eos_token_ids")
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

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        """A preset's config: `configs/<name>.yaml`, or the checkpoint in `configs/<name>/`."""
        path = preset_path(name)
        if path is None:
            raise ValueError(f"unknown model preset {name!r}; available: {list_presets()}")
        return cls.from_hf_config(path) if path.is_dir() else cls.from_yaml(path)

    @classmethod
    def load(cls, spec: str | os.PathLike | ModelConfig) -> ModelConfig:
        """A preset name, a YAML file, an HF config.json, or a directory holding config.json."""
        if isinstance(spec, ModelConfig):
            return spec
        path = Path(spec)
        if path.is_dir():
            return cls.from_hf_config(path)
        if path.suffix in (".yaml", ".yml"):
            return cls.from_yaml(path)
        if path.suffix == ".json":
            return cls.from_hf_config(path)
        if os.sep in str(spec) or path.exists():
            raise ValueError(
                f"model spec {str(spec)!r} is neither a directory with config.json, "
                "a .yaml file nor a .json file"
            )
        return cls.from_preset(str(spec))

    # ----- HF config.json -----

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | os.PathLike) -> ModelConfig:
        """Parse an HF `config.json` (a dict, the file, or the directory holding it). Read from
        a file, the stop ids also include those of the `generation_config.json` beside it."""
        name, generation = "", {}
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            name = path.parent.name
            try:
                config = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read HF config {path}: {e}") from e
            if not isinstance(config, dict):
                raise ValueError(f"HF config {path} is not a JSON object")
            generation = _read_generation_config(path.parent / "generation_config.json")
        model_type = config.get("model_type")
        if model_type == "nemotron_h":
            cfg = _from_nemotron_h(config, name)
        elif model_type == "mamba2":
            cfg = _from_mamba2(config, name)
        else:
            raise ValueError(
                f"unsupported model_type {model_type!r} in HF config; supported: {MODEL_TYPES}"
            )
        # HF and vLLM stop on every eos id of both files; config.json's first one leads.
        eos_ids = [
            *_token_ids(config, "eos_token_id", "HF config"),
            *_token_ids(generation, "eos_token_id", "generation_config.json"),
        ]
        if not eos_ids:
            return cfg  # the architecture's default eos id, if any
        eos_ids = list(dict.fromkeys(eos_ids))
        return dataclasses.replace(cfg, eos_token_id=eos_ids[0], eos_token_ids=tuple(eos_ids))

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict that transformers loads as this model."""
        common = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "layer_norm_epsilon": self.norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk_size,
            "use_conv_bias": self.use_conv_bias,
            "use_bias": self.mamba_proj_bias,
            "residual_in_fp32": self.residual_in_fp32,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id
            ),
            "pad_token_id": self.pad_token_id,
        }
        lo, hi = self.time_step_limit
        if self.model_type == "mamba2":
            expand, rem = divmod(self.d_inner, self.hidden_size)
            if rem:
                _bad("mamba_num_heads", self.mamba_num_heads, "d_inner a multiple of hidden_size")
            return {
                "model_type": "mamba2",
                "architectures": ["Mamba2ForCausalLM"],
                **common,
                "num_hidden_layers": self.num_layers,
                "num_heads": self.mamba_num_heads,
                "head_dim": self.mamba_head_dim,
                "state_size": self.ssm_state_size,
                "expand": expand,
                "hidden_act": "silu",
                "time_step_limit": [lo, hi],
            }
        if hi != math.inf:
            # HF NemotronH hard-codes the upper clamp to inf; it cannot express another.
            _bad("time_step_limit", self.time_step_limit, "(min, inf) for nemotron_h")
        return {
            "model_type": "nemotron_h",
            "architectures": ["NemotronHForCausalLM"],
            **common,
            "layers_block_type": [_HF_LAYER_NAMES[t] for t in self.layer_types],
            "mamba_num_heads": self.mamba_num_heads,
            "mamba_head_dim": self.mamba_head_dim,
            "ssm_state_size": self.ssm_state_size,
            "mamba_hidden_act": "silu",
            "time_step_min": lo,
            "num_attention_heads": self.num_attention_heads or 1,
            "num_key_value_heads": self.num_key_value_heads or 1,
            "head_dim": self.head_dim or 1,
            "attention_bias": self.attention_bias,
            "intermediate_size": self.intermediate_size or 1,
            "mlp_bias": self.mlp_bias,
            "mlp_hidden_act": self.mlp_activation,
        }


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


def _get(config: dict, *names: str, default: Any = None) -> Any:
    """The first of `names` present in an HF config (transformers renamed several keys)."""
    for n in names:
        if n in config and config[n] is not None:
            return config[n]
    return default


def _float(value: Any) -> float:
    # transformers 5 writes non-finite floats as {"__float__": "Infinity"}.
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _token_id(config: dict, key: str, default: int | None) -> int | None:
    """The (first) id of `key`; HF allows a list of eos ids (chat models), see `_token_ids`."""
    value = config.get(key, default)
    if isinstance(value, list):
        value = value[0] if value else None
    return value


def _token_ids(config: dict, key: str, source: str) -> list[int]:
    """Every id of `key`: an int, a list of ints, or absent/null."""
    value = config.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(
                f"{source} {key}={value!r} is invalid: expected an int or a list of ints"
            )
    return values


def _read_generation_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a JSON object")
    return d


def _require_act(config: dict, key: str, expected: str, default: str) -> None:
    value = config.get(key, default)
    if value != expected:
        raise ValueError(f"HF config {key}={value!r} is unsupported: only {expected!r}")


def _nemotron_h_layer_types(config: dict) -> tuple[str, ...]:
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
        if t in _MOE_LAYER_TYPES:
            raise ValueError(
                f"HF config {field}[{i}]={t!r}: MoE layers are not supported (dense models only)"
            )
        if t not in _LAYER_TYPE_ALIASES:
            raise ValueError(f"HF config {field}[{i}]={t!r} is not a known layer type")
        out.append(_LAYER_TYPE_ALIASES[t])
    return tuple(out)


def _from_nemotron_h(c: dict, name: str) -> ModelConfig:
    layer_types = _nemotron_h_layer_types(c)
    _require_act(c, "mamba_hidden_act", "silu", "silu")
    mlp_act = c.get("mlp_hidden_act", "relu2")
    if mlp_act not in MLP_ACTIVATIONS:
        raise ValueError(
            f"HF config mlp_hidden_act={mlp_act!r} is unsupported: only {MLP_ACTIVATIONS}"
        )
    # transformers' NemotronHAttention never applies RoPE (rope_theta etc. are inert there), so
    # those keys are ignored; an explicit position embedding or a sliding window would change
    # the numbers and is refused.
    pos = c.get("position_embedding_type")
    if pos not in (None, "none"):
        raise ValueError(f"HF config position_embedding_type={pos!r} is unsupported (no RoPE)")
    if c.get("sliding_window") is not None:
        raise ValueError(f"HF config sliding_window={c['sliding_window']!r} is unsupported")
    # num_nextn_predict_layers > 0 adds multi-token-prediction heads (`mtp.*` tensors); we serve
    # the main model only, so they are ignored here and skipped by the loader.
    num_heads = c.get("num_attention_heads", 32)
    hidden = c.get("hidden_size", 4096)
    return ModelConfig(
        model_type="nemotron_h",
        vocab_size=c.get("vocab_size", 131072),
        hidden_size=hidden,
        layer_types=layer_types,
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        mamba_num_heads=c.get("mamba_num_heads", 128),
        mamba_head_dim=c.get("mamba_head_dim", 64),
        n_groups=_get(c, "n_groups", "mamba_n_groups", default=8),
        ssm_state_size=c.get("ssm_state_size", 128),
        conv_kernel=_get(c, "conv_kernel", "mamba_d_conv", default=4),
        chunk_size=_get(c, "chunk_size", "mamba_chunk_size", default=128),
        use_conv_bias=bool(_get(c, "use_conv_bias", "mamba_conv_bias", default=True)),
        # The modeling code biases in_proj/out_proj by `use_bias` (not `mamba_proj_bias`).
        mamba_proj_bias=bool(c.get("use_bias", False)),
        # HF NemotronH clamps dt to (time_step_min, inf) and ignores config.time_step_limit.
        time_step_limit=(_float(_get(c, "time_step_min", "mamba_dt_min", default=0.001)), math.inf),
        residual_in_fp32=bool(c.get("residual_in_fp32", False)),
        num_attention_heads=num_heads,
        num_key_value_heads=_get(c, "num_key_value_heads", default=num_heads),
        head_dim=_get(c, "head_dim", default=hidden // num_heads),
        attention_bias=bool(c.get("attention_bias", False)),
        intermediate_size=c.get("intermediate_size", 21504),
        mlp_bias=bool(c.get("mlp_bias", False)),
        mlp_activation=mlp_act,
        bos_token_id=_token_id(c, "bos_token_id", 1),
        eos_token_id=_token_id(c, "eos_token_id", 2),
        pad_token_id=_token_id(c, "pad_token_id", 0),
        name=name,
    )


def _from_mamba2(c: dict, name: str) -> ModelConfig:
    _require_act(c, "hidden_act", "silu", "silu")
    hidden = c.get("hidden_size", 4096)
    num_heads = c.get("num_heads", 128)
    head_dim = c.get("head_dim", 64)
    expand = c.get("expand", 2)
    if expand * hidden != num_heads * head_dim:
        raise ValueError(
            f"HF mamba2 config expand*hidden_size={expand}*{hidden} != "
            f"num_heads*head_dim={num_heads}*{head_dim}"
        )
    limit = c.get("time_step_limit", (0.0, math.inf))
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
        time_step_limit=tuple(_float(v) for v in limit),
        residual_in_fp32=bool(c.get("residual_in_fp32", True)),
        num_attention_heads=0,
        num_key_value_heads=0,
        head_dim=0,
        attention_bias=False,
        intermediate_size=0,
        mlp_bias=False,
        mlp_activation="relu2",
        bos_token_id=_token_id(c, "bos_token_id", 0),
        eos_token_id=_token_id(c, "eos_token_id", 2),
        pad_token_id=_token_id(c, "pad_token_id", 1),
        name=name,
    )
