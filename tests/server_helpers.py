"""An in-process server on a real socket, and SSE parsing, for the server tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import httpx

from jaxmamba.serve.api_server import GracefulServer, OpenAIServer, ServerConfig


class ServerThread:
    """`GracefulServer` (uvicorn) serving `OpenAIServer(llm)` from a thread, on a free port of
    127.0.0.1; `stop` shuts it down as SIGTERM does, with `grace_s` for open requests."""

    def __init__(self, llm, config: ServerConfig, *, grace_s: float = 30):
        self.server = OpenAIServer(llm, config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uv = GracefulServer(self.server, grace_s=grace_s, log_level="warning")
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]})
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uv.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self, wait: bool = True) -> None:
        self.uv.should_exit = True
        if wait:
            self.thread.join(30)
            self.sock.close()


def sse_events(lines) -> list:
    """The `data:` payloads of an event stream: parsed JSON, or the string "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 180):
    """`jaxmamba serve ARGS --port P` as its own process, yielded as (process, url) once
    /health answers; killed on exit if it still runs. Its output (stdout and stderr) is the
    assertion message when it dies early."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxmamba.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=None if env is None else {**os.environ, **env})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class StreamedChoice(NamedTuple):
    content: str
    tool_calls: list[dict]
    finish_reason: str | None
    reasoning: str  # `delta.reasoning_content`, which must equal `delta.reasoning`


def reassembled(events: list) -> dict[int, StreamedChoice]:
    """Each choice of a chat stream's chunks (the `[DONE]` last), merged as OpenAI's clients
    merge them: by index, text concatenated, a call's name from its head and its arguments
    concatenated."""
    content: dict[int, str] = {}
    reasoning: dict[int, str] = {}
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str] = {}
    for e in events[:-1]:
        choice = e["choices"][0]
        i, delta = choice["index"], choice["delta"]
        content[i] = content.get(i, "") + (delta.get("content") or "")
        assert delta.get("reasoning") == delta.get("reasoning_content"), delta
        reasoning[i] = reasoning.get(i, "") + (delta.get("reasoning_content") or "")
        for d in delta.get("tool_calls") or ():
            call = calls.setdefault(i, {}).setdefault(
                d["index"], {"id": None, "name": None, "arguments": ""}
            )
            call["id"] = d.get("id") or call["id"]
            call["name"] = d.get("function", {}).get("name") or call["name"]
            call["arguments"] += d.get("function", {}).get("arguments", "")
        finish[i] = choice["finish_reason"] or finish.get(i)
    return {
        i: StreamedChoice(content[i], [{"id": c["id"], "type": "function",
                                        "function": {"name": c["name"],
                                                     "arguments": c["arguments"]}}
                                       for _, c in sorted(calls.get(i, {}).items())],
                          finish[i], reasoning[i])
        for i in content
    }  # fmt: skip


def call_args(calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments as an object) of OpenAI `tool_calls`."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@contextlib.contextmanager
def serving(llm, config: ServerConfig):
    """`ServerThread(llm, config)` with an httpx client and an `openai` client on it."""
    import openai

    server = ServerThread(llm, config)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            yield server, http, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none",
                                              max_retries=0)  # fmt: skip
    finally:
        server.stop()
