"""The model runner: the only part of the engine that touches the device.

It owns the parameters and the cache, and runs one jitted step per call:
`step(params, cache, slot_state, inputs) -> (packed sample output, cache, slot_state)`,
donating the cache and the per-slot sampler state (`SlotState`). The
static shape of a step is its bucket `(num_tokens, num_rows, num_decode)`; each bucket
compiles once, and each decode bucket twice more as its sampler variants: `PLAIN`, the
sampler without the sort for top-k/top-p/min-p and without the top logprobs, and `GREEDY`, the
argmax alone (no random draw, penalties or ranks), which the host chooses when no row of the
step needs what they leave out (`ModelRunner.sampler_variant`; the step itself has no device
branch, `tests/test_no_host_sync.py`). Each gives the tokens, logprobs and ranks the full program
gives for the rows it runs. `JAXMAMBA_SAMPLER_VARIANTS=0` turns the variants off (one program
a bucket).

Structured outputs: the FULL program of every bucket but a verify bucket's takes the token
bitmask (`step_contract` field `token_bitmask`) when the runner serves structured outputs
(`StepRunner.structured_outputs`); PLAIN and GREEDY never do, so the programs are as many as
without the feature. A step whose builder sent a bitmask (a constrained row) runs FULL; a FULL
step without one gets an all-allowing bitmask here (one cached array per row count). A runner
whose FULL programs take no mask (`JAXMAMBA_STRUCTURED_OUTPUTS=0`; an artifact exported without
it, whose manifest does not say `structured_outputs`) says so, and the engine refuses
constrained requests.

Two rare kinds of work run as programs of their own, dispatched after a step only when one
of its rows asks (`ModelRunner.step` decides from the host inputs; one program each, whatever
the bucket): `score_fn`, the prompt_logprobs of the prefill tokens that ask for them, from
their hidden states the step leaves in `SlotState.prompt_hidden`; and `fork_fn`, the copies of
a prompt's end state into its other samples' slots (n > 1). Inside every step they would cost
every prefill the top logprobs of its scored block and the state copies of its padded fork
entries, whether a row asked or not.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import StateCache, cache_shapes, init_cache
from jaxmamba.model.draft import DraftSpec
from jaxmamba.model.metadata import PackedStepInputs
from jaxmamba.model.mtp import MtpSpec, refuse_mtp_under_tp
from jaxmamba.model.sampling import needs_cutoff
from jaxmamba.model.speculative import NgramSpec
from jaxmamba.model.step import (
    FULL,
    GREEDY,
    PLAIN,
    TRACE_COUNTS,
    fork_fn,
    init_slot_state,
    jitted_fork,
    jitted_logits,
    jitted_score,
    jitted_step,
    jitted_step_without_cpu_fusion_emitters,
    logits_fn,
    score_fn,
    step_fn,
)
from jaxmamba.step_contract import (
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROB_TOKENS,
    CacheSpec,
    StepInputs,
    with_on_demand_fields,
)

__all__ = [
    "FULL", "GREEDY", "PLAIN", "TRACE_COUNTS", "ModelRunner", "StepOutput", "StepRunner",
    "fork_fn", "jitted_step", "logits_fn", "score_fn", "step_fn", "step_temporary_bytes",
    "takes_bitmask",
]  # fmt: skip


class StepOutput(NamedTuple):
    """What `ModelRunner.step` hands back, on device: the packed samples of every row
    (`pack_sample_output`), and the packed prompt logprobs of the prefill tokens that ask
    for them, in step order (`score_fn`; None when no row asks)."""

    packed: jax.Array  # i32[B, 3 + 2 * MAX_LOGPROBS]
    prompt_scores: jax.Array | None = None  # i32[MAX_PROMPT_LOGPROB_TOKENS, 3 + 2 * MAX_LOGPROBS]


class HostSample(NamedTuple):
    tokens: np.ndarray  # i32[B]
    logprobs: np.ndarray  # f32[B]
    ranks: np.ndarray  # i32[B] 1-based rank of the sampled token under the raw model
    top_ids: np.ndarray  # i32[B, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[B, MAX_LOGPROBS]


class HostVerify(NamedTuple):
    """A verify step's output on the host (speculative decoding): per row, the drafts it
    accepted and whether it proposed any, and its samples at each of its J positions (row r's
    position j is `samples` row ``r·J + j``); the row emits positions ``0..accepted[r]``."""

    accepted: np.ndarray  # i32[B]
    proposed: np.ndarray  # i32[B] 1 when the row had drafts
    samples: HostSample  # [B*J]
    num_positions: int  # J


def unpack_verify_output(packed: np.ndarray, num_positions: int) -> HostVerify:
    ints = np.ascontiguousarray(packed, dtype=np.int32)
    rows = ints.shape[0]
    samples = unpack_sample_output(ints[:, 2:].reshape(rows * num_positions, -1))
    return HostVerify(ints[:, 0], ints[:, 1], samples, num_positions)


def unpack_sample_output(packed: np.ndarray) -> HostSample:
    ints = np.ascontiguousarray(packed, dtype=np.int32)
    floats = ints.view(np.float32)
    k = MAX_LOGPROBS
    return HostSample(ints[:, 0], floats[:, 1], ints[:, 2], ints[:, 3 : 3 + k], floats[:, 3 + k :])


def _as_is(inputs):
    return inputs


def variants_enabled() -> bool:
    """Whether steps may run the PLAIN and GREEDY variants (`JAXMAMBA_SAMPLER_VARIANTS=0`:
    never)."""
    return os.environ.get("JAXMAMBA_SAMPLER_VARIANTS", "1") != "0"


def bucket_samplers(num_rows: int, num_decode: int) -> tuple[str, ...]:
    """The sampler programs of a bucket: a pure decode bucket has the PLAIN and GREEDY variants
    too (a mixed step pays the full sampler beside a prefill that costs far more)."""
    return (FULL, PLAIN, GREEDY) if num_decode == num_rows else (FULL,)


def choose_sampler(inputs: StepInputs, num_decode: int, top_logprobs: bool, vocab: int, *,
                   ranks: bool = True) -> str:  # fmt: skip
    """The cheapest sampler program that serves a step, read from the host inputs: for a pure
    decode step, GREEDY if every row is greedy without penalties and none reads ranks
    (`ranks`: some row asks for logprobs), else PLAIN if no row needs the cut-off or the top
    logprobs (`top_logprobs`: some row asks for them); else FULL. Inputs already on the device
    count as needing everything (no read back)."""
    rows = np.shape(inputs.state_slots)[0]
    if top_logprobs or num_decode != rows:
        return FULL
    arrays = (
        inputs.temperature,
        inputs.top_k,
        inputs.top_p,
        inputs.min_p,
        inputs.presence_penalty,
        inputs.frequency_penalty,
        inputs.repetition_penalty,
    )
    if not all(isinstance(a, np.ndarray) for a in arrays):
        return FULL
    temperature, top_k, top_p, min_p, presence, frequency, repetition = arrays
    penalised = np.any(presence != 0) or np.any(frequency != 0) or np.any(repetition != 1)
    if not ranks and not penalised and not np.any(temperature > 0):
        return GREEDY
    return FULL if needs_cutoff(temperature, top_k, top_p, min_p, vocab) else PLAIN


def sampler_flags(sampler: str) -> dict:
    """The `step` keywords that select ``sampler`` for a pure decode step of padding rows
    (greedy, no penalties): what no row of such a step reads."""
    return {"top_logprobs": sampler == FULL, "ranks": sampler != GREEDY}


def fallback_sampler(sampler: str, held) -> str:
    """``sampler``, or the next dearer program in ``held`` that serves the same rows (an
    artifact exported without a variant)."""
    order = (GREEDY, PLAIN, FULL)
    for candidate in order[order.index(sampler) :]:
        if candidate in held:
            return candidate
    return FULL


def structured_outputs_enabled() -> bool:
    """Whether a `ModelRunner`'s FULL programs take the token bitmask
    (`JAXMAMBA_STRUCTURED_OUTPUTS=0`: never, and the engine refuses constrained requests)."""
    return os.environ.get("JAXMAMBA_STRUCTURED_OUTPUTS", "1") != "0"


def takes_bitmask(bucket: tuple[int, int, int], sampler: str) -> bool:
    """Whether the step program `(bucket, sampler)` of a runner that serves structured outputs
    takes the token bitmask: FULL, in any bucket `(num_tokens, num_rows, num_decode)` but a
    verify bucket's (speculative decoding: its rows carry no grammar)."""
    num_tokens, num_rows, num_decode = bucket
    verify = num_decode == num_rows and num_tokens != num_rows
    return sampler == FULL and not verify


def all_allowed_bitmask(inputs: StepInputs, vocab_size: int) -> StepInputs:
    """`inputs` with a token bitmask that allows every token (-1 words) where they have none."""
    return with_on_demand_fields(inputs, vocab_size, ("token_bitmask",))


def default_compile_workers() -> int:
    """Threads that compile programs side by side: one per core, at most 8, on GPU and TPU;
    one on CPU, where XLA's compiles already use the cores the process itself runs on."""
    return 1 if jax.default_backend() == "cpu" else min(8, os.cpu_count() or 1)


def program_name(program: tuple) -> str:
    """`T=64 B=8 decode=4 greedy` for a step program `(bucket, sampler)`; `fork` or `score`
    for a side program."""
    if len(program) == 1:
        return program[0]
    bucket, sampler = program
    return f"T={bucket.num_tokens} B={bucket.num_rows} decode={bucket.num_decode} {sampler}"


def step_bucket(inputs: StepInputs, num_decode: int) -> tuple[int, int, int]:
    """The bucket `(num_tokens, num_rows, num_decode)` of a step's inputs."""
    return (int(np.shape(inputs.input_ids)[0]), int(np.shape(inputs.state_slots)[0]),
            int(num_decode))  # fmt: skip


def asked_targets(targets: np.ndarray, num_decode: int) -> np.ndarray | None:
    """Host side of `prompt_tokens_to_score`: the targets of the prefill tokens that ask for
    prompt_logprobs, in step order, padded with -1 to `MAX_PROMPT_LOGPROB_TOKENS`; None when
    none asks (the step needs no `score_fn`)."""
    if targets is None:
        return None
    prefill = np.asarray(targets)[num_decode:]
    asked = prefill[prefill >= 0]
    if asked.size == 0:
        return None
    if asked.size > MAX_PROMPT_LOGPROB_TOKENS:
        raise ValueError(f"{asked.size} prompt tokens to score in one step, at most "
                         f"{MAX_PROMPT_LOGPROB_TOKENS}")  # fmt: skip
    out = np.full(MAX_PROMPT_LOGPROB_TOKENS, -1, np.int32)
    out[: asked.size] = asked
    return out


def padding_targets() -> np.ndarray:
    """`score_fn`'s targets when no token asks (a warm-up run)."""
    return np.full(MAX_PROMPT_LOGPROB_TOKENS, -1, np.int32)


def fork_inputs(inputs: StepInputs) -> tuple:
    """`fork_fn`'s arguments after the cache, from a step's inputs."""
    return (inputs.fork_src_slots, inputs.fork_dst_slots, inputs.fork_src_pages,
            inputs.fork_dst_pages)  # fmt: skip


def asked_forks(inputs: StepInputs, num_decode: int, pad_slot: int) -> tuple | None:
    """`fork_fn`'s arguments after the cache when a step forks some sample (host inputs), else
    None (the step needs no `fork_fn`)."""
    if inputs.fork_dst_slots is None or len(inputs.state_slots) == num_decode:
        return None
    return fork_inputs(inputs) if np.any(np.asarray(inputs.fork_dst_slots) != pad_slot) else None


def unpack_step_output(out: StepOutput) -> tuple[HostSample, HostSample | None]:
    """A step's samples, and its scored prompt tokens in step order (None: none asked);
    `out` read to the host (`jax.device_get`)."""
    scored = None if out.prompt_scores is None else unpack_sample_output(out.prompt_scores)
    return unpack_sample_output(out.packed), scored


class StepRunner:
    """What the engine drives, whatever runs the step (`ModelRunner`: the model's live jit;
    `jaxmamba.export.serving.ArtifactRunner`: an artifact's exported steps): `step`,
    `precompile`, `programs`, the side programs, and the choice of sampler program. A
    subclass says how one program is held, compiled and dispatched (`held_samplers`,
    `_compile`, `_run_step`, `_run_fork`, `_run_score`), and sets `cfg`, `cache_spec`,
    `dtype`, `cache` and `slot_state`."""

    cfg: ModelConfig
    cache_spec: CacheSpec
    cache: object = None
    slot_state: object = None
    # Whether decode steps may run the PLAIN and GREEDY sampler programs.
    sampler_variants: bool = True
    # Whether its FULL programs take the token bitmask (`takes_bitmask`; structured outputs).
    structured_outputs: bool = True
    # Called with each step's host inputs and `num_decode` before it is dispatched, and
    # returns the inputs to run: the several-host leader sends them to its followers
    # (`jaxmamba.parallel.multihost`). None: nothing is sent.
    send_step: Callable | None = None
    # Speculative decoding: the n-gram or draft-model drafting its verify steps run (None: it
    # has no verify programs, and its slot state keeps no lengths or token history).
    speculative: NgramSpec | DraftSpec | MtpSpec | None = None

    def __init__(self):
        self.variant_steps: Counter = Counter()  # steps dispatched per sampler program
        self._all_allowed: dict[int, np.ndarray] = {}  # rows -> i32[B, VW] of -1, read-only

    # -- what a subclass provides -------------------------------------------------------------
    def held_samplers(self, bucket: tuple[int, int, int]) -> tuple[str, ...]:
        """The sampler programs this runner has for a bucket `(num_tokens, num_rows,
        num_decode)`, with the variants on."""
        raise NotImplementedError

    def _compile(self, program: tuple, inputs: StepInputs) -> None:
        """Compile the step program `(bucket, sampler)` for a bucket's host `inputs`."""
        raise NotImplementedError

    def _run_step(self, inputs: PackedStepInputs, bucket: tuple[int, int, int], sampler: str):
        """Dispatch the step of `bucket` `(num_tokens, num_rows, num_decode)` on its packed
        host inputs; returns the packed samples and sets `cache` and `slot_state`."""
        raise NotImplementedError

    def _run_fork(self, forks: tuple) -> None:
        """Dispatch `fork_fn` on `forks` (`fork_inputs`), replacing `cache`."""
        raise NotImplementedError

    def _run_score(self, targets: np.ndarray):
        """Dispatch `score_fn` on `targets` (`asked_targets`); returns its packed rows."""
        raise NotImplementedError

    def _new_state(self) -> tuple:
        """A fresh `(cache, slot_state)`, made as the constructor makes them."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------
    def reset_state(self) -> None:
        """Replace `cache` and `slot_state` with fresh ones (`_new_state`, so every compiled
        program takes them as it is): after a failed step consumed them. What they held is
        lost. Their buffers are freed first, whoever still holds them (a traceback may): a
        device sized for one state has no room for a second."""
        for leaf in jax.tree.leaves((self.cache, self.slot_state)):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self.cache, self.slot_state = self._new_state()

    def holds_state(self, cache, slot_state) -> bool:
        """Whether `cache` and `slot_state`, read before a call that raised, are still this
        runner's state and whole: no program replaced them, and none consumed (was donated)
        one of their buffers. A host-side look at each buffer's deleted flag: no device work."""
        if cache is not self.cache or slot_state is not self.slot_state:
            return False
        return not any(leaf.is_deleted() for leaf in jax.tree.leaves((cache, slot_state)))

    def samplers(self, bucket: tuple[int, int, int]) -> tuple[str, ...]:
        """The sampler programs `step` runs for a bucket (the full one alone with the variants
        off)."""
        return self.held_samplers(bucket) if self.sampler_variants else (FULL,)

    def programs(self, buckets) -> list[tuple]:
        """`(bucket, sampler)` of every program `step` can run for these buckets."""
        return [(b, sampler) for sampler in (FULL, PLAIN, GREEDY) for b in buckets
                if sampler in self.samplers((b.num_tokens, b.num_rows, b.num_decode))]  # fmt: skip

    def program_inputs(self, program: tuple, build_inputs) -> StepInputs:
        """Padding inputs of a step program `(bucket, sampler)`: `build_inputs(bucket)`, with
        the all-allowing token bitmask where the program takes one (`takes_bitmask`)."""
        bucket, sampler = program
        key = (bucket.num_tokens, bucket.num_rows, bucket.num_decode)
        return self._with_bitmask(build_inputs(bucket), key, sampler)

    def _with_bitmask(self, inputs: StepInputs, bucket: tuple[int, int, int], sampler: str
                      ) -> StepInputs:  # fmt: skip
        """`inputs`, with an all-allowing token bitmask if the program takes one and they have
        none: one read-only array per row count, kept (16 KiB a row for a 9B vocabulary),
        which the step's packing copies."""
        if (inputs.token_bitmask is not None or not self.structured_outputs
                or not takes_bitmask(bucket, sampler)):  # fmt: skip
            return inputs
        rows = bucket[1]
        mask = self._all_allowed.get(rows)
        if mask is None:
            mask = all_allowed_bitmask(inputs, self.cfg.vocab_size).token_bitmask
            mask.flags.writeable = False
            mask = self._all_allowed.setdefault(rows, mask)
        return inputs._replace(token_bitmask=mask)

    def sampler_variant(self, inputs: StepInputs, num_decode: int, top_logprobs: bool, *,
                        ranks: bool = True) -> str:  # fmt: skip
        """The sampler program `step` runs for these inputs: FULL for inputs with a token
        bitmask (a constrained row), else the cheapest that serves them (`choose_sampler`),
        or the next dearer one this runner holds (`fallback_sampler`)."""
        if inputs.token_bitmask is not None:
            bucket = step_bucket(inputs, num_decode)
            if not self.structured_outputs or not takes_bitmask(bucket, FULL):
                raise ValueError(
                    f"a step of bucket (num_tokens, num_rows, num_decode)={bucket} with a token "
                    f"bitmask (structured outputs), but {type(self).__name__} has no program "
                    f"of that bucket that takes one"
                )
            return FULL
        if not self.sampler_variants:
            return FULL
        sampler = choose_sampler(inputs, num_decode, top_logprobs, self.cfg.vocab_size,
                                 ranks=ranks)  # fmt: skip
        return fallback_sampler(sampler, self.held_samplers(step_bucket(inputs, num_decode)))

    def step(self, inputs: StepInputs, num_decode: int, *, top_logprobs: bool = True,
             ranks: bool = True) -> StepOutput:  # fmt: skip
        """Dispatch one step, and after it `fork_fn` and `score_fn` where some row needs them
        (`asked_forks`, `asked_targets`); returns the device outputs without waiting for them.
        `top_logprobs=False`: no row reads the top logprobs, `ranks=False`: no row reads the
        ranks (no row asks for logprobs); what no row reads may come back as zeros, which lets
        a decode step run a sampler variant. The inputs go in as one host buffer
        (`PackedStepInputs`), which the step's C++ dispatch moves in one copy."""
        if self.send_step is not None:
            inputs = self.send_step(inputs, num_decode)
        sampler = self.sampler_variant(inputs, num_decode, top_logprobs, ranks=ranks)
        forks = asked_forks(inputs, num_decode, self.cache_spec.pad_slot)
        targets = asked_targets(inputs.prompt_logprob_targets, num_decode)
        bucket = step_bucket(inputs, num_decode)
        inputs = self._with_bitmask(inputs, bucket, sampler)
        with jax.transfer_guard_host_to_device("allow"):  # the step's inputs, and only they
            packed = self._run_step(PackedStepInputs.pack(inputs), bucket, sampler)
        self.variant_steps[sampler] += 1
        return StepOutput(packed, self._side_programs(forks, targets))

    def _side_programs(self, forks: tuple | None, targets: np.ndarray | None):
        """`fork_fn` on `forks` (`fork_inputs`; None: no fork), then `score_fn` on `targets`
        (`asked_targets`; None: no score); returns the scores (or None)."""
        with jax.transfer_guard_host_to_device("allow"):  # their inputs, and only they
            if forks is not None:
                self._run_fork(forks)
            return None if targets is None else self._run_score(targets)

    def run_side_programs(self, padding: StepInputs) -> None:
        """Compile and run once `fork_fn` and `score_fn` (what a step with forks or
        prompt_logprobs adds), on a bucket's padding: pad slots onto themselves, no target."""
        jax.block_until_ready(self._side_programs(fork_inputs(padding), padding_targets()))

    def compile_programs(self, buckets, build_inputs, progress=None,
                         workers: int | None = None) -> dict[tuple, int | None]:  # fmt: skip
        """Compile every program `step` can run for these buckets (`programs`) and the side
        programs, in `workers` threads (`default_compile_workers`): XLA's compiles release
        the GIL, so they overlap (tracing does not). Returns each program's device
        bytes beyond its arguments (`program_bytes`; None where this runner cannot tell),
        keyed `(bucket, sampler)` and `("fork",)`, `("score",)`. `progress(done, total,
        program)` is called as each finishes."""
        programs = self.programs(buckets)
        inputs = [self.program_inputs(p, build_inputs) for p in programs]  # padding: greedy rows
        prefill = [b for b in buckets if b.num_rows > b.num_decode]
        side = [(("fork",), prefill[0]), (("score",), prefill[0])] if prefill else []
        jobs = [
            (lambda p=p, x=x: self._compile(p, x)) for p, x in zip(programs, inputs, strict=True)
        ]
        jobs += [(lambda p=p, b=b: self._compile_side(p, build_inputs(b))) for p, b in side]
        keys = programs + [p for p, _ in side]
        workers = workers or default_compile_workers()
        needs = {}
        with contextlib.ExitStack() as stack:
            if workers > 1:
                pool = stack.enter_context(ThreadPoolExecutor(workers))
                done = pool.map(lambda job: job(), jobs)
            else:  # on this thread: nothing runs beside a compile
                done = (job() for job in jobs)
            for i, (key, compiled) in enumerate(zip(keys, done, strict=True)):
                needs[key] = None if compiled is None else program_bytes(compiled)
                if progress is not None:
                    progress(i + 1, len(keys), key)
        return needs

    def precompile(self, buckets, build_inputs, progress=None, workers: int | None = None) -> None:
        """Compile every program of these buckets and the side programs (`compile_programs`),
        then run each once on padding only."""
        self.compile_programs(buckets, build_inputs, progress, workers)
        for bucket, sampler in self.programs(buckets):
            x = self.program_inputs((bucket, sampler), build_inputs)
            jax.block_until_ready(self.step(x, bucket.num_decode, **sampler_flags(sampler)))
        prefill = [b for b in buckets if b.num_rows > b.num_decode]
        if prefill:
            self.run_side_programs(build_inputs(prefill[0]))

    def _compile_side(self, program: tuple, padding: StepInputs):
        """Compile the side program `("fork",)` or `("score",)`; returns it compiled (None:
        this runner holds it already compiled)."""
        return None


class ModelRunner(StepRunner):
    """Runs the model's steps as live jits (one device, or sharded over a mesh)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        cache_spec: CacheSpec,
        *,
        dtype=jnp.float32,
        impl: str = "auto",
        small_m_impl: str | None = None,
        tensor_parallel_size: int = 1,
        mesh=None,
        allocate: bool = True,
        speculative: NgramSpec | DraftSpec | MtpSpec | None = None,
        draft_params=None,
    ):
        """`tensor_parallel_size > 1`: the model runs sharded over a mesh of that many
        devices (`mesh`, default the first devices; jaxmamba.parallel); `params` are the
        whole model's, as loaded. `allocate=False`: `cache` and `slot_state` are only their
        shapes (`jax.ShapeDtypeStruct`s), so the runner compiles its programs
        (`compile_programs`, for their memory) before the cache takes memory; it runs after
        `reset_state`. `speculative`: the runner runs verify steps with this n-gram drafting,
        and its slot state keeps each slot's length and token history; a `DraftSpec` drafts
        with its model, whose weights are `draft_params` and whose states the slot state
        keeps too (`jaxmamba.model.draft`). Sharded, the slot state and the draft model are
        replicated on every device (`jaxmamba.parallel.step`); an `MtpSpec` is refused."""
        from jaxmamba.model.model import Mamba2HybridLM

        super().__init__()
        sharded = tensor_parallel_size > 1 or mesh is not None
        if sharded and isinstance(speculative, MtpSpec):
            raise refuse_mtp_under_tp(tensor_parallel_size)
        if isinstance(speculative, DraftSpec | MtpSpec) != (draft_params is not None):
            raise ValueError("a DraftSpec or MtpSpec and its draft_params come together, got "
                             f"{type(speculative).__name__} and draft_params="
                             f"{'None' if draft_params is None else 'given'}")  # fmt: skip
        self.speculative = speculative
        self.draft_params = draft_params
        self.cfg = cfg
        self.cache_spec = cache_spec
        self.dtype = jnp.dtype(dtype)
        self.tensor_parallel_size = tensor_parallel_size
        # One device: the host arrays go to the jitted step as they are; its C++ dispatch moves
        # them, cheaper than a Python `device_put` per array (`scripts/bench_host_loop.py`).
        self._put_inputs = _as_is
        if not sharded:
            self.model = Mamba2HybridLM(cfg, self.dtype, impl, small_m_impl)
            self.params = params
            self._new_state = lambda: (init_cache(cfg, cache_spec, self.dtype),
                                       init_slot_state(cfg, cache_spec, self.dtype,
                                                       speculative))  # fmt: skip
            self._static = dict(model=self.model, spec=cache_spec)
            self._jit_step, self._jit_logits = jitted_step, jitted_logits
            if isinstance(speculative, MtpSpec) and jax.default_backend() == "cpu":
                self._jit_step = jitted_step_without_cpu_fusion_emitters
            self._jit_score, self._jit_fork = jitted_score, jitted_fork
            state_sharding = None  # the arrays `_new_state` makes are not committed
        else:
            from jaxmamba.parallel import sharding, step

            mesh_plan = step.mesh_plan(cfg, tensor_parallel_size, mesh)
            plan, replicated = mesh_plan.plan, sharding.replicated(mesh_plan.mesh)
            self.model = Mamba2HybridLM(plan.shard_config(), self.dtype, impl, small_m_impl,
                                        plan.layout())  # fmt: skip
            shard = sharding.shard_params if allocate else sharding.sharded_param_shapes
            self.params = shard(plan, params, mesh_plan.mesh)
            self._new_state = lambda: (
                sharding.init_sharded_cache(plan, cache_spec, self.dtype, mesh_plan.mesh),
                jax.device_put(init_slot_state(cfg, cache_spec, self.dtype, speculative),
                               replicated),
            )  # fmt: skip
            if draft_params is not None:  # a draft model is small: whole on every device
                self.draft_params = sharding.replicate_params(draft_params, mesh_plan.mesh,
                                                              allocate=allocate)  # fmt: skip
            self._put_inputs = functools.partial(jax.device_put, device=replicated)
            self._static = dict(model=self.model, spec=cache_spec, mesh_plan=mesh_plan)
            self._jit_step, self._jit_logits = step.jitted_tp_step, step.jitted_tp_logits
            self._jit_score, self._jit_fork = step.jitted_tp_score, step.jitted_tp_fork
            state_sharding = replicated
        # The step's static arguments: `speculative` only when set (the programs of a runner
        # that does not speculate are those it would have without the feature).
        self._step_static = dict(self._static)
        if speculative is not None:
            self._step_static["speculative"] = speculative
        self.cache: StateCache
        if allocate:
            self.reset_state()
        else:  # the arrays' shapes, on the devices they will be on
            self.cache, self.slot_state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(
                    a.shape, a.dtype, sharding=state_sharding, weak_type=a.weak_type
                ),
                jax.eval_shape(self._new_state),
            )
            if sharded:
                self.cache = sharding.sharded_cache_shapes(plan, cache_spec, self.dtype,
                                                           mesh_plan.mesh)  # fmt: skip
        # The sampler variants of decode steps (the sharded step has the full one only).
        self.sampler_variants = not sharded and variants_enabled()
        self.structured_outputs = structured_outputs_enabled()

    @property
    def num_compiles(self) -> int:
        """Compilations of this model+cache shape in this process (shared between runners)."""
        return TRACE_COUNTS[(self.model, self.cache_spec)]

    def held_samplers(self, bucket: tuple[int, int, int]) -> tuple[str, ...]:
        _, num_rows, num_decode = bucket
        return bucket_samplers(num_rows, num_decode)

    def _step_fn(self, params, cache, slot_state, inputs, *, num_decode, sampler=FULL):
        """The step body, unjitted (for jaxpr inspection)."""
        return step_fn(params, cache, slot_state, inputs, self.draft_params,
                       num_decode=num_decode, sampler=sampler, **self._step_static)  # fmt: skip

    def forward_logits(self, inputs: StepInputs, num_decode: int) -> jax.Array:
        """Like `step`, but returns float32 logits for every token `[T, V]` (scoring, tests)."""
        with jax.transfer_guard_host_to_device("allow"):  # the inputs, as in `step`
            logits, self.cache = self._jit_logits(
                self.params, self.cache, self._put_inputs(inputs), num_decode=num_decode,
                **self._static,
            )  # fmt: skip
        return logits

    def _run_step(self, inputs: PackedStepInputs, bucket: tuple[int, int, int], sampler: str):
        kwargs = {} if sampler == FULL else {"sampler": sampler}
        args = (self.params, self.cache, self.slot_state, self._put_inputs(inputs))
        if self.draft_params is not None:
            args += (self.draft_params,)
        packed, self.cache, self.slot_state = self._jit_step(
            *args, num_decode=bucket[2], **kwargs, **self._step_static
        )
        return packed

    def _run_fork(self, forks: tuple) -> None:
        self.cache = self._jit_fork(self.cache, *self._put_inputs(forks), **self._static)

    def _run_score(self, targets: np.ndarray):
        return self._jit_score(self.params, self.slot_state.prompt_hidden,
                               self._put_inputs(targets), **self._static)  # fmt: skip

    def step_args(self, inputs: StepInputs, num_decode: int, sampler: str = FULL
                  ) -> tuple[tuple, dict]:  # fmt: skip
        """`(args, kwargs)` of `jitted_step` (or the tensor-parallel `jitted_tp_step`) for
        these inputs, packed as `step` passes them (lowering, export: the FULL sampler, as
        `step` calls it)."""
        kwargs = dict(num_decode=num_decode, **self._step_static)
        if sampler != FULL:
            kwargs["sampler"] = sampler
        if isinstance(inputs, StepInputs):
            inputs = PackedStepInputs.pack(inputs)
        args = (self.params, self.cache, self.slot_state, inputs)
        if self.draft_params is not None:
            args += (self.draft_params,)
        return args, kwargs

    def _compile(self, program: tuple, inputs: StepInputs):
        bucket, sampler = program
        packed = self._put_inputs(PackedStepInputs.pack(inputs))
        args, kwargs = self.step_args(packed, bucket.num_decode, sampler)
        return self._jit_step.lower(*args, **kwargs).compile()  # fills the jit's own cache

    def _compile_side(self, program: tuple, padding: StepInputs):
        if program == ("fork",):
            forks = self._put_inputs(fork_inputs(padding))
            return self._jit_fork.lower(self.cache, *forks, **self._static).compile()
        targets = self._put_inputs(padding_targets())
        return self._jit_score.lower(self.params, self.slot_state.prompt_hidden, targets,
                                     **self._static).compile()  # fmt: skip


def step_temporary_bytes(
    cfg: ModelConfig,
    params,
    spec: CacheSpec,
    inputs: StepInputs,
    num_decode: int,
    *,
    dtype=jnp.float32,
    impl: str = "auto",
    small_m_impl: str | None = None,
    tensor_parallel_size: int = 1,
    speculative: NgramSpec | DraftSpec | MtpSpec | None = None,
    draft_params=None,
) -> int:
    """Device bytes one step of this bucket needs beyond its arguments: XLA's memory analysis
    of the compiled FULL program, as a `ModelRunner` compiles it (temporaries, and outputs
    that do not alias a donated input; host inputs get the token bitmask where it takes one,
    `takes_bitmask`). Only shapes are used: nothing is allocated or run. Sharded
    (`tensor_parallel_size > 1`): one device's. `speculative` (and a draft model's
    `draft_params`): the step of a runner that speculates (a verify bucket's too)."""
    if isinstance(inputs, StepInputs):  # as `step` passes them: the same program
        if structured_outputs_enabled() and takes_bitmask(step_bucket(inputs, num_decode), FULL):
            inputs = all_allowed_bitmask(inputs, cfg.vocab_size)
        inputs = PackedStepInputs.pack(inputs)
    from jaxmamba.model.model import Mamba2HybridLM

    if tensor_parallel_size > 1:
        from jaxmamba.parallel.step import step_memory

        analysis = step_memory(cfg, tensor_parallel_size, params, spec, inputs, num_decode,
                               dtype=dtype, impl=impl, small_m_impl=small_m_impl,
                               speculative=speculative, draft_params=draft_params)  # fmt: skip
        unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        return int(analysis.temp_size_in_bytes + max(unaliased, 0))

    dtype = jnp.dtype(dtype)
    model = Mamba2HybridLM(cfg, dtype, impl, small_m_impl)
    shapes = jax.eval_shape(lambda: init_slot_state(cfg, spec, dtype, speculative))
    args = (params, cache_shapes(cfg, spec, dtype), shapes, inputs)
    if draft_params is not None:
        args += (draft_params,)
    extra = {} if speculative is None else {"speculative": speculative}
    compiled = jitted_step.lower(*args, num_decode=num_decode, model=model, spec=spec,
                                 **extra).compile()  # fmt: skip
    return program_bytes(compiled)


def program_bytes(compiled) -> int:
    """Device bytes a compiled program needs beyond its arguments: XLA's memory analysis of
    it (temporaries, and outputs that alias no donated input); 0 where the backend has none."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return int(analysis.temp_size_in_bytes + max(unaliased, 0))
