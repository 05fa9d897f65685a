"""What the family modules share: the `Family` record, reading HF config.json values, and the
parameter-map entries (HF tensor name and shape -> our param path, with the transform between
layouts). Host side.

Our param tree (E hidden, V vocab, F MLP width, K conv width, X experts):

    {"embed": {"embedding": [V, E]},
     "layers_{i}": {"norm": {"scale": [E]}, "mixer": MIXER},
     "norm_f": {"scale": [E]},
     "lm_head": {"kernel": [E, V]}}          # absent when tie_word_embeddings

One of our layers is one pre-norm residual sub-block (`x + mixer(norm(x))`); an HF decoder
layer with a mixer and a feed-forward is two of ours. HF Linear weights are [out, in]; our
kernels are [in, out]. HF conv1d weights are [conv_dim, 1, K]; ours are [K, conv_dim].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from jaxmamba.config import ModelConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the HF `architectures[0]` of its causal LM
    from_hf: Callable[[dict, str], ModelConfig]  # config.json dict, name -> ModelConfig
    param_map: Callable[[ModelConfig], list[Entry]]
    # Prefixes of the base model in checkpoints, in lookup order; the first is the one written.
    base_prefixes: tuple[str, ...] = ("model.", "")
    # ModelConfig -> config.json dict, for writing checkpoints (None: not implemented).
    to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    # The MTP head's config (`mtp.mtp_config`) -> its entries, under their full checkpoint
    # names (`mtp.*`); None: the family's MTP layers do not run.
    mtp_param_map: Callable[[ModelConfig], list[Entry]] | None = None
    # (the target's config, the config.json text dict) -> the MTP head's config: the target's
    # with the head's layer types; a ValueError for a layout the head does not run.
    mtp_config: Callable[[ModelConfig, dict], ModelConfig] | None = None


# ----------------------------------------------------------------------------------------
# HF config.json values


def get(config: dict, *names: str, default: Any = None) -> Any:
    """The first of `names` present in an HF config (transformers renamed several keys)."""
    for n in names:
        if n in config and config[n] is not None:
            return config[n]
    return default


def as_float(value: Any) -> float:
    # transformers 5 writes non-finite floats as {"__float__": "Infinity"}.
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def token_id(config: dict, key: str, default: int | None) -> int | None:
    """The (first) id of `key`; HF allows a list of eos ids (chat models)."""
    value = config.get(key, default)
    if isinstance(value, list):
        value = value[0] if value else None
    return value


def token_ids(config: dict, key: str, source: str) -> list[int]:
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


def with_eos_ids(cfg: ModelConfig, *sources: tuple[str, dict]) -> ModelConfig:
    """`cfg` stopping on every eos id that the `(name, config)` sources list, in order; the
    first leads. Without any, `cfg` keeps its architecture's default eos id."""
    eos_ids = [i for name, config in sources for i in token_ids(config, "eos_token_id", name)]
    if not eos_ids:
        return cfg
    eos_ids = list(dict.fromkeys(eos_ids))
    return replace(cfg, eos_token_id=eos_ids[0], eos_token_ids=tuple(eos_ids))


def require(config: dict, key: str, allowed: tuple, default: Any) -> Any:
    """`config[key]` (or `default`), raising unless it is one of `allowed`."""
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(
            f"HF config {key}={value!r} is unsupported: only {' or '.join(map(repr, allowed))}"
        )
    return value


def refuse(config: dict, key: str, allowed: tuple = (None,)) -> None:
    """Raise naming `key` when the config sets it to a value we do not implement."""
    require(config, key, allowed, None)


def finite_multiplier(config: dict, key: str) -> float:
    """`config[key]` (default 1) as a float, raising unless it is finite."""
    value = as_float(config.get(key, 1.0))
    if not math.isfinite(value):
        raise ValueError(f"HF config {key}={value!r} is invalid: expected a finite float")
    return value


def time_step_limit(config: dict) -> tuple[float, float]:
    """The `(min, max)` clamp of dt (default none: `(0, inf)`)."""
    return tuple(as_float(v) for v in get(config, "time_step_limit", default=(0.0, math.inf)))


def special_token_ids(config: dict, *, bos: int | None, eos: int | None, pad: int | None) -> dict:
    """`ModelConfig`'s bos/eos/pad ids, with the family's defaults."""
    return dict(
        bos_token_id=token_id(config, "bos_token_id", bos),
        eos_token_id=token_id(config, "eos_token_id", eos),
        pad_token_id=token_id(config, "pad_token_id", pad),
    )


def attention_fields(config: dict, num_heads: int, head_dim: int) -> dict:
    """`ModelConfig`'s attention fields; `num_key_value_heads` defaults to `num_heads`."""
    return dict(
        num_attention_heads=num_heads,
        num_key_value_heads=get(config, "num_key_value_heads", default=num_heads),
        head_dim=head_dim,
        attention_bias=bool(config.get("attention_bias", False)),
    )


def mamba_prefixed_fields(config: dict, d_inner: int, d_inner_name: str) -> dict:
    """`ModelConfig`'s Mamba2 fields from the `mamba_*` keys that bamba, granitemoehybrid and
    falcon_h1 share; `mamba_d_head` "auto" is `d_inner / mamba_n_heads`. `d_inner_name` says
    where `d_inner` came from, for the error."""
    heads = config.get("mamba_n_heads", 128)
    head_dim = config.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = d_inner // heads
    if head_dim * heads != d_inner:
        raise ValueError(
            f"HF config mamba_d_head*mamba_n_heads={head_dim}*{heads} != {d_inner_name}"
        )
    return dict(
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        n_groups=config.get("mamba_n_groups", 1),
        ssm_state_size=config.get("mamba_d_state", 256),
        conv_kernel=config.get("mamba_d_conv", 4),
        chunk_size=config.get("mamba_chunk_size", 256),
        use_conv_bias=bool(config.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
        time_step_limit=time_step_limit(config),
    )


def mamba2_hf_keys(cfg: ModelConfig) -> dict:
    """The config.json keys nemotron_h and mamba2 spell alike (writing checkpoints)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "n_groups": cfg.n_groups,
        "conv_kernel": cfg.conv_kernel,
        "chunk_size": cfg.chunk_size,
        "use_conv_bias": cfg.use_conv_bias,
        "use_bias": cfg.mamba_proj_bias,
        "residual_in_fp32": cfg.residual_in_fp32,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (
            list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id
        ),
        "pad_token_id": cfg.pad_token_id,
    }


def rope(config: dict, head_dim: int, *, partial_rotary_factor: float = 1.0) -> tuple[float, int]:
    """`(rope_theta, rotated dims per head)` from `rope_parameters` (or the legacy top-level
    keys); only the default RoPE type (no scaling) is implemented."""
    params = dict(config.get("rope_parameters") or {})
    if config.get("rope_scaling") not in (None, {}):
        params.setdefault("rope_type", (config["rope_scaling"] or {}).get("rope_type"))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"HF config rope_parameters.rope_type={rope_type!r} is unsupported: only 'default'"
        )
    theta = as_float(get(params, "rope_theta", default=get(config, "rope_theta", default=1e4)))
    factor = as_float(params.get("partial_rotary_factor", partial_rotary_factor))
    return theta, int(head_dim * factor)


# ----------------------------------------------------------------------------------------
# parameter map


@dataclass(frozen=True)
class Entry:
    """One array of our param tree and the HF tensor(s) it comes from.

    `hf_name` is one name, or a tuple of names whose tensors are joined first: stacked along a
    new leading axis, each of `hf_shape` (per-expert weights), or, when `rows` gives their
    sizes along axis 0, concatenated along that axis into `hf_shape` (projections HF keeps
    apart that we fuse). Names are without the base prefix (`lm_head.weight` is outside the
    base). `alt_names` are other spellings of a single name; `alternatives` are other HF
    layouts of the whole array (entries with the same path), read when a tensor of this one
    is missing. `to_hf` returns the joined array. `quantizable`: an HF Linear weight (or
    stacked expert weights) that the model can run quantized (`jaxmamba.model.quantization`);
    routers, gates, the lm_head, embeddings, convs and norms are not.
    """

    path: tuple[str, ...]  # our path in the param tree
    hf_name: str | tuple[str, ...]
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray] | None
    fp32: bool  # kept in float32 regardless of the requested dtype
    alt_names: tuple[str, ...] = field(default=())
    rows: tuple[int, ...] = field(default=())
    alternatives: tuple[Entry, ...] = field(default=())
    quantizable: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.rows and (
            not isinstance(self.hf_name, tuple)
            or len(self.rows) != len(self.hf_name)
            or sum(self.rows) != self.hf_shape[0]
        ):
            raise ValueError(
                f"Entry {'/'.join(self.path)}: rows {self.rows} must give one size per name of "
                f"{self.hf_name!r}, summing to hf_shape[0] of {self.hf_shape}"
            )

    @property
    def joined_shape(self) -> tuple[int, ...]:
        if isinstance(self.hf_name, tuple) and not self.rows:
            return (len(self.hf_name), *self.hf_shape)
        return self.hf_shape

    @property
    def shape(self) -> tuple[int, ...]:
        # A zero-stride view: the transforms (a row permutation aside) run on it without
        # allocating anything.
        return tuple(self.to_ours(np.broadcast_to(np.int8(0), self.joined_shape)).shape)

    def hf_parts(self) -> list[tuple[str, tuple[int, ...]]]:
        """Each HF tensor (name, shape) that the array is joined from."""
        if not isinstance(self.hf_name, tuple):
            return [(self.hf_name, self.hf_shape)]
        if self.rows:
            rest = self.hf_shape[1:]
            return [(n, (r, *rest)) for n, r in zip(self.hf_name, self.rows, strict=True)]
        return [(n, self.hf_shape) for n in self.hf_name]

    def join(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The HF tensors (in `hf_parts` order) as one array of `joined_shape`."""
        if not isinstance(self.hf_name, tuple):
            return arrays[0]
        return np.concatenate(arrays) if self.rows else np.stack(arrays)

    def split(self, x: np.ndarray) -> list[np.ndarray]:
        """`join`'s inverse."""
        if not isinstance(self.hf_name, tuple):
            return [x]
        if self.rows:
            return np.split(x, np.cumsum(self.rows)[:-1])
        return list(x)


def identity(x: np.ndarray) -> np.ndarray:
    return x


def transpose(x: np.ndarray) -> np.ndarray:
    return x.T


def swap_last(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


@dataclass(frozen=True, eq=False)
class Scaled:
    """`fn` then a multiplication by `factor` (a float, or a vector over the last axis), in
    float32: how a constant multiplier of HF's forward folds into a weight. A quantized
    weight keeps its values: the loader moves it with `fn` alone and folds `factor` into its
    scales."""

    fn: Callable[[np.ndarray], np.ndarray]
    factor: Any

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.fn(x).astype(np.float32) * np.asarray(self.factor, np.float32)


def scaled(fn: Callable[[np.ndarray], np.ndarray], factor) -> Callable[[np.ndarray], np.ndarray]:
    if isinstance(factor, int | float) and factor == 1:
        return fn
    return Scaled(fn, factor)


def layout(to_ours: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """`to_ours` without a folded multiplier: where each value goes, nothing more."""
    return to_ours.fn if isinstance(to_ours, Scaled) else to_ours


def _conv_to_ours(x: np.ndarray) -> np.ndarray:
    return x[:, 0, :].T  # [C, 1, K] -> [K, C]


def _conv_to_hf(x: np.ndarray) -> np.ndarray:
    return x.T[:, None, :]  # [K, C] -> [C, 1, K]


def vector(path, hf_name, n, fp32=False, to_ours=identity) -> Entry:
    return Entry(path, hf_name, (n,), to_ours, identity if to_ours is identity else None, fp32)


def linear(
    path, hf, d_in, d_out, bias, *, scale=1.0, bias_scale=None, quantizable=True
) -> list[Entry]:
    """An HF `nn.Linear` -> our `Linear`; `scale` (a float or a per-output vector) folds a
    constant multiplier of its input or output into the weight (and, as `bias_scale`, its
    bias: defaults to `scale`)."""
    to_hf = transpose if isinstance(scale, int | float) and scale == 1 else None
    out = [
        Entry((*path, "kernel"), f"{hf}.weight", (d_out, d_in), scaled(transpose, scale), to_hf,
              False, quantizable=quantizable)
    ]  # fmt: skip
    if bias:
        bias_scale = scale if bias_scale is None else bias_scale
        out.append(
            vector((*path, "bias"), f"{hf}.bias", d_out, to_ours=scaled(identity, bias_scale))
        )
    return out


def norm(path, hf, dim) -> Entry:
    return vector((*path, "scale"), f"{hf}.weight", dim, fp32=True)


def embedding(hf_name: str, cfg: ModelConfig, alt_names: tuple[str, ...] = ()) -> Entry:
    V, E = cfg.vocab_size, cfg.hidden_size
    return Entry(("embed", "embedding"), hf_name, (V, E), identity, identity, False, alt_names)


def lm_head(cfg: ModelConfig, *, scale=1.0) -> list[Entry]:
    if cfg.tie_word_embeddings:
        return []
    V, E = cfg.vocab_size, cfg.hidden_size
    to_hf = transpose if scale == 1 else None
    return [
        Entry(("lm_head", "kernel"), "lm_head.weight", (V, E), scaled(transpose, scale), to_hf,
              False)
    ]  # fmt: skip


def mamba_mixer(
    m: tuple[str, ...], hm: str, cfg: ModelConfig, *, in_scale=1.0, out_scale=1.0
) -> list[Entry]:
    """The Mamba2 mixer's tensors (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, gated `norm`,
    `out_proj`) under HF module `hm`; the scales fold constant multipliers into the two
    projections."""
    E, H, C = cfg.hidden_size, cfg.mamba_num_heads, cfg.conv_dim
    bias = cfg.mamba_proj_bias
    out = linear((*m, "in_proj"), f"{hm}.in_proj", E, cfg.in_proj_dim, bias, scale=in_scale)
    conv = (C, 1, cfg.conv_kernel)
    out.append(
        Entry((*m, "conv1d", "kernel"), f"{hm}.conv1d.weight", conv, _conv_to_ours, _conv_to_hf,
              False)
    )  # fmt: skip
    if cfg.use_conv_bias:
        out.append(vector((*m, "conv1d", "bias"), f"{hm}.conv1d.bias", C))
    for p in ("dt_bias", "A_log", "D"):
        out.append(vector((*m, p), f"{hm}.{p}", H, fp32=True))
    if cfg.mamba_rms_norm:
        out.append(norm((*m, "norm"), f"{hm}.norm", cfg.d_inner))
    out += linear((*m, "out_proj"), f"{hm}.out_proj", cfg.d_inner, E, bias, scale=out_scale)
    return out


def attention(
    m: tuple[str, ...], hm: str, cfg: ModelConfig, *, in_scale=1.0, k_scale=1.0, out_scale=1.0
) -> list[Entry]:
    """q/k/v/o projections under HF module `hm`. `in_scale` multiplies the attention input,
    `k_scale` the keys, `out_scale` the output: folded into the weights (biases get the scale
    of what follows them only)."""
    E = cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    b = cfg.attention_bias
    out = linear((*m, "q_proj"), f"{hm}.q_proj", E, q, b, scale=in_scale, bias_scale=1.0)
    out += linear(
        (*m, "k_proj"), f"{hm}.k_proj", E, kv, b, scale=in_scale * k_scale, bias_scale=k_scale
    )
    out += linear((*m, "v_proj"), f"{hm}.v_proj", E, kv, b, scale=in_scale, bias_scale=1.0)
    out += linear((*m, "o_proj"), f"{hm}.o_proj", q, E, b, scale=out_scale)
    return out


def relu2_mlp(m: tuple[str, ...], hm: str, E: int, F: int, bias: bool) -> list[Entry]:
    return linear((*m, "up_proj"), f"{hm}.up_proj", E, F, bias) + linear(
        (*m, "down_proj"), f"{hm}.down_proj", F, E, bias
    )


def glu_mlp(
    m: tuple[str, ...], hm: str, E: int, F: int, bias: bool, *, gate_scale=1.0, down_scale=1.0
) -> list[Entry]:
    """`down(silu(gate(x)) * up(x))` from separate `gate_proj`/`up_proj`/`down_proj`."""
    out = linear((*m, "gate_proj"), f"{hm}.gate_proj", E, F, bias, scale=gate_scale)
    out += linear((*m, "up_proj"), f"{hm}.up_proj", E, F, bias)
    out += linear((*m, "down_proj"), f"{hm}.down_proj", F, E, bias, scale=down_scale)
    return out


def fused_glu_mlp(
    m: tuple[str, ...], hm: str, E: int, F: int, *, up: str, down: str, down_scale=1.0
) -> list[Entry]:
    """A gated MLP whose gate and up projections are one HF tensor `[2F, E]`, gate first."""
    gate_up = f"{hm}.{up}.weight"
    return [
        Entry(
            (*m, "gate_proj", "kernel"),
            gate_up,
            (2 * F, E),
            lambda x: x[:F].T,
            None,
            False,
            quantizable=True,
        ),
        Entry(
            (*m, "up_proj", "kernel"),
            gate_up,
            (2 * F, E),
            lambda x: x[F:].T,
            None,
            False,
            quantizable=True,
        ),
        *linear((*m, "down_proj"), f"{hm}.{down}", F, E, False, scale=down_scale),
    ]


def is_base(entry: Entry) -> bool:
    return entry.path[0] != "lm_head"


def two_block_layers(
    cfg: ModelConfig, hf_layer: Callable[[int], str], *, norms: tuple[str, str]
) -> list[tuple[tuple[str, ...], str, str]]:
    """For families whose HF decoder layer is `x += mixer(norm1(x)); x += ffn(norm2(x))`: our
    layer j is HF layer j // 2, its mixer (j even) or its feed-forward (j odd). Yields
    (our mixer path, HF layer name, HF norm name) per layer, norms written into `plan` by the
    caller."""
    out = []
    for j in range(cfg.num_layers):
        hf = hf_layer(j // 2)
        out.append(((f"layers_{j}", "mixer"), hf, f"{hf}.{norms[j % 2]}"))
    return out


def paired_layer_types(mixers: list[str], ffn: str) -> tuple[str, ...]:
    """Our layer types for HF decoder layers of (mixer, feed-forward) each."""
    return tuple(t for m in mixers for t in (m, ffn))


# ----------------------------------------------------------------------------------------
# Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5)


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) + 1


def _minus_one(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) - 1


def zero_centered_norm(path, hf, dim) -> Entry:
    """An HF RMSNorm computing x̂·(1 + w) (Qwen3-Next, Qwen3.5): we store 1 + w."""
    return Entry((*path, "scale"), f"{hf}.weight", (dim,), _plus_one, _minus_one, True)


def permuted_rows(order: np.ndarray) -> tuple[Callable, Callable]:
    """(to_ours, to_hf) of an HF Linear weight [out, in] whose outputs we reorder: our column
    j is HF's output `order[j]`."""
    inverse = np.argsort(order)
    return (lambda x: x[order].T), (lambda x: x.T[inverse])


def gated_attention(m: tuple[str, ...], hm: str, cfg: ModelConfig) -> list[Entry]:
    """Attention with a per-head output gate and q/k RMSNorms under HF module `hm`: `q_proj`
    yields [q_h | gate_h] per head h (kept in HF's column order); `q_norm`/`k_norm` compute
    x̂·(1 + w) over a head."""
    E, Dh = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * Dh, cfg.num_key_value_heads * Dh
    b = cfg.attention_bias
    out = linear((*m, "q_proj"), f"{hm}.q_proj", E, 2 * q, b)
    out += linear((*m, "k_proj"), f"{hm}.k_proj", E, kv, b)
    out += linear((*m, "v_proj"), f"{hm}.v_proj", E, kv, b)
    out += linear((*m, "o_proj"), f"{hm}.o_proj", q, E, b)
    out.append(zero_centered_norm((*m, "q_norm"), f"{hm}.q_norm", Dh))
    out.append(zero_centered_norm((*m, "k_norm"), f"{hm}.k_norm", Dh))
    return out


def gdn_mixer(m: tuple[str, ...], hm: str, cfg: ModelConfig, in_proj: Entry) -> list[Entry]:
    """The Gated DeltaNet mixer's tensors under HF module `hm`, its `in_proj` (columns
    [q | k | v | z | b | a]) given by the family: the depthwise conv over [q | k | v] (no
    bias), `dt_bias`, `A_log`, the gated output norm (x̂·w, stored as is) and `out_proj`."""
    E, HV, C = cfg.hidden_size, cfg.gdn_num_value_heads, cfg.gdn_conv_dim
    conv = (C, 1, cfg.conv_kernel)
    return [
        in_proj,
        Entry((*m, "conv1d", "kernel"), f"{hm}.conv1d.weight", conv, _conv_to_ours, _conv_to_hf,
              False),
        vector((*m, "dt_bias"), f"{hm}.dt_bias", HV, fp32=True),
        vector((*m, "A_log"), f"{hm}.A_log", HV, fp32=True),
        norm((*m, "norm"), f"{hm}.norm", cfg.gdn_value_head_dim),
        *linear((*m, "out_proj"), f"{hm}.out_proj", cfg.gdn_value_dim, E, False),
    ]  # fmt: skip


def _gate_up_to_ours(x: np.ndarray) -> np.ndarray:
    # [2X, F, E] (every expert's gate, then every expert's up) -> [X, E, 2F] (gate | up)
    two_x, F, E = x.shape
    X = two_x // 2
    return x.reshape(2, X, F, E).transpose(1, 0, 2, 3).reshape(X, 2 * F, E).swapaxes(1, 2)


def _gate_up_to_hf(x: np.ndarray) -> np.ndarray:
    X, E, two_f = x.shape
    F = two_f // 2
    return x.swapaxes(1, 2).reshape(X, 2, F, E).transpose(1, 0, 2, 3).reshape(2 * X, F, E)


def softmax_moe(m: tuple[str, ...], hm: str, cfg: ModelConfig) -> list[Entry]:
    """A Qwen sparse MoE block under HF module `hm`: the router `gate`, the SwiGLU experts and
    a SwiGLU `shared_expert` scaled by sigmoid(`shared_expert_gate`). Checkpoints (and
    transformers 5.24's `save_pretrained`) keep one tensor per expert
    (`experts.{i}.{gate,up,down}_proj.weight`); transformers holds them fused
    (`experts.gate_up_proj` [X, 2F, E], `experts.down_proj` [X, E, F]): either is read."""
    E, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    experts = [f"{hm}.experts.{i}" for i in range(X)]
    gate_up = tuple(f"{e}.{p}_proj.weight" for p in ("gate", "up") for e in experts)
    down = tuple(f"{e}.down_proj.weight" for e in experts)
    fused_up = Entry((*m, "experts_up"), f"{hm}.experts.gate_up_proj", (X, 2 * F, E), swap_last,
                     swap_last, False, quantizable=True)  # fmt: skip
    fused_down = Entry((*m, "experts_down"), f"{hm}.experts.down_proj", (X, E, F), swap_last,
                       swap_last, False, quantizable=True)  # fmt: skip
    return [
        Entry((*m, "router", "kernel"), f"{hm}.gate.weight", (X, E), transpose, transpose, False),
        Entry((*m, "experts_up"), gate_up, (F, E), _gate_up_to_ours, _gate_up_to_hf, False,
              alternatives=(fused_up,), quantizable=True),
        Entry((*m, "experts_down"), down, (E, F), swap_last, swap_last, False,
              alternatives=(fused_down,), quantizable=True),
        *glu_mlp((*m, "shared_expert"), f"{hm}.shared_expert", E,
                 cfg.moe_shared_intermediate_size, False),
        *linear((*m, "shared_expert_gate"), f"{hm}.shared_expert_gate", E, 1, False,
                quantizable=False),
    ]  # fmt: skip


def rotary_factor(rope_dim: int, head_dim: int) -> float:
    """The `partial_rotary_factor` that HF turns back into `rope_dim` (`int(head_dim·f)`)."""
    factor = rope_dim / head_dim
    while int(head_dim * factor) < rope_dim:
        factor = math.nextafter(factor, math.inf)
    return factor


def checked_hf_config(
    cfg: ModelConfig,
    hf: dict[str, Any],
    from_hf: Callable[[dict, str], ModelConfig],
    inert: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`hf`, the config.json written for `cfg`, after checking that the family's `from_hf`
    reads it back as `cfg`: raises naming the first field the HF config cannot express.
    `inert` fields (that HF has no key for, and the model does not read for this family) are
    not compared."""
    back = with_eos_ids(from_hf(hf, ""), ("HF config", hf))
    for f in fields(cfg):
        if f.name not in ("name", *inert) and getattr(back, f.name) != getattr(cfg, f.name):
            raise ValueError(
                f"ModelConfig.{f.name}={getattr(cfg, f.name)!r} cannot be written as a "
                f"{hf['model_type']} config.json (it reads back as {getattr(back, f.name)!r})"
            )
    return hf
