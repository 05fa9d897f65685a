"""The user-facing generation API, shaped like vLLM's `LLM`.

from jaxmamba import LLM, SamplingParams
llm = LLM("nemotron-h-tiny", max_num_seqs=8)
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig, checkpoint_dir
from jaxmamba.engine.engine import LLMEngine
from jaxmamba.engine.request import Request, SamplingParams
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.engine.scheduler import EngineConfig
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.params import init_params, param_shapes
from jaxmamba.tokenizer import load_tokenizer

DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}


@dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def load_params(model: str, cfg: ModelConfig, dtype, seed: int):
    """An HF checkpoint (a directory or a checkpoint preset) → its weights; a YAML preset or
    file → random weights from `seed`."""
    path = checkpoint_dir(model)
    if path is not None:
        from jaxmamba.model.loader import load_hf_checkpoint

        return load_hf_checkpoint(path, cfg, dtype=dtype, expected=param_shapes(cfg, dtype))
    return init_params(cfg, dtype, seed)


class LLM:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        max_num_seqs: int = 8,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 512,
        max_prefill_seqs: int = 8,
        page_size: int = 16,
        enable_prefix_caching: bool = True,
        track_interval: int = 256,
        num_state_slots: int | None = None,
        num_pages: int | None = None,
        precompile: bool = False,
        seed: int = 0,
        impl: str = "auto",
        params=None,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.model_cfg = ModelConfig.load(model)
        self.dtype = DTYPES[dtype]
        self.engine_cfg = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_seqs=max_prefill_seqs,
            page_size=page_size,
            enable_prefix_caching=enable_prefix_caching,
            track_interval=track_interval,
            num_state_slots=num_state_slots,
            num_pages=num_pages,
        )
        if params is None:
            params = load_params(model, self.model_cfg, self.dtype, seed)
        spec = CacheSpec(
            num_slots=self.engine_cfg.state_slots,
            num_pages=self.engine_cfg.pages,
            page_size=page_size,
        )
        self.runner = ModelRunner(self.model_cfg, params, spec, dtype=self.dtype, impl=impl)
        self.engine = LLMEngine(self.model_cfg, self.runner, self.engine_cfg)
        if precompile:
            self.engine.precompile()
        self.tokenizer = load_tokenizer(model, self.model_cfg)
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()

    def _prompt_ids(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
            return list(prompts), [self.tokenizer.encode(p) for p in prompts]
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        ids = [[int(t) for t in p] for p in prompt_token_ids]
        return [None] * len(ids), ids

    def _validate(self, i: int, ids: list[int]) -> None:
        vocab, limit = self.model_cfg.vocab_size, self.engine_cfg.max_model_len
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) > limit:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_model_len={limit}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocab [0, {vocab})")

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order."""
        texts, ids = self._prompt_ids(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(ids)
        if len(sampling_params) != len(ids):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(ids)} prompts")
        for i, p in enumerate(ids):
            self._validate(i, p)
        requests = [
            Request(
                request_id=next(self._ids),
                prompt_token_ids=p,
                params=sp,
                seed=sp.seed if sp.seed is not None else int(self._rng.integers(0, 2**31 - 1)),
            )
            for p, sp in zip(ids, sampling_params, strict=True)
        ]
        self.engine.run(requests)
        return [self._output(text, req) for text, req in zip(texts, requests, strict=True)]

    def _output(self, prompt: str | None, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob,
            logprobs=req.output_logprobs if req.params.logprobs is not None else None,
            finish_reason=req.finish_reason,
        )
        return RequestOutput(
            request_id=str(req.request_id),
            prompt=prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.stats(),
        )

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running request uses."""
        cache = self.engine.scheduler.prefix_cache
        if cache is not None:
            cache.reset()

    def stats(self) -> dict[str, float]:
        """Engine counters: steps, tokens, device reads, compilations, free slots/pages, hits."""
        return self.engine.counters()
