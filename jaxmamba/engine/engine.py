"""A small generation engine: admit requests into slots, prefill (chunked), then decode.

Host bookkeeping only; `ModelRunner` is the one that touches the device. Each step is one
jitted call over a bucketed batch, and reads back one packed array of sampled tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import jax

from jaxmamba.config import ModelConfig
from jaxmamba.engine.allocator import BlockAllocator
from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder, pow2_buckets, smallest_fitting
from jaxmamba.engine.runner import ModelRunner, unpack_sample_output


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names). `temperature=0` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        from jaxmamba.model.sampling import MAX_LOGPROBS

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed: int = 0  # tokens whose state is in the cache
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    page_size: int = 16

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


class Engine:
    def __init__(self, cfg: ModelConfig, runner: ModelRunner, config: EngineConfig):
        self.cfg = cfg
        self.runner = runner
        self.config = config
        spec = runner.cache_spec
        self.slots = BlockAllocator(spec.num_slots, "state slot")
        self.pages = BlockAllocator(spec.num_pages, "KV page")
        self.builder = StepBuilder(spec, config.max_pages_per_seq, cfg.vocab_size, cfg.chunk_size)
        self.row_buckets = pow2_buckets(config.max_num_seqs)
        self.token_buckets = pow2_buckets(config.max_num_batched_tokens, start=16)
        self.eos_token_id = cfg.eos_token_id
        self.num_steps = 0

    # -- host bookkeeping -------------------------------------------------------------------
    def _admit(self, req: Request) -> None:
        req.slot = self.slots.allocate(1)[0]

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.slots.free([req.slot])
            req.slot = None
        self.pages.free(req.pages)
        req.pages = []

    def _reserve_pages(self, req: Request, length: int) -> None:
        need = -(-length // self.config.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.pages.allocate(need))

    def _row(self, req: Request, tokens: list[int]) -> RowSpec:
        p = req.params
        self._reserve_pages(req, req.num_computed + len(tokens))
        return RowSpec(
            tokens=tokens,
            prefix_len=req.num_computed,
            state_slot=req.slot,
            pages=req.pages,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=req.seed,
            sample_counter=len(req.output_token_ids),
        )

    def _schedule(self, running: list[Request]) -> tuple[list[Request], list[RowSpec], Bucket]:
        prefilling = [r for r in running if r.in_prefill]
        if prefilling:
            budget = self.config.max_num_batched_tokens
            reqs, rows = [], []
            for req in prefilling:
                if budget == 0:
                    break
                chunk = req.prompt_token_ids[req.num_computed : req.num_computed + budget]
                budget -= len(chunk)
                reqs.append(req)
                rows.append(self._row(req, chunk))
            num_tokens = sum(len(r.tokens) for r in rows)
            bucket = Bucket(
                smallest_fitting(self.token_buckets, num_tokens, "prefill tokens"),
                smallest_fitting(self.row_buckets, len(rows), "rows"),
            )
            return reqs, rows, bucket
        rows = [self._row(req, [req.all_token_ids[-1]]) for req in running]
        b = smallest_fitting(self.row_buckets, len(rows), "rows")
        return running, rows, Bucket(b, b, b)

    def _postprocess(self, reqs: list[Request], rows: list[RowSpec], sampled) -> None:
        now = time.perf_counter()
        for i, (req, row) in enumerate(zip(reqs, rows, strict=True)):
            req.num_computed += len(row.tokens)
            if req.in_prefill:
                continue  # a prompt chunk that did not reach the end: its sample is unused
            token = int(sampled.tokens[i])
            req.output_token_ids.append(token)
            req.cumulative_logprob += float(sampled.logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            k = req.params.logprobs
            if k is not None:
                top = {
                    int(t): float(v)
                    for t, v in zip(
                        sampled.top_ids[i, :k], sampled.top_logprobs[i, :k], strict=True
                    )
                }
                top[token] = float(sampled.logprobs[i])
                req.output_logprobs.append(top)
            req.finish_reason = self._finish_reason(req, token)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        if len(req.all_token_ids) >= self.config.max_model_len:
            return "length"
        return None

    # -- the loop ---------------------------------------------------------------------------
    def run(self, requests: list[Request], progress=None) -> list[Request]:
        waiting = deque(requests)
        running: list[Request] = []
        try:
            while waiting or running:
                while waiting and len(running) < self.config.max_num_seqs and self.slots.num_free:
                    req = waiting.popleft()
                    self._admit(req)
                    running.append(req)
                reqs, rows, bucket = self._schedule(running)
                inputs = self.builder.build(rows, bucket)
                packed = self.runner.step(inputs, bucket.num_decode)
                sampled = unpack_sample_output(jax.device_get(packed))
                self.num_steps += 1
                self._postprocess(reqs, rows, sampled)
                for req in [r for r in running if r.finish_reason is not None]:
                    running.remove(req)
                    self._release(req)
                    if progress is not None:
                        progress(req)
        finally:
            for req in running:
                self._release(req)
        return requests
