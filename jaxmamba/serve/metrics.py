"""The server's Prometheus metrics, in their own registry (one per app).

Request-level figures are measured in the handlers (what a client sees, server overhead
included). Engine figures come from the engine thread's latest `counters()` snapshot: every
numeric counter it reports is exported as the gauge `jaxmamba_engine_<name>`, so counters
added to the engine later appear without a change here.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# Latency buckets (seconds): sub-millisecond ITLs on small models up to minutes of e2e.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
            0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
PREFIX = "jaxmamba"


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict[str, float]]):
        self._snapshot = snapshot

    def collect(self):
        for key, value in sorted(self._snapshot().items()):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            name = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
            yield GaugeMetricFamily(
                f"{PREFIX}_engine_{name}", f"engine counter {key!r}", value=float(value)
            )


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, float]]):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by route and status code",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.finished = Counter(
            f"{PREFIX}_request_finished", "finished sequences by finish reason",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected", "requests refused before the engine saw them",
            ["reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "generated tokens", registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_prompt_cached_tokens", "prompt tokens served from the prefix cache",
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "time between a sequence's tokens",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "arrival to last token", buckets=_LATENCY,
            registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
