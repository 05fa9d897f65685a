"""The engine loop: schedule → dispatch → read the previous step's tokens → post-process.

`LLMEngine` is the streaming API (vLLM's names): `add_request(id, prompt, params)`, then
`step()` until `has_unfinished_requests()` is False; each step returns, for every request
that moved, a `RequestOutput` holding only what is new (tokens, incrementally detokenized
text); `abort_request(id)` drops one. `LLM.generate` runs on it.

`step()` dispatches step n+1 before it reads step n's sampled tokens (one packed device→host
read per step), so the device is never idle waiting for Python. Stop tokens and strings are
therefore noticed one step late; the extra step's sample is dropped. Scheduling, building and
dispatching a step is one transaction: if any of it raises, the scheduler's undo log puts
every slot, page, queue and counter back, and the step can be retried.
"""

from __future__ import annotations

import logging
import numbers
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.engine.batch import StepBuilder
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.detokenizer import IncrementalDetokenizer
from jaxmamba.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxmamba.engine.request import Request
from jaxmamba.engine.runner import ModelRunner, StepOutput, unpack_step_output
from jaxmamba.engine.scheduler import ScheduledStep, Scheduler
from jaxmamba.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


def sibling_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (sample 0 uses `seed` itself):
    each of the n samples draws from its own stream."""
    return (seed + index * 0x9E3779B9) & 0x7FFFFFFF


@dataclass
class RequestGroup:
    """One `add_request`: its n sibling sequences and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    # prompt_logprobs so far (None for the first prompt token), handed out with the first
    # output; None when not asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def metrics(self) -> dict[str, float]:
        if len(self.seqs) == 1:
            return self.seqs[0].stats()
        per_seq = [s.stats() for s in self.seqs]
        out = {"num_cached_tokens": per_seq[0]["num_cached_tokens"]}
        for key, pick in (("ttft_s", min), ("e2e_s", max)):
            values = [m[key] for m in per_seq if key in m]
            if values:
                out[key] = pick(values)
        return out


class LLMEngine:
    def __init__(
        self,
        model_cfg: ModelConfig,
        runner: ModelRunner,
        config: EngineConfig,
        tokenizer=None,
        seed: int = 0,
    ):
        self.model_cfg = model_cfg
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(model_cfg, config)
        split = self.scheduler.pool_split()
        logger.info(
            "state slots: %d (%d for running requests, %d for prefix-cache checkpoints)",
            split["state_slots"], split["state_slots_running"], split["state_slots_checkpoints"],
        )  # fmt: skip
        self.builder = StepBuilder(
            runner.cache_spec, config.max_pages_per_seq, model_cfg.vocab_size, model_cfg.chunk_size
        )
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)
        self.stats = EngineStats()
        self._rng = np.random.default_rng(seed)
        self._groups: dict[str, RequestGroup] = {}
        self._inflight: tuple[ScheduledStep, StepOutput] | None = None

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Mapping | Sequence[int],
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request. `prompt`: token ids, a string (tokenized here), or a dict with
        `prompt_token_ids` (and optionally the `prompt` text they came from) or `prompt`.

        `params.n > 1` queues n sibling sequences (seeds from `sibling_seed`): sample 0
        prefills the prompt, and the others are forked off its end state inside the step that
        finishes it (see `Scheduler`), each sampling its first token from the same logits."""
        request_id = str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already running")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._parse_prompt(prompt)
        try:
            self.check_prompt(ids)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from e
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        seqs = [
            Request(request_id, list(ids), params, seed=sibling_seed(seed, i), index=i)
            for i in range(params.n)
        ]
        for sib in seqs[1:]:
            sib.leader = seqs[0]
        detokenizers = [self._detokenizer(params) for _ in seqs]
        group = RequestGroup(request_id, text, list(ids), seqs, detokenizers)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self._groups[request_id] = group
        self.scheduler.waiting.extend(seqs)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (all its samples): its slot and pages are free for the next step.
        An unknown or finished id is ignored, as in vLLM; no further output comes for it."""
        group = self._groups.pop(str(request_id), None)
        if group is None:
            return
        for req in group.seqs:
            if req.finished:
                continue
            req.finish_reason = "abort"
            if any(r is req for r in self.scheduler.waiting):
                self.scheduler.waiting.remove(req)
            else:
                self.scheduler.release(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def _parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, Mapping):
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                return text, _token_ids(prompt["prompt_token_ids"])
            if text is None:
                raise TypeError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, _token_ids(prompt)

    def check_prompt(self, ids: list[int]) -> None:
        """ValueError unless `ids` fit this engine (non-empty, within max_model_len, in vocab)."""
        vocab, limit = self.model_cfg.vocab_size, self.config.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={limit}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt has token ids {bad[:5]} outside the vocab [0, {vocab})")

    def _detokenizer(self, p: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
        )

    # -- warm-up ------------------------------------------------------------------------------
    def precompile(self, show_progress: bool = True) -> int:
        """Compile every bucket now (with the sampler variant of each decode bucket, where the
        runner has it); returns how many programs. Afterwards nothing compiles."""
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
        return len(self.runner.programs(buckets))

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Dispatch the next step, then post-process the previous one; returns the outputs
        (deltas) of the requests that moved."""
        dispatched = self._dispatch()
        outputs = []
        if self._inflight is not None:
            outputs = self._postprocess(*self._inflight)
        elif dispatched is None and self.scheduler.running:
            raise RuntimeError("scheduler made no progress with requests still running")
        self._inflight = dispatched
        return outputs

    def _dispatch(self) -> tuple[ScheduledStep, StepOutput] | None:
        with self.scheduler.transaction():
            scheduled = self.scheduler.schedule()
            if scheduled is None:
                return None
            inputs = self.builder.build(
                scheduled.specs, scheduled.bucket, scheduled.num_decode_rows
            )
            packed = self._step(scheduled, inputs)
        self.scheduler.record_dispatched(scheduled)
        self._count(scheduled)
        return scheduled, packed

    def _step(self, scheduled: ScheduledStep, inputs) -> StepOutput:
        """Dispatch on the runner, telling it whether some row reads the top logprobs
        (logprobs >= 1) or the ranks (logprobs set at all): a decode step that needs neither
        them nor a cut-off may run a sampler without them
        (`jaxmamba.engine.runner.choose_sampler`)."""
        asked = [row.request.params.logprobs for row in scheduled.rows]
        return self.runner.step(inputs, scheduled.bucket.num_decode,
                                top_logprobs=any(asked),
                                ranks=any(k is not None for k in asked))  # fmt: skip

    def _count(self, step: ScheduledStep) -> None:
        st = self.stats
        st.steps += 1
        nd = step.num_decode_rows
        st.decode_tokens += nd
        st.prefill_tokens += sum(len(r.spec.tokens) for r in step.rows[nd:])
        kind = "decode" if nd == len(step.rows) else ("mixed" if nd else "prefill")
        st.step_kinds[kind] += 1

    def _postprocess(self, step: ScheduledStep, out: StepOutput) -> list[RequestOutput]:
        sampled, scored = unpack_step_output(jax.device_get(out))  # the one read per step
        tokens, logprobs = sampled.tokens.tolist(), sampled.logprobs.tolist()
        scored_offset = 0  # of the row's first scored token among the step's scored tokens
        self.stats.device_reads += 1
        now = time.perf_counter()
        deltas: dict[str, list[CompletionOutput]] = {}
        num_decode = step.num_decode_rows
        for i, row in enumerate(step.rows):
            req = row.request
            if row.checkpoints:
                for slot, length in row.output_checkpoints:
                    if req.finished:
                        self.scheduler.drop_checkpoint(req, slot)
                    else:
                        self.scheduler.record_checkpoint(req, length, slot)
            targets = row.spec.prompt_logprob_targets
            if i >= num_decode and targets:
                targets = targets[: len(row.spec.tokens)]  # as the step builder writes them
                if not req.finished:
                    self._prompt_logprobs(req, targets, scored, scored_offset)
                scored_offset += len(targets)
            if req.finished or not row.samples:  # finished, or mid-prompt
                continue
            i = i if i < num_decode else step.output_row(i)
            token, logprob = tokens[i], logprobs[i]
            req.output_token_ids.append(token)
            req.cumulative_logprob += logprob
            if req.first_token_time is None:
                req.first_token_time = now
            top = None
            if req.params.logprobs is not None:
                top = self._logprobs(sampled, i, token, logprob, req.params.logprobs)
                req.output_logprobs.append(top)
            deltas.setdefault(req.request_id, []).append(self._advance(req, token, top, now))
        outputs = []
        for request_id, completions in deltas.items():
            group = self._groups[request_id]
            finished = group.finished
            if finished:
                del self._groups[request_id]
            if len(completions) > 1:
                completions.sort(key=lambda c: c.index)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=group.prompt,
                    prompt_token_ids=group.prompt_token_ids,
                    outputs=completions,
                    finished=finished,
                    num_cached_tokens=group.seqs[0].num_cached_tokens,
                    metrics=group.metrics(),
                    prompt_logprobs=group.prompt_logprobs,
                )
            )
            group.prompt_logprobs = None  # complete with the first output, handed out once
        return outputs

    def _advance(self, req: Request, token: int, top, now: float) -> CompletionOutput:
        """Detokenize the new token, check every stop condition; the sequence's delta."""
        reason, stop_reason = self._finish_reason(req, token)
        detok = self._groups[req.request_id].detokenizers[req.index]
        text = None
        if detok is not None:
            stop_string = detok.update([token], stopped_on_token=reason == "stop")
            if stop_string is not None:
                reason, stop_reason = "stop", stop_string
            elif reason is not None:
                detok.flush()
            text = detok.take_delta(finished=reason is not None)
        if reason is not None:
            req.finish_reason, req.stop_reason, req.finish_time = reason, stop_reason, now
            self.scheduler.release(req)
            self.stats.finished_requests += 1
        return CompletionOutput(
            index=req.index,
            text=text,
            token_ids=[token],
            cumulative_logprob=req.cumulative_logprob,
            logprobs=None if top is None else [top],
            finish_reason=reason,
            stop_reason=stop_reason,
        )

    def _logprobs(self, sampled, i: int, token: int, logprob: float, k: int) -> dict:
        """vLLM's layout: the sampled (or prompt) token first, then the top-k (rank 1 = most
        likely); a token in both keeps its place and takes its top-k rank, as vLLM's dict
        does. decoded_token: each token decoded alone with the tokenizer's default
        skip_special_tokens=False (vLLM's convert_ids_list_to_tokens), so specials show."""
        decode = self._token_text
        ids, values = sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist()
        top = {token: Logprob(logprob, int(sampled.ranks[i]), decode(token))}
        for rank, (t, v) in enumerate(zip(ids, values, strict=True), start=1):
            top[t] = Logprob(v, rank, top[t].decoded_token if t in top else decode(t))
        return top

    def _prompt_logprobs(self, req: Request, targets: list[int], scored, offset: int) -> None:
        """Add the prompt logprobs of a prefill chunk's tokens (scored rows from `offset`)."""
        logprobs = self._groups[req.request_id].prompt_logprobs
        k = req.params.prompt_logprobs
        for j, target in enumerate(targets):
            r = offset + j
            logprobs.append(self._logprobs(scored, r, target, float(scored.logprobs[r]), k))

    def _token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _finish_reason(self, req: Request, token: int) -> tuple[str | None, int | None]:
        p = req.params
        n = len(req.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and n >= p.max_tokens:
            return "length", None
        if req.prompt_len + n >= self.config.max_model_len:  # without building all_token_ids
            return "length", None
        return None, None

    def abort_all(self) -> None:
        """Drop every request and return its resources (after an error, or on shutdown)."""
        if self._inflight is not None:
            jax.block_until_ready(self._inflight[1])
            for row in self._inflight[0].rows:
                for slot, _ in row.output_checkpoints:
                    self.scheduler.drop_checkpoint(row.request, slot)
            self._inflight = None
        for req in list(self.scheduler.running):
            req.finish_reason = req.finish_reason or "abort"
            self.scheduler.release(req)
        for req in self.scheduler.waiting:
            req.finish_reason = req.finish_reason or "abort"
        self.scheduler.waiting.clear()
        self._groups.clear()

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
            "forked_samples": s.forked_samples,
            **{f"{k}_steps": v for k, v in st.step_kinds.items()},
        }
        out.update(self.scheduler.pool_split())
        if cache is not None:
            out["prefix_cache_nodes"] = cache.num_nodes
            out["prefix_cache_hit_rate"] = cache.hit_tokens / max(cache.query_tokens, 1)
            out["prefix_cache_checkpoint_slots_in_use"] = cache.num_checkpoints
            out["prefix_cache_held_requests"] = s.held_admissions
            out.update({f"prefix_cache_{k}": v for k, v in cache.stats.items()})
        return out


def _token_ids(ids) -> list[int]:
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"token ids must be a 1-D integer array, got {ids.dtype}{ids.shape}")
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"a prompt must be a str, a dict or token ids, got {type(ids).__name__}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"token ids must be ints, got {t!r} ({type(t).__name__})")
    return [int(t) for t in ids]
