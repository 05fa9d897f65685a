"""Quantized weights at load time: a checkpoint's quantization scheme (`read_quantization`), the
names and scale layout of a quantized array in our param tree (host, numpy), and quantizing a
float model's weights where they lie (`quantize_params`, jitted).

A quantized array of our tree — a Linear's `kernel [K, N]`, or the stacked experts'
`experts_up`/`experts_down [X, K, N]` — is kept as checkpoints publish it, in leaves side by
side (`quantized_names`; `experts_up_weight`, ... for experts):

    weight        [..., N, K]       float8_e4m3fn or int8 (HF's [out, in])
    weight_scale  f32[..., NS, KS]  (its layout: `jaxmamba.kernels.matmul.quantized`)
    input_scale   f32[]             the static activation scale, where the checkpoint has one

A Linear or an expert stack whose params hold these runs quantized (`layers.Linear`,
`moe.MoE`). An attention layer may also hold the checkpoint's KV-cache scales
(`k_cache_scale`, `v_cache_scale`), used when its pages are FP8.

Schemes read (vLLM's names): NVIDIA ModelOpt (`quant_method: "modelopt"`, `quant_algo: "FP8"`
with per-tensor `weight_scale` and static `input_scale`, or `"FP8_PER_CHANNEL_PER_TOKEN"`; in
config.json or in `hf_quant_config.json`), and `quant_method: "fp8"` (per-tensor
`weight_scale`, or 128×128 blocks of `weight_scale_inv` with dynamic activations, as Qwen and
DeepSeek ship). Anything else is refused, naming the field.
"""

from __future__ import annotations

import fnmatch
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.engine.config import QUANTIZATION_METHODS
from jaxmamba.kernels.matmul.quantized import BLOCK, FP8, FP8_MAX, INT8_MAX
from jaxmamba.model.families import get_family

K_CACHE_SCALE, V_CACHE_SCALE = "k_cache_scale", "v_cache_scale"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's own file


def quantized_names(name: str) -> tuple[str, str, str]:
    """`(weight, weight_scale, input_scale)`: the leaves that stand for float leaf `name`
    (`kernel`, `experts_up`, `experts_down`) quantized."""
    prefix = "" if name == "kernel" else f"{name}_"
    return f"{prefix}weight", f"{prefix}weight_scale", f"{prefix}input_scale"


def quantized_leaf(leaf: str) -> tuple[str, str | None]:
    """`(float leaf, role)` of a param leaf of a quantized layer: role "weight" or "scale" (a
    `weight` or `weight_scale` leaf, of float leaf `kernel`, `experts_up`, ...), "replicated"
    (an `input_scale`, a KV-cache scale: scalars), None (no quantized leaf)."""
    for suffix, role in (("weight_scale", "scale"), ("weight", "weight"),
                         ("input_scale", "replicated")):  # fmt: skip
        if leaf == suffix:
            return "kernel", role
        if leaf.endswith("_" + suffix):
            return leaf.removesuffix("_" + suffix), role
    if leaf in (K_CACHE_SCALE, V_CACHE_SCALE):
        return leaf, "replicated"
    return leaf, None


def float_name(leaf: str) -> str | None:
    """The float leaf a quantized `weight` leaf stands for (None: `leaf` is no such leaf)."""
    if leaf == "weight":
        return "kernel"
    return leaf.removesuffix("_weight") if leaf.endswith("_weight") else None


# ----------------------------------------------------------------------------------------
# a checkpoint's scheme


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's quantization config says about its tensors."""

    method: str  # "modelopt" or "fp8"
    block_scaled: bool  # a `weight_scale_inv` per 128×128 block (else `weight_scale`)
    static_activations: bool  # an `input_scale` beside every quantized weight
    excluded: tuple[str, ...]  # modules (names or wildcards) left unquantized
    source: str  # where it was read, for errors

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.block_scaled else "weight_scale"

    def excludes(self, module: str) -> bool:
        """Whether the config lists `module` (an HF module name) as left unquantized: the name,
        a module above it, or a wildcard (ModelOpt's) that matches it."""
        return any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p)
                   for p in self.excluded)  # fmt: skip


def read_quantization(path: Path) -> CheckpointQuantization | None:
    """The quantization scheme of the checkpoint directory `path`: config.json's
    `quantization_config`, else ModelOpt's `hf_quant_config.json`; None when it has neither.
    Raises ValueError naming the field of a scheme we do not implement."""
    config = _read_json(path / "config.json")
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is not None:
        where = f"{path / 'config.json'} quantization_config"
        if not isinstance(qc, dict):
            raise ValueError(f"{where} is not a JSON object: {qc!r}")
        method = qc.get("quant_method")
        if method == "fp8":
            return _fp8(qc, where)
        if method == "modelopt":
            nested = qc.get("quantization")
            if nested is not None:  # hf_quant_config.json's form, inside config.json
                return _modelopt(_object(nested, f"{where}.quantization"), f"{where}.quantization")
            return _modelopt(qc, where)
        raise ValueError(
            f"{where}.quant_method={method!r} is unsupported: only 'modelopt' (NVIDIA ModelOpt "
            "FP8) or 'fp8' (per-tensor or 128x128 block-scaled FP8)"
        )
    modelopt = path / HF_QUANT_CONFIG
    if modelopt.is_file():
        where = str(modelopt)
        q = _read_json(modelopt).get("quantization")
        return _modelopt(_object(q, f"{where} quantization"), f"{where} quantization")
    return None


def _modelopt(q: dict, where: str) -> CheckpointQuantization:
    algo = q.get("quant_algo")
    name = str(algo).upper() if isinstance(algo, str) else algo
    if name not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        raise ValueError(
            f"{where}.quant_algo={algo!r} is unsupported: only 'FP8' (per-tensor weight and "
            "activation scales) or 'FP8_PER_CHANNEL_PER_TOKEN'"
        )
    kv = q.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() != "FP8":
        raise ValueError(f"{where}.kv_cache_quant_algo={kv!r} is unsupported: only 'FP8' or null")
    scheme = q.get("kv_cache_scheme")
    if scheme is not None and not (
        isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
    ):
        raise ValueError(
            f"{where}.kv_cache_scheme={scheme!r} is unsupported: only 8-bit float or null"
        )
    key = "exclude_modules" if "exclude_modules" in q else "ignore"
    return CheckpointQuantization(
        method="modelopt",
        block_scaled=False,
        static_activations=name == "FP8",
        excluded=_names(q.get(key), f"{where}.{key}"),
        source=where,
    )


def _fp8(q: dict, where: str) -> CheckpointQuantization:
    fmt = q.get("fmt")
    if fmt not in (None, "e4m3"):
        raise ValueError(f"{where}.fmt={fmt!r} is unsupported: only 'e4m3' (float8_e4m3fn)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"{where}.activation_scheme={scheme!r} is unsupported: only 'dynamic' or 'static'"
        )
    block = q.get("weight_block_size")
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise ValueError(
            f"{where}.weight_block_size={block!r} is unsupported: only [{BLOCK}, {BLOCK}] or null"
        )
    if block is not None and scheme != "dynamic":
        raise ValueError(
            f"{where}.activation_scheme={scheme!r} is unsupported with weight_block_size: "
            "block-scaled weights take dynamic activations only"
        )
    key = "modules_to_not_convert" if "modules_to_not_convert" in q else "ignored_layers"
    return CheckpointQuantization(
        method="fp8",
        block_scaled=block is not None,
        static_activations=scheme == "static",
        excluded=_names(q.get(key), f"{where}.{key}"),
        source=where,
    )


def _names(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}={value!r} is invalid: expected a list of module names")
    return tuple(value)


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not a JSON object: {value!r}")
    return value


def _read_json(path: Path) -> dict:
    try:
        return _object(json.loads(path.read_text()), str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


# ----------------------------------------------------------------------------------------
# scale layouts (host, numpy)


def row_scales(
    scale: np.ndarray, weight_shape: tuple[int, ...], block_scaled: bool, name: str
) -> np.ndarray:
    """A checkpoint weight's scale `[*lead, rows, cols]` as one row of scales per output
    channel, `f32[*lead, rows, KS]` (KS = ceil(cols / 128) when block-scaled, else 1), so that
    it joins and moves exactly like the weight's rows. Accepts a scale per tensor, per leading
    index (an expert), per output channel, or per 128×128 block."""
    *lead, rows, cols = weight_shape
    s = np.asarray(scale, np.float32)
    if block_scaled:
        want = (*lead, -(-rows // BLOCK), -(-cols // BLOCK))
        if s.shape != want:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {list(s.shape)}, expected {list(want)}: "
                f"a scale per {BLOCK}x{BLOCK} block of its weight {list(weight_shape)}"
            )
        return np.repeat(s, BLOCK, axis=-2)[..., :rows, :]
    if s.size == 1:
        s = s.reshape(())
    if s.shape == () or s.shape == tuple(lead):
        s = s[..., None, None]
    elif s.shape in ((*lead, rows), (*lead, rows, 1)):
        s = s.reshape(*lead, rows, 1)
    else:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {list(s.shape)}: expected a scale per tensor, "
            f"per output channel {[*lead, rows]} of its weight {list(weight_shape)}"
            + (f", or per leading index {list(lead)}" if lead else "")
        )
    return np.broadcast_to(s, (*lead, rows, 1))


def compress_rows(s: np.ndarray) -> np.ndarray:
    """Row scales `f32[..., N, KS]` in the fewest rows that say the same: one (a scale per
    tensor), one per 128 rows (blocks), or N."""
    n = s.shape[-2]
    if np.all(s == s[..., :1, :]):
        return np.ascontiguousarray(s[..., :1, :])
    nb = -(-n // BLOCK)
    pad = np.repeat(s[..., -1:, :], nb * BLOCK - n, axis=-2)
    blocks = np.concatenate([s, pad], axis=-2).reshape(*s.shape[:-2], nb, BLOCK, s.shape[-1])
    if np.all(blocks == blocks[..., :1, :]):
        return np.ascontiguousarray(blocks[..., 0, :])
    return np.ascontiguousarray(s)


def dequantize_np(weight: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A checkpoint weight `[*lead, rows, cols]` times its row scales (`row_scales`), f32."""
    cols = weight.shape[-1]
    if rows.shape[-1] != 1:
        rows = np.repeat(rows, BLOCK, axis=-1)[..., :cols]
    return np.asarray(weight, np.float32) * rows


# ----------------------------------------------------------------------------------------
# quantizing at load time


def quantizable_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """Our param paths that the model can run quantized (the family's map says which)."""
    plan = get_family(cfg.model_type).param_map(cfg)
    return sorted({e.path for e in plan if e.quantizable})


@functools.partial(jax.jit, static_argnames="method")
def _quantize(x: jax.Array, method: str) -> tuple[jax.Array, jax.Array]:
    w = jnp.swapaxes(x, -1, -2).astype(jnp.float32)  # [..., N, K]
    amax = jnp.maximum(jnp.max(jnp.abs(w), axis=-1, keepdims=True), 1e-12)
    if method == "fp8":
        scale = amax / FP8_MAX
        return jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale
    scale = amax / INT8_MAX
    return jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def quantize_params(params: dict, cfg: ModelConfig, method: str) -> dict:
    """`params` with every projection and expert weight quantized (`method` "fp8": FP8 e4m3
    weights, the activations quantized per token in the matmul; "int8": weight-only), one
    scale per output channel: its absolute maximum over the inputs / 448 (127). Norms,
    embeddings, the conv, A_log/D/dt_bias, routers, gates and the lm_head stay as they are,
    as in vLLM's `quantization="fp8"`."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={method!r} is unsupported: only {QUANTIZATION_METHODS} or None"
        )
    out = _copy_dicts(params)
    for path in quantizable_paths(cfg):
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        weight, scale = _quantize(parent.pop(path[-1]), method)
        names = quantized_names(path[-1])
        parent[names[0]], parent[names[1]] = weight, scale
    return out


def _copy_dicts(tree):
    return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
