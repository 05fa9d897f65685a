"""The engine's own thread: the only code that touches the (not thread-safe) `LLMEngine`.

Handlers call `submit` / `abort` / `call`, which append a command and notify a condition;
the thread drains the commands between steps, steps while anything is unfinished, and
otherwise sleeps on the condition (no busy wait). Each step's outputs go back to the
handlers' asyncio queues in one `loop.call_soon_threadsafe` per event loop per step; a request
that a failed step ended gets its output with `error` set, like any last output.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxmamba.engine.outputs import RequestOutput
from jaxmamba.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """The engine queued `request_id` (the first item of every accepted request)."""

    request_id: str


@dataclass(frozen=True)
class Failed:
    """`request_id` will produce nothing more: `error` says why."""

    request_id: str
    error: BaseException


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: dict[str, Any]  # {"prompt": text or None, "prompt_token_ids": [...]}
    params: SamplingParams


class _Sink:
    """Where one HTTP request's items go: an asyncio queue and the loop that owns it."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue


class EngineLoop:
    def __init__(self, engine, *, on_step: Callable[[dict[str, float]], None] | None = None):
        self._engine = engine
        self._cv = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._stopping = False
        self._sinks: dict[str, _Sink] = {}  # engine request id -> sink; engine thread only
        self._on_step = on_step
        self.snapshot: dict[str, float] = {}  # replaced (never mutated) by the engine thread
        self.error: BaseException | None = None  # set if the thread itself died
        self._step_seconds = 0.0  # wall time inside engine.step (the rest: waiting, routing)
        self._thread = threading.Thread(target=self._run, name="jaxmamba-engine", daemon=True)

    # -- called from any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._snapshot()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, requests: Sequence[EngineRequest], queue: asyncio.Queue) -> None:
        """Queue `requests`; each yields `Accepted` or `Failed`, then its `RequestOutput`
        deltas, into `queue` (which belongs to the running event loop)."""
        sink = _Sink(asyncio.get_running_loop(), queue)
        self._push(("add", list(requests), sink))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._push(("abort", list(request_ids)))

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between steps; the future gets its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._push(("call", fn, loop, future))
        return future

    def call_blocking(self, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """`call` for a thread without an event loop: waits for and returns `fn(engine)`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._push(("call", fn, None, future))
        return future.result(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Abort everything still running (each gets `Failed`) and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _push(self, command) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError(
                    "the engine loop is shutting down"
                    if self.error is None
                    else f"the engine loop is down: {self.error}"
                )
            self._commands.append(command)
            self._cv.notify()

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                with self._cv:
                    while not (
                        self._commands or self._stopping or engine.has_unfinished_requests()
                    ):
                        self._cv.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                out: dict[asyncio.AbstractEventLoop, list] = {}
                for command in commands:
                    self._apply(command, out)
                if stopping:
                    self._fail_all(RuntimeError("the server is shutting down"), out)
                    self._deliver(out)
                    return
                if engine.has_unfinished_requests():
                    started = time.perf_counter()
                    try:
                        outputs = engine.step()
                    except Exception as err:  # a failure no request carried: reset it all
                        logger.exception("engine step failed; aborting every running request")
                        if not self._fail_all(err, out):
                            raise  # the engine cannot even be reset: this loop ends
                        outputs = []
                    self._step_seconds += time.perf_counter() - started
                    for output in outputs:
                        self._route(output, out)
                    self._snapshot()
                self._deliver(out)
        except BaseException as err:
            self.error = err
            logger.exception("the engine loop died")
            with self._cv:
                self._stopping = True
            out = {}
            for rid, sink in self._sinks.items():
                out.setdefault(sink.loop, []).append((sink.queue, Failed(rid, err)))
            self._sinks.clear()
            self._deliver(out)

    def _apply(self, command, out) -> None:
        kind = command[0]
        if kind == "add":
            _, requests, sink = command
            for req in requests:
                try:
                    self._engine.add_request(req.request_id, req.prompt, req.params)
                except Exception as err:
                    out.setdefault(sink.loop, []).append((sink.queue, Failed(req.request_id, err)))
                    continue
                self._sinks[req.request_id] = sink
                out.setdefault(sink.loop, []).append((sink.queue, Accepted(req.request_id)))
        elif kind == "abort":
            for rid in command[1]:
                if self._sinks.pop(rid, None) is not None:
                    self._engine.abort_request(rid)
            self._snapshot()
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result, error = fn(self._engine), None
            except Exception as err:
                result, error = None, err
            self._snapshot()
            if loop is None:  # a concurrent.futures.Future (call_blocking)
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            else:
                loop.call_soon_threadsafe(_resolve, future, result, error)

    def _route(self, output: RequestOutput, out) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if output.finished:
            del self._sinks[output.request_id]
        out.setdefault(sink.loop, []).append((sink.queue, output))

    def _fail_all(self, err: BaseException, out) -> bool:
        """Fail every request; False if the engine could not be reset."""
        for rid, sink in self._sinks.items():
            out.setdefault(sink.loop, []).append((sink.queue, Failed(rid, err)))
        self._sinks.clear()
        try:
            self._engine.abort_all()
            self._snapshot()
        except Exception:
            logger.exception("abort_all failed")
            return False
        return True

    @staticmethod
    def _deliver(out) -> None:
        for loop, items in out.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass

    def _snapshot(self) -> None:
        engine = self._engine
        snap = dict(engine.counters())
        snap["num_requests_running"] = len(engine.scheduler.running)
        snap["num_requests_waiting"] = len(engine.scheduler.waiting)
        snap["loop_step_seconds"] = self._step_seconds
        self.snapshot = snap
        if self._on_step is not None:
            self._on_step(snap)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
