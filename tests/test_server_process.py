"""`jaxmamba serve` as its own process: flags reach the server, requests past
--max-queued-requests get 429 with Retry-After, and SIGTERM lets in-flight streams finish,
refuses new connections, and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from server_helpers import serve_process

MAX_TOKENS = 100


@pytest.fixture(scope="module")
def served():
    args = ["--model", "nemotron-h-tiny", "--served-model-name", "tiny", "alias",
            "--max-num-seqs", "2", "--max-model-len", "128", "--max-num-batched-tokens", "16",
            "--max-queued-requests", "1", "--shutdown-grace-s", "60",
            "--log-level", "warning"]  # fmt: skip
    with serve_process(args, timeout_s=120) as (proc, url):
        yield proc, url


class Stream(threading.Thread):
    """One streaming completion read to its end on a thread; `first` is set at its first chunk."""

    def __init__(self, url: str, i: int):
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.first = threading.Event()
        self.events: list = []
        self.error: BaseException | None = None

    def run(self):
        body = {"model": "alias", "prompt": f"stream {self.i}", "max_tokens": MAX_TOKENS,
                "stream": True, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first.set()
        except BaseException as err:
            self.error = err
            self.first.set()

    def tokens(self) -> int:
        return sum(len(c.get("token_ids", [])) for e in self.events[:-1] for c in e["choices"])


def test_queue_full_is_429_and_sigterm_finishes_in_flight_streams_then_exits_0(served):
    proc, url = served
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "alias"]
    # max_num_seqs 2 + max_queued_requests 1: three streams fill the server.
    streams = [Stream(url, i) for i in range(3)]
    for s in streams:
        s.start()
    for s in streams[:2]:
        assert s.first.wait(120) and s.error is None, s.error
    for _ in range(600):  # the third waits in the engine's queue (bounded wait)
        if "jaxmamba_engine_num_requests_waiting 1.0" in httpx.get(f"{url}/metrics").text:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the third stream never queued")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "one more", "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"].isdigit()
    assert r.json()["error"]["code"] == "rate_limit_exceeded"

    proc.send_signal(signal.SIGTERM)
    for s in streams:
        s.join(120)
        assert not s.is_alive() and s.error is None, s.error
        assert s.events[-1] == "[DONE]"
        assert s.tokens() == MAX_TOKENS  # finished within the grace period, not cut
    assert proc.wait(60) == 0, proc.stdout.read()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
