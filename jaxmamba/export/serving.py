"""Serve an artifact: `ArtifactRunner` runs the deserialized steps (a `StepRunner`, as
`ModelRunner` is), and `serve_artifact` builds the engine `LLM(DIR)` runs on one. Nothing
here imports or traces the model code (`jaxmamba.model.model` and its layers): the host side
is the scheduler, prefix cache and sampling parameters, and the device side is the exported
StableHLO.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.engine.config import EngineConfig, SpeculativeConfig
from jaxmamba.engine.engine import LLMEngine
from jaxmamba.engine.runner import FULL, StepRunner, variants_enabled
from jaxmamba.engine.scheduler import Scheduler
from jaxmamba.export.artifact import (
    Artifact,
    ArtifactError,
    artifact_speculation,
    input_avals,
    programs,
    read_artifact,
    serves_structured_outputs,
)
from jaxmamba.model.metadata import PackedStepInputs
from jaxmamba.model.step import fork_fn, init_slot_state
from jaxmamba.step_contract import CacheSpec, StepInputs
from jaxmamba.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

_COMPILE = threading.local()  # per compiling thread: did its last compile hit the disk cache


def _note_cache_hit(name: str, **kwargs) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        _COMPILE.hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def _zeros(avals: list[dict]) -> list[jax.Array]:
    # Committed to the device, as the step's outputs that replace them are: an uncommitted
    # first cache would give the first step's bucket a second compile once its outputs return.
    device = jax.devices()[0]
    return [jax.device_put(jnp.zeros(tuple(a["shape"]), a["dtype"]), device) for a in avals]


def _aval(x) -> dict:
    return {"shape": [int(d) for d in x.shape], "dtype": np.dtype(x.dtype).name}


def _bucket_key(entry: dict) -> tuple[int, int, int]:
    return entry["num_tokens"], entry["num_rows"], entry["num_decode"]


class ArtifactRunner(StepRunner):
    """A `StepRunner` on an artifact's exported steps. `params`: the flat weight leaves in
    the exported order (from the artifact's Orbax checkpoint, or given). A decode bucket
    exported with its sampler variants runs them when `ModelRunner` would. Its FULL programs
    take the token bitmask where `takes_bitmask` says when the manifest's `structured_outputs`
    says so (`structured_outputs`, as a `ModelRunner`'s); an artifact without it (format
    version 2, or exported with `JAXMAMBA_STRUCTURED_OUTPUTS=0`) takes none, and the engine
    refuses constrained requests on it. An artifact exported with an n-gram
    `speculative_config` holds the verify programs: the runner speculates (`speculative`, as a
    `ModelRunner`'s), and its slot state keeps each slot's length and token history."""

    def __init__(self, artifact: Artifact, params=None, *, platform: str | None = None,
                 weights: str | os.PathLike | None = None):  # fmt: skip
        super().__init__()
        m = artifact.manifest
        self.artifact = artifact
        self.platform = platform or _runtime_platform()
        self.cfg = ModelConfig.from_dict(m["model"], source=f"{artifact.where} model")
        self.cache_spec = CacheSpec(**m["cache"])
        self.dtype = jnp.dtype(m["dtype"])
        self.structured_outputs = serves_structured_outputs(m)
        self.speculative = artifact_speculation(EngineConfig(**m["engine"]).speculative_config)
        # The slot state's shapes, as a live runner of these settings makes it.
        self._slot_shapes = jax.eval_shape(
            lambda: init_slot_state(self.cfg, self.cache_spec, self.dtype, self.speculative)
        )
        self.params = self._load_params(params, weights)
        self._check_state()
        self.reset_state()
        self._entries = {_bucket_key(e): e for e in artifact.buckets()}
        self._steps: dict[tuple, Callable] = {}  # (bucket, sampler) -> its step
        self._side: dict[str, Callable] = {}  # "score", "fork" -> the program, once built
        self._lock = threading.Lock()
        self.sampler_variants = variants_enabled()
        # bucket -> the sampler programs the artifact holds for it
        self._samplers = {key: tuple(name for name, _ in programs(e))
                          for key, e in self._entries.items()}  # fmt: skip
        self.loaded_executables = 0  # steps loaded compiled (`export --executables`)
        # (bucket, sampler) -> (its compiled step, compiled here afresh, not from the cache)
        self.compiled: dict[tuple, tuple] = {}
        self._check_inputs()

    def _new_state(self) -> tuple:
        # The slot state's first values are `init_slot_state`'s (a token history starts at -1,
        # "none yet"), committed to the device as `_zeros` are.
        device = jax.devices()[0]
        slot_state = init_slot_state(self.cfg, self.cache_spec, self.dtype, self.speculative)
        return (_zeros(self.artifact.manifest["state"]["cache"]),
                [jax.device_put(x, device) for x in jax.tree.leaves(slot_state)])  # fmt: skip

    def _check_state(self) -> None:
        """The cache and sampler state the manifest lists are what its `model` and `cache`
        fields imply, and what every bucket's step takes."""
        from jaxmamba.model.cache import cache_shapes

        m, where = self.artifact.manifest, self.artifact.where
        implied = {
            "cache": [
                _aval(a)
                for a in jax.tree.leaves(cache_shapes(self.cfg, self.cache_spec, self.dtype))
            ],  # fmt: skip
            "slot_state": [_aval(a) for a in jax.tree.leaves(self._slot_shapes)],
        }
        for name, avals in implied.items():
            if m["state"][name] != avals:
                raise ArtifactError(
                    f"{where}: field 'state.{name}' holds {m['state'][name]}, expected "
                    f"{avals} (implied by its fields 'model', 'cache' and "
                    f"'engine.speculative_config')"
                )
        p, c = m["state"]["params"], len(implied["cache"])
        for entry in self.artifact.buckets():
            held = entry["inputs"][p : p + c]
            if held != implied["cache"]:
                raise ArtifactError(
                    f"{where}: bucket {_bucket_key(entry)} field 'inputs' (cache) holds {held}, "
                    f"expected {implied['cache']}"
                )

    def _check_inputs(self) -> None:
        """Every program's packed input buffer is the one this process sends it: this
        jaxmamba's padding of its bucket, with the token bitmask where the program takes one
        (`program_inputs`: the manifest's `structured_outputs` and `takes_bitmask`)."""
        from jaxmamba.engine.batch import Bucket, StepBuilder

        m, where = self.artifact.manifest, self.artifact.where
        engine = EngineConfig(**m["engine"])
        builder = StepBuilder(
            self.cache_spec, engine.max_pages_per_seq, self.cfg.vocab_size, self.cfg.chunk_size,
            speculative=self.speculative is not None,
        )  # fmt: skip
        for key, entry in self._entries.items():
            for sampler, node in programs(entry):
                inputs = self.program_inputs((Bucket(*key), sampler), builder.padding)
                expected = [_aval(PackedStepInputs.pack(inputs).buffer)]
                held = input_avals(entry, node)[-1:]
                if held != expected:
                    raise ArtifactError(
                        f"{where}: bucket {key} ({sampler} sampler) field 'inputs' ends with "
                        f"{held}, expected {expected} (the packed StepInputs this jaxmamba "
                        f"sends it, {'with' if inputs.token_bitmask is not None else 'without'}"
                        f" the token bitmask: field 'structured_outputs' holds "
                        f"{m.get('structured_outputs')!r})"
                    )

    # -- weights ------------------------------------------------------------------------------
    def _expected(self) -> dict[str, tuple[tuple[int, ...], str]]:
        w = self.artifact.manifest["weights"]
        if w is None:
            return {}
        return {k: (tuple(v["shape"]), v["dtype"]) for k, v in w["tensors"].items()}

    def _load_params(self, params, weights):
        from jaxmamba.model.orbax_io import check_specs, flat_specs, restore_params

        m = self.artifact.manifest
        inputs = self.artifact.buckets()[0]["inputs"]
        expected_leaves = inputs[: m["state"]["params"]]
        if params is None:
            if weights is None:
                if m["weights"] is None:
                    raise ArtifactError(
                        f"{self.artifact.where}: exported with --no-weights: pass params= "
                        "or weights= (an Orbax checkpoint)"
                    )
                weights = self.artifact.path / m["weights"]["path"]
            expected = self._expected() or None
            params = restore_params(weights, expected)
        elif self._expected():
            check_specs(flat_specs(params), self._expected(), "params")
        leaves = jax.tree.leaves(params)
        found = [{"shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name} for x in leaves]
        if found != expected_leaves:
            raise ArtifactError(
                f"{self.artifact.where}: the weights' leaves {found} do not match the exported "
                f"step's parameters {expected_leaves}"
            )
        return [jax.device_put(x, jax.devices()[0]) for x in leaves]

    # -- steps --------------------------------------------------------------------------------
    @property
    def num_compiles(self) -> int:
        """Compiled executables of this runner's exported steps (one per bucket it ran or
        precompiled; none is traced from the model code)."""
        programs = [*self._steps.values(), *self._side.values()]
        return sum(fn._cache_size() for fn in programs if hasattr(fn, "_cache_size"))

    def buckets(self) -> list[tuple[int, int, int]]:
        return list(self._entries)

    def _entry(self, key: tuple[int, int, int]) -> dict:
        entry = self._entries.get(key)
        if entry is None:
            raise ArtifactError(
                f"{self.artifact.where}: no exported step for bucket (num_tokens, num_rows, "
                f"num_decode)={key}; the artifact holds {sorted(self._entries)}"
            )
        return entry

    def held_samplers(self, bucket: tuple[int, int, int]) -> tuple[str, ...]:
        self._entry(bucket)
        return self._samplers[bucket]

    def _step(self, key: tuple[int, int, int], sampler: str = FULL) -> Callable:
        fn = self._steps.get((key, sampler))
        if fn is not None:
            return fn
        entry = self._entry(key)
        node = dict(programs(entry))[sampler]
        files = node["files"]
        if self.platform not in files:
            raise ArtifactError(
                f"{self.artifact.where}: bucket {key} ({sampler} sampler) field 'files' holds "
                f"platforms {sorted(files)}, expected one for {self.platform!r}"
            )
        path = self.artifact.file(files[self.platform]["path"], files[self.platform]["sha256"])
        try:
            exported = jax.export.deserialize(bytearray(path.read_bytes()))
        except Exception as e:
            raise ArtifactError(f"{path}: corrupted: jax.export cannot read it ({e})") from e
        expected = {"inputs": input_avals(entry, node), "outputs": entry["outputs"]}
        _check_exported(exported, expected, (key, sampler), self.platform, self.artifact.where)
        fn = self._load_executable(node) or jax.jit(exported.call, donate_argnums=(1, 2))
        with self._lock:
            self._steps.setdefault((key, sampler), fn)
        return self._steps[key, sampler]

    def _load_executable(self, node: dict):
        """A program's serialized compiled step (`node`: its manifest entry, `programs`), if
        the artifact has one for this platform and device (`export --executables`); None
        otherwise. Loading unpickles: artifacts are trusted files (their sha256 is checked,
        their origin is not)."""
        import pickle

        from jax.experimental.serialize_executable import deserialize_and_load

        from jaxmamba.export.writer import device_key

        stored = node.get("executables", {}).get(self.platform)
        if stored is None or stored["device"] != device_key():
            return None
        path = self.artifact.file(stored["path"], stored["sha256"])
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        loaded = deserialize_and_load(payload, in_tree, out_tree)
        with self._lock:
            self.loaded_executables += 1
        return loaded

    def load_steps(self, workers: int | None = None) -> None:
        """Read, check (sha256, platform, shapes) and deserialize every program's step now,
        in `workers` threads (default: one per core, at most 8)."""
        workers = workers or max(1, min(8, os.cpu_count() or 1))
        jobs = [(key, sampler) for key in self._samplers for sampler in self.samplers(key)]
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda job: self._step(*job), jobs))

    def _score_program(self) -> Callable:
        """The artifact's prompt_logprobs program (`runner.score_fn`), read once."""
        if "score" not in self._side:
            files = self.artifact.manifest["score"]["files"]
            if self.platform not in files:
                raise ArtifactError(
                    f"{self.artifact.where}: field 'score.files' holds platforms "
                    f"{sorted(files)}, expected one for {self.platform!r}"
                )
            path = self.artifact.file(files[self.platform]["path"],
                                      files[self.platform]["sha256"])  # fmt: skip
            exported = jax.export.deserialize(bytearray(path.read_bytes()))
            self._side["score"] = jax.jit(exported.call)
        return self._side["score"]

    def _fork_program(self) -> Callable:
        """`runner.fork_fn` on the flat cache leaves (plain copies: compiled here)."""
        if "fork" not in self._side:
            from jaxmamba.model.cache import cache_shapes

            tree = jax.tree.structure(cache_shapes(self.cfg, self.cache_spec, self.dtype))
            flat = lambda leaves, *forks: jax.tree.leaves(  # noqa: E731
                fork_fn(jax.tree.unflatten(tree, leaves), *forks)
            )
            self._side["fork"] = jax.jit(flat, donate_argnums=(0,))
        return self._side["fork"]

    def _run_step(self, inputs: PackedStepInputs, bucket: tuple[int, int, int], sampler: str):
        fn = self._step(bucket, sampler)
        packed, self.cache, self.slot_state = fn(
            self.params, self.cache, self.slot_state, [inputs.buffer]
        )
        return packed

    def _run_fork(self, forks: tuple) -> None:
        self.cache = self._fork_program()(self.cache, *forks)

    def _run_score(self, targets: np.ndarray):
        # the slot state's `prompt_hidden` leaf: after `last_tokens` and `penalties`' leaves
        hidden = len(jax.tree.leaves(self._slot_shapes[:2]))
        return self._score_program()(self.params, self.slot_state[hidden], targets)

    def _compile(self, program: tuple, inputs: StepInputs) -> None:
        bucket, sampler = program
        key = (bucket.num_tokens, bucket.num_rows, bucket.num_decode)
        fn = self._step(key, sampler)
        if not hasattr(fn, "lower"):
            return  # a loaded executable: nothing to compile
        _COMPILE.hit = False
        lowered = fn.lower(
            self.params, self.cache, self.slot_state, [PackedStepInputs.pack(inputs).buffer]
        )
        compiled = lowered.compile()
        self.compiled[key, sampler] = (compiled, not _COMPILE.hit)

    def forward_logits(self, inputs, num_decode: int):
        raise NotImplementedError("an exported artifact holds the sampling step only")


def _runtime_platform() -> str:
    from jaxmamba.export.artifact import runtime_platform

    return runtime_platform()


def _check_exported(exported, expected: dict, program: tuple, platform: str, where: str
                    ) -> None:  # fmt: skip
    """The deserialized step's platforms and avals are what the manifest lists for the program
    `(bucket, sampler)` (`expected`: its "inputs" and "outputs")."""
    key, sampler = program
    if tuple(exported.platforms) != (platform,):
        raise ArtifactError(
            f"{where}: bucket {key} ({sampler} sampler) step holds platforms "
            f"{list(exported.platforms)}, expected [{platform!r}]"
        )
    for field, avals in (("inputs", exported.in_avals), ("outputs", exported.out_avals)):
        found = [{"shape": [int(d) for d in a.shape], "dtype": np.dtype(a.dtype).name}
                 for a in avals]  # fmt: skip
        held = expected[field]
        if found != held:
            bad = next(
                (i for i, (f, e) in enumerate(zip(found, held, strict=False)) if f != e),
                min(len(found), len(held)),
            )
            raise ArtifactError(
                f"{where}: bucket {key} ({sampler} sampler) field {field!r}[{bad}] holds "
                f"{held[bad] if bad < len(held) else 'nothing'}, the exported "
                f"step has {found[bad] if bad < len(found) else 'nothing'}"
            )


class ArtifactCachePlan:
    """The cache an artifact was exported with (fixed: its shapes are in the steps)."""

    def __init__(self, artifact: Artifact):
        m = artifact.manifest
        self.state_slots = m["cache"]["num_slots"]
        self.pages = m["cache"]["num_pages"]
        self.page_size = m["cache"]["page_size"]
        self.cache_bytes = sum(
            int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize for a in m["state"]["cache"]
        )

    def describe(self) -> str:
        return (
            f"cache: {self.state_slots} state slots, {self.pages} KV pages of {self.page_size} "
            f"tokens, {self.cache_bytes / 2**20:.1f} MiB (fixed by the exported artifact)"
        )


# EngineConfig fields an artifact fixes (its bucket shapes and cache depend on them).
_ENGINE_FIELDS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "max_prefill_seqs",
                  "page_size", "enable_prefix_caching", "track_interval", "num_state_slots",
                  "num_pages", "mamba_ssm_cache_dtype")  # fmt: skip


# `speculative_config` keys that steer only the scheduler (which decode steps verify), not
# the programs: a served value may differ from the exported one (`served_speculation`).
SCHEDULING_SPECULATIVE_KEYS = ("disable_by_batch_size",)


def served_speculation(artifact: Artifact, asked) -> SpeculativeConfig:
    """The speculative config to serve the artifact with when `asked` (a `speculative_config`
    setting): the recorded one, but for the keys in `SCHEDULING_SPECULATIVE_KEYS`. Methods
    "draft_model" and "mtp", an artifact exported without speculation, and a key that shapes
    the programs (method, k, the lookup lengths) differing from the recorded one are an
    `ArtifactError` naming it."""
    asked = SpeculativeConfig.parse(asked)
    artifact_speculation(asked)  # draft_model, mtp: refused by name
    held = artifact.manifest["engine"].get("speculative_config")
    if held is None:
        raise ArtifactError(
            f"{artifact.where}: engine field 'speculative_config' holds None, expected "
            f"{dataclasses.asdict(asked)} (asked for): the artifact was exported without "
            "speculation and holds no verify programs; re-export with that speculative_config"
        )
    held = SpeculativeConfig.parse(held)
    for f in dataclasses.fields(SpeculativeConfig):
        mine, theirs = getattr(held, f.name), getattr(asked, f.name)
        if f.name not in SCHEDULING_SPECULATIVE_KEYS and mine != theirs:
            raise ArtifactError(
                f"{artifact.where}: engine field 'speculative_config.{f.name}' holds {mine!r}, "
                f"expected {theirs!r} (asked for): the verify programs are built for it; "
                "re-export with that setting"
            )
    return asked


def engine_config(artifact: Artifact, requested: dict | None = None) -> EngineConfig:
    """The artifact's engine settings; a `requested` value that differs from both
    `EngineConfig`'s default and the artifact's is an error naming the field. A requested
    `speculative_config` is checked by `served_speculation` (which lets
    `disable_by_batch_size` differ)."""
    m = artifact.manifest
    cfg = EngineConfig(**m["engine"])
    if requested:
        defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
        for name, value in requested.items():
            held = m["engine"].get(name)
            if name == "speculative_config":
                if value is not None:
                    cfg = dataclasses.replace(cfg, speculative_config=served_speculation(
                        artifact, value))  # fmt: skip
                continue
            if value != held and value != defaults.get(name):
                raise ArtifactError(
                    f"{artifact.where}: engine field {name!r} holds {held!r}, expected "
                    f"{value!r} (asked for): re-export with that setting"
                )
    return cfg


class ServedArtifact(NamedTuple):
    """What serving an artifact takes: the engine on its `ArtifactRunner`, and the settings,
    tokenizer and cache it was exported with."""

    artifact: Artifact
    runner: ArtifactRunner
    engine: LLMEngine
    model_cfg: ModelConfig
    engine_cfg: EngineConfig
    tokenizer: Tokenizer | None
    cache_plan: ArtifactCachePlan
    dtype: np.dtype


def serve_artifact(path, *, seed: int = 0, params=None, precompile: bool = False,
                   engine: dict | None = None, weights=None) -> ServedArtifact:  # fmt: skip
    """The engine that serves the artifact at `path` (`engine`: the `EngineConfig` settings
    asked for, checked against the exported ones by `engine_config`)."""
    artifact = read_artifact(path)
    engine_cfg = engine_config(artifact, engine)
    runner = ArtifactRunner(artifact, params, weights=weights)
    runner.load_steps()
    exported = sorted(runner.buckets())

    def needed(cfg: EngineConfig) -> list[tuple[int, int, int]]:
        return sorted((b.num_tokens, b.num_rows, b.num_decode)
                      for b in Scheduler(runner.cfg, cfg).all_buckets())  # fmt: skip

    recorded = EngineConfig(**artifact.manifest["engine"])
    if len(exported) == artifact.manifest["all_buckets"] and exported != needed(recorded):
        raise ArtifactError(
            f"{artifact.where}: field 'buckets' holds {exported}, expected the scheduler's "
            f"{needed(recorded)} for these engine settings"
        )
    missing = sorted(set(needed(engine_cfg)) - set(exported))
    if missing and engine_cfg.speculative_config != recorded.speculative_config:
        key = "disable_by_batch_size"
        raise ArtifactError(
            f"{artifact.where}: engine field 'speculative_config.{key}' holds "
            f"{getattr(recorded.speculative_config, key)!r}, expected "
            f"{getattr(engine_cfg.speculative_config, key)!r} (asked for), whose verify "
            f"buckets {missing} the artifact does not hold: ask for at most the exported "
            "value, or re-export with it"
        )
    tok = artifact.manifest.get("tokenizer")
    if tok == "byte":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = load_tokenizer(Path(path) / tok, runner.cfg) if tok else None
    llm_engine = LLMEngine(runner.cfg, runner, engine_cfg, tokenizer=tokenizer, seed=seed)
    if precompile:
        llm_engine.precompile()
    return ServedArtifact(artifact, runner, llm_engine, runner.cfg, engine_cfg, tokenizer,
                          ArtifactCachePlan(artifact), runner.dtype)  # fmt: skip
