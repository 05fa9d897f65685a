"""The engine loop: schedule → dispatch → read the previous step's tokens → post-process.

`LLMEngine.step()` dispatches step n+1 before it reads step n's sampled tokens (one packed
device→host read per step), so the device is never idle waiting for Python. Stop tokens are
therefore noticed one step late; the extra step's sample is dropped.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import jax

from jaxmamba.config import ModelConfig
from jaxmamba.engine.batch import StepBuilder
from jaxmamba.engine.request import Request
from jaxmamba.engine.runner import ModelRunner, unpack_sample_output
from jaxmamba.engine.scheduler import EngineConfig, ScheduledStep, Scheduler


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished_requests: int = 0
    device_reads: int = 0
    step_kinds: dict[str, int] = field(
        default_factory=lambda: {"decode": 0, "prefill": 0, "mixed": 0}
    )


class LLMEngine:
    def __init__(self, model_cfg: ModelConfig, runner: ModelRunner, config: EngineConfig):
        self.model_cfg = model_cfg
        self.runner = runner
        self.config = config
        self.scheduler = Scheduler(model_cfg, config)
        self.builder = StepBuilder(
            runner.cache_spec, config.max_pages_per_seq, model_cfg.vocab_size, model_cfg.chunk_size
        )
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)
        self.stats = EngineStats()
        self._inflight: tuple[ScheduledStep, jax.Array] | None = None

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.scheduler.waiting.append(req)

    def has_unfinished(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self._inflight)

    # -- warm-up ------------------------------------------------------------------------------
    def precompile(self, show_progress: bool = True) -> int:
        """Compile every bucket now; returns how many. Afterwards nothing compiles."""
        buckets = self.scheduler.all_buckets()
        start = time.perf_counter()

        def progress(i, n, bucket):
            if show_progress:
                width = 30
                bar = "#" * (width * i // n) + "-" * (width - width * i // n)
                sys.stderr.write(
                    f"\rprecompiling [{bar}] {i}/{n} buckets "
                    f"({time.perf_counter() - start:.0f} s, last T={bucket.num_tokens} "
                    f"B={bucket.num_rows} decode={bucket.num_decode})"
                )
                if i == n:
                    sys.stderr.write("\n")
                sys.stderr.flush()

        self.runner.precompile(buckets, self.builder.padding, progress)
        return len(buckets)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Dispatch the next step, then post-process the previous one; returns finished requests."""
        scheduled = self.scheduler.schedule()
        dispatched = None
        if scheduled is not None:
            inputs = self.builder.build(
                scheduled.specs, scheduled.bucket, scheduled.num_decode_rows
            )
            dispatched = (scheduled, self.runner.step(inputs, scheduled.bucket.num_decode))
            self._count(scheduled)
        finished = []
        if self._inflight is not None:
            finished = self._postprocess(*self._inflight)
        elif dispatched is None and self.scheduler.running:
            raise RuntimeError("scheduler made no progress with requests still running")
        self._inflight = dispatched
        return finished

    def _count(self, step: ScheduledStep) -> None:
        st = self.stats
        st.steps += 1
        nd = step.num_decode_rows
        st.decode_tokens += nd
        st.prefill_tokens += sum(len(r.spec.tokens) for r in step.rows[nd:])
        kind = "decode" if nd == len(step.rows) else ("mixed" if nd else "prefill")
        st.step_kinds[kind] += 1

    def _postprocess(self, step: ScheduledStep, packed: jax.Array) -> list[Request]:
        sampled = unpack_sample_output(jax.device_get(packed))  # the one read per step
        self.stats.device_reads += 1
        now = time.perf_counter()
        finished = []
        for i, row in enumerate(step.rows):
            req = row.request
            track_slot = row.spec.track_slot if row.track_len else None
            if req.finished:
                if track_slot is not None:
                    self.scheduler.slots.free([track_slot])
                continue
            if track_slot is not None:
                self.scheduler.record_checkpoint(req, row.track_len, track_slot)
            if not row.samples:
                continue
            i = step.output_row(i)
            token = int(sampled.tokens[i])
            req.output_token_ids.append(token)
            req.cumulative_logprob += float(sampled.logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            k = req.params.logprobs
            if k is not None:
                ids, values = sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist()
                top = dict(zip(ids, values, strict=True))
                top[token] = float(sampled.logprobs[i])
                req.output_logprobs.append(top)
            req.finish_reason = self._finish_reason(req, token)
            if req.finished:
                req.finish_time = now
                self.scheduler.release(req)
                self.stats.finished_requests += 1
                finished.append(req)
        return finished

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        if len(req.all_token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def run(self, requests: list[Request]) -> list[Request]:
        """Add `requests` and step until every one has finished."""
        for req in requests:
            self.add_request(req)
        try:
            while self.has_unfinished():
                self.step()
        except BaseException:
            self.abort_all()
            raise
        return requests

    def abort_all(self) -> None:
        """Drop every request and return its resources (after an error, or on shutdown)."""
        if self._inflight is not None:
            jax.block_until_ready(self._inflight[1])
            for row in self._inflight[0].rows:
                if row.track_len and row.spec.track_slot is not None:
                    self.scheduler.slots.free([row.spec.track_slot])
            self._inflight = None
        for req in list(self.scheduler.running):
            req.finish_reason = req.finish_reason or "abort"
            self.scheduler.release(req)
        self.scheduler.waiting.clear()

    def counters(self) -> dict[str, float]:
        s, st = self.scheduler, self.stats
        cache = s.prefix_cache
        out = {
            "steps": st.steps,
            "prefill_tokens": st.prefill_tokens,
            "decode_tokens": st.decode_tokens,
            "device_reads": st.device_reads,
            "finished_requests": st.finished_requests,
            "compilations": self.runner.num_compiles,
            "free_slots": s.slots.num_free,
            "free_pages": s.pages.num_free,
            **{f"{k}_steps": v for k, v in st.step_kinds.items()},
        }
        if cache is not None:
            out["prefix_cache_nodes"] = cache.num_nodes
            out["prefix_cache_hit_rate"] = cache.hit_tokens / max(cache.query_tokens, 1)
        return out
