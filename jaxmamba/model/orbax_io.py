"""Weights as an Orbax checkpoint: save, inspect and restore a params tree.

A checkpoint is what `orbax.checkpoint.StandardCheckpointer` writes (a folder of tensorstore
arrays and their metadata). `restore_params` checks the checkpoint's tensors against the
expected ones first, so a missing, extra or mis-shaped tensor is an error that names it
rather than a tensorstore traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def flat_specs(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{"a/b/c": (shape, dtype name)}` for every leaf of a nested dict of arrays/specs."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[name] = (tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name)
    return out


def nest(flat: dict[str, Any]) -> dict:
    """The nested dict of `{"a/b/c": x}` (the inverse of the paths of `flat_specs`)."""
    root: dict = {}
    for name, value in flat.items():
        node = root
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return root


def save_params(path: str | os.PathLike, params) -> Path:
    """Write `params` (a nested dict of arrays) as an Orbax checkpoint at `path` (created;
    an existing folder is an error). Returns the absolute path."""
    path = Path(path).absolute()
    ckptr = _orbax().StandardCheckpointer()
    ckptr.save(path, params)
    ckptr.wait_until_finished()
    return path


def checkpoint_specs(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors an Orbax checkpoint holds: `{"a/b/c": (shape, dtype name)}`."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no Orbax checkpoint (not a directory)")
    meta = _orbax().StandardCheckpointer().metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return flat_specs(tree)


def check_specs(found: dict, expected: dict, where: str) -> None:
    """Raise ValueError naming every missing, extra and mis-shaped/-typed tensor."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = [
        f"{name}: {found[name][0]} {found[name][1]}, expected {expected[name][0]} "
        f"{expected[name][1]}"
        for name in sorted(set(found) & set(expected))
        if tuple(found[name][0]) != tuple(expected[name][0]) or found[name][1] != expected[name][1]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if wrong:
        problems.append("mis-shaped tensors [" + "; ".join(wrong) + "]")
    if problems:
        raise ValueError(f"{where}: " + ", ".join(problems))


def restore_params(path: str | os.PathLike, expected: dict | None = None, sharding=None):
    """Restore the params tree of the checkpoint at `path` as jax arrays.

    `expected`: `{"a/b/c": (shape, dtype)}` the caller needs (e.g. `flat_specs` of
    `param_shapes(cfg, dtype)`); checked before anything is read. `sharding`: one
    `jax.sharding.Sharding` for every tensor, or a callable `name -> Sharding` (a mesh's
    target shardings); default: the first device, unsharded."""
    path = Path(path).absolute()
    found = checkpoint_specs(path)
    if expected is not None:
        check_specs(found, {k: (tuple(s), np.dtype(d).name) for k, (s, d) in expected.items()},
                    f"Orbax checkpoint {path}")  # fmt: skip
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(name, shape, dtype):
        s = sharding(name) if callable(sharding) else sharding
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=s)

    abstract = nest({k: target(k, s, d) for k, (s, d) in found.items()})
    return _orbax().StandardCheckpointer().restore(path, abstract)


CONVERTED_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json",
                   "hf_quant_config.json")  # fmt: skip
ORBAX_SUBDIR = "orbax"  # where a converted checkpoint keeps its weights
# config.json's field naming the method ("fp8", "int8") `convert --quantization` applied
QUANTIZED_AT_CONVERSION = "jaxmamba_quantization"


def is_orbax_model(path: str | os.PathLike) -> bool:
    """A `convert_checkpoint` directory (config.json and an Orbax checkpoint)."""
    p = Path(path)
    return (p / ORBAX_SUBDIR).is_dir() and (p / "config.json").is_file()


def converted_quantization(path: str | os.PathLike) -> str | None:
    """The method ("fp8", "int8") that `convert_checkpoint(..., quantization=)` quantized the
    weights of directory `path` with; None for any other directory (a float one, or an FP8
    checkpoint's weights as published: its quantization_config says so)."""
    from jaxmamba.engine.config import QUANTIZATION_METHODS

    if not is_orbax_model(path):
        return None
    config = Path(path) / "config.json"
    method = json.loads(config.read_text()).get(QUANTIZED_AT_CONVERSION)
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"{config}: {QUANTIZED_AT_CONVERSION}={method!r} is unsupported: only "
            f"{QUANTIZATION_METHODS} or none"
        )
    return method


def quantized_specs(expected: dict, found: dict) -> dict:
    """`expected` (float tensors) with each float leaf that `found` holds quantized — a
    `weight`, `experts_up_weight`, ... in place of its `kernel`, `experts_up`, ...
    (`quantization.quantized_names`) — replaced by the leaves that stand for it: the weight
    float8_e4m3fn `[..., N, K]` (the float `[..., K, N]` swapped), its scale f32 `[..., NS, KS]`
    (NS 1, N or ceil(N/128); KS 1 or ceil(K/128)), the `input_scale` f32[] where found; and
    the KV-cache scales f32[] found beside a `k_proj`/`v_proj`."""
    from jaxmamba.kernels.matmul.quantized import BLOCK
    from jaxmamba.model import quantization as quant

    out = dict(expected)
    modules = {n.rpartition("/")[0] for n in expected}
    attention = {
        m.rpartition("/")[0] for m in modules if m.rpartition("/")[2] in ("k_proj", "v_proj")
    }
    for name in sorted(set(found) - set(expected)):
        parent, _, leaf = name.rpartition("/")
        join = lambda n, parent=parent: f"{parent}/{n}" if parent else n  # noqa: E731
        base = quant.float_name(leaf)
        if base is not None and join(base) in expected:
            *lead, k, n = expected[join(base)][0]
            weight, scale, input_scale = (join(x) for x in quant.quantized_names(base))
            del out[join(base)]
            out[weight] = ((*lead, n, k), "float8_e4m3fn")
            s = tuple(found[scale][0]) if scale in found else ()
            laid_out = len(s) == len(lead) + 2
            ns = s[-2] if laid_out and s[-2] in (1, n, -(-n // BLOCK)) else n
            ks = s[-1] if laid_out and s[-1] in (1, -(-k // BLOCK)) else 1
            out[scale] = ((*lead, ns, ks), "float32")
            if input_scale in found:
                out[input_scale] = ((), "float32")
        elif leaf in (quant.K_CACHE_SCALE, quant.V_CACHE_SCALE) and parent in attention:
            out[name] = ((), "float32")
    return out


def expected_specs(path: str | os.PathLike, cfg, dtype) -> dict:
    """The tensors the `convert_checkpoint` directory `path` must hold for `cfg` in `dtype`:
    the float params; quantized as `convert --quantization` recorded
    (`quantized_param_shapes`); or, for an FP8 checkpoint converted as published (its
    quantization_config kept), the float params with those it holds quantized replaced by
    their quantized leaves (`quantized_specs`)."""
    from jaxmamba.model.params import param_shapes, quantized_param_shapes
    from jaxmamba.model.quantization import read_quantization

    path = Path(path)
    method = converted_quantization(path)
    if method is not None:
        return flat_specs(quantized_param_shapes(cfg, dtype, method))
    expected = flat_specs(param_shapes(cfg, dtype))
    if read_quantization(path) is None:
        return expected
    return quantized_specs(expected, checkpoint_specs(path / ORBAX_SUBDIR))


def load_orbax_model(path: str | os.PathLike, cfg, dtype, sharding=None):
    """The params of a `convert_checkpoint` directory, float or quantized, checked against
    `cfg`'s shapes in `dtype` (`expected_specs`: missing, extra or mis-shaped tensors are
    named)."""
    return restore_params(Path(path) / ORBAX_SUBDIR, expected_specs(path, cfg, dtype), sharding)
