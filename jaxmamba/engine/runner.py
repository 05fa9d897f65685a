"""The model runner: the only part of the engine that touches the device.

It owns the parameters and the cache, and runs one jitted step per call:
`step(params, cache, inputs) -> (packed sample output, cache)`, donating the cache. The
static shape of a step is its bucket `(num_tokens, num_rows, num_decode)`; each bucket
compiles once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.model.cache import CacheSpec, StateCache, init_cache
from jaxmamba.model.metadata import ForwardMetadata, StepInputs
from jaxmamba.model.model import Mamba2HybridLM
from jaxmamba.model.sampling import MAX_LOGPROBS, SampleOutput, sample

# Packed per-row output of a step (one device→host transfer): the sampled token, its
# logprob, the top token ids and their logprobs; ids are bit-cast into the float32 row.
PACKED_WIDTH = 2 + 2 * MAX_LOGPROBS


def pack_sample_output(out: SampleOutput) -> jax.Array:
    as_f32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.float32)  # noqa: E731
    return jnp.concatenate(
        [as_f32(out.tokens)[:, None], out.logprobs[:, None], as_f32(out.top_ids), out.top_logprobs],
        axis=-1,
    )


class HostSample(NamedTuple):
    tokens: np.ndarray  # i32[B]
    logprobs: np.ndarray  # f32[B]
    top_ids: np.ndarray  # i32[B, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[B, MAX_LOGPROBS]


def unpack_sample_output(packed: np.ndarray) -> HostSample:
    packed = np.ascontiguousarray(packed, dtype=np.float32)
    ints = packed.view(np.int32)
    k = MAX_LOGPROBS
    return HostSample(ints[:, 0], packed[:, 1], ints[:, 2 : 2 + k], packed[:, 2 + k : 2 + 2 * k])


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        params,
        cache_spec: CacheSpec,
        *,
        dtype=jnp.float32,
        impl: str = "auto",
    ):
        self.cfg = cfg
        self.params = params
        self.cache_spec = cache_spec
        self.dtype = jnp.dtype(dtype)
        self.model = Mamba2HybridLM(cfg, self.dtype, impl)
        self.cache: StateCache = init_cache(cfg, cache_spec, self.dtype)
        self.last_tokens = jnp.zeros(cache_spec.num_slots + 1, jnp.int32)
        self.num_compiles = 0
        self._step = jax.jit(
            self._step_fn,
            static_argnames=("num_decode",),
            donate_argnames=("cache", "last_tokens"),
        )
        self._forward_logits = jax.jit(
            self._logits_fn, static_argnames=("num_decode",), donate_argnames=("cache",)
        )

    def build_metadata(self, inputs: StepInputs, num_decode: int) -> ForwardMetadata:
        return ForwardMetadata.build(
            inputs,
            num_decode=num_decode,
            chunk_size=self.cfg.chunk_size,
            page_size=self.cache_spec.page_size,
            pad_page=self.cache_spec.pad_page,
            pad_slot=self.cache_spec.pad_slot,
        )

    @staticmethod
    def _input_ids(inputs: StepInputs, last_tokens: jax.Array, num_decode: int) -> jax.Array:
        if num_decode == 0:
            return inputs.input_ids
        decode_ids = jnp.where(
            inputs.tokens_from_device[:num_decode],
            last_tokens[inputs.state_slots[:num_decode]],
            inputs.input_ids[:num_decode],
        )
        return inputs.input_ids.at[:num_decode].set(decode_ids)

    def _step_fn(self, params, cache: StateCache, last_tokens, inputs: StepInputs, *, num_decode):
        self.num_compiles += 1  # runs only while tracing, i.e. once per compiled bucket
        meta = self.build_metadata(inputs, num_decode)
        input_ids = self._input_ids(inputs, last_tokens, num_decode)
        hidden, cache = self.model.apply({"params": params}, input_ids, cache, meta)
        logits = self.model.apply(
            {"params": params}, hidden[meta.last_token_index], method=Mamba2HybridLM.logits
        )
        out = sample(
            logits,
            inputs.temperature,
            inputs.top_p,
            inputs.top_k,
            inputs.seeds,
            inputs.sample_counters,
        )
        last_tokens = last_tokens.at[inputs.state_slots].set(out.tokens)
        return pack_sample_output(out), cache, last_tokens

    def _logits_fn(self, params, cache: StateCache, inputs: StepInputs, *, num_decode: int):
        self.num_compiles += 1
        meta = self.build_metadata(inputs, num_decode)
        return self.model.apply(
            {"params": params}, inputs.input_ids, cache, meta, method=Mamba2HybridLM.forward_logits
        )

    def forward_logits(self, inputs: StepInputs, num_decode: int) -> jax.Array:
        """Like `step`, but returns float32 logits for every token `[T, V]` (scoring, tests)."""
        logits, self.cache = self._forward_logits(
            self.params, self.cache, jax.device_put(inputs), num_decode=num_decode
        )
        return logits

    def step(self, inputs: StepInputs, num_decode: int) -> jax.Array:
        """Dispatch one step; returns the packed device output without waiting for it."""
        packed, self.cache, self.last_tokens = self._step(
            self.params, self.cache, self.last_tokens, jax.device_put(inputs), num_decode=num_decode
        )
        return packed

    def lower_step(self, inputs: StepInputs, num_decode: int):
        """The step lowered for these shapes (for jaxpr/HLO inspection and export)."""
        return self._step.lower(
            self.params, self.cache, self.last_tokens, inputs, num_decode=num_decode
        )

    def precompile(self, buckets, build_inputs, progress=None) -> None:
        """Compile (and run once, on padding only) the step of every bucket."""
        for i, bucket in enumerate(buckets):
            jax.block_until_ready(self.step(build_inputs(bucket), bucket.num_decode))
            if progress is not None:
                progress(i + 1, len(buckets), bucket)
