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
