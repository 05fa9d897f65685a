"""An in-process server on a real socket, and SSE parsing, for the server tests."""

from __future__ import annotations

import json
import socket
import threading
import time

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
