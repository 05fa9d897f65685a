"""The artifact directory `jaxmamba export` writes, and its manifest.

    DIR/manifest.json            format, versions, platforms, model/engine/cache settings,
                                 every bucket's input/output shapes, dtypes and shardings,
                                 and the sha256 of every file below
    DIR/steps/<platform>/<T>x<B>x<D>.jaxexport   the serialized `jax.export` step of a bucket
    DIR/steps/<platform>/<T>x<B>x<D>.plain.jaxexport   a decode bucket's PLAIN and GREEDY
    DIR/steps/<platform>/<T>x<B>x<D>.greedy.jaxexport  sampler programs (listed under the
                                 entry's "variants"; no token bitmask in their inputs)
    DIR/steps/<platform>/score.jaxexport   the prompt_logprobs program (`runner.score_fn`),
                                 run after a step where some row asks for them
    DIR/steps/<platform>/*.executable   with --executables: those steps compiled for a device
    DIR/weights/                 the params as an Orbax checkpoint (absent with --no-weights)
    DIR/tokenizer/               the model's tokenizer files, if it has any

A step takes four flat lists of arrays `(params, cache, slot_state, inputs)` (the leaves, in
`jax.tree` order, of the live runner's arguments; the last is one int32 buffer, the
`StepInputs` packed by `PackedStepInputs`, whose field names the manifest keeps; with the
manifest's `structured_outputs`, a FULL program's buffer holds the token bitmask, as the live
runner's does) and returns `(packed sample output, cache, slot_state)`; cache and slot
state are donated. The score program takes `(params, prompt_hidden, targets)` (the params'
leaves, the slot state's `prompt_hidden` leaf, i32 targets) and returns the packed prompt
logprobs; the fork copies (`runner.fork_fn`) are plain array copies, which the serving
process compiles itself. With the engine's `speculative_config` (method "ngram", format
version 4) the buckets include the verify buckets (`Bucket(b * (1 + k), b, b)`), and every
step takes the speculating slot state (`SlotState.spec`) and `lens_from_device`, as a live
speculating runner's does. Reading checks every field a step depends on and rejects a mismatch with
`ArtifactError` naming the field, what it holds and what was expected.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "jaxmamba-artifact"
# 2: the step leaves prompt_logprobs and forks to programs of their own (`SlotState` gained
# `prompt_hidden`; the score program), and takes its inputs as one packed buffer.
# 3: the manifest's `structured_outputs` says whether every FULL program but a verify
# bucket's takes the token bitmask in its buffer (`runner.takes_bitmask`); a variant whose
# buffer differs from its bucket's FULL program lists its own `inputs`.
# 4: the engine's `speculative_config` may be set (method "ngram"): the artifact then holds
# the verify buckets, and every program takes and returns the speculating slot state
# (`SlotState.spec`) and reads `lens_from_device` from its buffer.
FORMAT_VERSION = 4
# The versions this jaxmamba serves: a version 2 artifact's FULL programs take no token
# bitmask (it has no `structured_outputs`), so it serves everything but constrained requests;
# versions 2 and 3 never speculate.
READ_VERSIONS = (2, 3, 4)
MANIFEST = "manifest.json"
# jax.export platform names -> the model's kernel choice when tracing for that platform.
PLATFORM_IMPLS = {"cpu": "ref", "cuda": "auto_gpu", "tpu": "auto_tpu"}
# Triton custom calls carry no serialization-compatibility guarantee; export them anyway.
UNSTABLE_CUSTOM_CALLS = ("__gpu$xla.gpu.triton",)


class ArtifactError(ValueError):
    """A manifest or artifact file that does not match what this process needs."""


def is_artifact(path: str | os.PathLike) -> bool:
    try:
        return (Path(path) / MANIFEST).is_file()
    except (OSError, TypeError):
        return False


def bucket_name(num_tokens: int, num_rows: int, num_decode: int) -> str:
    return f"{num_tokens}x{num_rows}x{num_decode}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def runtime_platform() -> str:
    """This process's default backend as a `jax.export` platform name."""
    import jax

    backend = jax.default_backend()
    return {"gpu": "cuda"}.get(backend, backend)


def _mismatch(field: str, held: Any, expected: Any, where: str, hint: str = "") -> ArtifactError:
    return ArtifactError(
        f"{where}: manifest field {field!r} holds {held!r}, expected {expected!r}{hint}"
    )


@dataclass
class Artifact:
    """A read and checked manifest; `path` is the artifact directory."""

    path: Path
    manifest: dict

    @property
    def where(self) -> str:
        return str(self.path / MANIFEST)

    def file(self, rel: str, digest: str) -> Path:
        """`DIR/rel`, after checking it exists and its sha256 is the manifest's."""
        path = self.path / rel
        if not path.is_file():
            raise ArtifactError(f"{self.path}: {rel} is missing (the manifest lists it)")
        found = sha256(path)
        if found != digest:
            raise ArtifactError(
                f"{path}: corrupted: sha256 {found}, expected {digest} (from the manifest)"
            )
        return path

    def buckets(self) -> list[dict]:
        return self.manifest["buckets"]


def programs(entry: dict) -> list[tuple[str, dict]]:
    """`(sampler, node)` of every program a bucket's manifest entry holds: the full sampler's
    files in the entry itself, each variant's (by its `jaxmamba.engine.runner` name) in
    `entry["variants"]`; a node has "files" and, with --executables, "executables"; a variant's
    node has "inputs" when they differ from the full program's (the token bitmask)."""
    return [("full", entry), *entry.get("variants", {}).items()]


def input_avals(entry: dict, node: dict) -> list[dict]:
    """The input avals of the program `node` (`programs`) of a bucket's manifest entry."""
    return node.get("inputs", entry["inputs"])


def serves_structured_outputs(manifest: dict) -> bool:
    """Whether the artifact's FULL programs take the token bitmask where
    `jaxmamba.engine.runner.takes_bitmask` says (its `structured_outputs`; a version 2
    artifact's take none)."""
    return bool(manifest.get("structured_outputs", False))


# Why an artifact speculates with method "ngram" only: the others draft with weights of
# their own, which export does not write.
UNEXPORTED_DRAFTING = {
    "draft_model": "the draft model's weights (and its cache and programs) would have to be "
    "exported too",
    "mtp": "the MTP layer's weights (and its KV pages) would have to be exported too",
}


def artifact_speculation(speculative_config):
    """The `NgramSpec` an artifact's verify programs draft with for `speculative_config` (an
    `EngineConfig.speculative_config`), or None without speculation; methods "draft_model"
    and "mtp" are an `ArtifactError` naming the method and why."""
    if speculative_config is None:
        return None
    method = speculative_config.method
    if method in UNEXPORTED_DRAFTING:
        raise ArtifactError(
            f"speculative_config.method={method!r}: exported artifacts speculate with method "
            f"'ngram' only: {UNEXPORTED_DRAFTING[method]}; serve the model itself to draft "
            "with it"
        )
    from jaxmamba.model.speculative import NgramSpec

    sc = speculative_config
    return NgramSpec(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)


REQUIRED = ("format", "format_version", "jax_version", "platforms", "model", "dtype", "engine",
            "cache", "input_fields", "state", "buckets", "score", "weights")  # fmt: skip


def read_artifact(path: str | os.PathLike, *, platform: str | None = None) -> Artifact:
    """Read `DIR/manifest.json` and check it against this process: format and its version,
    jax version, and that `platform` (default: this process's backend) is among the exported
    platforms and `StepInputs` has the fields the steps were traced with."""
    import jax

    from jaxmamba.step_contract import StepInputs

    path = Path(path)
    where = str(path / MANIFEST)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no {MANIFEST}: not a jaxmamba export directory") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{where}: corrupted, not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{where}: corrupted: holds a {type(manifest).__name__}, not a dict")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"{where}: corrupted: missing fields {missing}")
    if manifest["format"] != FORMAT:
        raise _mismatch("format", manifest["format"], FORMAT, where)
    if manifest["format_version"] not in READ_VERSIONS:
        raise _mismatch(
            "format_version", manifest["format_version"], f"one of {list(READ_VERSIONS)}",
            where, ": re-export the model with this jaxmamba",
        )  # fmt: skip
    if manifest["format_version"] >= 3 and "structured_outputs" not in manifest:
        raise ArtifactError(f"{where}: corrupted: missing field 'structured_outputs' (format "
                            f"version {manifest['format_version']} has it)")  # fmt: skip
    speculative = manifest["engine"].get("speculative_config")
    if manifest["format_version"] < 4 and speculative is not None:
        raise ArtifactError(f"{where}: corrupted: engine field 'speculative_config' holds "
                            f"{speculative!r}, but format version {manifest['format_version']} "
                            "artifacts do not speculate (version 4 may)")  # fmt: skip
    if manifest["jax_version"] != jax.__version__:
        raise _mismatch(
            "jax_version", manifest["jax_version"], jax.__version__, where,
            " (this process's jax): re-export, or install the jax it was exported with",
        )  # fmt: skip
    platform = platform or runtime_platform()
    if platform not in manifest["platforms"]:
        raise _mismatch(
            "platforms", manifest["platforms"], f"a list with {platform!r}", where,
            f" (this process runs on {platform}): export with --platforms {platform}",
        )  # fmt: skip
    fields = list(StepInputs._fields)
    if manifest["input_fields"] != fields:
        raise _mismatch(
            "input_fields", manifest["input_fields"], fields, where,
            " (this jaxmamba's StepInputs): re-export the model with this jaxmamba",
        )  # fmt: skip
    return Artifact(path, manifest)
