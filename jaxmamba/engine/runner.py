"""The model runner: the only part of the engine that touches the device.

It owns the parameters and the cache, and runs one jitted step per call:
`step(params, cache, slot_state, inputs) -> (packed sample output, cache, slot_state)`,
donating the cache and the per-slot sampler state (`SlotState`). The
static shape of a step is its bucket `(num_tokens, num_rows, num_decode)`; each bucket
compiles once, and each decode bucket twice more as its sampler variants: `PLAIN`, the
sampler without the sort for top-k/top-p/min-p and without the top logprobs, and `GREEDY`, the
argmax alone (no random draw, penalties or ranks), which the host chooses when no row of the
step needs what they leave out (`ModelRunner.sampler_variant`; a device branch instead cost
~5 ms a step, docs/benchmarks.md). Each gives the tokens, logprobs and ranks the full program
gives for the rows it runs. `JAXMAMBA_SAMPLER_VARIANTS=0` turns the variants off (one program
a bucket).

Two rare kinds of work run as programs of their own, dispatched after a step only when one
of its rows asks (`ModelRunner.step` decides from the host inputs; one program each, whatever
the bucket): `score_fn`, the prompt_logprobs of the prefill tokens that ask for them, from
their hidden states the step leaves in `SlotState.prompt_hidden`; and `fork_fn`, the copies of
a prompt's end state into its other samples' slots (n > 1). Inside every step they cost a
prefill of 2,048 tokens on the 9B model ~1.6 ms (the top logprobs of 128 rows, and the state
copies of 4 padded forks in each of 27 layers; H200, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import CacheSpec, StateCache, cache_shapes, init_cache
from jaxmamba.model.metadata import (
    MAX_PROMPT_LOGPROB_TOKENS,
    ForwardMetadata,
    PackedStepInputs,
    StepInputs,
)
from jaxmamba.model.sampling import (
    MAX_LOGPROBS,
    Penalties,
    PenaltyState,
    SampleOutput,
    init_penalty_state,
    needs_cutoff,
    prompt_logprobs,
    record_tokens,
    sample,
)

if TYPE_CHECKING:  # the model is imported where a runner is built: serving an exported
    # artifact (jaxmamba.export) runs the engine without importing the model code
    from jaxmamba.model.model import Mamba2HybridLM


class SlotState(NamedTuple):
    """What the sampler keeps per state slot between steps, on device, and the hidden states
    the last step with prefill rows leaves for `score_fn`."""

    last_tokens: jax.Array  # i32[S+1] the slot's last sampled token (fed to its next decode)
    penalties: PenaltyState  # prompt tokens and output counts, [S+1, V]
    # [MAX_PROMPT_LOGPROB_TOKENS, E] model dtype: at the prefill tokens that ask for
    # prompt_logprobs (`prompt_tokens_to_score`), in step order; padding repeats a position
    prompt_hidden: jax.Array


def init_slot_state(cfg: ModelConfig, spec: CacheSpec, dtype) -> SlotState:
    """A runner's first `SlotState` (under `jax.eval_shape`: its shapes)."""
    return SlotState(
        jnp.zeros(spec.num_slots + 1, jnp.int32),
        init_penalty_state(spec.num_slots, cfg.vocab_size),
        jnp.zeros((MAX_PROMPT_LOGPROB_TOKENS, cfg.hidden_size), dtype),
    )


class StepOutput(NamedTuple):
    """What `ModelRunner.step` hands back, on device: the packed samples of every row
    (`pack_sample_output`), and the packed prompt logprobs of the prefill tokens that ask
    for them, in step order (`score_fn`; None when no row asks)."""

    packed: jax.Array  # i32[B, 3 + 2 * MAX_LOGPROBS]
    prompt_scores: jax.Array | None = None  # i32[MAX_PROMPT_LOGPROB_TOKENS, 3 + 2 * MAX_LOGPROBS]


def pack_sample_output(out: SampleOutput) -> jax.Array:
    """One `i32[B, 3 + 2 * MAX_LOGPROBS]` array per step (the one device→host transfer): the
    sampled token, its logprob, its rank, the top token ids and their logprobs; the float
    logprobs are bit-cast to int32, the ids are stored as they are."""
    as_i32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    columns = [out.tokens[:, None], as_i32(out.logprobs)[:, None], out.ranks[:, None]]
    return jnp.concatenate([*columns, out.top_ids, as_i32(out.top_logprobs)], axis=-1)


class HostSample(NamedTuple):
    tokens: np.ndarray  # i32[B]
    logprobs: np.ndarray  # f32[B]
    ranks: np.ndarray  # i32[B] 1-based rank of the sampled token under the raw model
    top_ids: np.ndarray  # i32[B, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[B, MAX_LOGPROBS]


def unpack_sample_output(packed: np.ndarray) -> HostSample:
    ints = np.ascontiguousarray(packed, dtype=np.int32)
    floats = ints.view(np.float32)
    k = MAX_LOGPROBS
    return HostSample(ints[:, 0], floats[:, 1], ints[:, 2], ints[:, 3 : 3 + k], floats[:, 3 + k :])


def _as_is(inputs):
    return inputs


def build_metadata(model: Mamba2HybridLM, spec: CacheSpec, inputs: StepInputs, num_decode: int):
    return ForwardMetadata.build(
        inputs,
        num_decode=num_decode,
        chunk_size=model.cfg.chunk_size,
        page_size=spec.page_size,
        pad_page=spec.pad_page,
        pad_slot=spec.pad_slot,
    )


def _input_ids(inputs: StepInputs, last_tokens: jax.Array, num_decode: int) -> jax.Array:
    if num_decode == 0:
        return inputs.input_ids
    decode_ids = jnp.where(
        inputs.tokens_from_device[:num_decode],
        last_tokens[inputs.state_slots[:num_decode]],
        inputs.input_ids[:num_decode],
    )
    return inputs.input_ids.at[:num_decode].set(decode_ids)


# Traces (= compilations) of the jitted step per (model, cache spec) in this process.
TRACE_COUNTS: Counter = Counter()

# The sampler variants of a step (its static `sampler` argument): FULL samples any mix of
# parameters and returns the top logprobs; PLAIN has neither the cut-off's sort nor the top
# logprobs (zeros), for a decode step where no row filters or asks for them; GREEDY is the
# argmax of the biased logits and the token's logprob, for a decode step of greedy rows
# without penalties where no row asks for logprobs (ranks and top logprobs are zeros) — vLLM's
# all-greedy path. On the 9B model PLAIN's draw, penalties and ranks cost 0.07 ms a decode step
# at batch 1 and 32, 0.29 at 128 and 0.45 at 256 (docs/benchmarks.md, issue 17).
FULL, PLAIN, GREEDY = "full", "plain", "greedy"


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


def step_fn(params, cache: StateCache, slot_state: SlotState, inputs: StepInputs, *, model, spec,
            num_decode, sampler: str = FULL):  # fmt: skip
    """One engine step: forward, sample at each row's last token, remember the samples.

    The packed output has a row per step row. A bucket with prefill rows also keeps the
    hidden states of the prefill tokens that ask for prompt_logprobs (`SlotState.
    prompt_hidden`, for `score_fn`); forks' state copies are `fork_fn`'s."""
    TRACE_COUNTS[(model, spec)] += 1  # runs only while tracing
    if isinstance(inputs, PackedStepInputs):
        inputs = inputs.unpack()
    meta = build_metadata(model, spec, inputs, num_decode)
    input_ids = _input_ids(inputs, slot_state.last_tokens, num_decode)
    hidden, cache = model.apply({"params": params}, input_ids, cache, meta)
    num_rows = inputs.state_slots.shape[0]
    prompt_hidden = slot_state.prompt_hidden
    if inputs.prompt_logprob_targets is not None and num_rows > num_decode:
        positions = prompt_tokens_to_score(inputs.prompt_logprob_targets, num_decode)
        prompt_hidden = hidden[positions].astype(prompt_hidden.dtype)
    logits = model.apply({"params": params}, hidden[meta.last_token_index], method="logits")
    slots = inputs.state_slots
    seen = record_tokens(
        slot_state.penalties, input_ids, meta.token_rows, meta.token_valid, slots,
        inputs.penalty_reset, num_decode=num_decode, pad_slot=spec.pad_slot,
    )  # fmt: skip
    if num_rows > num_decode and inputs.fork_src_slots is not None:
        # n > 1: the forked samples see the prompt as their own from this step on
        src, dst = inputs.fork_src_slots, inputs.fork_dst_slots
        seen = PenaltyState(
            seen.prompt_mask.at[dst].set(seen.prompt_mask[src]),
            seen.output_counts.at[dst].set(seen.output_counts[src]),
        )
    penalties = None
    if sampler != GREEDY:  # the [B, V] gathers: GREEDY steps have no penalised row
        penalties = Penalties(
            seen.prompt_mask[slots], seen.output_counts[slots], inputs.presence_penalty,
            inputs.frequency_penalty, inputs.repetition_penalty,
        )  # fmt: skip
    out = sample(
        logits, inputs.temperature, inputs.top_p, inputs.top_k, inputs.seeds,
        inputs.sample_counters, inputs.min_p, inputs.min_tokens, inputs.stop_ids,
        inputs.logit_bias_ids, inputs.logit_bias_values, penalties,
        cutoff=sampler == FULL, top_logprobs=sampler == FULL, draw=sampler != GREEDY,
        ranks=sampler != GREEDY,
    )  # fmt: skip
    last_tokens = slot_state.last_tokens.at[slots].set(out.tokens)
    return pack_sample_output(out), cache, SlotState(last_tokens, seen, prompt_hidden)


def prompt_tokens_to_score(
    targets: jax.Array,  # i32[T] next prompt token where prompt_logprobs is asked, else -1
    num_decode: int,
) -> jax.Array:
    """i32[MAX_PROMPT_LOGPROB_TOKENS]: the step positions of the prefill tokens that ask for
    prompt_logprobs, in order (the scheduler keeps their count within the width); padding
    repeats the first prefill position. `asked_targets` lists the same tokens' targets."""
    (index,) = jnp.nonzero(targets[num_decode:] >= 0, size=MAX_PROMPT_LOGPROB_TOKENS,
                           fill_value=0)  # fmt: skip
    return num_decode + index


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


def score_fn(params, prompt_hidden: jax.Array, targets: jax.Array, *, model, spec) -> jax.Array:
    """vLLM's prompt logprobs of the tokens a step kept (`SlotState.prompt_hidden`), packed as
    the samples are: `i32[W, 3 + 2 * MAX_LOGPROBS]`, per token its target (the next prompt
    token; -1 for padding), its logprob and rank, and the top ids and logprobs."""
    TRACE_COUNTS[(model, spec)] += 1  # runs only while tracing
    logits = model.apply({"params": params}, prompt_hidden, method="logits")
    p = prompt_logprobs(logits, targets)
    return pack_sample_output(SampleOutput(targets, p.logprobs, p.ranks, p.top_ids,
                                           p.top_logprobs))  # fmt: skip


def fork_fn(cache: StateCache, src_slots, dst_slots, src_pages, dst_pages, *, model=None,
            spec=None) -> StateCache:  # fmt: skip
    """n > 1: copy a prompt's end state into its other samples' slots, and its partial last
    KV page into theirs, after the step that ends the prompt (unused entries: the pad slot
    and page onto themselves). `model` and `spec` only count its compilations."""
    TRACE_COUNTS[(model, spec)] += 1  # runs only while tracing
    copy = lambda pool, src, dst: pool.at[dst].set(pool[src])  # noqa: E731
    return StateCache(
        tuple(copy(c, src_slots, dst_slots) for c in cache.conv),
        tuple(copy(c, src_slots, dst_slots) for c in cache.ssm),
        tuple(copy(k, src_pages, dst_pages) for k in cache.k_pages),
        tuple(copy(v, src_pages, dst_pages) for v in cache.v_pages),
    )


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


def logits_fn(params, cache: StateCache, inputs: StepInputs, *, model, spec, num_decode):
    TRACE_COUNTS[(model, spec)] += 1
    meta = build_metadata(model, spec, inputs, num_decode)
    return model.apply({"params": params}, inputs.input_ids, cache, meta, method="forward_logits")


# Module-level jits with the model and cache spec static: every runner of the same model
# and cache shape (several `LLM`s, tests) shares one compiled executable per bucket.
jitted_step = jax.jit(
    step_fn,
    static_argnames=("model", "spec", "num_decode", "sampler"),
    donate_argnames=("cache", "slot_state"),
)
jitted_logits = jax.jit(
    logits_fn, static_argnames=("model", "spec", "num_decode"), donate_argnames=("cache",)
)
jitted_score = jax.jit(score_fn, static_argnames=("model", "spec"))
jitted_fork = jax.jit(fork_fn, static_argnames=("model", "spec"), donate_argnames=("cache",))


class ModelRunner:
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
    ):
        """`tensor_parallel_size > 1`: the model runs sharded over a mesh of that many
        devices (`mesh`, default the first devices; jaxmamba.parallel); `params` are the
        whole model's, as loaded."""
        from jaxmamba.model.model import Mamba2HybridLM

        self.cfg = cfg
        self.cache_spec = cache_spec
        self.dtype = jnp.dtype(dtype)
        self.tensor_parallel_size = tensor_parallel_size
        slot_state = init_slot_state(cfg, cache_spec, self.dtype)
        # One device: the host arrays go to the jitted step as they are, and its C++ dispatch
        # moves them (~2.5 ms a step less than 29 Python `device_put`s on CPU, where the
        # host's dispatch is what bounds the H200's offline throughput, docs/benchmarks.md).
        self._put_inputs = _as_is
        if tensor_parallel_size == 1 and mesh is None:
            self.model = Mamba2HybridLM(cfg, self.dtype, impl, small_m_impl)
            self.params = params
            self.cache: StateCache = init_cache(cfg, cache_spec, self.dtype)
            self._static = dict(model=self.model, spec=cache_spec)
            self._jit_step, self._jit_logits = jitted_step, jitted_logits
            self._jit_score, self._jit_fork = jitted_score, jitted_fork
        else:
            from jaxmamba.parallel import sharding, step

            mesh_plan = step.mesh_plan(cfg, tensor_parallel_size, mesh)
            plan, replicated = mesh_plan.plan, sharding.replicated(mesh_plan.mesh)
            self.model = Mamba2HybridLM(plan.shard_config(), self.dtype, impl, small_m_impl,
                                        plan.layout())  # fmt: skip
            self.params = sharding.shard_params(plan, params, mesh_plan.mesh)
            self.cache = sharding.init_sharded_cache(plan, cache_spec, self.dtype,
                                                     mesh_plan.mesh)  # fmt: skip
            slot_state = jax.device_put(slot_state, replicated)
            self._put_inputs = functools.partial(jax.device_put, device=replicated)
            self._static = dict(model=self.model, spec=cache_spec, mesh_plan=mesh_plan)
            self._jit_step, self._jit_logits = step.jitted_tp_step, step.jitted_tp_logits
            self._jit_score, self._jit_fork = step.jitted_tp_score, step.jitted_tp_fork
        self.slot_state = slot_state
        # The sampler variants of decode steps (the sharded step has the full one only).
        self.sampler_variants = tensor_parallel_size == 1 and mesh is None and variants_enabled()
        self.variant_steps: Counter = Counter()  # steps dispatched per sampler variant

    @property
    def num_compiles(self) -> int:
        """Compilations of this model+cache shape in this process (shared between runners)."""
        return TRACE_COUNTS[(self.model, self.cache_spec)]

    def _step_fn(self, params, cache, slot_state, inputs, *, num_decode, sampler=FULL):
        """The step body, unjitted (for jaxpr inspection)."""
        return step_fn(params, cache, slot_state, inputs, num_decode=num_decode, sampler=sampler,
                       **self._static)  # fmt: skip

    def forward_logits(self, inputs: StepInputs, num_decode: int) -> jax.Array:
        """Like `step`, but returns float32 logits for every token `[T, V]` (scoring, tests)."""
        with jax.transfer_guard_host_to_device("allow"):  # the inputs, as in `step`
            logits, self.cache = self._jit_logits(
                self.params, self.cache, self._put_inputs(inputs), num_decode=num_decode,
                **self._static,
            )  # fmt: skip
        return logits

    def sampler_variant(self, inputs: StepInputs, num_decode: int, top_logprobs: bool, *,
                        ranks: bool = True) -> str:  # fmt: skip
        """The sampler program `step` runs for these inputs (`choose_sampler`)."""
        if not self.sampler_variants:
            return FULL
        return choose_sampler(inputs, num_decode, top_logprobs, self.cfg.vocab_size,
                              ranks=ranks)  # fmt: skip

    def step(self, inputs: StepInputs, num_decode: int, *, top_logprobs: bool = True,
             ranks: bool = True) -> StepOutput:  # fmt: skip
        """Dispatch one step, and after it `fork_fn` and `score_fn` where some row needs them
        (`asked_forks`, `asked_targets`); returns the device outputs without waiting for them.
        `top_logprobs=False`: no row reads the top logprobs, `ranks=False`: no row reads the
        ranks (no row asks for logprobs); what no row reads may come back as zeros, which lets
        a decode step run a sampler variant."""
        sampler = self.sampler_variant(inputs, num_decode, top_logprobs, ranks=ranks)
        self.variant_steps[sampler] += 1
        kwargs = {} if sampler == FULL else {"sampler": sampler}
        forks = asked_forks(inputs, num_decode, self.cache_spec.pad_slot)
        targets = asked_targets(inputs.prompt_logprob_targets, num_decode)
        with jax.transfer_guard_host_to_device("allow"):  # the step's inputs, and only they
            packed, self.cache, self.slot_state = self._jit_step(
                self.params, self.cache, self.slot_state,
                self._put_inputs(PackedStepInputs.pack(inputs)), num_decode=num_decode,
                **kwargs, **self._static,
            )  # fmt: skip
        return StepOutput(packed, self._side_programs(forks, targets))

    def _side_programs(self, forks: tuple | None, targets: np.ndarray | None):
        """`fork_fn` on `forks` (`fork_inputs`; None: no fork), then `score_fn` on `targets`
        (`asked_targets`; None: no score); returns the scores (or None)."""
        with jax.transfer_guard_host_to_device("allow"):  # their inputs, and only they
            if forks is not None:
                self.cache = self._jit_fork(self.cache, *self._put_inputs(forks), **self._static)
            if targets is None:
                return None
            return self._jit_score(self.params, self.slot_state.prompt_hidden,
                                   self._put_inputs(targets), **self._static)  # fmt: skip

    def step_args(self, inputs: StepInputs, num_decode: int, sampler: str = FULL
                  ) -> tuple[tuple, dict]:  # fmt: skip
        """`(args, kwargs)` of `jitted_step` (or the tensor-parallel `jitted_tp_step`) for
        these inputs, packed as `step` passes them (lowering, export: the FULL sampler, as
        `step` calls it)."""
        kwargs = dict(num_decode=num_decode, **self._static)
        if sampler != FULL:
            kwargs["sampler"] = sampler
        if isinstance(inputs, StepInputs):
            inputs = PackedStepInputs.pack(inputs)
        return (self.params, self.cache, self.slot_state, inputs), kwargs

    def programs(self, buckets) -> list[tuple]:
        """`(bucket, sampler)` of every program `step` can run for these buckets."""
        if not self.sampler_variants:
            return [(b, FULL) for b in buckets]
        return [(b, sampler) for sampler in (FULL, PLAIN, GREEDY) for b in buckets
                if sampler in bucket_samplers(b.num_rows, b.num_decode)]  # fmt: skip

    def precompile(self, buckets, build_inputs, progress=None, workers: int | None = None) -> None:
        """Compile the step of every bucket (and the sampler variants of each decode bucket,
        `programs`), then run each once on padding only. The programs are traced,
        lowered and compiled in `workers` threads (default: one per core, at most 8): XLA's
        compiles release the GIL, so they overlap (tracing does not)."""
        from concurrent.futures import ThreadPoolExecutor

        programs = self.programs(buckets)
        inputs = [
            self._put_inputs(PackedStepInputs.pack(build_inputs(bucket))) for bucket, _ in programs
        ]

        def compile_one(program, x):
            bucket, sampler = program
            args, kwargs = self.step_args(x, bucket.num_decode, sampler)
            self._jit_step.lower(*args, **kwargs).compile()  # fills the jit's own cache

        workers = workers or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for i, _ in enumerate(pool.map(compile_one, programs, inputs)):
                if progress is not None:
                    progress(i + 1, len(programs), programs[i][0])
        host = [build_inputs(bucket) for bucket, _ in programs]  # padding: greedy rows
        for (bucket, sampler), x in zip(programs, host, strict=True):
            jax.block_until_ready(self.step(x, bucket.num_decode, **sampler_flags(sampler)))
        prefill = [b for b in buckets if b.num_rows > b.num_decode]
        if prefill:
            self.run_side_programs(build_inputs(prefill[0]))

    def run_side_programs(self, padding: StepInputs) -> None:
        """Compile and run once `fork_fn` and `score_fn` (what a step with forks or
        prompt_logprobs adds), on a bucket's padding: pad slots onto themselves, no target."""
        jax.block_until_ready(self._side_programs(fork_inputs(padding), padding_targets()))


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
) -> int:
    """Device bytes one step of this bucket needs beyond its arguments: XLA's memory analysis
    of the compiled step (temporaries, and outputs that do not alias a donated input). Only
    shapes are used: nothing is allocated or run. Sharded (`tensor_parallel_size > 1`): one
    device's."""
    if isinstance(inputs, StepInputs):  # as `step` passes them: the same program
        inputs = PackedStepInputs.pack(inputs)
    from jaxmamba.model.model import Mamba2HybridLM

    if tensor_parallel_size > 1:
        from jaxmamba.parallel.step import step_memory

        analysis = step_memory(cfg, tensor_parallel_size, params, spec, inputs, num_decode,
                               dtype=dtype, impl=impl, small_m_impl=small_m_impl)  # fmt: skip
        unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        return int(analysis.temp_size_in_bytes + max(unaliased, 0))

    dtype = jnp.dtype(dtype)
    model = Mamba2HybridLM(cfg, dtype, impl, small_m_impl)
    shapes = jax.eval_shape(lambda: init_slot_state(cfg, spec, dtype))
    args = (params, cache_shapes(cfg, spec, dtype), shapes, inputs)
    compiled = jitted_step.lower(*args, num_decode=num_decode, model=model, spec=spec).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    unaliased = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return int(analysis.temp_size_in_bytes + max(unaliased, 0))
