"""The OpenAI-compatible HTTP API on FastAPI + uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (server-sent events with
`"stream": true`), `GET /v1/models`, `GET /health`, `GET /metrics`, `POST /reset_prefix_cache`.
Structured outputs (`response_format`, vLLM's `structured_outputs` and `guided_*`) become the
request's `StructuredOutputsParams` (`constraints`); chat's `tools` are rendered by the chat
template and its tool calls read from the output (`tool_parsers`), after the reasoning of a
thinking model (`reasoning_parsers`, vLLM's `--reasoning-parser`), docs/structured_outputs.md.
Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}` with a 4xx status for
the client's mistakes, and 500 (`"type": "InternalServerError"`, `"code": 500`, as vLLM sends
it) for the engine's: a request whose step failed gets that, or on a stream an error event
before `[DONE]`, while the others go on. The engine runs in its own thread (`EngineLoop`);
handlers only queue commands to it and await their outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxmamba.engine.outputs import Logprob, RequestOutput
from jaxmamba.sampling_params import SamplingParams
from jaxmamba.serve.constraints import output_constraint, resolve_tool_choice
from jaxmamba.serve.engine_loop import Accepted, EngineLoop, EngineRequest, Failed
from jaxmamba.serve.metrics import ServerMetrics
from jaxmamba.serve.protocol import (
    MAX_N,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    NamedToolChoice,
)
from jaxmamba.serve.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    split_reasoning,
)
from jaxmamba.serve.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedToolCall,
    RequiredToolCalls,
    ToolCallDelta,
    ToolCallParser,
    detect_tool_call_parser,
    parse_tool_calls,
    tool_call_tags,
)

logger = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
           "/reset_prefix_cache", "/openapi.json", "/docs")  # fmt: skip
_OPEN_ROUTES = ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect")
SWITCH_INTERVAL_S = 0.0005
# uvicorn cuts the connections this long after the grace period, by which time the server has
# ended every open request itself (with an error event on streams).
_CUT_AFTER_GRACE_S = 5.0
# What JSON cannot hold (-inf) becomes this floor, as in vLLM.
MIN_LOGPROB = -9999.0
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    # Sequences (a request of n samples counts n) allowed to wait beyond the engine's
    # max_num_seqs running ones; past that, 429.
    max_queued_requests: int = 1024
    max_body_bytes: int = 8 << 20
    chat_template: str | None = None
    retry_after_s: int = 1
    # tool_choice "auto" parses tool calls out of the output, with `tool_call_parser`'s
    # format (None: the one the chat template teaches); vLLM's --enable-auto-tool-choice.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Chat completions split a thinking model's <think>...</think> off into
    # `reasoning_content`, and constrained outputs start after it (vLLM's --reasoning-parser).
    reasoning_parser: str | None = None


def internal_error(message: str) -> ApiError:
    """The engine failed this request: 500 in the shape vLLM gives it."""
    return ApiError(500, message, type="InternalServerError", code=500)


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote input that is not valid
    Unicode (a lone surrogate), which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return _AsciiJSONResponse(body, status_code=status, headers=headers)


def _from_api_error(err: ApiError) -> JSONResponse:
    return error_response(err.status, err.message, type=err.type, param=err.param,
                          code=err.code, headers=err.headers)  # fmt: skip


# The first word of a SamplingParams error names the field ("top_p must be in (0, 1]").
def _bad_params(err: Exception) -> ApiError:
    message = str(err)
    param = message.split(" ", 1)[0].split("[", 1)[0]
    return ApiError(400, message, param=param if param.isidentifier() else None)


class _Disconnected(Exception):
    pass


_DISCONNECTED = object()


@dataclass(frozen=True)
class _Ended:
    """Put in an open request's queue when the server ends it (a shutdown's grace ran out)."""

    message: str


@dataclass
class _Sequence:
    """One choice as it accumulates."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None


class _Generation:
    """The engine requests of one HTTP request (one per prompt), consumed in step order."""

    def __init__(self, server: OpenAIServer, request: Request, prompts, params, n: int, *,
                 hide_output: bool = False):  # fmt: skip
        self.server, self.http_request, self.n = server, request, n
        # echo with max_tokens 0: the engine samples one token, which nobody is shown
        self.hide_output = hide_output
        self.base_id = uuid.uuid4().hex
        self.prompts = prompts  # [(text or None, ids)]
        self.rids = [f"{self.base_id}-{i}" for i in range(len(prompts))]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self.params = params
        self.arrival = time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs = [[_Sequence() for _ in range(n)] for _ in prompts]
        self.prompt_logprobs: list[list[dict[int, Logprob] | None] | None] = [None] * len(prompts)
        self.cached = [0] * len(prompts)
        self.unfinished = set(self.rids)
        self._seats = n * len(prompts)
        self._watch: asyncio.Task | None = None
        self._closed = False

    async def start(self) -> None:
        self.server.take_seats(self._seats)
        try:
            self.server.loop.submit(
                [EngineRequest(rid, {"prompt": text, "prompt_token_ids": ids}, self.params)
                 for rid, (text, ids) in zip(self.rids, self.prompts, strict=True)],
                self.queue,
            )  # fmt: skip
        except RuntimeError as err:
            self.server.give_seats(self._seats)
            self._closed = True
            raise ApiError(503, str(err), type="server_error", code="shutting_down") from err
        self.server.generations.add(self)
        self._watch = asyncio.create_task(self._watch_disconnect())
        pending = set(self.rids)
        failure = None
        while pending:
            item = await self.queue.get()
            self._check_gone(item)
            if isinstance(item, Accepted):
                pending.discard(item.request_id)
            elif isinstance(item, Failed):
                pending.discard(item.request_id)
                self.unfinished.discard(item.request_id)
                failure = failure or item.error
        if failure is not None:
            self.close()
            if isinstance(failure, ValueError | TypeError | NotImplementedError):
                raise _bad_params(failure)
            raise internal_error(f"the engine failed: {failure}")

    def _check_gone(self, item) -> None:
        """Raise if `item` says the client left or the server ended this request."""
        if item is _DISCONNECTED:
            self.close()
            raise _Disconnected
        if isinstance(item, _Ended):
            self.close()
            raise ApiError(503, item.message, type="server_error", code="shutting_down")

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.http_request.receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait(_DISCONNECTED)
                return

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) until every request is finished; each choice's `_Sequence`
        is updated before the delta is yielded."""
        metrics = self.server.metrics
        while self.unfinished:
            item = await self.queue.get()
            self._check_gone(item)
            if isinstance(item, Failed):
                self.unfinished.discard(item.request_id)
                self.close()
                raise internal_error(f"the engine failed: {item.error}")
            if not isinstance(item, RequestOutput):
                continue
            if item.error is not None:  # a step that carried it failed: the others go on
                self.unfinished.discard(item.request_id)
                failed = sum(c.finish_reason == "error" for c in item.outputs)
                metrics.finished.labels("error").inc(failed)
                self.close()
                raise internal_error(item.error)
            p = self.index[item.request_id]
            if item.prompt_logprobs is not None:
                self.prompt_logprobs[p] = item.prompt_logprobs
            if self.hide_output:
                hidden = [dataclasses.replace(c, text="", token_ids=[], logprobs=None)
                          for c in item.outputs]  # fmt: skip
                item = dataclasses.replace(item, outputs=hidden)
            now = time.perf_counter()
            for c in item.outputs:
                seq = self.seqs[p][c.index]
                if c.token_ids:
                    if seq.last_token_time is None:
                        metrics.ttft.observe(now - self.arrival)
                    else:
                        metrics.itl.observe(now - seq.last_token_time)
                    seq.last_token_time = now
                    metrics.generation_tokens.inc(len(c.token_ids))
                seq.text += c.text or ""
                seq.token_ids.extend(c.token_ids)
                if c.logprobs:
                    seq.logprobs.extend(c.logprobs)
                if c.finish_reason is not None:
                    seq.finish_reason, seq.stop_reason = c.finish_reason, c.stop_reason
                    metrics.finished.labels(c.finish_reason).inc()
            self.cached[p] = item.num_cached_tokens
            if item.finished:
                self.unfinished.discard(item.request_id)
                metrics.e2e.observe(now - self.arrival)
                metrics.prompt_tokens.inc(len(self.prompts[p][1]))
                metrics.cached_tokens.inc(item.num_cached_tokens)
            yield p, item
        self.close()

    async def run(self) -> None:
        """Consume every delta; the non-streaming responses then read `seqs`."""
        try:
            async for _ in self.outputs():
                pass
        finally:
            self.close()

    def close(self) -> None:
        """Abort what is unfinished (its sequences count as finished by "abort") and free this
        request's seats (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.unfinished:
            with contextlib.suppress(RuntimeError):
                self.server.loop.abort(sorted(self.unfinished))
            aborted = sum(seq.finish_reason is None for rid in self.unfinished
                          for seq in self.seqs[self.index[rid]])  # fmt: skip
            self.server.metrics.finished.labels("abort").inc(aborted)
            self.unfinished.clear()
        self.server.generations.discard(self)
        self.server.give_seats(self._seats)
        if self._watch is not None:
            self._watch.cancel()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(len(s.token_ids) for seqs in self.seqs for s in seqs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached)},
        }


class OpenAIServer:
    def __init__(self, llm, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.engine_config = llm.engine.config
        self.max_model_len = self.engine_config.max_model_len
        self.vocab_size = llm.model_cfg.vocab_size
        self._check_prompt = llm.engine.check_prompt  # pure: reads the config only
        self.loop = EngineLoop(llm.engine)
        self.metrics = ServerMetrics(lambda: self.loop.snapshot)
        self.capacity = self.engine_config.max_num_seqs + config.max_queued_requests
        self.seats_taken = 0  # touched on the event loop only
        self.generations: set[_Generation] = set()  # the open requests; event loop only
        self.created = int(time.time())
        self.tool_call_parser = self._tool_call_parser()
        self.reasoning_parser = self._reasoning_parser()
        self.app = self._build_app()

    def _tool_call_parser(self) -> str | None:
        """The tool-call format for tool_choice "auto": the configured one, else the one the
        chat template teaches (None: tool_choice "auto" is a 400)."""
        from jaxmamba.chat import template_text

        name = self.config.tool_call_parser
        if name is not None and name not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got "
                             f"{name!r}")  # fmt: skip
        if name is None and self.tokenizer is not None:
            template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
            name = detect_tool_call_parser(template_text(template, tools=True))
        if self.config.enable_auto_tool_choice and name is None:
            raise ValueError(
                "enable_auto_tool_choice: this model's chat template teaches no tool-call format "
                f"this server knows ({', '.join(TOOL_CALL_PARSERS)}); name one with "
                "tool_call_parser (--tool-call-parser)"
            )
        # Where the tags are special tokens, the text keeps them only with specials shown.
        self.tool_tags_are_special = (
            name is not None and self.tokenizer is not None and self._special(tool_call_tags(name))
        )
        return name

    def _reasoning_parser(self) -> type[ReasoningParser] | None:
        """The configured reasoning parser's class (None: no reasoning is split off), and the
        token ids that end the reasoning (where a constraint starts)."""
        name = self.config.reasoning_parser
        if name is None:
            return None
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                             f"{name!r}")  # fmt: skip
        if self.tokenizer is None:
            raise ValueError("reasoning_parser: this model has no tokenizer, so no chat template")
        parser = REASONING_PARSERS[name]
        self.reasoning_end_ids = tuple(self.tokenizer.encode(parser.END, add_special_tokens=False))
        self.reasoning_tags_are_special = self._special((parser.START, parser.END))
        return parser

    def _special(self, tags) -> bool:
        """Whether some of `tags` are special tokens (gone from the text unless specials are
        shown)."""
        return any(
            tag not in self.tokenizer.decode(self.tokenizer.encode(tag, add_special_tokens=False))
            for tag in tags
        )

    # -- back-pressure ------------------------------------------------------------------------
    def take_seats(self, n: int) -> None:
        if self.seats_taken + n > self.capacity:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429,
                f"the server is at capacity ({self.seats_taken} sequences running or waiting, "
                f"limit {self.capacity} = max_num_seqs {self.engine_config.max_num_seqs} + "
                f"max_queued_requests {self.config.max_queued_requests}); retry later",
                type="rate_limit_error", code="rate_limit_exceeded",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )  # fmt: skip
        self.seats_taken += n

    def give_seats(self, n: int) -> None:
        self.seats_taken -= n

    def end_open_requests(self, message: str) -> None:
        """End every open request now: a stream gets an error event with `message` and
        `[DONE]`, a non-streaming request a 503; their sequences are aborted."""
        for gen in self.generations:
            gen.queue.put_nowait(_Ended(message))

    # -- validation ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        names = self.config.served_model_names
        if model is None:
            return names[0]
        if model not in names:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                           f"{list(names)})", param="model", code="model_not_found")  # fmt: skip
        return model

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        try:
            self._check_prompt(ids)
        except ValueError as err:
            code = "context_length_exceeded" if "max_model_len" in str(err) else None
            raise ApiError(400, str(err), param=param, code=code) from None
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                "of max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip

    def check_options(self, req) -> None:
        """The request-level rules both routes share (vLLM's)."""
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options can only be set with stream: true",
                           param="stream_options")  # fmt: skip
        if req.stream and req.prompt_logprobs:
            raise ApiError(400, "prompt_logprobs are not available with stream: true",
                           param="prompt_logprobs")  # fmt: skip

    async def output_constraint(self, req, tool_choice="none", after: tuple[int, ...] = ()):
        """The request's `StructuredOutputsParams` (None if its output is free), starting after
        the tokens `after` (the end of the reasoning), compiled by the engine (once per
        constraint: it caches them), so that one it cannot enforce is a 400 before the request
        starts."""
        found = output_constraint(req, tool_choice)
        if found is None:
            return None
        param, constraint = found
        if after:
            constraint = dataclasses.replace(constraint, reasoning_end_ids=after)
        try:
            call = self.loop.call(lambda engine: engine.compile_grammar(constraint))
        except RuntimeError as err:  # the engine loop is shutting down
            raise ApiError(503, str(err), type="server_error", code="shutting_down") from None
        try:
            await asyncio.wrap_future(await call)
        except ValueError as err:  # what validation could not see (an unsatisfiable schema)
            raise ApiError(400, str(err), param=param) from None
        return constraint

    def sampling_params(self, req, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured_outputs=None):  # fmt: skip
        if not isinstance(req.n, int) or not 1 <= req.n <= MAX_N:
            raise ApiError(400, f"n must be an int in [1, {MAX_N}], got {req.n}", param="n")
        if req.n > self.capacity:
            raise ApiError(400, f"n={req.n} is more than this server holds ({self.capacity})",
                           param="n")  # fmt: skip
        bias = None
        if req.logit_bias is not None:
            bias = {}
            for key, value in req.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}",
                                   param="logit_bias") from None  # fmt: skip
                if not 0 <= token < self.vocab_size:
                    raise ApiError(400, f"logit_bias key {token} is outside the vocab "
                                   f"[0, {self.vocab_size})", param="logit_bias")  # fmt: skip
                bias[token] = value
        for t in req.stop_token_ids or ():
            if not 0 <= t < self.vocab_size:
                raise ApiError(400, f"stop_token_ids holds {t}, outside the vocab "
                               f"[0, {self.vocab_size})", param="stop_token_ids")  # fmt: skip
        if req.stop and self.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer and this model has none: use "
                           "stop_token_ids", param="stop")  # fmt: skip
        kwargs = dict(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=bias,
        )
        if structured_outputs is not None:
            kwargs["structured_outputs"] = structured_outputs
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise _bad_params(err) from None

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, f"{param} is text but this model has no tokenizer: send token "
                           "ids", param=param)  # fmt: skip
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(
                400, f"{param} is not valid Unicode: it holds a lone surrogate "
                f"{text[err.start]!r} at character {err.start} (JSON \\ud800-\\udfff escapes "
                "must come in high-low pairs); send valid text or token ids", param=param,
            ) from None  # fmt: skip
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_text(self, token: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.decode_token(token)

    def decode_token(self, token: int) -> str:
        """One token's text as the engine's `decoded_token` has it (specials shown)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def prompt_logprobs_json(self, logprobs: list[dict[int, Logprob] | None] | None):
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id:
        {logprob, rank, decoded_token}}, the prompt token first."""
        if logprobs is None:
            return None
        return [
            None if top is None else {
                str(t): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                         "decoded_token": self.token_text(t, lp)} for t, lp in top.items()
            } for top in logprobs
        ]  # fmt: skip

    # -- the app ------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            # The engine thread must get the GIL back quickly when a step's device work ends,
            # while this thread serializes chunks: Python's default switch interval (5 ms) is
            # a decode step's length.
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            self.loop.start()
            try:
                yield
            finally:
                await asyncio.get_running_loop().run_in_executor(None, self.loop.stop, 30.0)

        app = FastAPI(title="jaxmamba OpenAI-compatible server", lifespan=lifespan,
                      responses=_ERRORS)  # fmt: skip

        @app.exception_handler(ApiError)
        async def _api_error(request, err: ApiError):
            return _from_api_error(err)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request, err: RequestValidationError):
            return _validation_error(err)

        @app.exception_handler(_Disconnected)
        async def _gone(request, err: _Disconnected):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, err: StarletteHTTPException):
            kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
            return error_response(err.status_code, str(err.detail), type=kind,
                                  headers=getattr(err, "headers", None))  # fmt: skip

        @app.exception_handler(Exception)
        async def _internal(request, err: Exception):
            logger.exception("unhandled error in %s", request.url.path)
            return _from_api_error(internal_error(f"internal error: {type(err).__name__}: {err}"))

        @app.get("/health")
        async def health():
            if not self.loop.alive:
                return error_response(503, f"the engine loop is down: {self.loop.error}",
                                      type="server_error")  # fmt: skip
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models():
            data = [{"id": name, "object": "model", "created": self.created,
                     "owned_by": "jaxmamba", "max_model_len": self.max_model_len}
                    for name in self.config.served_model_names]  # fmt: skip
            return {"object": "list", "data": data}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            def reset(engine):
                cache = engine.scheduler.prefix_cache
                if cache is not None:
                    cache.reset()

            await self.loop.call(reset)
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self.completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            return await self.chat_completions(body, request)

        return _Gate(app, self)

    # -- /v1/completions ----------------------------------------------------------------------
    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            return [(p, self.encode(p, "prompt"))]
        if not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        if isinstance(p[0], str):
            return [(t, self.encode(t, "prompt")) for t in p]
        if isinstance(p[0], int):
            return [(None, list(p))]
        return [(None, list(ids)) for ids in p]

    async def completions(self, req: CompletionRequest, request: Request):
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, f"best_of must equal n (got best_of={req.best_of}, n={req.n})",
                           param="best_of")  # fmt: skip
        self.check_options(req)
        prompts = self._completion_prompts(req)
        # As vLLM: echo with logprobs scores the prompt too, and echo with max_tokens 0 returns
        # the prompt alone (the engine samples one token that is not shown).
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.logprobs
        echo_only = req.echo and req.max_tokens == 0
        max_tokens = 1 if echo_only else req.max_tokens
        for _, ids in prompts:
            self.check_prompt(ids, max_tokens, "prompt")
        constraint = await self.output_constraint(req)
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                      prompt_logprobs=prompt_logprobs,
                                      structured_outputs=constraint)  # fmt: skip
        gen = await self._start(request, prompts, params, req.n, hide_output=echo_only)
        head = {"id": f"cmpl-{gen.base_id}", "object": "text_completion",
                "created": int(time.time()), "model": model}  # fmt: skip
        echo = [self._echo(text, ids) if req.echo else "" for text, ids in prompts]
        if req.stream:
            return self._stream(gen, head, req, *self._completion_chunks(gen, req, echo))
        await gen.run()
        choices = []
        for p, seqs in enumerate(gen.seqs):
            ids, prompt_lps = gen.prompts[p][1], gen.prompt_logprobs[p]
            for i, seq in enumerate(seqs):
                logprobs = None
                if req.logprobs is not None:
                    shown = (seq.token_ids, seq.logprobs)
                    if req.echo:
                        shown = ([*ids, *seq.token_ids], [*prompt_lps, *seq.logprobs])
                    logprobs = self._completion_logprobs(*shown, 0)
                choice = {
                    "index": p * req.n + i, "text": echo[p] + seq.text, "logprobs": logprobs,
                    "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                    "prompt_logprobs": self.prompt_logprobs_json(prompt_lps),
                }  # fmt: skip
                if req.return_token_ids:
                    choice["prompt_token_ids"] = ids
                    choice["token_ids"] = seq.token_ids
                choices.append(choice)
        return {**head, "choices": choices, "usage": gen.usage()}

    def _echo(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def _completion_logprobs(self, token_ids, logprobs, offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs; a None step (the first prompt token) has neither a
        logprob nor top logprobs."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token, top in zip(token_ids, logprobs, strict=True):
            if top is None:
                text = self.decode_token(token)
                token_logprobs.append(None)
                tops.append(None)
            else:
                text = self.token_text(token, top.get(token))
                token_logprobs.append(max(top[token].logprob, MIN_LOGPROB))
                tops.append({self.token_text(t, lp): max(lp.logprob, MIN_LOGPROB)
                             for t, lp in top.items()})  # fmt: skip
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def _completion_chunks(self, gen: _Generation, req, echo):
        """The opening choices (the echoed prompts, the prompts' token ids) and the choices of
        one delta, for a streamed completion. With logprobs the echo waits for the prompt's
        logprobs, which come with its first delta."""
        late_echo = req.echo and req.logprobs is not None
        opening = [
            {"index": p * req.n + i, "text": "" if late_echo else e, "logprobs": None,
             "finish_reason": None,
             **({"prompt_token_ids": gen.prompts[p][1]} if req.return_token_ids else {})}
            for p, e in enumerate(echo)
            for i in range(req.n if (e and not late_echo) or req.return_token_ids else 0)
        ]  # fmt: skip
        offsets = [[0 if late_echo else len(e)] * req.n for e in echo]
        echoed = [not late_echo] * len(echo)

        def choices(p: int, out: RequestOutput):
            if not echoed[p]:
                echoed[p] = True
                lp = self._completion_logprobs(gen.prompts[p][1], gen.prompt_logprobs[p], 0)
                for i in range(req.n):
                    offsets[p][i] = sum(len(t) for t in lp["tokens"])
                    yield {"index": p * req.n + i, "text": echo[p], "logprobs": lp,
                           "finish_reason": None, "stop_reason": None}  # fmt: skip
            for c in out.outputs:
                choice = {
                    "index": p * req.n + c.index,
                    "text": c.text or "",
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.logprobs is not None and c.logprobs:
                    lp = self._completion_logprobs(c.token_ids, c.logprobs, offsets[p][c.index])
                    choice["logprobs"] = lp
                    offsets[p][c.index] += sum(len(t) for t in lp["tokens"])
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                yield choice

        return opening, choices

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        from jaxmamba.chat import render_chat

        model = self.check_model(req.model)
        self.check_options(req)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template: use "
                           "/v1/completions with token ids", param="messages")  # fmt: skip
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ApiError(400, "this model's tokenizer has no chat template: start the server "
                           "with --chat-template", param="messages")  # fmt: skip
        tool_choice = resolve_tool_choice(req)
        new_parser = self._tool_call_parser_for(tool_choice, req.tools)
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:  # rendered whatever tool_choice says, "none" included (as in vLLM)
            template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            text = render_chat(
                self.tokenizer, [m.for_template() for m in req.messages], chat_template=template,
                add_generation_prompt=req.add_generation_prompt, **template_kwargs,
            )  # fmt: skip
        except Exception as err:  # a template's raise_exception, or a field it cannot render
            raise ApiError(400, f"the chat template could not render these messages: "
                           f"{type(err).__name__}: {err}", param="messages") from None  # fmt: skip
        # The template writes the special tokens itself (as in LLM.chat).
        ids = self.encode(text, "messages", add_special_tokens=False)
        # A constraint starts after the reasoning: `after`, the tokens that end it.
        new_reasoner, after = self._reasoning_parser_for(req, text, template, template_kwargs)
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        self.check_prompt(ids, max_tokens, "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise ApiError(400, f"top_logprobs must be an int in [0, 20], got {logprobs}",
                           param="top_logprobs")  # fmt: skip
        if (tool_choice == "auto" and self.tool_tags_are_special) or (
            new_reasoner is not None and self.reasoning_tags_are_special
        ):
            req = req.model_copy(update={"skip_special_tokens": False})
        constraint = await self.output_constraint(req, tool_choice, after)
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                      prompt_logprobs=req.prompt_logprobs,
                                      structured_outputs=constraint)  # fmt: skip
        gen = await self._start(request, [(text, ids)], params, req.n)
        head = {"id": f"chatcmpl-{gen.base_id}", "object": "chat.completion",
                "created": int(time.time()), "model": model}  # fmt: skip
        if req.stream:
            head["object"] = "chat.completion.chunk"
            # vLLM sends the prompt's token ids with the opening (role) chunks.
            opening_fields = {"prompt_token_ids": ids} if req.return_token_ids else None
            chunks = self._chat_chunks(req, logprobs, new_parser, tool_choice, new_reasoner)
            return self._stream(gen, head, req, *chunks, opening_fields=opening_fields)
        await gen.run()
        choices = []
        for i, seq in enumerate(gen.seqs[0]):
            message = {"role": "assistant", "content": seq.text}
            if new_reasoner is not None:  # vLLM's: the calls are read from the content only
                reasoning, message["content"] = split_reasoning(new_reasoner(), seq.text)
                reasoning = reasoning if req.include_reasoning else None
                message.update(reasoning=reasoning, reasoning_content=reasoning)
            finish_reason = seq.finish_reason
            if new_parser is not None:
                parser = new_parser()
                message["content"], calls = parse_tool_calls(parser, message["content"] or "")
                if new_reasoner is not None and not message["content"]:
                    message["content"] = None
                if calls:
                    message["tool_calls"] = [call.to_json() for call in calls]
                finish_reason = _finish_reason(seq.finish_reason, parser, tool_choice)
            choice = {
                "index": i,
                "message": message,
                "logprobs": self._chat_logprobs(seq.token_ids, seq.logprobs, logprobs)
                if logprobs is not None else None,
                "finish_reason": finish_reason, "stop_reason": seq.stop_reason,
            }  # fmt: skip
            if req.return_token_ids:
                choice["token_ids"] = seq.token_ids
            choices.append(choice)
        out = {**head, "choices": choices, "usage": gen.usage(),
               "prompt_logprobs": self.prompt_logprobs_json(gen.prompt_logprobs[0])}  # fmt: skip
        if req.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    def _chat_logprobs(self, token_ids, logprobs, k: int) -> dict[str, Any]:
        content = []
        for token, top in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token, top.get(token))
            ranked = sorted((lp.rank, t, lp) for t, lp in top.items() if lp.rank and lp.rank <= k)
            content.append({
                "token": text, "logprob": max(top[token].logprob, MIN_LOGPROB),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (s := self.token_text(t, lp)),
                     "logprob": max(lp.logprob, MIN_LOGPROB), "bytes": list(s.encode())}
                    for _, t, lp in ranked
                ],
            })  # fmt: skip
        return {"content": content}

    def _reasoning_parser_for(self, req, prompt: str, template, template_kwargs: dict):
        """A new reasoning parser per choice (a factory; None without one) and the token ids
        after which a constraint starts (none when the output starts past the reasoning). The
        output starts inside the reasoning unless the generation prompt (what the template adds
        for the assistant's turn) closed it, or the request turned thinking off where the
        parser honours that."""
        if self.reasoning_parser is None:
            return None, ()
        from jaxmamba.chat import render_chat

        generation_prompt = prompt  # the whole prompt where the turns are not its start
        if req.add_generation_prompt:
            try:
                turns = render_chat(self.tokenizer, [m.for_template() for m in req.messages],
                                    chat_template=template, add_generation_prompt=False,
                                    **template_kwargs)  # fmt: skip
            except Exception:  # the template insists on a generation prompt
                turns = None
            if turns is not None and prompt.startswith(turns):
                generation_prompt = prompt[len(turns) :]
        in_reasoning = self.reasoning_parser.starts_in_reasoning(generation_prompt,
                                                                 template_kwargs)  # fmt: skip
        after = self.reasoning_end_ids if in_reasoning else ()
        return functools.partial(self.reasoning_parser, in_reasoning=in_reasoning), after

    def _tool_call_parser_for(self, tool_choice, tools):
        """A new parser per choice for this request's tool calls (a factory), or None when
        the output is not read for calls."""
        if tool_choice == "required":
            return RequiredToolCalls
        if isinstance(tool_choice, NamedToolChoice):
            return functools.partial(NamedToolCall, tool_choice.function.name)
        if tool_choice != "auto":
            return None
        others = 'or send tool_choice "required", "none" or a named function'
        if self.tool_call_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) reads tool calls in '
                           "the format the chat template teaches, and this model's template "
                           f"teaches none this server knows ({', '.join(TOOL_CALL_PARSERS)}): "
                           "start the server with --enable-auto-tool-choice --tool-call-parser "
                           f"NAME, {others}", param="tool_choice")  # fmt: skip
        if not self.config.enable_auto_tool_choice:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) requires the server '
                           "to run with --enable-auto-tool-choice (this model's chat template "
                           f"uses the {self.tool_call_parser!r} format), {others}",
                           param="tool_choice")  # fmt: skip
        functions = [t.function.model_dump(exclude_none=True) for t in tools]
        return functools.partial(TOOL_CALL_PARSERS[self.tool_call_parser], functions)

    def _chat_chunks(self, req, logprobs: int | None, new_parser=None, tool_choice="none",
                     new_reasoner=None):  # fmt: skip
        """The opening choices (the assistant's role) and the choices of one delta, for a
        streamed chat completion. With a reasoning parser, a delta's reasoning comes first, in
        `delta.reasoning_content` (and `delta.reasoning`); with a tool-call parser (one per
        choice), its content, then each piece of a call in a chunk of its own, OpenAI's
        `delta.tool_calls`; the last chunk of a delta carries its finish_reason."""
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(req.n)]  # fmt: skip
        parsers: dict[int, ToolCallParser] = {}
        reasoners: dict[int, ReasoningParser] = {}

        def deltas(c) -> tuple[list[dict], str | None]:
            text, head = c.text or "", []
            if new_reasoner is not None:
                reasoner = reasoners.setdefault(c.index, new_reasoner())
                reasoning, text = reasoner.feed(text)
                if c.finish_reason is not None:
                    more, rest = reasoner.finish()
                    reasoning, text = reasoning + more, text + rest
                if reasoning and req.include_reasoning:
                    head = [{"reasoning": reasoning, "reasoning_content": reasoning}]
            if new_parser is None:
                return head + ([{"content": text}] if text or not head else []), c.finish_reason
            parser = parsers.setdefault(c.index, new_parser())
            content, calls = parser.feed(text)
            if c.finish_reason is not None:
                rest, more = parser.finish()
                content, calls = content + rest, calls + more
            finish_reason = _finish_reason(c.finish_reason, parser, tool_choice)
            pieces = _tool_deltas(content, calls)
            return head + (pieces if pieces != [{"content": ""}] or not head else []), finish_reason

        def choices(_p: int, out: RequestOutput):
            for c in out.outputs:
                pieces, finish_reason = deltas(c)
                for k, delta in enumerate(pieces):
                    last = k == len(pieces) - 1
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": finish_reason if last else None,
                        "stop_reason": c.stop_reason if last else None,
                    }
                    if k == 0 and logprobs is not None and c.logprobs:
                        choice["logprobs"] = self._chat_logprobs(c.token_ids, c.logprobs,
                                                                 logprobs)  # fmt: skip
                    if k == 0 and req.return_token_ids:
                        choice["token_ids"] = c.token_ids
                    yield choice

        return opening, choices

    # -- both routes --------------------------------------------------------------------------
    async def _start(self, request: Request, prompts, params, n: int, *,
                     hide_output: bool = False) -> _Generation:  # fmt: skip
        """Hand the prompts to the engine; returns once it accepted them (a request it refuses
        raises its 4xx here, before any response starts)."""
        gen = _Generation(self, request, prompts, params, n, hide_output=hide_output)
        await gen.start()
        return gen

    def _stream(self, gen: _Generation, head: dict, req, opening, choices, *,
                opening_fields: dict | None = None) -> StreamingResponse:  # fmt: skip
        """Server-sent events: `opening`'s chunks (with `opening_fields` beside `choices`), a
        chunk per choice of every delta, the usage (with `stream_options.include_usage`), then
        `[DONE]`. A failure mid-stream, or a shutdown's grace running out, is an error event; a
        client that leaves aborts the generation."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = _Chunks(head, include_usage)

        async def events():
            try:
                for choice in opening:
                    yield chunk(choice, opening_fields)
                async for p, out in gen.outputs():
                    for choice in choices(p, out):
                        yield chunk(choice)
                if include_usage:
                    yield _data({**head, "choices": [], "usage": gen.usage()})
            except _Disconnected:
                return
            except ApiError as err:
                yield _data({"error": {"message": err.message, "type": err.type, "param": None,
                                       "code": err.code}})  # fmt: skip
            finally:
                gen.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip


def _finish_reason(reason: str | None, parser: ToolCallParser, tool_choice) -> str | None:
    """A choice that ended by itself with tool calls finished by "tool_calls", but for a named
    function, which is "stop", as in OpenAI's API and vLLM."""
    if reason == "stop" and parser.num_calls and not isinstance(tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason


def _tool_deltas(content: str, calls: list[ToolCallDelta]) -> list[dict]:
    """A delta's chunks: its content (if any, or if nothing else), then one per call piece."""
    pieces = [{"content": content}] if content or not calls else []
    return pieces + [{"tool_calls": [call.to_json()]} for call in calls]


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Chunks:
    """SSE chunks of one response: the constant head is serialized once, each chunk only
    serializes its choice (this runs once per token per stream)."""

    def __init__(self, head: dict, include_usage: bool):
        self.head, self.include_usage = head, include_usage
        self.prefix = "data: " + json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-1]
        self.prefix += ',"choices":['
        self.suffix = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    def __call__(self, choice: dict, fields: dict | None = None) -> str:
        """The chunk of `choice`, with `fields` beside `choices` when given."""
        if fields:
            usage = {"usage": None} if self.include_usage else {}
            return _data({**self.head, "choices": [choice], **usage, **fields})
        return (
            self.prefix
            + json.dumps(choice, ensure_ascii=False, separators=(",", ":"))
            + (self.suffix)
        )


def _validation_error(err: RequestValidationError) -> JSONResponse:
    errors = err.errors()
    first = errors[0] if errors else {}
    # Union members add their type to the location ("content.str"): keep the field path only.
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(x)]
    kind = first.get("type", "")
    param = next((x for x in reversed(loc) if not x.isdigit()), None)
    if kind == "json_invalid":
        ctx = first.get("ctx", {}) or {}
        message = f"the body is not valid JSON: {ctx.get('error', first.get('msg', ''))}"
        param = None
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {'.'.join(loc)}"
    elif kind == "missing":
        message = f"Missing required parameter: {'.'.join(loc) or 'body'}"
    elif not loc:
        message = f"the body must be a JSON object: {first.get('msg', '')}"
    else:
        got = first.get("input")
        shown = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
        message = f"{'.'.join(loc)}: {first.get('msg', 'invalid')} (got {shown})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})"
    return error_response(400, message, param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _is_type_tag(x) -> bool:
    return isinstance(x, str) and ("[" in x or x in _TYPE_TAGS or x.startswith("function-"))


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
    except (TypeError, ValueError):
        return False
    return True


class _Gate:
    """ASGI middleware in front of the app: the API key, the body-size limit (the body is read
    here, up to the limit, and replayed to the app), and the request counter by status."""

    def __init__(self, app: FastAPI, server: OpenAIServer):
        self.app, self.server = app, server
        self.openapi = app.openapi  # what tests and fuzzers read

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            key = self.server.config.api_key
            if key is not None and path not in _OPEN_ROUTES and not self._authorized(scope, key):
                return await error_response(
                    401, "Incorrect or missing API key: send the header 'Authorization: Bearer "
                    "<key>'", type="authentication_error", code="invalid_api_key",
                )(scope, receive, counting_send)  # fmt: skip
            limit = self.server.config.max_body_bytes
            too_big = error_response(
                413, f"the request body is larger than this server's limit of {limit} bytes",
                code="request_too_large", headers={"Connection": "close"},
            )  # fmt: skip
            declared = dict(scope.get("headers") or ()).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                return await too_big(scope, receive, counting_send)
            body, more = [], True
            size = 0
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return await too_big(scope, receive, counting_send)
                body.append(chunk)
                more = message.get("more_body", False)
            replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

            async def replay_receive():
                return replay.pop() if replay else await receive()

            await self.app(scope, replay_receive, counting_send)
        finally:
            self.server.metrics.http_requests.labels(route, str(status[0])).inc()

    @staticmethod
    def _authorized(scope, key: str) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), key)


class GracefulServer(uvicorn.Server):
    """uvicorn serving an `OpenAIServer`. On shutdown it stops accepting and lets open
    requests run for up to `grace_s` seconds; then the server ends the rest itself (a stream
    gets an error event and `[DONE]`, a waiting response a 503), so no stream is cut
    mid-chunk; uvicorn's own cut comes `_CUT_AFTER_GRACE_S` later, for a client that does not
    read."""

    def __init__(self, server: OpenAIServer, *, grace_s: float, **config):
        cut_s = grace_s + _CUT_AFTER_GRACE_S
        super().__init__(uvicorn.Config(server.app, lifespan="on", **config,
                                        timeout_graceful_shutdown=cut_s))  # fmt: skip
        self.openai_server, self.grace_s = server, grace_s

    async def shutdown(self, sockets=None) -> None:
        message = (f"the server shut down before this request finished (grace period "
                   f"{self.grace_s:g} s)")  # fmt: skip
        timer = asyncio.get_running_loop().call_later(
            self.grace_s, self.openai_server.end_open_requests, message
        )
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run_server(llm, config: ServerConfig, *, host: str, port: int, grace_s: int = 30,
               log_level: str = "info") -> int:  # fmt: skip
    """Serve until SIGINT/SIGTERM: then stop accepting, let in-flight requests finish for up to
    `grace_s` seconds, end the rest with an error (their sequences are aborted), and return 0."""
    server = OpenAIServer(llm, config)
    uv = GracefulServer(server, grace_s=grace_s, host=host, port=port, log_level=log_level,
                        access_log=False)  # fmt: skip
    # uvicorn re-raises the signal it caught once it has shut down; with the default handler
    # SIGTERM would then kill the process (exit -15) after a clean shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uv.run()
    return 0 if uv.started else 1
