"""HF checkpoints (config.json + *.safetensors) <-> our parameter tree. Host side only.

Which HF tensor becomes which array of our tree is the model family's parameter map
(`jaxmamba.model.families`, the tree's layout in `families/common.py`). A_log, D, dt_bias and
norm scales load as float32, everything else in the requested dtype.

A quantized checkpoint (FP8, `jaxmamba.model.quantization` names the schemes) keeps its
quantized weights as published, with their scales, where the model can run them quantized
(the entries the family marks `quantizable`); a quantized tensor anywhere else (a router, the
lm_head) or fused with unquantized ones is dequantized to the requested dtype.

Safetensors files are read through our own small header parser and `np.memmap`, because the
`safetensors` numpy backend cannot represent bfloat16 (ml_dtypes can), and memory-mapping keeps
host memory flat for large checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.model import quantization as quant
from jaxmamba.model.families import config_from_hf, get_family, hf_config_from
from jaxmamba.model.families.common import Entry, is_base, layout, swap_last

Params = dict[str, Any]

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

# Tensors a checkpoint may carry that we deliberately do not load.
IGNORABLE_TENSORS = (
    re.compile(r"^mtp\."),  # multi-token-prediction heads (NemotronH, Qwen3-Next, Qwen3.5)
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),  # non-persistent RoPE buffers of old exports
    re.compile(r"\.(q_scale|prob_scale)$"),  # FP8 attention scales we do not use (vLLM neither)
)
# Modules of a multimodal checkpoint beside the text model we serve: skipped, with one log line
# per module giving the count (Qwen3.5's vision tower; transformers' Qwen3_5ForCausalLM skips
# it too).
SKIPPED_MODULES = (("vision-tower", re.compile(r"^model\.visual\.")),)

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


# ----------------------------------------------------------------------------------------
# safetensors files


class _SafetensorsFile:
    """Lazy reader of one .safetensors file: header parsed and checked, data memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise ValueError("file shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds file size {size}")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from e
        if not isinstance(header, dict):
            raise ValueError(f"cannot read safetensors file {path}: header is not a JSON object")
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        data_len = size - self._data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _ST_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"safetensors file {path}: bad header entry {name!r}: {e}") from e
            nbytes = math.prod(shape) * dtype.itemsize
            if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
                raise ValueError(
                    f"safetensors file {path}: tensor {name!r} {info['dtype']}{list(shape)} has "
                    f"data_offsets [{begin}, {end}] inconsistent with its size {nbytes} bytes "
                    f"or the data length {data_len} (truncated or corrupted file?)"
                )
            self.entries[name] = (dtype, shape, begin, end)

    def get(self, name: str) -> np.ndarray:
        dtype, shape, begin, _ = self.entries[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(
            self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape
        )


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_NAMES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {a.dtype} to safetensors")
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())


class _Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, by HF name."""

    def __init__(self, path: Path):
        index = path / SAFETENSORS_INDEX
        single = path / SAFETENSORS_SINGLE
        self.where: dict[str, _SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise ValueError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read checkpoint index {index}: {e}") from e
            files = {}
            for fname in sorted(set(weight_map.values())):
                if not (path / fname).is_file():
                    raise ValueError(f"checkpoint index {index} names missing shard {path / fname}")
                files[fname] = _SafetensorsFile(path / fname)
            for name, fname in weight_map.items():
                if name not in files[fname].entries:
                    raise ValueError(
                        f"checkpoint index {index} puts {name!r} in {fname}, which lacks it"
                    )
                self.where[name] = files[fname]
            # Tensors present in shards but absent from the index are still unexpected extras.
            for f in files.values():
                for name in f.entries:
                    self.where.setdefault(name, f)
        else:
            paths = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
            if not paths:
                raise ValueError(f"no *.safetensors files in checkpoint directory {path}")
            for p in paths:
                f = _SafetensorsFile(p)
                for name in f.entries:
                    if name in self.where:
                        raise ValueError(
                            f"tensor {name!r} is in both {self.where[name].path} and {p}"
                        )
                    self.where[name] = f

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].entries[name][1]

    def get(self, name: str) -> np.ndarray:
        return self.where[name].get(name)


# ----------------------------------------------------------------------------------------
# name/shape plan


def _plan(cfg: ModelConfig) -> list[Entry]:
    return get_family(cfg.model_type).param_map(cfg)


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _path_str(path: tuple[str, ...]) -> str:
    return "/".join(path)


def checkpoint_param_shapes(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
    """The param tree of `cfg` as ShapeDtypeStructs (what `load_hf_checkpoint` returns)."""
    tree: Params = {}
    for e in _plan(cfg):
        _set(tree, e.path, jax.ShapeDtypeStruct(e.shape, jnp.float32 if e.fp32 else dtype))
    return tree


# ----------------------------------------------------------------------------------------
# load / save


def _find_prefix(names: set[str], path: Path, cfg: ModelConfig) -> str:
    embed = _plan(cfg)[0]
    spellings = (embed.hf_name, *embed.alt_names)
    prefixes = get_family(cfg.model_type).base_prefixes
    for prefix in prefixes:
        if any(prefix + n in names for n in spellings):
            return prefix
    raise ValueError(
        f"checkpoint {path} has no embedding tensor (looked for "
        f"{[p + spellings[0] for p in prefixes]})"
    )


def _resolve(names: set[str], prefix: str, e: Entry) -> list[str | None]:
    """The checkpoint name of each of `e`'s HF tensors (None where absent)."""
    out = []
    for name, _ in e.hf_parts():
        full = prefix + name if is_base(e) else name
        if full not in names:
            full = next((prefix + a for a in e.alt_names if prefix + a in names), None)
        out.append(full)
    return out


def _read(ckpt, names: set[str], prefix: str, e: Entry, path: Path) -> tuple[np.ndarray, list]:
    """Entry `e`'s array in our layout (from its own HF tensors, or else from those of the
    first of its alternatives that the checkpoint holds), and the names read."""
    hf, found = _locate(ckpt, names, prefix, e, path)
    return hf.to_ours(hf.join([ckpt.get(n) for n in found])), found


def _locate(ckpt, names: set[str], prefix: str, e: Entry, path: Path) -> tuple[Entry, list[str]]:
    """The HF layout of entry `e` that the checkpoint holds (`e` or one of its alternatives)
    and the names of its tensors, their shapes checked."""
    for hf in (e, *e.alternatives):
        found = _resolve(names, prefix, hf)
        if None not in found:
            break
    else:
        hf, found = e, _resolve(names, prefix, e)
        name, shape = e.hf_parts()[found.index(None)]
        full = prefix + name if is_base(e) else name
        others = "".join(
            f", nor {prefix + a.hf_parts()[0][0]!r} (another layout)" for a in e.alternatives
        )
        raise ValueError(
            f"checkpoint {path} is missing tensor {full!r} (for {_path_str(e.path)}, "
            f"expected HF shape {list(shape)}){others}"
        )
    for full, (_, want) in zip(found, hf.hf_parts(), strict=True):
        shape = ckpt.shape(full)
        if shape != want:
            raise ValueError(
                f"checkpoint tensor {full!r} has shape {list(shape)}, expected {list(want)} "
                f"for {_path_str(e.path)} (our shape {list(e.shape)})"
            )
    return hf, found


def _module(name: str) -> str:
    return name.removesuffix(".weight")


def _scale_names(name: str, scheme: quant.CheckpointQuantization) -> tuple[str, str]:
    """The scale and input-scale tensor names of quantized tensor `name`."""
    if name.endswith(".weight"):
        base = _module(name)
        return f"{base}.{scheme.scale_suffix}", f"{base}.input_scale"
    return f"{name}_{scheme.scale_suffix.removeprefix('weight_')}", f"{name}_input_scale"


def _quantized_parts(ckpt, found: list[str], scheme, path: Path) -> list[bool]:
    """Which of an entry's tensors the checkpoint stores quantized (FP8), their scales
    checked present."""
    out = []
    for name in found:
        dtype = ckpt.where[name].entries[name][0]
        if dtype == np.dtype(ml_dtypes.float8_e5m2):
            raise ValueError(
                f"checkpoint tensor {name!r} is float8_e5m2: only float8_e4m3fn weights are "
                "supported"
            )
        fp8 = dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        if fp8 and scheme is None:
            raise ValueError(
                f"checkpoint {path} stores {name!r} in float8_e4m3fn, but its config.json has "
                f"no quantization_config (nor a {quant.HF_QUANT_CONFIG}) saying how to read it"
            )
        if fp8:
            scale, input_scale = _scale_names(name, scheme)
            if scale not in ckpt.where:
                raise ValueError(
                    f"checkpoint {path} stores {name!r} in float8_e4m3fn without its scale "
                    f"{scale!r} ({scheme.source})"
                )
            if scheme.static_activations and input_scale not in ckpt.where:
                raise ValueError(
                    f"checkpoint {path} lacks {input_scale!r}: {scheme.source} says the "
                    "activations have static scales"
                )
            if scheme.excludes(_module(name)):
                raise ValueError(
                    f"checkpoint {path} stores {name!r} in float8_e4m3fn, but {scheme.source} "
                    "lists it among the modules left unquantized"
                )
        out.append(fp8)
    return out


def _load_entry(
    ckpt, hf: Entry, found: list[str], scheme, dtype, used: set[str], path: Path
) -> dict:
    """Entry `hf`'s leaves (our leaf name -> array): its array in our layout, or, quantized,
    the weight as published with its scales."""
    leaf, out_dtype = hf.path[-1], jnp.float32 if hf.fp32 else dtype
    quantized = _quantized_parts(ckpt, found, scheme, path)
    if not any(quantized):
        x = hf.to_ours(hf.join([ckpt.get(n) for n in found]))
        return {leaf: jnp.asarray(x, dtype=out_dtype)}
    rows = []  # each tensor's scales, one row per output channel
    for name, fp8 in zip(found, quantized, strict=True):
        shape = ckpt.shape(name)
        if fp8:
            scale = _scale_names(name, scheme)[0]
            rows.append(quant.row_scales(ckpt.get(scale), shape, scheme.block_scaled, scale))
            used.add(scale)
        else:
            rows.append(np.ones((*shape[:-1], 1), np.float32))
    if not (hf.quantizable and all(quantized)):
        # Run unquantized (a router, the lm_head, a projection fused from quantized and
        # unquantized tensors): dequantized here, once.
        arrays = [quant.dequantize_np(ckpt.get(n), r)
                  for n, r in zip(found, rows, strict=True)]  # fmt: skip
        used.update(_scale_names(n, scheme)[1] for n in found)  # input scales, unused
        x = hf.to_ours(hf.join(arrays))
        return {leaf: jnp.asarray(x, dtype=out_dtype)}
    # Values move with the layout alone; a multiplier the map folds in goes to the scales.
    weight = swap_last(layout(hf.to_ours)(hf.join([ckpt.get(n) for n in found])))
    scale = quant.compress_rows(swap_last(np.asarray(hf.to_ours(hf.join(rows)), np.float32)))
    names = quant.quantized_names(leaf)
    out = {names[0]: jnp.asarray(weight), names[1]: jnp.asarray(scale)}
    inputs = [_scale_names(n, scheme)[1] for n in found]
    used.update(inputs)  # a dynamic scheme's checkpoint may hold them too: known, unused
    if scheme.static_activations:
        # One activation feeds every tensor of the entry (and every expert): vLLM's choice,
        # the largest of their scales.
        out[names[2]] = jnp.asarray(max(float(np.max(ckpt.get(n))) for n in inputs), jnp.float32)
    return out


def _kv_cache_scales(ckpt, names: set[str], prefix: str, plan: list[Entry]) -> list:
    """`(HF name, our leaf path, f32[])` of each of the checkpoint's KV-cache scales: ModelOpt
    writes `k_proj.k_scale`, others `self_attn.k_scale`, old exports one `self_attn.kv_scale`
    for both (vLLM's spellings)."""
    out = []
    for e in plan:
        proj = e.path[-2] if len(e.path) >= 2 else ""
        if proj not in ("k_proj", "v_proj") or not isinstance(e.hf_name, str):
            continue
        which = proj[0]
        module = e.hf_name.removesuffix(f".{proj}.weight")
        base = prefix if is_base(e) else ""
        spellings = (f"{proj}.{which}_scale", f"{which}_scale", "kv_scale")
        for name in (f"{base}{module}.{s}" for s in spellings):
            if name in names:
                leaf = quant.K_CACHE_SCALE if which == "k" else quant.V_CACHE_SCALE
                value = jnp.asarray(float(np.max(ckpt.get(name))), jnp.float32)
                out.append((name, (*e.path[:-2], leaf), value))
                break
    return out


def _check_config(path: Path, cfg: ModelConfig) -> None:
    ckpt_cfg = config_from_hf(path)
    for field in ckpt_cfg.to_dict():
        if field in ("name", "bos_token_id", "eos_token_id", "eos_token_ids", "pad_token_id"):
            continue
        a, b = getattr(cfg, field), getattr(ckpt_cfg, field)
        if a != b:
            raise ValueError(
                f"ModelConfig.{field}={a!r} does not match the checkpoint's "
                f"{path / 'config.json'} ({b!r})"
            )


def load_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    dtype: Any = jnp.bfloat16,
    expected: Params | None = None,
) -> Params:
    """Load an HF safetensors checkpoint directory into our param tree.

    `cfg` defaults to the checkpoint's config.json; when given, its architecture fields must
    match it. `expected` (a tree of ShapeDtypeStructs) is checked against the result. An FP8
    checkpoint's quantized weights keep their bytes and scales (`jaxmamba.model.quantization`);
    `dtype` is that of everything else.
    Raises ValueError naming the tensor, our path and both shapes on any mismatch.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint path {path} is not a directory")
    if cfg is None:
        cfg = config_from_hf(path)
    else:
        _check_config(path, cfg)
    ckpt = _Checkpoint(path)
    scheme = quant.read_quantization(path)
    names = set(ckpt.where)
    prefix = _find_prefix(names, path, cfg)
    dtype = jnp.dtype(dtype)

    params: Params = {}
    used: set[str] = set()
    plan = _plan(cfg)
    for e in plan:
        hf, read = _locate(ckpt, names, prefix, e, path)
        for leaf, x in _load_entry(ckpt, hf, read, scheme, dtype, used, path).items():
            _set(params, (*e.path[:-1], leaf), x)
        used.update(read)
    for name, where, x in _kv_cache_scales(ckpt, names, prefix, plan):
        _set(params, where, x)
        used.add(name)

    extra = names - used
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        # Some exports write the tied head anyway; accept it only if it really is the embedding.
        head = ckpt.get("lm_head.weight")
        emb, _ = _read(ckpt, names, prefix, plan[0], path)  # [V, E] in both layouts
        if head.shape != emb.shape or not np.array_equal(head, emb):
            raise ValueError(
                f"checkpoint {path} has an lm_head.weight different from the embeddings, but "
                "tie_word_embeddings=True"
            )
        extra.discard("lm_head.weight")
    for what, pattern in SKIPPED_MODULES:
        skipped = {n for n in extra if pattern.search(n)}
        if skipped:
            logger.info("%s: skipping %d %s tensors", path, len(skipped), what)
            extra -= skipped
    extra = sorted(n for n in extra if not any(p.search(n) for p in IGNORABLE_TENSORS))
    if extra:
        raise ValueError(
            f"checkpoint {path} has unexpected tensors {extra[:10]} ({len(extra)} total)"
        )
    if expected is not None:
        check_params(params, expected)
    return params


def load_tensors(path: str | os.PathLike, entries: list[Entry], *, dtype: Any = jnp.bfloat16
                 ) -> Params:  # fmt: skip
    """The tree of `entries` (full checkpoint names, no base prefix) from checkpoint `path`,
    quantized ones as `load_hf_checkpoint` keeps them: a module beside the model, such as
    its MTP layer (`jaxmamba.model.mtp`). A missing tensor or a wrong shape is a ValueError
    naming it."""
    path = Path(path)
    ckpt = _Checkpoint(path)
    scheme = quant.read_quantization(path)
    names, dtype = set(ckpt.where), jnp.dtype(dtype)
    params: Params = {}
    used: set[str] = set()
    for e in entries:
        hf, read = _locate(ckpt, names, "", e, path)
        for leaf, x in _load_entry(ckpt, hf, read, scheme, dtype, used, path).items():
            _set(params, (*e.path[:-1], leaf), x)
    return params


def check_params(params: Params, expected: Params) -> None:
    """Raise ValueError unless `params` has the structure, shapes and dtypes of `expected`
    (float params, `param_shapes`): a quantized weight stands for its float leaf, its shape
    that leaf's with the last two axes swapped; KV-cache scales may come in addition."""
    got = _float_view(dict(_flatten(params)))
    want = dict(_flatten(expected))
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(f"param tree mismatch: missing {missing}, unexpected {extra}")
    for k, w in want.items():
        g = got[k]
        if tuple(g.shape) != tuple(w.shape) or (
            g.dtype is not None and jnp.dtype(g.dtype) != jnp.dtype(w.dtype)
        ):
            raise ValueError(
                f"param {k}: got {jnp.dtype(g.dtype)}{list(g.shape)}, "
                f"expected {jnp.dtype(w.dtype)}{list(w.shape)}"
            )


class _Spec(NamedTuple):
    shape: tuple[int, ...]
    dtype: Any = None  # not compared


def _float_view(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with each quantized weight's leaves replaced by the float leaf they stand for
    (its shape swapped back, its dtype not compared), and without KV-cache scales."""
    quantized = {}  # the key of each quantized leaf -> the float leaf's key, or None to drop
    for key in flat:
        parent, _, leaf = key.rpartition("/")
        name = quant.float_name(leaf)
        join = lambda n, parent=parent: f"{parent}/{n}" if parent else n  # noqa: E731
        weight, scale, input_scale = quant.quantized_names(name) if name else ("", "", "")
        if name is not None and join(scale) in flat:
            quantized.update({key: join(name), join(scale): None, join(input_scale): None})
        elif leaf in (quant.K_CACHE_SCALE, quant.V_CACHE_SCALE):
            quantized[key] = None
    out = {}
    for key, x in flat.items():
        if key not in quantized:
            out[key] = x
        elif quantized[key] is not None:
            out[quantized[key]] = _Spec((*x.shape[:-2], x.shape[-1], x.shape[-2]))
    return out


def _flatten(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix, tree


def save_hf_checkpoint(params: Params, cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write `params` as an HF checkpoint (config.json + model.safetensors) transformers loads.

    Tensor names use the family's first base prefix (what transformers 5.24 itself writes).
    Dtypes are kept as they are in `params`. Families whose map folds multipliers into the
    weights, or splits an HF tensor into several arrays, cannot be written.
    """
    path = Path(path)
    hf_config = hf_config_from(cfg)
    path.mkdir(parents=True, exist_ok=True)
    prefix = get_family(cfg.model_type).base_prefixes[0]
    flat = dict(_flatten(params))
    tensors = {}
    for e in _plan(cfg):
        key = _path_str(e.path)
        if key not in flat:
            raise ValueError(f"save_hf_checkpoint: params lack {key}")
        x = np.asarray(jax.device_get(flat.pop(key)))
        if tuple(x.shape) != e.shape:
            raise ValueError(
                f"save_hf_checkpoint: {key} has shape {list(x.shape)}, expected {list(e.shape)}"
            )
        if e.to_hf is None:
            raise ValueError(
                f"save_hf_checkpoint: writing {key} of {cfg.model_type} is not implemented"
            )
        for (name, _), part in zip(e.hf_parts(), e.split(e.to_hf(x)), strict=True):
            tensors[(prefix + name) if is_base(e) else name] = part
    if flat:
        raise ValueError(
            f"save_hf_checkpoint: params have entries not in the model: {sorted(flat)}"
        )
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    _write_safetensors(path / SAFETENSORS_SINGLE, tensors)
