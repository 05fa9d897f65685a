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
                   "tokenizer_config.json", "special_tokens_map.json")  # fmt: skip
ORBAX_SUBDIR = "orbax"  # where a converted checkpoint keeps its weights


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "auto"):
    """An HF checkpoint directory -> `dst/` with its config and tokenizer files and the
    weights (in the engine's layout, `dtype`: "auto" keeps the checkpoint's) as an Orbax
    checkpoint in `dst/orbax`; `LLM(dst)` restores it. Returns `dst`."""
    import shutil

    from jaxmamba.model.dtypes import DTYPES, resolve_dtype
    from jaxmamba.model.families import load_config
    from jaxmamba.model.loader import load_hf_checkpoint
    from jaxmamba.model.params import param_shapes

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ValueError(f"{dst} exists: pick a new directory")
    cfg = load_config(str(src))
    jdtype = DTYPES[resolve_dtype(dtype, str(src))]
    params = load_hf_checkpoint(src, cfg, dtype=jdtype, expected=param_shapes(cfg, jdtype))
    dst.mkdir(parents=True)
    for name in CONVERTED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = np.dtype(jdtype).name  # what dtype="auto" then restores
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_params(dst / ORBAX_SUBDIR, params)
    return dst


def is_orbax_model(path: str | os.PathLike) -> bool:
    """A `convert_checkpoint` directory (config.json and an Orbax checkpoint)."""
    p = Path(path)
    return (p / ORBAX_SUBDIR).is_dir() and (p / "config.json").is_file()


def load_orbax_model(path: str | os.PathLike, cfg, dtype, sharding=None):
    """The params of a `convert_checkpoint` directory, checked against `cfg`'s shapes in
    `dtype` (missing, extra or mis-shaped tensors are named)."""
    from jaxmamba.model.params import param_shapes

    expected = flat_specs(param_shapes(cfg, dtype))
    return restore_params(Path(path) / ORBAX_SUBDIR, expected, sharding)
