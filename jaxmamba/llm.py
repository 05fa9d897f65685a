"""The user-facing generation API, shaped like vLLM's `LLM`.

from jaxmamba import LLM, SamplingParams
llm = LLM("nemotron-h-tiny", max_num_seqs=8)
out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.engine.engine import Engine, EngineConfig, Request, SamplingParams
from jaxmamba.engine.runner import ModelRunner
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
    """HF checkpoint directory → its weights; a preset or YAML → random weights from `seed`."""
    path = Path(model)
    if path.is_dir():
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
        page_size: int = 16,
        seed: int = 0,
        impl: str = "auto",
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.model_cfg = ModelConfig.load(model)
        self.dtype = DTYPES[dtype]
        self.engine_cfg = EngineConfig(
            max_num_seqs, max_model_len, max_num_batched_tokens, page_size
        )
        params = load_params(model, self.model_cfg, self.dtype, seed)
        spec = CacheSpec(
            num_slots=max_num_seqs, num_pages=max_num_seqs * self.engine_cfg.max_pages_per_seq,
            page_size=page_size,
        )  # fmt: skip
        self.runner = ModelRunner(self.model_cfg, params, spec, dtype=self.dtype, impl=impl)
        self.engine = Engine(self.model_cfg, self.runner, self.engine_cfg)
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
        metrics = {}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
            metrics["e2e_s"] = time.perf_counter() - req.arrival_time
        return RequestOutput(
            request_id=str(req.request_id),
            prompt=prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            metrics=metrics,
        )
