"""The engine loop: schedule → dispatch → read the previous step's tokens → post-process.

`LLMEngine` is the streaming API (vLLM's names): `add_request(id, prompt, params)`, then
`step()` until `has_unfinished_requests()` is False; each step returns, for every request
that moved, a `RequestOutput` holding only what is new (tokens, incrementally detokenized
text); `abort_request(id)` drops one. `LLM.generate` runs on it.

`step()` dispatches step n+1 before it reads step n's sampled tokens (one packed device→host
read per step), so the device is never idle waiting for Python. Stop tokens and strings are
therefore noticed one step late; the extra step's sample is dropped.

Structured outputs (docs/structured_outputs.md): a constrained request's grammar compiles on
a background thread (`compile_grammar`) while the request waits in the queue; then each of its
samples gets a `GrammarMatcher`, whose bitmask of the tokens allowed next goes into every step
that samples for it. That bitmask needs the token the previous step sampled, so when the step
in flight samples for a constrained row, `step()` reads it before it builds the next one (the
device idles meanwhile); steps without constrained rows keep the overlap. A sample finishes
with "stop" once its grammar is complete (its matcher accepted a stop token, or allows nothing
else: the output is whole, even with ignore_eos), "length" at max_tokens, and "error" if the
grammar hits a dead end.

A step that fails loses nothing else (`_fail_step`): the requests it carried end with
`finish_reason="error"` and `RequestOutput.error` saying why (vLLM's `FinishReason.ERROR`), and
the engine goes on. Scheduling, building and dispatching a step is one transaction: if any of
it raises, the scheduler's undo log first puts every slot, page, queue and counter back.
Whether the device state survived decides the rest. The step donates the runner's cache and
slot state, so the engine then asks the runner whether they are still its own and undeleted.
If they are (the failure came before the device took them), only the carried requests end,
their slots and pages free, and every other request goes on. If not, or when reading a step's
tokens back raises (every later step continued from that one's state), every request whose
state was on the device ends, the runner re-creates its state (the compiled programs stay),
the prefix cache forgets its checkpoints, and the waiting requests prefill from scratch. A
failure that no request carried (`schedule()` raising before it began to schedule any)
propagates with the scheduler as it was, and the step can be retried.
"""

from __future__ import annotations

import logging
import numbers
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxmamba.config import ModelConfig
from jaxmamba.engine.batch import StepBuilder
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.detokenizer import IncrementalDetokenizer
from jaxmamba.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxmamba.engine.request import Request
from jaxmamba.engine.runner import (
    ModelRunner,
    StepOutput,
    program_name,
    unpack_step_output,
    unpack_verify_output,
)
from jaxmamba.engine.scheduler import ScheduledStep, Scheduler
from jaxmamba.sampling_params import SamplingParams
from jaxmamba.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished_requests: int = 0
    device_reads: int = 0
    failed_steps: int = 0
    failed_requests: int = 0  # requests a failed step ended (finish_reason "error")
    step_kinds: dict[str, int] = field(
        default_factory=lambda: {"decode": 0, "prefill": 0, "mixed": 0}
    )
    # Speculative decoding: verify steps; per draft position, rows that proposed a draft
    # there and rows that accepted it (read back with each verify step's output).
    verify_steps: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


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
    # why a sample ended with finish_reason "error" (its grammar failed), handed out with it
    error: str | None = None

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


class _DispatchFailed(Exception):
    """Scheduling, building or dispatching a step raised `cause` (the scheduler rolled back):
    `carried`, the requests that step carried; `state_lost`, whether the dispatch consumed the
    runner's device state."""

    def __init__(self, cause: Exception, carried: list[Request], state_lost: bool):
        super().__init__(cause)
        self.cause, self.carried, self.state_lost = cause, carried, state_lost


def compile_progress(what: str):
    """A `progress(done, total, program)` callback for `StepRunner.compile_programs` that
    draws a bar on stderr: tqdm's where it is installed, else a line of its own."""
    start = time.perf_counter()
    bar = None

    def progress(done: int, total: int, program: tuple) -> None:
        nonlocal bar
        last = program_name(program)
        if bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                bar = False
            else:
                bar = tqdm(total=total, desc=what, unit="program", dynamic_ncols=True)
        if bar:
            bar.set_postfix_str(last, refresh=False)
            bar.update(1)
            if done == total:
                bar.close()
            return
        width = 30
        drawn = "#" * (width * done // total) + "-" * (width - width * done // total)
        sys.stderr.write(f"\r{what} [{drawn}] {done}/{total} programs "
                         f"({time.perf_counter() - start:.0f} s, last {last})")  # fmt: skip
        sys.stderr.write("\n" if done == total else "")
        sys.stderr.flush()

    return progress


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
        spec = config.speculative_config
        if spec is not None and runner.speculative is None:
            raise ValueError(
                f"speculative_config={spec}: this engine's {type(runner).__name__} has no verify "
                "programs (an artifact exported without a speculative_config holds none)"
            )
        if spec is not None and runner.speculative.num_tokens != spec.num_speculative_tokens:
            raise ValueError(f"speculative_config {spec} but the runner speculates "
                             f"{runner.speculative}")  # fmt: skip
        self.scheduler = Scheduler(model_cfg, config)
        split = self.scheduler.pool_split()
        logger.info(
            "state slots: %d (%d for running requests, %d for prefix-cache checkpoints)",
            split["state_slots"], split["state_slots_running"], split["state_slots_checkpoints"],
        )  # fmt: skip
        self.builder = StepBuilder(
            runner.cache_spec, config.max_pages_per_seq, model_cfg.vocab_size,
            model_cfg.chunk_size, speculative=spec is not None,
        )  # fmt: skip

        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)
        self.stats = EngineStats()
        if spec is not None:
            self.stats.drafted = [0] * spec.num_speculative_tokens
            self.stats.accepted = [0] * spec.num_speculative_tokens
        self._rng = np.random.default_rng(seed)
        self._groups: dict[str, RequestGroup] = {}
        self._inflight: tuple[ScheduledStep, StepOutput] | None = None
        self._grammars = None  # the GrammarCompiler, made for the first constrained request
        self._compiling: list[Request] = []  # requests whose grammar is not compiled yet
        self._undelivered: list[RequestOutput] = []  # outputs of a step() that raised

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
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.compile_grammar(params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"request {request_id!r}: {e}") from e
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        seqs = [
            Request(request_id, list(ids), params, seed=sibling_seed(seed, i), index=i)
            for i in range(params.n)
        ]
        for sib in seqs[1:]:
            sib.leader = seqs[0]
        if grammar is not None:
            for seq in seqs:
                seq.grammar = grammar
            self._compiling.extend(seqs)
        detokenizers = [self._detokenizer(params) for _ in seqs]
        group = RequestGroup(request_id, text, list(ids), seqs, detokenizers)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self._groups[request_id] = group
        self.scheduler.waiting.extend(seqs)

    def compile_grammar(self, constraint: StructuredOutputsParams) -> Future:
        """Start compiling a structured-output constraint for this model (once per constraint:
        the compiled grammars are cached), on a background thread; returns the future of its
        `CompiledGrammar`, whose `result()` raises ValueError for a grammar the engine cannot
        enforce (an unsatisfiable schema). Raises ValueError at once for what shows without
        compiling: a malformed schema, regex or grammar, a JSON-schema keyword the engine does
        not enforce (`jaxmamba.structured.validate`), a model without a tokenizer, or a runner
        whose FULL programs take no token bitmask (an artifact exported without it)."""
        if not isinstance(constraint, StructuredOutputsParams):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams, got "
                f"{type(constraint).__name__}"
            )
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        if not self.runner.structured_outputs:
            raise ValueError(
                f"structured outputs need FULL sampler programs that take the token bitmask, "
                f"which this engine's {type(self.runner).__name__} does not have: an exported "
                f"artifact's take none when its manifest does not say 'structured_outputs' "
                f"(format version 2, or exported with JAXMAMBA_STRUCTURED_OUTPUTS=0: export it "
                f"again with this jaxmamba), and JAXMAMBA_STRUCTURED_OUTPUTS=0 builds a live "
                f"engine's without it"
            )
        if self.runner.send_step is not None:
            raise ValueError("structured outputs do not run over several processes yet")
        from jaxmamba.structured import GrammarCompiler, validate

        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.model_cfg.vocab_size, self.model_cfg.eos_token_ids
            )
        if not self._grammars.cached(constraint):
            validate(constraint)
        return self._grammars.submit(constraint)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (all its samples): its slot and pages are free for the next step.
        An unknown or finished id is ignored, as in vLLM; no further output comes for it."""
        group = self._groups.pop(str(request_id), None)
        if group is None:
            return
        for req in group.seqs:
            if not req.finished:
                self._end(req, "abort")

    def _end(self, req: Request, reason: str) -> None:
        """Finish `req` by `reason` and free what it holds (a waiting one holds nothing)."""
        req.finish_reason = reason
        if req in self.scheduler.waiting:  # Request compares by identity
            self.scheduler.waiting.remove(req)
        elif req in self.scheduler.running:
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
        runner has it) and the side programs, and run each once; returns how many step
        programs. Afterwards nothing compiles."""
        buckets = self.scheduler.all_buckets()
        progress = compile_progress("precompiling") if show_progress else None
        self.runner.precompile(buckets, self.builder.padding, progress)
        return len(self.runner.programs(buckets))

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Dispatch the next step, then post-process the previous one; returns the outputs
        (deltas) of the requests that moved, and of those a failed step ended (module
        docstring): the previous step's outputs are read first, so a request it finished
        finishes normally. When the previous step sampled for a constrained row, it is
        post-processed first: the next step's token bitmask needs its tokens."""
        outputs, self._undelivered = self._undelivered, []
        if self._compiling:
            outputs += self._start_grammars()
        previous, failed, read = self._inflight, None, False
        if previous is not None and previous[0].constrained:
            self._inflight, read = None, True
            outputs += self._postprocess(*previous)
            previous = None
        try:
            self._inflight = self._dispatch()
        except _DispatchFailed as err:
            if not err.carried and not err.state_lost:
                self._undelivered = outputs  # handed out by the next step()
                raise err.cause from None  # nothing to pin it on; the scheduler is as it was
            self._inflight, failed = None, err
        if previous is not None:
            outputs += self._postprocess(*previous)
        if failed is not None:
            outputs += self._fail_step(failed.cause, failed.carried, state_lost=failed.state_lost)
        elif not read and previous is None and self._inflight is None:
            if self.scheduler.running:
                raise RuntimeError("scheduler made no progress with requests still running")
            if self._compiling and not outputs:  # nothing to run until a grammar compiles
                wait([r.grammar for r in self._compiling], timeout=0.1,
                     return_when=FIRST_COMPLETED)  # fmt: skip
        return outputs

    def _start_grammars(self) -> list[RequestOutput]:
        """Give every sample whose grammar has compiled its matcher (it may be admitted now),
        and end with an error those whose grammar failed to compile; returns their outputs."""
        from jaxmamba.structured import GrammarMatcher

        deltas: dict[str, list[CompletionOutput]] = {}
        compiling, vocab = [], self.model_cfg.vocab_size
        for req in self._compiling:
            if req.finished:
                continue
            if not req.grammar.done():
                compiling.append(req)
                continue
            try:
                stop_ids = [t for t in req.params.stop_token_ids if t < vocab]
                req.matcher = GrammarMatcher(req.grammar.result(), stop_ids)
            except Exception as e:  # the grammar cannot be enforced: never run unconstrained
                self._end_with_error(req, f"structured_outputs: {e}", deltas)
        self._compiling = compiling
        return self._outputs(deltas)

    def _end_with_error(self, req: Request, message: str,
                        deltas: dict[str, list[CompletionOutput]]) -> None:  # fmt: skip
        """Finish one sample with finish_reason "error" (`message` goes to its request's
        output) and free what it holds; its delta goes to `deltas`."""
        group = self._groups[req.request_id]
        group.error = message
        self._end(req, "error")
        req.finish_time = time.perf_counter()
        self.stats.finished_requests += 1
        detok = group.detokenizers[req.index]
        text = None
        if detok is not None:
            detok.flush()
            text = detok.take_delta(finished=True)
        deltas.setdefault(req.request_id, []).append(
            CompletionOutput(
                index=req.index,
                text=text,
                token_ids=[],
                cumulative_logprob=req.cumulative_logprob,
                logprobs=None if req.params.logprobs is None else [],
                finish_reason="error",
            )
        )

    def _dispatch(self) -> tuple[ScheduledStep, StepOutput] | None:
        """Schedule, build and dispatch the next step; None when there is nothing to run.
        Raises `_DispatchFailed` if any of it raises."""
        scheduled = None
        cache, slot_state = self.runner.cache, self.runner.slot_state
        try:
            with self.scheduler.transaction():
                scheduled = self.scheduler.schedule()
                if scheduled is None:
                    return None
                inputs = self.builder.build(
                    scheduled.specs, scheduled.bucket, scheduled.num_decode_rows
                )
                # The builder's bitmask: some row has a grammar. (The runner gives every
                # other FULL step an all-allowing one, which needs no read-back.)
                scheduled.constrained = inputs.token_bitmask is not None
                packed = self._step(scheduled, inputs)
            self.scheduler.record_dispatched(scheduled)
            self._count(scheduled)
        except Exception as err:
            if scheduled is None:
                carried = self.scheduler.transaction_requests()
            else:
                carried = [row.request for row in scheduled.rows]
            state_lost = not self.runner.holds_state(cache, slot_state)
            raise _DispatchFailed(err, carried, state_lost) from err
        return scheduled, packed

    def _fail_step(
        self,
        err: Exception,
        carried: list[Request],
        *,
        state_lost: bool,
        produced: dict[str, list[CompletionOutput]] | None = None,
    ) -> list[RequestOutput]:
        """A step raised `err`: end the requests it `carried` (every sample of each) with
        finish_reason "error" and free what they hold; with `state_lost`, also every request
        whose state was on the device, and re-create the device state (module docstring).
        `produced`: completions the step made before it raised, handed out with the error.
        Returns the failed requests' outputs."""
        logger.error("engine step failed (device state %s); failing the requests it carried",
                     "lost" if state_lost else "intact", exc_info=err)  # fmt: skip
        self.stats.failed_steps += 1
        failed = list(carried)
        if state_lost:
            self._inflight = None  # it continued from the lost state
            failed += self.scheduler.drop_device_state()
            self.runner.reset_state()
        message = f"the engine step failed: {type(err).__name__}: {err}"
        now = time.perf_counter()
        outputs = []
        for request_id in dict.fromkeys(req.request_id for req in failed):
            group = self._groups.pop(request_id, None)
            if group is None:  # finished, or aborted, already
                continue
            by_index = {c.index: c for c in (produced or {}).get(request_id, [])}
            for req in group.seqs:
                if req.finished:
                    continue
                self._end(req, "error")
                req.finish_time = now
                if req.index in by_index:
                    by_index[req.index].finish_reason = "error"
                    continue
                by_index[req.index] = CompletionOutput(
                    index=req.index,
                    text=None if group.detokenizers[req.index] is None else "",
                    token_ids=[],
                    cumulative_logprob=req.cumulative_logprob,
                    logprobs=None if req.params.logprobs is None else [],
                    finish_reason="error",
                )
            self.stats.failed_requests += 1
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=group.prompt,
                    prompt_token_ids=group.prompt_token_ids,
                    outputs=[by_index[i] for i in sorted(by_index)],
                    num_cached_tokens=group.seqs[0].num_cached_tokens,
                    metrics=group.metrics(),
                    error=message,
                )
            )
        return outputs

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
        """Read a dispatched step's samples back (the one read per step) and hand them to its
        requests; returns their outputs. A read that raises loses the device state: the step
        produced nothing valid, and every step dispatched since continued from it. If handing
        them out raises, the step's requests fail with what it had made for them, but for
        those it had finished."""
        try:
            host = jax.device_get(out)
        except Exception as err:
            return self._fail_step(err, [row.request for row in step.rows], state_lost=True)
        self.stats.device_reads += 1
        deltas: dict[str, list[CompletionOutput]] = {}
        try:
            if step.num_spec:
                self._take_verified(step, unpack_verify_output(host.packed, 1 + step.num_spec),
                                    deltas)  # fmt: skip
            else:
                self._take_samples(step, *unpack_step_output(host), deltas)
        except Exception as err:
            done = {rid: c for rid, c in deltas.items() if self._groups[rid].finished}
            carried = [row.request for row in step.rows if row.request.request_id not in done]
            produced = {rid: c for rid, c in deltas.items() if rid not in done}
            return self._outputs(done) + self._fail_step(err, carried, state_lost=False,
                                                         produced=produced)  # fmt: skip
        return self._outputs(deltas)

    def _take_samples(self, step: ScheduledStep, sampled, scored,
                      deltas: dict[str, list[CompletionOutput]]) -> None:  # fmt: skip
        """Append each row's sample to its request, record the step's checkpoints, and put
        each sequence's delta in `deltas` (request id -> completions)."""
        tokens, logprobs = sampled.tokens.tolist(), sampled.logprobs.tolist()
        scored_offset = 0  # of the row's first scored token among the step's scored tokens
        now = time.perf_counter()
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
            if req.matcher is not None:
                error = req.matcher.error
                if error is None and not req.matcher.accept_token(token):
                    error = f"the grammar does not allow the sampled token {token}"
                if error is not None:  # never continue unconstrained
                    self._end_with_error(req, f"structured_outputs: {error}", deltas)
                    continue
            deltas.setdefault(req.request_id, []).append(
                self._emit(req, sampled, i, token, logprob, now)
            )

    def _emit(self, req: Request, sampled, i: int, token: int, logprob: float, now: float
              ) -> CompletionOutput:  # fmt: skip
        """Append one sampled token (output row `i` of `sampled`) to `req`, with its logprob
        and the top logprobs it asks for, and advance the request (stop rules, detokenizing):
        returns the delta to stream."""
        req.output_token_ids.append(token)
        req.cumulative_logprob += logprob
        if req.first_token_time is None:
            req.first_token_time = now
        top = None
        if req.params.logprobs is not None:
            top = self._logprobs(sampled, i, token, logprob, req.params.logprobs)
            req.output_logprobs.append(top)
        return self._advance(req, token, top, now)

    def _take_verified(self, step: ScheduledStep, verified,
                       deltas: dict[str, list[CompletionOutput]]) -> None:  # fmt: skip
        """A verify step's rows (speculative decoding): each emits its accepted drafts and the
        token after them, appended one at a time as `_take_samples` does a step's one token
        (stop rules, logprobs, detokenizing), until its request finishes; the scheduler's
        counters move on by what the row kept beyond the one token it counted."""
        st, k = self.stats, step.num_spec
        st.verify_steps += 1
        self.scheduler.verified(int(sum(verified.accepted[: len(step.rows)])))
        samples, num = verified.samples, verified.num_positions
        tokens, logprobs = samples.tokens.tolist(), samples.logprobs.tolist()
        now = time.perf_counter()
        for i, row in enumerate(step.rows):
            req = row.request
            accepted = int(verified.accepted[i])
            if verified.proposed[i]:
                for j in range(k):
                    st.drafted[j] += 1
                    st.accepted[j] += j < accepted
            if req.finished:
                continue
            self.scheduler.accepted(req, accepted)
            for j in range(i * num, i * num + accepted + 1):
                completion = self._emit(req, samples, j, tokens[j], logprobs[j], now)
                mine = deltas.setdefault(req.request_id, [])
                if mine and mine[-1].index == completion.index:
                    mine[-1].add(completion)
                else:
                    mine.append(completion)
                if req.finished:
                    break

    def _outputs(self, deltas: dict[str, list[CompletionOutput]]) -> list[RequestOutput]:
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
                    error=group.error,
                )
            )
            group.prompt_logprobs = None  # complete with the first output, handed out once
        return outputs

    def _advance(self, req: Request, token: int, top, now: float) -> CompletionOutput:
        """Detokenize the new token, check every stop condition; the sequence's delta."""
        reason, stop_reason = self._finish_reason(req, token)
        stop_token = reason == "stop"
        if req.matcher is not None and req.matcher.must_stop():
            # The grammar is complete: by the stop token just accepted, or allowing no more.
            stop_token = req.matcher.is_terminated()
            reason = "stop"
            stop_reason = token if stop_token and token in req.params.stop_token_ids else None
        detok = self._groups[req.request_id].detokenizers[req.index]
        text = None
        if detok is not None:
            stop_string = detok.update([token], stopped_on_token=stop_token)
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
        self._compiling.clear()

    def counters(self) -> dict[str, float]:
        s, st = self.scheduler, self.stats
        cache = s.prefix_cache
        out = {
            "steps": st.steps,
            "prefill_tokens": st.prefill_tokens,
            "decode_tokens": st.decode_tokens,
            "device_reads": st.device_reads,
            "finished_requests": st.finished_requests,
            "failed_steps": st.failed_steps,
            "failed_requests": st.failed_requests,
            "compilations": self.runner.num_compiles,
            "grammar_compiles": 0 if self._grammars is None else self._grammars.num_compiles,
            "free_slots": s.slots.num_free,
            "free_pages": s.pages.num_free,
            "forked_samples": s.forked_samples,
            **{f"{k}_steps": v for k, v in st.step_kinds.items()},
        }
        if st.drafted:  # speculative decoding (vLLM's spec_decode metrics, per position too)
            drafted, accepted = sum(st.drafted), sum(st.accepted)
            out["spec_verify_steps"] = st.verify_steps
            out["spec_paused_steps"] = s.spec_paused_steps  # no draft kept: not speculating
            out["spec_draft_tokens"] = drafted
            out["spec_accepted_tokens"] = accepted
            out["spec_acceptance_rate"] = accepted / max(drafted, 1)
            for j, (d, a) in enumerate(zip(st.drafted, st.accepted, strict=True)):
                out[f"spec_acceptance_rate_pos{j}"] = a / max(d, 1)
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
